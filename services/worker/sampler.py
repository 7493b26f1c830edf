"""Batched token sampling: one row of logits per sequence that samples this step, after the
features' logits processors (shared/sampling/processors.py) have changed the rows.

Every transform works row by row (sorts, cumsums and softmaxes along the vocab of one row), and
a seeded request draws its noise from its own ``torch.Generator`` with a fixed-size draw per
step, so a seeded request gets the same tokens whatever else is in the batch. Sampling uses the
exponential race (``argmax(p / q)``, q ~ Exp(1)), which is exactly sampling from ``p``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shared.messages import SampleLogprobs, SamplingParams, ScheduledSeq
from shared.sampling import GREEDY_EPS


@dataclass
class SamplingBatch:
    """Per-row sampling settings as tensors, built once per step by ``make_batch``."""

    temperature: torch.Tensor  # [S] float; rows below GREEDY_EPS are greedy
    top_p: torch.Tensor  # [S] float, 1.0 = off
    top_k: torch.Tensor  # [S] long, 0 = off
    min_p: torch.Tensor  # [S] float, 0.0 = off
    generators: list[torch.Generator | None]  # per row; None = the shared default RNG
    all_greedy: bool
    needs_top_k_top_p: bool
    needs_min_p: bool


def make_batch(
    params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None] | None = None
) -> SamplingBatch:
    temp = torch.tensor([float(p.temperature) for p in params], dtype=torch.float32)
    top_p = torch.tensor([float(p.top_p) for p in params], dtype=torch.float32)
    top_k = torch.tensor([max(int(p.top_k), 0) for p in params], dtype=torch.long)
    min_p = torch.tensor([float(p.min_p) for p in params], dtype=torch.float32)
    greedy = temp < GREEDY_EPS
    sampled = ~greedy
    return SamplingBatch(
        temperature=temp,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        generators=list(generators) if generators is not None else [None] * len(params),
        all_greedy=bool(greedy.all()),
        needs_top_k_top_p=bool(((top_k > 0) | (top_p < 1.0))[sampled].any()),
        needs_min_p=bool((min_p > 0)[sampled].any()),
    )


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the top token's."""
    probs = torch.softmax(logits, dim=-1)
    thresh = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < thresh, float("-inf"))


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Keep the top-k tokens, then the minimal nucleus whose probability reaches top_p (the
    top token is always kept)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    rank = torch.arange(vocab)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    sorted_logits = sorted_logits.masked_fill(rank >= k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
    drop = (before >= top_p[:, None]) & (rank > 0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Pick one token per row of ``logits`` [S, V] (fp32). Returns [S] long."""
    logits = logits.float()
    greedy_tokens = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy_tokens
    greedy = batch.temperature < GREEDY_EPS
    temp = torch.where(greedy, 1.0, batch.temperature)
    x = logits / temp[:, None]
    if batch.needs_min_p:
        x = _apply_min_p(x, batch.min_p)
    if batch.needs_top_k_top_p:
        x = _apply_top_k_top_p(x, batch.top_k, batch.top_p)
    probs = torch.softmax(x, dim=-1)
    q = torch.empty_like(probs)
    shared = [i for i, g in enumerate(batch.generators) if g is None and not greedy[i]]
    if shared:
        q[shared] = torch.empty(len(shared), probs.shape[1]).exponential_()
    for i, g in enumerate(batch.generators):
        if g is not None and not greedy[i]:
            q[i] = torch.empty(probs.shape[1]).exponential_(generator=g)
    q[greedy] = 1.0
    random_tokens = (probs / q.clamp_min(1e-20)).argmax(dim=-1)
    return torch.where(greedy, greedy_tokens, random_tokens)


def logprobs_of(
    raw: torch.Tensor, asking: list[tuple[ScheduledSeq, int]], requests: Mapping[str, Any]
) -> list[SampleLogprobs]:
    """Log-probabilities of the model's raw distribution (before penalties, bias or
    temperature, as vLLM reports them) for each sampled token, plus the top ``logprobs``."""
    lp = torch.log_softmax(raw.float(), dim=-1)
    out = []
    for row, (s, tok) in enumerate(asking):
        k = min(int(requests[s.request_id].params.logprobs or 0), 20)
        top_v, top_i = lp[row].topk(k) if k else (lp[row][:0], lp[row][:0].long())
        out.append(SampleLogprobs(float(lp[row, tok]), top_i.tolist(), top_v.tolist()))
    return out
