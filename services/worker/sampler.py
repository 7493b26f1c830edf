"""Batched token sampling: one row of logits per sequence that samples this step.

Every transform works row by row (sorts, cumsums and softmaxes along the vocab of one row), and
a seeded request draws its noise from its own ``torch.Generator`` with a fixed-size draw per
step, so a seeded request gets the same tokens whatever else is in the batch. Sampling uses the
exponential race (``argmax(p / q)``, q ~ Exp(1)), which is exactly sampling from ``p``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.messages import SamplingParams

_GREEDY_EPS = 1e-5  # temperatures below this are greedy (vLLM's rule)


@dataclass
class SamplingBatch:
    """Per-row sampling settings as tensors, built once per step by ``make_batch``."""

    temperature: torch.Tensor  # [S] float; rows below _GREEDY_EPS are greedy
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
    greedy = temp < _GREEDY_EPS
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


def apply_logit_bias(logits: torch.Tensor, row: int, bias: dict[int, float]) -> None:
    """OpenAI's ``logit_bias``: add each value to its token's logit (in place); ids outside
    the vocabulary are ignored (the gateway rejects them)."""
    vocab = logits.shape[-1]
    items = [(int(t), float(b)) for t, b in bias.items() if 0 <= int(t) < vocab]
    if items:
        ids = torch.tensor([t for t, _ in items])
        logits[row, ids] += torch.tensor([b for _, b in items], dtype=logits.dtype)


def allow_only_tokens(logits: torch.Tensor, row: int, token_ids: Sequence[int]) -> None:
    """vLLM's ``allowed_token_ids``: every other token of ``row`` is forbidden (in place)."""
    keep = torch.tensor([t for t in token_ids if 0 <= t < logits.shape[-1]], dtype=torch.long)
    mask = torch.ones(logits.shape[-1], dtype=torch.bool)
    mask[keep] = False
    logits[row, mask] = float("-inf")


def ban_bad_words(
    logits: torch.Tensor, row: int, words: Sequence[Sequence[int]], output: Sequence[int]
) -> None:
    """vLLM's ``bad_words``: forbid each word's last token where the output so far ends with
    the rest of the word (in place), so no banned token sequence is ever completed."""
    vocab = logits.shape[-1]
    banned = [
        w[-1]
        for w in words
        if w
        and len(w) - 1 <= len(output)
        and (len(w) == 1 or list(output[len(output) - len(w) + 1 :]) == list(w[:-1]))
        and 0 <= w[-1] < vocab
    ]
    if banned:
        kept = logits[row, banned].clone()
        logits[row, banned] = float("-inf")
        if not torch.isfinite(logits[row]).any():  # nothing left (allowed_token_ids): undo
            logits[row, banned] = kept


def suppress_tokens(logits: torch.Tensor, row: int, token_ids: Sequence[int]) -> None:
    """Forbid ``token_ids`` in ``row`` (in place); used to hold back EOS/stop ids before
    ``min_tokens`` outputs. Never forbids the last tokens a row has left (when
    ``allowed_token_ids`` holds only stop tokens, a stop token is the only answer)."""
    ids = [t for t in token_ids if 0 <= t < logits.shape[-1]]
    if not ids:
        return
    kept = logits[row, ids].clone()
    logits[row, ids] = float("-inf")
    if not torch.isfinite(logits[row]).any():
        logits[row, ids] = kept


def apply_penalties(
    logits: torch.Tensor,
    row: int,
    params: SamplingParams,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
) -> None:
    """vLLM's repetition (prompt + output tokens), presence and frequency (output tokens)
    penalties, in place on one row. The runner calls it only for rows that set one."""
    x = logits[row]
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_token_ids) | set(output_token_ids)), dtype=torch.long)
        if seen.numel():
            v = x[seen]
            pen = params.repetition_penalty
            x[seen] = torch.where(v > 0, v / pen, v * pen)
    if output_token_ids and (params.presence_penalty or params.frequency_penalty):
        ids = torch.tensor(list(output_token_ids), dtype=torch.long)
        counts = torch.bincount(ids, minlength=x.shape[0])[: x.shape[0]].to(x.dtype)
        x -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(x.dtype)


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
    greedy = batch.temperature < _GREEDY_EPS
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
