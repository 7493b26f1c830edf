"""``kvflow bench tp``: what a tensor-parallel worker costs or gains. One ``kvflow serve
--tensor-parallel-size N`` per size in ``--tp-sizes`` (one worker; ``--threads 0`` gives each
rank its share of the cores), then batches of 1 and ``--tp-batch`` requests sent at once
(ignore_eos, the same prompt and max_tokens). Reports output tokens/s and time per output token
(TPOT, about one decode step) per size, best of ``--tp-rounds`` rounds each, and the ratio to
the first size."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time

import httpx

from kvflow.benchmarks.client import RunSummary, one_request, summarize
from kvflow.shared.model_source import resolve_model

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp-sizes", default="1,2", help="tensor-parallel sizes to compare")
    p.add_argument("--tp-batch", type=int, default=16, help="requests of the larger batch")
    p.add_argument("--tp-max-tokens", type=int, default=64, help="max_tokens of each request")
    p.add_argument("--tp-rounds", type=int, default=3, help="rounds per configuration (best)")


async def _batch(url: str, model: str, n: int, max_tokens: int) -> RunSummary:
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        stats = await asyncio.gather(
            *(one_request(client, url, model, PROMPT, max_tokens) for _ in range(n))
        )
        return summarize("tp", n, list(stats), time.perf_counter() - t0)


def main(args: argparse.Namespace) -> int:
    from kvflow.benchmarks.stack import start_stack

    src = resolve_model(args.model)
    sizes = [int(s) for s in args.tp_sizes.split(",") if s.strip()]
    batches = sorted({1, args.tp_batch})
    rows: list[tuple[int, int, RunSummary]] = []
    for size in sizes:
        print(f"starting kvflow serve --tensor-parallel-size {size} ...", flush=True)
        flags = ["--tensor-parallel-size", str(size), "--max-num-seqs", str(max(batches))]
        proc, url = start_stack(args.serve_args.split() + flags)
        try:
            asyncio.run(_batch(url, src.name, 2, 2))  # warm-up, not counted
            for n in batches:
                best = None
                for r in range(args.tp_rounds):
                    s = asyncio.run(_batch(url, src.name, n, args.tp_max_tokens))
                    print(
                        f"  TP={size} batch {n}, round {r + 1}: {s.output_tokens_per_s:.1f} tok/s, "
                        f"TPOT p50 {s.tpot_p50_s * 1000:.1f} ms",
                        flush=True,
                    )
                    if best is None or s.output_tokens_per_s > best.output_tokens_per_s:
                        best = s
                assert best is not None
                rows.append((size, n, best))
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
    print(f"\n{args.tp_max_tokens} tokens per request, best of {args.tp_rounds} rounds")
    print(
        f"{'TP':>3} {'batch':>6} {'tok/s':>8} {'TPOT p50 ms':>12} {'tok/s vs TP=' + str(sizes[0]):>14}"
    )
    for size, n, s in rows:
        base = next(b for sz, bn, b in rows if sz == sizes[0] and bn == n)
        ratio = s.output_tokens_per_s / base.output_tokens_per_s
        print(
            f"{size:>3} {n:>6} {s.output_tokens_per_s:>8.1f} {s.tpot_p50_s * 1000:>12.1f} "
            f"{ratio:>13.2f}x"
        )
    return 0
