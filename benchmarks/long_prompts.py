"""Short requests beside long prompts: ``python -m kvflow.benchmarks.long_prompts``.

Starts ``kvflow serve`` (by default with the simulated worker, so that what is measured is the
pipeline's own work), then runs two phases of ``--seconds`` each: short streamed completions at
``--rate`` per second alone, then the same with one long prompt (``--long-kib`` KiB of text)
every ``--long-every`` seconds. Prints the short requests' TTFT (p50, p99, max) in each phase
and how long the long prompts took to be answered.

With the default model (SmolLM2, an 8k context) a long prompt of 256 KiB is tokenized (~60k
tokens) and then refused as longer than the context: the phase measures how long the short
requests wait behind a long prompt at the tokenizer, the wait a long-context model's valid
100k-token prompt causes there too.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import time

import httpx

from kvflow.benchmarks.client import one_request, percentile
from kvflow.benchmarks.stack import start_stack

LONG_TEXT = "The river bends past the old mill, and the water runs slow and brown. "


async def _phase(
    base: str, model: str, seconds: float, rate: float, long_every: float, long_kib: int
) -> dict[str, list[float]]:
    """TTFTs of the short requests and answer times of the long prompts sent in ``seconds``."""
    out: dict[str, list[float]] = {"short": [], "long": [], "long_status": []}
    long_prompt = LONG_TEXT * (long_kib * 1024 // len(LONG_TEXT))
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:

        async def short() -> None:
            s = await one_request(client, base, model, "Hello, how are", 4)
            out["short"].append(s.ttft_s)

        async def long() -> None:
            t = time.perf_counter()
            body = {"model": model, "prompt": long_prompt, "max_tokens": 4}
            r = await client.post(f"{base}/v1/completions", json=body)
            out["long"].append(time.perf_counter() - t)
            out["long_status"].append(r.status_code)

        tasks: list[asyncio.Task[None]] = []
        t0 = time.perf_counter()
        next_short, next_long = t0, t0 + long_every / 2
        while (now := time.perf_counter()) < t0 + seconds:
            if now >= next_short:
                tasks.append(asyncio.create_task(short()))
                next_short += 1 / rate
            if long_every > 0 and now >= next_long:
                tasks.append(asyncio.create_task(long()))
                next_long += long_every
            await asyncio.sleep(min(next_short, next_long if long_every > 0 else 1e9) - now)
        await asyncio.gather(*tasks)
    return out


def _row(name: str, xs: list[float]) -> str:
    ms = [x * 1000 for x in xs]
    return (
        f"{name:28s} {len(ms):5d} {percentile(ms, 50):9.1f} {percentile(ms, 99):9.1f} "
        f"{max(ms, default=float('nan')):9.1f}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each phase")
    ap.add_argument("--rate", type=float, default=20.0, help="short requests per second")
    ap.add_argument("--long-every", type=float, default=1.0, help="seconds between long prompts")
    ap.add_argument("--long-kib", type=int, default=256, help="size of a long prompt")
    ap.add_argument(
        "--serve-args",
        default="--worker-backend sim --sim-step-ms 5",
        help="arguments for `kvflow serve`",
    )
    args = ap.parse_args(argv)

    print(f"starting kvflow serve {args.serve_args} ...", flush=True)
    proc, base = start_stack(shlex.split(args.serve_args))
    try:
        model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        print(f"  short requests alone ({args.seconds:g} s) ...", flush=True)
        alone = asyncio.run(_phase(base, model, args.seconds, args.rate, 0, args.long_kib))
        print(f"  with a {args.long_kib} KiB prompt every {args.long_every:g} s ...", flush=True)
        mixed = asyncio.run(
            _phase(base, model, args.seconds, args.rate, args.long_every, args.long_kib)
        )
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    print(f"\n{'ms':28s} {'n':>5s} {'p50':>9s} {'p99':>9s} {'max':>9s}")
    print(_row("short TTFT, alone", alone["short"]))
    print(_row("short TTFT, beside long", mixed["short"]))
    print(_row("long prompt answered", mixed["long"]))
    print(f"long prompts' statuses: {sorted(set(mixed['long_status']))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
