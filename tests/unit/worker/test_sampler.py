"""Sampler: greedy rules, seeded reproducibility independent of the batch, top-k/top-p/min-p
filtering and penalties, with exact token ids."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hs

from kvflow.services.worker import sampler
from kvflow.shared.messages import SamplingParams
from kvflow.shared.sampling import PROCESSORS, apply_processors, needs_token_history, processors


def batch(params: list[SamplingParams], position: int = 0) -> sampler.SamplingBatch:
    """Every row drawing its output token ``position`` (what a seeded row's uniform is for)."""
    return sampler.make_batch([sampler.draw_row(p) for p in params], [position] * len(params))


def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(0))
    out = sampler.sample(logits, batch([SamplingParams(temperature=0.0)] * 6))
    assert out.tolist() == logits.argmax(-1).tolist()


def test_top_k_1_is_greedy_even_when_hot() -> None:
    logits = torch.randn(4, 500, generator=torch.Generator().manual_seed(1))
    p = [SamplingParams(temperature=5.0, top_k=1)] * 4
    for _ in range(5):
        assert sampler.sample(logits, batch(p)).tolist() == logits.argmax(-1).tolist()


def test_greedy_and_random_rows_mix() -> None:
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(2))
    p = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=7),
        SamplingParams(temperature=0.0),
    ]
    out = sampler.sample(logits, batch(p))
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_seeded_is_reproducible_and_batch_independent() -> None:
    g = torch.Generator().manual_seed(3)
    row = torch.randn(1, 2000, generator=g)
    others = torch.randn(5, 2000, generator=g)
    hot = SamplingParams(temperature=1.3, top_p=0.9, top_k=50, seed=42)

    def draws(logits: torch.Tensor, row_idx: int, params: list[SamplingParams]) -> list[int]:
        """The row's tokens for output positions 0..19, one step each."""
        return [int(sampler.sample(logits, batch(params, n))[row_idx]) for n in range(20)]

    alone = draws(row, 0, [hot])
    assert alone == draws(row, 0, [hot])
    mixed = torch.cat([others[:2], row, others[2:]])
    params = [SamplingParams(temperature=0.7, seed=9), SamplingParams(temperature=0.0), hot]
    params += [SamplingParams(temperature=1.0), SamplingParams(temperature=2.0, min_p=0.1, seed=1)]
    params += [SamplingParams()]
    assert draws(mixed, 2, params) == alone
    assert len(set(alone)) > 1  # really random, not stuck on the argmax
    other_seed = SamplingParams(temperature=1.3, top_p=0.9, top_k=50, seed=43)
    assert draws(row, 0, [other_seed]) != alone
    # a position's draw depends on (seed, position) alone: resumed at position 7 (after a
    # preemption, on another worker, after drafts were rejected) it goes on as it would have
    assert [int(sampler.sample(row, batch([hot], n))[0]) for n in range(7, 20)] == alone[7:]


@settings(max_examples=100, deadline=None)
@given(
    hs.lists(
        hs.tuples(hs.integers(-(2**70), 2**70), hs.integers(0, 2**40)), min_size=1, max_size=40
    )
)
def test_a_batch_s_uniforms_are_counter_uniform_bit_for_bit(rows: list[tuple[int, int]]) -> None:
    """make_batch computes the seeded rows' uniforms together (numpy's wrapping uint64): the
    same bits as ``counter_uniform`` one row at a time, for any seed (negative, past 64 bits)
    and position, with unseeded and greedy rows between them."""
    params, positions = [], []
    for seed, pos in rows:
        params += [SamplingParams(temperature=0.9, seed=seed), SamplingParams(temperature=0.5)]
        params.append(SamplingParams(temperature=0.0, seed=seed))  # greedy: draws nothing
        positions += [pos, pos, pos]
    b = sampler.make_batch([sampler.draw_row(p) for p in params], positions)
    assert b.seeded is not None and b.seeded_u is not None
    assert b.seeded.tolist() == [3 * i for i in range(len(rows))]
    want = [sampler.counter_uniform(seed, pos) for seed, pos in rows]
    assert b.seeded_u.dtype == torch.float64 and b.seeded_u.tolist() == want


