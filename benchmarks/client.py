"""Load a running kvflow (or any OpenAI-compatible server) with concurrent streamed requests and
report output tokens/s, requests/s, TTFT and time per output token. Used by ``kvflow bench``."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import httpx


@dataclass
class RequestStats:
    ttft_s: float
    latency_s: float
    output_tokens: int

    @property
    def tpot_s(self) -> float:
        return (self.latency_s - self.ttft_s) / max(1, self.output_tokens - 1)


@dataclass
class RunSummary:
    name: str
    concurrency: int
    requests: int
    duration_s: float
    output_tokens: int
    output_tokens_per_s: float
    requests_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    latency_mean_s: float = math.nan  # end to end: request sent to its last chunk

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[k]


async def one_request(
    client: httpx.AsyncClient,
    base: str,
    model: str,
    prompt: str | list[int],
    max_tokens: int,
    ignore_eos: bool = True,
) -> RequestStats:
    body: dict = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:  # a vLLM extension; servers without it get the field left out
        body["ignore_eos"] = True
    start = time.perf_counter()
    ttft = None
    tokens = chunks = 0
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):  # a failure reported inside a 200 stream (llama-server does)
                raise RuntimeError(f"{base}: {chunk['error']}")
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter() - start
    # servers that send no usage: one token per chunk with text (what streaming servers send)
    return RequestStats(ttft if ttft is not None else end, end, tokens or chunks)


async def run_load(
    base: str,
    model: str,
    workload: list[tuple[str | list[int], int]],
    concurrency: int,
    name: str = "kvflow",
    ignore_eos: bool = True,
    warmup: Sequence[str | list[int]] = (),
    warmup_tokens: int = 2,
) -> RunSummary:
    """Send every (prompt, max_tokens) of ``workload`` with at most ``concurrency`` in flight,
    after warm-up requests that are not counted: the ``warmup`` prompts all at once (default:
    the first prompt of the workload), ``warmup_tokens`` tokens each."""
    sem = asyncio.Semaphore(concurrency)
    done = 0

    # a new connection per request: llama-server (build 11434) exits after a streamed response
    # on a reused keep-alive connection now and then (seen with Gemma 3, 8 to 71 requests in);
    # every system gets the same client (a local connect costs well under a millisecond)
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        # warm-up first: lazy start-up work (model load on first use, allocator growth) is not
        # what the run measures
        warm = list(warmup) or [workload[0][0]]
        await asyncio.gather(
            *(one_request(client, base, model, p, warmup_tokens, ignore_eos) for p in warm)
        )

        async def guarded(p: str | list[int], n: int) -> RequestStats:
            nonlocal done
            async with sem:
                s = await one_request(client, base, model, p, n, ignore_eos)
                done += 1
                print(f"\r  {name}: {done}/{len(workload)} requests", end="", flush=True)
                return s

        t0 = time.perf_counter()
        stats = await asyncio.gather(*(guarded(p, n) for p, n in workload))
        dur = time.perf_counter() - t0
    print()
    return summarize(name, concurrency, list(stats), dur)


def summarize(
    name: str, concurrency: int, stats: list[RequestStats], duration: float
) -> RunSummary:
    """Throughput and latency percentiles of one run."""
    toks = sum(s.output_tokens for s in stats)
    ttft = [s.ttft_s for s in stats]
    tpot = [s.tpot_s for s in stats]
    return RunSummary(
        name=name,
        concurrency=concurrency,
        requests=len(stats),
        duration_s=duration,
        output_tokens=toks,
        output_tokens_per_s=toks / duration,
        requests_per_s=len(stats) / duration,
        ttft_p50_s=percentile(ttft, 50),
        ttft_p99_s=percentile(ttft, 99),
        tpot_p50_s=percentile(tpot, 50),
        tpot_p99_s=percentile(tpot, 99),
        latency_mean_s=sum(s.latency_s for s in stats) / len(stats) if stats else math.nan,
    )
