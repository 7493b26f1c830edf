"""What a user would otherwise run on the same machine and model: Hugging Face transformers
``generate``, one request at a time and in static batches (left-padded, each batch running to its
longest request, as a static server must). Only useful tokens (each request's own max_tokens)
count towards throughput."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from services.bench_client import RunSummary, percentile
from shared.model_source import ModelSource


@dataclass
class Timed:
    ttft_s: float
    latency_s: float
    output_tokens: int


def load_hf(src: ModelSource):  # -> (model, pad_id)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    if src.kind == "gguf":
        model = AutoModelForCausalLM.from_pretrained(
            str(src.directory), gguf_file=src.path.name, dtype=torch.float32
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(str(src.path), dtype=torch.float32)
    return model.eval()


def _run_batch(model, batch: list[tuple[list[int], int]], pad_id: int) -> tuple[float, float]:
    """One static batch: (its prefill time, i.e. its time to first token; its whole time)."""
    width = max(len(p) for p, _ in batch)
    longest = max(n for _, n in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, (p, _) in enumerate(batch):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.no_grad():
        t0 = time.perf_counter()
        model(input_ids=ids, attention_mask=mask)  # the prefill alone, for TTFT
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=longest,
            min_new_tokens=longest,
            do_sample=False,
            pad_token_id=pad_id,
        )
        total = time.perf_counter() - t0
    return first, total


def static_batches(
    model, workload: list[tuple[list[int], int]], batch_size: int, pad_id: int, name: str
) -> RunSummary:
    """Requests in arrival order, ``batch_size`` at a time; every request of a batch waits for
    the batch before it (queueing) and for its batch's longest request."""
    clock = 0.0
    stats: list[Timed] = []
    for start in range(0, len(workload), batch_size):
        batch = workload[start : start + batch_size]
        first, total = _run_batch(model, batch, pad_id)
        stats += [Timed(clock + first, clock + total, n) for _, n in batch]
        clock += total
        print(
            f"\r  {name}: {min(start + batch_size, len(workload))}/{len(workload)} requests",
            end="",
            flush=True,
        )
    print()
    return summarize(name, batch_size, stats, clock)


def summarize(name: str, concurrency: int, stats: list[Timed], duration: float) -> RunSummary:
    toks = sum(s.output_tokens for s in stats)
    ttft = [s.ttft_s for s in stats]
    tpot = [(s.latency_s - s.ttft_s) / max(1, s.output_tokens - 1) for s in stats]
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
    )
