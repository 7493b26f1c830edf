"""Disaggregated against aggregated serving on the same workload: TTFT, time per output token
and throughput of each, and the KV transfer throughput between prefill and decode workers.

    python -m kvflow.benchmarks.disagg [--num-requests 16] [--concurrency 4]

Both stacks get the same cores: aggregated is one ``both`` worker with every core, disaggregated
is one prefill and one decode worker with half the cores each. The workload is the bench's
(prompts of real text, mixed lengths, greedy, EOS ignored), run with a bounded number of
requests in flight so that TTFT measures a request's own path, not a queue.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

import httpx

from kvflow.benchmarks.client import RunSummary, run_load
from kvflow.benchmarks.serving import make_workload
from kvflow.benchmarks.stack import start_stack
from kvflow.shared.config import Settings
from kvflow.shared.model_source import load_tokenizer, resolve_model


def run_one(
    name: str, serve_args: list[str], workload, model: str, concurrency: int
) -> tuple[RunSummary, dict]:
    print(f"starting kvflow serve {' '.join(serve_args)} ...", flush=True)
    proc, url = start_stack(serve_args)
    try:
        summary = asyncio.run(run_load(url, model, workload, concurrency, name=name))
        stats = httpx.get(f"{url}/stats", timeout=10).json()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    return summary, stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvflow.benchmarks.disagg", description=__doc__)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--prompt-len", default="200:1000")
    p.add_argument("--max-tokens", default="16:64")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    span = lambda s: tuple(int(x) for x in s.split(":"))  # noqa: E731
    src = resolve_model()
    tok = load_tokenizer(src, Settings.from_env().ops.cache_root())
    workload = make_workload(
        tok, args.num_requests, args.seed, span(args.prompt_len), span(args.max_tokens)
    )
    common = ["--max-model-len", "2048"]
    runs = [
        ("aggregated", common),
        ("disaggregated", [*common, "--prefill-workers", "1", "--decode-workers", "1"]),
    ]
    rows = []
    for name, serve_args in runs:
        summary, stats = run_one(name, serve_args, workload, src.name, args.concurrency)
        rows.append((summary, stats))
    print(
        f"\nworkload: {args.num_requests} requests, prompts {args.prompt_len} tokens, "
        f"max_tokens {args.max_tokens}, {args.concurrency} in flight, greedy, EOS ignored\n"
    )
    print("| mode | output tok/s | TTFT p50 (s) | TTFT p99 (s) | TPOT p50 (s) | TPOT p99 (s) |")
    print("|---|---:|---:|---:|---:|---:|")
    for s, _ in rows:
        print(
            f"| {s.name} | {s.output_tokens_per_s:.1f} | {s.ttft_p50_s:.2f} | {s.ttft_p99_s:.2f} "
            f"| {s.tpot_p50_s:.3f} | {s.tpot_p99_s:.3f} |"
        )
    st = rows[1][1]
    n, mb, secs = st["kv_transfers"], st["kv_transfer_bytes"] / 2**20, st["kv_transfer_seconds"]
    if n:
        print(
            f"\nKV transfers: {n} ({st['kv_transfer_failures']} failed), {mb:.1f} MiB in "
            f"{secs:.2f} s of transfer time: {mb / secs:.0f} MiB/s per transfer on average, "
            f"{mb / n:.1f} MiB per request"
        )
    agg, dis = rows[0][0], rows[1][0]
    print(
        f"TTFT cost of disaggregation: p50 {dis.ttft_p50_s - agg.ttft_p50_s:+.2f} s, "
        f"p99 {dis.ttft_p99_s - agg.ttft_p99_s:+.2f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