def kept(logits: torch.Tensor, top_k: list[int], top_p: list[float], width: int = 0):
    """The token ids each row keeps after top-k and top-p, sorted."""
    vals, ids = sampler._candidates(logits, torch.tensor(top_k), torch.tensor(top_p), width)
    return [sorted(ids[r][torch.isfinite(vals[r])].tolist()) for r in range(len(logits))]


def test_top_p_keeps_minimal_nucleus() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]])
    assert kept(probs.log(), [0, 0, 0], [0.8, 0.81, 0.5]) == [
        [0, 1],  # 0.5 + 0.3 reaches 0.8
        [0, 1, 2],  # 0.81 needs the third token
        [3],  # top token alone has 0.5
    ]


def test_top_p_after_top_k_is_over_the_top_k() -> None:
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]] * 2)
    # top-2 renormalised: 0.571, 0.429; top_p 0.55 keeps only the first, 0.6 both
    assert kept(probs.log(), [2, 2], [0.55, 0.6], width=2) == [[0], [0, 1]]
    assert kept(probs.log(), [2, 0], [0.55, 0.6]) == [[0], [0, 1]]  # the other row: no top-k


@pytest.mark.parametrize("guess", [3, 200], ids=["guess-too-small", "guess-holds-the-nucleus"])
def test_the_cpu_nucleus_guess_equals_a_whole_sort(monkeypatch, guess: int) -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(7, 400, generator=g) * 4
    # a row whose best 20 hold ~0.9 and a long flat tail the rest: its nucleus is measured
    # against the whole row, not the best ``guess`` alone
    logits[6] = -1.0 + 0.01 * torch.randn(400, generator=g)
    logits[6, :20] = 4.0 + torch.linspace(0, 1, 20)
    top_k, top_p = [0, 0, 7, 0, 300, 0, 0], [0.9, 0.5, 0.95, 0.999, 0.8, 0.3, 0.85]
    monkeypatch.setattr(sampler, "NUCLEUS_GUESS", 10**6)  # always the whole-row sort
    want = kept(logits, top_k, top_p)
    monkeypatch.setattr(sampler, "NUCLEUS_GUESS", guess)
    assert kept(logits, top_k, top_p) == want
    held = sampler._best(logits, torch.tensor(top_k), torch.tensor(top_p), 0)[2]
    assert (held is None) == (guess == 3)  # 3 tokens hold too little: a whole-row sort
    assert max(len(w) for w in want) == 187 and len(want[6]) == 18


def _frequencies(params: SamplingParams, logits: torch.Tensor, draws: int) -> torch.Tensor:
    rows = logits.expand(draws, -1)
    out = sampler.sample(rows, batch([params] * draws))
    return torch.bincount(out, minlength=logits.shape[-1]).double() / draws


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=3),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=1.0, top_p=0.9, top_k=4, min_p=0.05),
    ],
    ids=["plain", "top-k", "top-p", "all"],
)
def test_draws_follow_the_filtered_distribution(params: SamplingParams) -> None:
    """40,000 draws of one row: each token's frequency within 5 standard errors of its
    probability after temperature, min-p, top-k and top-p (computed here from their
    definitions), and no token outside them ever drawn."""
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.5, 1.2, 0.3, 0.0, -0.5, -1.0, -3.0]])
    p = torch.softmax(logits[0] / params.temperature, -1).double()
    keep = torch.ones(8, dtype=torch.bool)
    if params.min_p:
        keep &= p >= params.min_p * p.max()
    order = p.argsort(descending=True)
    if params.top_k:
        keep[order[params.top_k :]] = False
    q = torch.where(keep, p, 0.0)
    q /= q.sum()
    before = torch.cumsum(q[order], 0) - q[order]
    keep[order[(before >= params.top_p) & (torch.arange(8) > 0)]] = False
    want = torch.where(keep, q, 0.0)
    want /= want.sum()
    got = _frequencies(params, logits, 40_000)
    sigma = (want * (1 - want) / 40_000).sqrt()
    assert ((got - want).abs() <= 5 * sigma + 1e-12).all(), (got, want)
    assert (got[~keep] == 0).all()


