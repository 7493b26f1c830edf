"""Batched token sampling where the logits are (the GPU on the device path, the CPU otherwise):
one row of logits per sequence that samples this step, after the features' logits processors
(shared/sampling/processors.py) have changed the rows.

Nothing here reads a value back from the device: the batch's settings are tensors made on the
logits' device from the requests' parameters (Python values), every branch is decided from
those parameters, and only the sampled ids (and the logprobs asked for) leave the device, once
per step. Every transform works row by row (sorts, cumsums and softmaxes along the vocab of one
row), and a seeded request draws its noise from its own ``torch.Generator`` (on the logits'
device) with a fixed-size draw per step, so a seeded request gets the same tokens whatever else
is in the batch. Sampling uses the exponential race (``argmax(p / q)``, q ~ Exp(1)), which is
exactly sampling from ``p``. Greedy rows skip temperature, top-k/top-p/min-p and the draw
(they cannot change a greedy row's argmax), as vLLM's sampler does.
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
    """Per-row sampling settings as tensors on the logits' device, built once per step by
    ``make_batch``; the flags and ``greedy`` are the parameters' own (host) values."""

    temperature: torch.Tensor  # [S] float; 1.0 for greedy rows
    top_p: torch.Tensor  # [S] float, 1.0 = off
    top_k: torch.Tensor  # [S] long, 0 = off
    min_p: torch.Tensor  # [S] float, 0.0 = off
    greedy_rows: torch.Tensor  # [S] bool
    greedy: list[bool]  # per row, as decided from the parameters
    generators: list[torch.Generator | None]  # per row; None = the device's default RNG
    all_greedy: bool
    needs_top_k_top_p: bool
    needs_min_p: bool


def make_batch(
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None] | None = None,
    device: torch.device | str = "cpu",
) -> SamplingBatch:
    """The rows' settings on ``device`` (where the logits are); a seeded row's generator must
    live on that device too."""
    greedy = [float(p.temperature) < GREEDY_EPS for p in params]
    sampled = [p for p, g in zip(params, greedy, strict=True) if not g]
    temperature = [1.0 if g else float(p.temperature) for p, g in zip(params, greedy, strict=True)]

    def on(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    return SamplingBatch(
        temperature=on(temperature, torch.float32),
        top_p=on([float(p.top_p) for p in params], torch.float32),
        top_k=on([max(int(p.top_k), 0) for p in params], torch.long),
        min_p=on([float(p.min_p) for p in params], torch.float32),
        greedy_rows=on(greedy, torch.bool),
        greedy=greedy,
        generators=list(generators) if generators is not None else [None] * len(params),
        all_greedy=not sampled,
        needs_top_k_top_p=any(p.top_k > 0 or p.top_p < 1.0 for p in sampled),
        needs_min_p=any(p.min_p > 0 for p in sampled),
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
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    sorted_logits = sorted_logits.masked_fill(rank >= k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
    drop = (before >= top_p[:, None]) & (rank > 0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Pick one token per row of ``logits`` [S, V]; returns [S] long on the logits' device."""
    logits = logits.float()
    greedy_tokens = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy_tokens
    x = logits / batch.temperature[:, None]
    if batch.needs_min_p:
        x = _apply_min_p(x, batch.min_p)
    if batch.needs_top_k_top_p:
        x = _apply_top_k_top_p(x, batch.top_k, batch.top_p)
    probs = torch.softmax(x, dim=-1)
    q = torch.ones_like(probs)
    rows = [(i, g) for i, g in enumerate(batch.generators) if not batch.greedy[i]]
    shared = [i for i, g in rows if g is None]
    if len(shared) == len(probs):
        q.exponential_()
    elif shared:
        q[shared] = torch.empty_like(q[shared]).exponential_()
    for i, g in rows:
        if g is not None:
            q[i].exponential_(generator=g)
    random_tokens = (probs / q.clamp_min(1e-20)).argmax(dim=-1)
    return torch.where(batch.greedy_rows, greedy_tokens, random_tokens)


def logprobs_of(
    raw: torch.Tensor, asking: list[tuple[ScheduledSeq, int]], requests: Mapping[str, Any]
) -> list[SampleLogprobs]:
    """Log-probabilities of the model's raw distribution (before penalties, bias or
    temperature, as vLLM reports them) for each sampled token, plus the top ``logprobs``.
    Computed where ``raw`` is; one copy of the results to the host."""
    lp = torch.log_softmax(raw.float(), dim=-1)
    ks = [min(int(requests[s.request_id].params.logprobs or 0), 20) for s, _ in asking]
    toks = torch.tensor([t for _, t in asking], dtype=torch.long).to(lp.device)
    chosen = lp.gather(1, toks[:, None])[:, 0].tolist()
    top_v, top_i = lp.topk(max(ks), dim=-1) if max(ks, default=0) else (lp[:, :0], lp[:, :0].long())
    top_v, top_i = top_v.tolist(), top_i.tolist()
    return [SampleLogprobs(chosen[r], top_i[r][:k], top_v[r][:k]) for r, k in enumerate(ks)]
