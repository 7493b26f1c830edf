"""Soak test: minutes of streamed load against kvflow, optionally with faults, counting every
request's fate and watching each process's memory.

    python loadtest/soak.py --duration 300 --concurrency 8            # starts kvflow serve
    python loadtest/soak.py --url http://127.0.0.1:8000 --duration 600
    python loadtest/soak.py --duration 300 --chaos 60 \\
        --serve-args "--prefill-workers 1 --decode-workers 2 --schedulers 2"

Each request streams a completion of exactly ``max_tokens`` tokens (``ignore_eos``) with
``logprobs: 0``, so every token arrives with its own logprob entry and can be counted. At the
end it reports:

- sent: requests started;
- completed: finished with finish_reason "length" and exactly max_tokens tokens, each once;
- failed: ended with an HTTP error or an error event (told to the client, e.g. 429 or 503);
- duplicated: more tokens than asked, or usage disagreeing with the tokens received;
- lost: neither (no final chunk and no error by the deadline) -- must be 0.

With ``--chaos N`` (only when it starts the stack) it SIGKILLs a random worker every N seconds
(`kvflow serve` starts it again); `kvflow bench chaos` runs faults of every role, with the
texts checked. Memory: every ``--sample`` seconds the RSS of each process of
the stack it started (or of ``--pids``) is recorded; the report gives start / peak / end.
Not part of CI (it runs for minutes); its figures go into the notes and docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvflow.benchmarks.chaos import rss_mib, service_pids  # noqa: E402
from kvflow.benchmarks.stack import logged_stack  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"


async def one(
    client: httpx.AsyncClient, base: str, i: int, max_tokens: int, deadline: float
) -> str:
    body = {
        "model": MODEL,
        "prompt": f"Request {i}: write about the number {i} and the sea.",
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "logprobs": 0,
        "stream_options": {"include_usage": True},
    }
    tokens = 0
    finish = None
    usage = None
    try:
        async with asyncio.timeout(deadline):
            async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    return "failed"
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return "failed"
                    if chunk.get("usage"):
                        usage = chunk["usage"]["completion_tokens"]
                    for c in chunk.get("choices", []):
                        lp = c.get("logprobs") or {}
                        tokens += len(lp.get("tokens") or [])
                        finish = c.get("finish_reason") or finish
    except TimeoutError:
        return "lost"
    except httpx.HTTPError:
        return "failed"
    if finish is None:
        return "lost"
    if tokens > max_tokens or (usage is not None and usage != tokens):
        return "duplicated"
    if finish == "length" and tokens == max_tokens:
        return "completed"
    return "failed"


async def soak(args: argparse.Namespace, base: str, nats_url: str | None) -> int:
    rng = random.Random(args.seed)
    fates: Counter[str] = Counter()
    memory: dict[str, list[float]] = {}
    stop_at = time.monotonic() + args.duration
    sent = 0
    sem = asyncio.Semaphore(args.concurrency)
    tasks: set[asyncio.Task] = set()

    async def sampler() -> None:
        while time.monotonic() < stop_at + 30:
            pids = service_pids(nats_url) if nats_url else dict(p.split("=") for p in args.pids)
            for name, pid in pids.items():
                mib = rss_mib(int(pid))
                if mib is not None:
                    memory.setdefault(name, []).append(mib)
            await asyncio.sleep(args.sample)

    async def chaos() -> None:
        while nats_url and args.chaos and time.monotonic() < stop_at:
            await asyncio.sleep(args.chaos)
            workers = [p for n, p in service_pids(nats_url).items() if n.startswith("worker")]
            if workers:
                victim = rng.choice(workers)
                print(f"\nchaos: SIGKILL worker pid {victim}", flush=True)
                os.kill(victim, signal.SIGKILL)

    async def run_one(i: int, n: int) -> None:
        async with sem:
            fate = await one(client, base, i, n, args.request_deadline)
            fates[fate] += 1
            print(
                f"\r  sent {sent}  " + "  ".join(f"{k} {v}" for k, v in sorted(fates.items())),
                end="",
                flush=True,
            )

    async with httpx.AsyncClient(timeout=None) as client:
        side = [asyncio.create_task(sampler()), asyncio.create_task(chaos())]
        while time.monotonic() < stop_at:
            await sem.acquire()
            sem.release()
            sent += 1
            t = asyncio.create_task(run_one(sent, rng.randint(*args.max_tokens)))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
        for t in side:
            t.cancel()
    print()
    print(f"\nsoak: {args.duration:.0f} s, concurrency {args.concurrency}")
    print(
        f"sent {sent}, completed {fates['completed']}, failed {fates['failed']}, "
        f"duplicated {fates['duplicated']}, lost {fates['lost']}"
    )
    print("\n| process | RSS start (MiB) | peak | end |")
    print("|---|---:|---:|---:|")
    for name, xs in sorted(memory.items()):
        print(f"| {name} | {xs[0]:.0f} | {max(xs):.0f} | {xs[-1]:.0f} |")
    return 0 if fates["lost"] == 0 and fates["duplicated"] == 0 else 1


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", default=None, help="a running kvflow (default: start kvflow serve)")
    p.add_argument("--serve-args", default="", help="flags for the kvflow serve it starts")
    p.add_argument("--duration", type=float, default=300)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument(
        "--max-tokens", type=lambda s: tuple(int(x) for x in s.split(":")), default=(16, 64)
    )
    p.add_argument("--request-deadline", type=float, default=300)
    p.add_argument("--chaos", type=float, default=0, help="SIGKILL a worker every N seconds")
    p.add_argument("--sample", type=float, default=5.0, help="seconds between memory samples")
    p.add_argument("--pids", nargs="*", default=[], help="NAME=PID to watch with --url")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.url:
        return asyncio.run(soak(args, args.url, None))
    log_path = ROOT / "bench-results" / "soak-serve.log"
    with logged_stack(args.serve_args.split(), log_path, timeout=300) as (base, nats_url):
        return asyncio.run(soak(args, base, nats_url))


if __name__ == "__main__":
    sys.exit(main())
