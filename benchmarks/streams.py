"""Start-up time and streaming throughput of a fresh ``kvflow serve``: time to ready and to the
first streamed token, then output tokens/s with 1 and with 16 concurrent streams.

Run: ``python -m kvflow.benchmarks.streams`` (figures recorded in docs/benchmarks.md)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx

from kvflow.benchmarks.client import run_load
from kvflow.shared.infra import free_port, wait_for_http

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Write a long story about a lighthouse keeper and the sea."


def main() -> int:
    port = free_port()
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvflow.cli.main", "serve", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_for_http(f"{base}/health", proc, "kvflow serve")
        except RuntimeError as e:
            print(e, file=sys.stderr)
            return 1
        ready = time.monotonic() - t0
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    break
        first = time.monotonic() - t0
        print(f"kvflow serve -> ready {ready:.1f} s, -> first streamed token {first:.1f} s")
        for conc in (1, 16):
            s = asyncio.run(
                run_load(base, MODEL, [(PROMPT, 128)] * conc, conc, name=f"{conc} streams")
            )
            print(
                f"{conc:>2} streams: {s.output_tokens_per_s:.1f} output tok/s, "
                f"TTFT p50 {s.ttft_p50_s:.2f} s, TPOT p50 {s.tpot_p50_s * 1000:.0f} ms"
            )
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