def test_top_p_samples_only_from_nucleus() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0, -2.0]])
    seen = set()
    b = batch([SamplingParams(temperature=1.0, top_p=0.6)], [0])
    for _ in range(200):
        seen.add(int(sampler.sample(logits, b)[0]))
    assert seen == {0, 1}


def test_top_k_and_min_p() -> None:
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    assert kept(logits, [2], [1.0], width=2) == [[0, 1]]
    kept_ = sampler._apply_min_p(logits, torch.tensor([0.45]))  # threshold 0.18 keeps 0.4 .. 0.2
    assert torch.isfinite(kept_).tolist() == [[True, True, True, False]]


def test_penalties_and_suppression() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    p = SamplingParams(repetition_penalty=2.0, presence_penalty=0.25, frequency_penalty=0.5)
    processors.apply_penalties(logits, 0, p, prompt_token_ids=[0], output_token_ids=[1, 2, 2])
    want = [1.0, -4.0 - 0.75, 0.5 - 1.25, 0.5]
    assert torch.allclose(logits[0], torch.tensor(want))
    processors.suppress_tokens(logits, 0, [0, 99])
    assert (
        logits[0, 0] == -math.inf
        and sampler.sample(logits, batch([SamplingParams(temperature=0)])) == 3
    )


def test_allowed_tokens_and_suppression_never_empty_a_row() -> None:
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(3))
    processors.allow_only_tokens(logits, 0, [4, 9])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [4, 9]
    processors.suppress_tokens(logits, 0, [9])  # min_tokens holds a stop token back
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [4]
    processors.suppress_tokens(logits, 0, [4])  # the last token left stays
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [4]
    assert torch.isfinite(logits[1]).all()


def test_bad_words_ban_only_the_token_that_would_complete_a_word() -> None:
    words = [[7], [3, 4], [1, 2, 5]]
    logits = torch.zeros(3, 10)
    processors.ban_bad_words(logits, 0, words, [])  # nothing generated: only one-token words
    processors.ban_bad_words(logits, 1, words, [9, 3])  # "3" so far: 4 would finish [3, 4]
    processors.ban_bad_words(logits, 2, words, [1, 2])  # "1 2": 5 would finish [1, 2, 5]
    banned = [(logits[r] == -math.inf).nonzero().flatten().tolist() for r in range(3)]
    assert banned == [[7], [4, 7], [5, 7]]
    only = torch.full((1, 10), -math.inf)
    only[0, 7] = 1.0  # allowed_token_ids left nothing but a bad word: it stays possible
    processors.ban_bad_words(only, 0, words, [])
    assert only[0, 7] == 1.0


def test_sampling_and_processors_stay_on_the_logits_device() -> None:
    """Everything a step does to its sampled rows (every processor but the grammar, top-k/top-p,
    min-p, temperature, the draw) runs on the ``meta`` device: a tensor made on the host among
    them, or a value read back from the device (a sync on a GPU), raises there."""
    from kvflow.services.worker.runner import RequestState

    def state(**kw) -> RequestState:
        p = SamplingParams(**kw)
        return RequestState(
            p, 3, 1, frozenset([1]), frozenset([2]), needs_token_history(p), [5, 6], [7]
        )

    states = [
        state(temperature=0.0),
        state(temperature=0.8, top_p=0.9, top_k=5, min_p=0.05, logit_bias={3: 2.0}),
        state(allowed_token_ids=[3, 4, 9], min_tokens=4, repetition_penalty=1.2),
        state(temperature=1.3, presence_penalty=0.5, frequency_penalty=0.2),
        state(bad_words=["x"], bad_words_token_ids=[[7, 8], [9]], temperature=0.5),
    ]
    assert {type(pr) for st in states for pr in st.processors} == {
        type(pr) for pr in PROCESSORS if type(pr).__name__ != "Grammar"
    }
    logits = torch.empty(len(states), 16, device="meta")
    apply_processors(logits, states)
    b = sampler.make_batch([st.draw for st in states], device="meta")
    tokens = sampler.sample(logits, b)
    assert tokens.device.type == "meta" and tokens.shape == (len(states),)
    with pytest.raises(RuntimeError):  # the test's premise: meta refuses host tensors
        logits + torch.ones(16)


