"""How fast and how heavy a fresh ``kvflow serve`` starts: seconds to ``/health`` 200, the CPU
seconds the whole process tree spent getting there (on a 2-core machine the start is CPU-bound:
every service imports and loads at once), and each service's resident memory once ready.

Run: ``python -m kvflow.benchmarks.startup --runs 3`` (add ``--serve-args "..."`` for other
settings; figures recorded in docs/benchmarks.md). The tokenizer cache is warm after the first
run ever on a machine (the first converts the GGUF's tokenizer); run it twice for a fresh
machine's figure.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import subprocess
import sys
import time
from collections import defaultdict

import psutil

from kvflow.shared.infra import free_port, wait_for_http


def _service(proc: psutil.Process) -> str:
    """``worker``, ``scheduler``, ... for ``kvflow run NAME``; the binary's name otherwise."""
    try:
        cmd = proc.cmdline()
    except psutil.Error:
        return "?"
    if "run" in cmd and cmd.index("run") + 1 < len(cmd):
        return cmd[cmd.index("run") + 1]
    if "serve" in cmd:
        return "serve (launcher)"
    return proc.name()


def one_start(serve_args: list[str], timeout: float = 300.0) -> dict[str, object]:
    """Start ``kvflow serve``, wait for /health, measure, stop it; the figures as a dict."""
    port = free_port()
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvflow.cli.main", "serve", "--port", str(port), *serve_args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for_http(f"http://127.0.0.1:{port}/health", proc, "kvflow serve", timeout, 0.1)
        ready = time.monotonic() - t0
        root = psutil.Process(proc.pid)
        cpu = 0.0
        rss: dict[str, float] = defaultdict(float)
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                cpu += t.user + t.system
                rss[_service(p)] += p.memory_info().rss / 2**20
            except psutil.Error:
                continue
        return {"ready_s": ready, "cpu_s": cpu, "rss_mib": dict(rss)}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--serve-args", default="", help="more `kvflow serve` arguments, quoted")
    args = ap.parse_args(argv)
    runs = []
    for i in range(args.runs):
        print(f"start {i + 1}/{args.runs} ...", file=sys.stderr, flush=True)
        runs.append(one_start(shlex.split(args.serve_args)))
    print("| run | ready (s) | CPU of the tree (s) | RSS total (MiB) |")
    print("|---:|---:|---:|---:|")
    for i, r in enumerate(runs, 1):
        total = sum(r["rss_mib"].values())
        print(f"| {i} | {r['ready_s']:.2f} | {r['cpu_s']:.2f} | {total:,.0f} |")
    print()
    print(
        "RSS by process, last run (MiB): "
        + ", ".join(f"{name} {mib:.0f}" for name, mib in sorted(runs[-1]["rss_mib"].items()))
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
