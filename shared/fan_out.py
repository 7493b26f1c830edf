"""n and best_of: one request becomes several pipeline sequences, and the best come back.

The pipeline runs one sequence per GenerateRequest, so a request for ``best_of`` samples of
each of its prompts is expanded here into ``prompts x best_of`` requests, and the finished ones
are ranked here; the gateway (services/gateway/generation.py, legacy.py) and the Python API
(kvflow/llm.py) both go through this module so their ids, seeds and choices agree.

Rules (OpenAI's and vLLM's): sequence ``i = p * best_of + k`` (the k-th of prompt p) has the id
``<request id>-<i>`` when there is more than one sequence in all (a single one keeps the id) and,
when the request is seeded, the seed ``seed + k``; siblings share their prompt's KV blocks
through prefix caching. With ``best_of > n`` a prompt's ``n`` sequences with the highest
cumulative logprob (sum of the sampled tokens' logprobs, 0 with none) are kept, best first, ties
in sequence order."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import msgspec

from kvflow.shared.messages import GenerateRequest, TokenLogprob

T = TypeVar("T")


def sequences_per_prompt(n: int, best_of: int | None) -> int:
    """How many sequences each prompt runs: ``best_of`` when given, else ``n`` (a ``best_of``
    below ``n`` is the callers' validation's to refuse)."""
    return n if best_of is None else best_of


def ranks(n: int, best_of: int | None) -> bool:
    """Whether the sequences are ranked (and so need their sampled tokens' logprobs)."""
    return best_of is not None and best_of > n


def expand(prompts: Sequence[GenerateRequest], best_of: int) -> list[GenerateRequest]:
    """One pipeline request per sequence, prompt by prompt (the module's id and seed rules)."""
    if len(prompts) * best_of == 1:
        return list(prompts)
    out = []
    for p, gen in enumerate(prompts):
        for k in range(best_of):
            params = gen.params
            if params.seed is not None:
                params = msgspec.structs.replace(params, seed=params.seed + k)
            rid = f"{gen.request_id}-{p * best_of + k}"
            out.append(msgspec.structs.replace(gen, request_id=rid, params=params))
    return out


def cumulative_logprob(logprobs: Iterable[TokenLogprob] | None) -> float:
    """What ranking compares: the sum of the sampled tokens' logprobs (0 with none)."""
    return sum(lp.logprob for lp in logprobs or [])


def best(group: Sequence[T], n: int, score: Callable[[T], float]) -> list[T]:
    """The ``n`` of one prompt's sequences with the highest ``score`` (its cumulative logprob),
    best first, ties in sequence order; the whole group, in order, when it has ``n`` or fewer."""
    if len(group) <= n:
        return list(group)
    return sorted(group, key=score, reverse=True)[:n]


def best_per_prompt(
    finished: Sequence[T], best_of: int, n: int, score: Callable[[T], float]
) -> list[list[T]]:
    """``finished`` (every sequence, in ``expand``'s order) cut into prompts, each ranked by
    ``best``."""
    groups = [finished[i : i + best_of] for i in range(0, len(finished), best_of)]
    return [best(g, n, score) for g in groups]