def test_batched_penalties_equal_each_row_alone() -> None:
    """``Penalties.apply`` (one pass over the batch) gives the bits ``apply_penalties`` gives
    row by row, for rows with each penalty, none, no outputs yet, and ids past the vocabulary."""
    from kvflow.services.worker.runner import RequestState

    g = torch.Generator().manual_seed(9)
    vocab = 50

    def state(prompt, output, **kw) -> RequestState:
        p = SamplingParams(**kw)
        return RequestState(p, len(prompt), len(output), frozenset(), frozenset(), True,
                            list(prompt), list(output))  # fmt: skip

    states = [
        state([1, 2, 3, 60], [4, 4, 5], repetition_penalty=1.7),
        state([1], [2, 2, 2, 9], frequency_penalty=0.6, presence_penalty=-0.3),
        state([7, 8], [], repetition_penalty=0.8, presence_penalty=1.0),  # no outputs yet
        state([3], [3, 49, 70], temperature=0.7),  # no penalty: untouched
        state([0, 49], [0, 0, 12, 49], repetition_penalty=1.2, frequency_penalty=-1.5),
    ]
    logits = torch.randn(len(states), vocab, generator=g) * 3
    want = logits.clone()
    for r, st in enumerate(states):
        if processors.Penalties().applies(st):
            processors.apply_penalties(want, r, st.params, st.prompt_tokens, st.output_tokens)
    got = logits.clone()
    processors.Penalties().apply(got, states)
    assert torch.equal(got, want)
    assert not torch.equal(got, logits)  # the penalties changed something
    assert torch.equal(got[3], logits[3])


def test_penalties_kept_between_steps_equal_each_row_alone() -> None:
    """Over steps whose outputs grow (repeats, new tokens, tokens of the prompt, ids past the
    vocabulary), the batched penalties that read only the new outputs each step
    (``TokenHistory``) give the bits ``apply_penalties`` gives from the whole history; so does
    a state read again after its outputs were cut or the vocabulary changed. Logit bias
    batched equals it row by row too."""
    import random

    from kvflow.services.worker.runner import RequestState

    rnd = random.Random(3)
    g = torch.Generator().manual_seed(4)

    def state(prompt, **kw) -> RequestState:
        p = SamplingParams(**kw)
        return RequestState(p, len(prompt), 0, frozenset(), frozenset(), True,
                            list(prompt), [])  # fmt: skip

    states = [
        state([1, 2, 3, 60, 3], repetition_penalty=1.7, logit_bias={4: 2.5, 99: 1.0}),
        state([5], frequency_penalty=0.6, presence_penalty=-0.3),
        state([7, 8], repetition_penalty=0.8, presence_penalty=1.0, logit_bias={7: -3.0}),
        state([3], temperature=0.7),
        state([0, 49], repetition_penalty=1.2, frequency_penalty=-1.5),
    ]
    for step in range(12):
        vocab = 50 if step < 8 else 40  # a vocabulary change: every history read again
        if step == 10:
            del states[1].output_tokens[2:]  # outputs cut: read again
        logits = torch.randn(len(states), vocab, generator=g) * 3
        want = logits.clone()
        for r, st in enumerate(states):
            if processors.Penalties().applies(st):
                processors.apply_penalties(want, r, st.params, st.prompt_tokens, st.output_tokens)
            if processors.LogitBias().applies(st):
                processors.apply_logit_bias(want, r, st.params.logit_bias)
        got = logits.clone()
        processors.Penalties().apply(got, states)
        processors.LogitBias().apply(got, states)
        assert torch.equal(got, want), step
        for st in states:  # this step's outputs: a repeat, a prompt token or a new one
            pool = [*st.output_tokens[-2:], *st.prompt_tokens, rnd.randrange(60)]
            st.output_tokens.append(rnd.choice(pool))
    assert isinstance(states[0].history_memo, processors.TokenHistory)
    assert states[0].history_memo.folded == 11  # the outputs before the last step's append
