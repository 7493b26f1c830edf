"""Beam search over the pipeline, as vLLM V1 does it: each step asks the engine for one token of
every live beam with its top ``2 * width`` log-probabilities; beams share their prompt's and
their common prefix's KV blocks through the prefix cache (full blocks, counted as prefix hits),
so only each beam's last partial block and new token are computed.

The selection follows Hugging Face's ``generate(num_beams=..., do_sample=False)``: every step
takes the top ``2 * width`` continuations of all beams by cumulative log-probability; those among
the best ``width`` that end (EOS, or the length limit) become finished hypotheses scored
``cumulative / generated_length ** length_penalty``; the best ``width`` that do not end go on;
the search stops when no running beam can beat the worst of ``width`` finished ones (HF's
default ``early_stopping=False`` heuristic) or at ``max_tokens``. Pure logic: the caller passes
``expand``, which runs one step for a list of token sequences.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from kvflow.shared.messages import SamplingParams

# expand(sequences, k) -> for each sequence (prompt + beam tokens), its top-k (token, logprob)
Expand = Callable[[list[list[int]], int], Awaitable[list[list[tuple[int, float]]]]]


@dataclass
class Beam:
    tokens: list[int]  # generated tokens (the prompt not included)
    logprobs: list[float] = field(default_factory=list)  # each token's log-probability
    cum_logprob: float = 0.0
    finished: bool = False
    score: float = 0.0  # cum_logprob / len(tokens) ** length_penalty, once finished


def score(cum_logprob: float, length: int, length_penalty: float) -> float:
    return cum_logprob / (max(1, length) ** length_penalty)


def step_params(k: int) -> SamplingParams:
    """What ``expand`` asks the engine for, per sequence: one greedy token with its top ``k``
    log-probabilities (EOS ignored: the search decides what ends a beam)."""
    return SamplingParams(max_tokens=1, temperature=0.0, logprobs=k, ignore_eos=True)


def top_pairs(top_ids: Sequence[int], top: Sequence[tuple[str, float]]) -> list[tuple[int, float]]:
    """A step's top-k as ``expand`` returns it: (token id, logprob) pairs, from a delta's or
    a completion's logprobs (token ids, and (token string, logprob) pairs)."""
    return list(zip(top_ids, [v for _, v in top], strict=True))


def ended_by_eos(beam: Beam, eos_token_ids: Sequence[int], ignore_eos: bool) -> bool:
    """Whether ``beam`` ends with an EOS token (its text then leaves the token out, unless
    asked to keep it)."""
    return bool(beam.tokens) and beam.tokens[-1] in eos_token_ids and not ignore_eos


async def beam_search(
    prompt: Sequence[int],
    expand: Expand,
    width: int,
    max_tokens: int,
    eos_token_ids: Sequence[int] = (),
    length_penalty: float = 1.0,
    ignore_eos: bool = False,
) -> list[Beam]:
    """The ``width`` best finished beams, best first."""
    if width < 1 or max_tokens < 1:
        raise ValueError("beam_width and max_tokens must be at least 1")
    k = 2 * width
    eos = set() if ignore_eos else set(eos_token_ids)
    running = [Beam([])]
    finished: list[Beam] = []
    for step in range(max_tokens):
        tops = await expand([list(prompt) + b.tokens for b in running], k)
        candidates = [
            (b.cum_logprob + lp, i, tok, lp)
            for i, (b, top) in enumerate(zip(running, tops, strict=True))
            for tok, lp in top
        ]
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        candidates = candidates[:k]
        last_step = step == max_tokens - 1
        new_running: list[Beam] = []
        for rank, (cum, i, tok, lp) in enumerate(candidates):
            parent = running[i]
            beam = Beam([*parent.tokens, tok], [*parent.logprobs, lp], cum)
            if tok in eos or last_step:
                if rank < width:  # only the top ``width`` may finish (HF)
                    beam.finished = True
                    beam.score = score(cum, len(beam.tokens), length_penalty)
                    finished.append(beam)
            elif len(new_running) < width:
                new_running.append(beam)
        finished.sort(key=lambda b: -b.score)
        del finished[width:]
        running = new_running
        if not running or last_step:
            break
        if len(finished) == width:
            best_possible = score(running[0].cum_logprob, step + 1, length_penalty)
            if best_possible <= finished[-1].score:
                break
    return finished
