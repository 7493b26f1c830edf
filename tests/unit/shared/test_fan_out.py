"""shared/fan_out.py: the n/best_of expansion (ids, seeds) and the ranking that the gateway and
the Python API share; exact ids, seeds and orders, no network."""

from __future__ import annotations

from kvflow.shared.fan_out import (
    best,
    best_per_prompt,
    cumulative_logprob,
    expand,
    ranks,
    sequences_per_prompt,
)
from kvflow.shared.messages import GenerateRequest, SamplingParams, TokenLogprob


def gen(rid: str, seed: int | None = None, prompt: str = "p") -> GenerateRequest:
    return GenerateRequest(rid, "inbox", SamplingParams(max_tokens=4, seed=seed), prompt=prompt)


def lp(value: float) -> TokenLogprob:
    return TokenLogprob(" x", value, [], 7)


def test_one_sequence_keeps_its_request() -> None:
    req = gen("r")
    assert expand([req], 1) == [req]
    assert expand([req], 1)[0] is req


def test_sequences_are_numbered_across_prompts_and_seeded_per_prompt() -> None:
    kids = expand([gen("r", 10, "a"), gen("r", 10, "b")], 3)
    assert [k.request_id for k in kids] == [f"r-{i}" for i in range(6)]
    assert [k.prompt for k in kids] == ["a"] * 3 + ["b"] * 3
    assert [k.params.seed for k in kids] == [10, 11, 12, 10, 11, 12]
    unseeded = expand([gen("q")], 2)
    assert [(k.request_id, k.params.seed) for k in unseeded] == [("q-0", None), ("q-1", None)]
    two_prompts = expand([gen("r", prompt="a"), gen("r", prompt="b")], 1)
    assert [k.request_id for k in two_prompts] == ["r-0", "r-1"]


def test_counts_and_when_to_rank() -> None:
    assert sequences_per_prompt(2, None) == 2 and sequences_per_prompt(2, 5) == 5
    assert not ranks(2, None) and not ranks(2, 2) and ranks(2, 3)


def test_best_keeps_the_highest_first_and_ties_in_order() -> None:
    assert best([-3.0, -1.0, -2.0, -1.0], 2, lambda x: x) == [-1.0, -1.0]
    named = [("a", -1.0), ("b", -0.5), ("c", -1.0), ("d", -4.0)]
    assert best(named, 3, lambda t: t[1]) == [("b", -0.5), ("a", -1.0), ("c", -1.0)]
    assert best(named, 4, lambda t: t[1]) == named  # n of n: not reordered
    assert best([], 1, lambda x: x) == []


def test_best_per_prompt_ranks_each_prompt_alone() -> None:
    scores = [-5.0, -1.0, -3.0, -0.5, -9.0, -2.0]
    assert best_per_prompt(scores, 3, 2, lambda x: x) == [[-1.0, -3.0], [-0.5, -2.0]]
    assert best_per_prompt(scores, 2, 2, lambda x: x) == [[-5.0, -1.0], [-3.0, -0.5], [-9.0, -2.0]]


def test_cumulative_logprob_sums_and_counts_none_as_zero() -> None:
    assert cumulative_logprob([lp(-0.25), lp(-1.5)]) == -1.75
    assert cumulative_logprob([]) == 0.0 and cumulative_logprob(None) == 0.0
