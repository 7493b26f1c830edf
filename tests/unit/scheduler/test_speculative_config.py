"""--speculative-config (vLLM's JSON), the n-gram proposer, the verification rule and the
per-sequence back-off: pure logic, no model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.services.scheduler.sequence import Sequence
from kvflow.services.scheduler.spec_state import MAX_CANDIDATES, NgramIndex
from kvflow.services.scheduler.speculation import MAX_COOLDOWN, Drafts, Speculator
from kvflow.services.worker.speculation import accept, expand
from kvflow.shared.messages import SamplingParams, ScheduledSeq, StructuredOutput
from kvflow.shared.speculative import (
    SpeculativeConfig,
    SpeculativeConfigError,
    can_speculate,
    parse_speculative_config,
)


def test_parse_vllm_shapes() -> None:
    cfg = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,'
        ' "prompt_lookup_min": 2}'
    )
    assert cfg == SpeculativeConfig("ngram", 4, 2, 4, 0)
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3}) == (
        SpeculativeConfig("ngram", 3, 5, 5, 0)  # vLLM's lookup defaults
    )
    assert parse_speculative_config(
        {"model": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    ) == SpeculativeConfig("ngram", 2, 3, 3, 0)
    cfg = parse_speculative_config(
        {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 8}
    )
    assert cfg is not None and cfg.disable_by_batch_size == 8
    assert parse_speculative_config(cfg.to_json()) == cfg
    assert parse_speculative_config("") is None
    assert parse_speculative_config(None) is None


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ("{nope", "not valid JSON"),
        ("[1]", "JSON object"),
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"num_speculative_tokens": 2}', '"method"'),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be"),
        ('{"method": "ngram", "num_speculative_tokens": "4"}', "must be an integer"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,'
            ' "prompt_lookup_max": 2}',
            "prompt_lookup_min <= prompt_lookup_max",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 2, "typo": 1}', "unknown key(s) typo"),
        ('{"method": "draft_model", "num_speculative_tokens": 4}', '"draft_model" needs "model"'),
        ('{"method": "eagle", "num_speculative_tokens": 4}', "'eagle' is not served"),
    ],
)
def test_parse_errors_name_the_problem(raw: str, says: str) -> None:
    with pytest.raises(SpeculativeConfigError, match=None) as e:
        parse_speculative_config(raw)
    assert says in str(e.value)


def test_which_requests_speculate() -> None:
    assert can_speculate(SamplingParams(temperature=0.7, top_p=0.9, logprobs=2), 0)
    assert can_speculate(SamplingParams(temperature=0.0, seed=3), 0)  # greedy: exact anyway
    # seeded random sampling too: a token's draw is (seed, position)'s, whatever was verified
    assert can_speculate(SamplingParams(temperature=0.7, seed=3), 0)
    assert can_speculate(SamplingParams(logit_bias={5: 1.0}, allowed_token_ids=[1, 2]), 0)
    assert not can_speculate(SamplingParams(repetition_penalty=1.2), 5)
    assert not can_speculate(SamplingParams(presence_penalty=0.5), 5)
    assert not can_speculate(SamplingParams(structured_output=StructuredOutput("regex", "a")), 5)
    assert not can_speculate(SamplingParams(min_tokens=4), 3)
    assert can_speculate(SamplingParams(min_tokens=4), 4)


def test_ngram_index_longest_then_latest_match() -> None:
    idx = NgramIndex(2, 3)
    toks = [1, 2, 3, 9, 1, 2, 4, 7, 5, 1, 2]
    # suffix [1, 2]: "5 1 2" (3 tokens) never occurred before; [1, 2] last occurred at 4..5,
    # followed by 4, 7, 5
    assert idx.propose(toks, 3) == [4, 7, 5]
    toks += [3]  # suffix [1, 2, 3] (3 tokens) occurred at 0..2: followed by 9, 1, 2
    assert idx.propose(toks, 5) == [9, 1, 2, 4, 7]
    assert NgramIndex(2, 3).propose([8, 8], 2) == []  # a suffix never matches itself
    # [8, 8] at 0..1 is followed by 8, then by what the copy itself gives: the run goes on
    assert NgramIndex(2, 2).propose([8, 8, 8], 4) == [8, 8, 8, 8]
    assert NgramIndex(2, 2).propose([1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]
    assert NgramIndex(2, 2).propose([1, 2, 3], 4) == []
    assert NgramIndex(3, 4).propose([1, 2], 4) == []  # shorter than any n-gram


def test_ngram_index_is_incremental() -> None:
    """Proposals as tokens are appended one by one equal a fresh index's each time."""
    toks = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 1, 4]
    idx = NgramIndex(1, 3)
    for n in range(1, len(toks) + 1):
        assert idx.propose(toks[:n], 4) == NgramIndex(1, 3).propose(toks[:n], 4), n


def test_accept_rule() -> None:
    assert accept([], [7]) == [7]
    assert accept([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all accepted, plus the bonus
    assert accept([4, 5, 6], [4, 9, 6, 7]) == [4, 9]  # the second draft was not sampled
    assert accept([4, 5, 6], [8, 5, 6, 7]) == [8]


def test_expand_lays_drafts_out_as_decode_rows() -> None:
    plain = ScheduledSeq("a", [1, 2, 3], 0, [0])
    spec = ScheduledSeq("b", [9, 4, 5], 7, [1, 2], num_draft=2)
    rows = expand([plain, spec])
    assert rows[0] is plain
    assert [(r.request_id, r.token_ids, r.start_pos, r.sample) for r in rows[1:]] == [
        ("b", [9], 7, True),
        ("b", [4], 8, True),
        ("b", [5], 9, True),
    ]
    assert expand([plain]) == [plain]
    with pytest.raises(ValueError, match="drafts"):
        expand([ScheduledSeq("c", [4, 5], 7, [1], num_draft=2)])


def _seq(tokens: list[int], **params) -> Sequence:
    return Sequence("r", list(tokens), 2, SamplingParams(temperature=0, **params))


def _propose(sp: Speculator, seq: Sequence, budget: int, batch_size: int = 1) -> Drafts | None:
    """A proposal for ``seq``'s next step, applied as the worker state applies a plan's: the
    sequence keeps its proposer state and the step spends what the proposal says."""
    proposal = sp.propose(seq, budget, 10_000, batch_size)
    if seq.spec is None:
        seq.spec = proposal.state
    sp.proposed(proposal)
    return proposal.drafts


def test_speculator_backs_off_after_misses_and_counts() -> None:
    sp = Speculator(SpeculativeConfig("ngram", 3, 1, 2, 0))
    seq = _seq([1, 2, 1, 2, 1])  # suffix [2, 1] -> followed by 2, 1, ...
    assert _propose(sp, seq, 8) == Drafts([2, 1, 2])
    assert sp.verified(seq, Drafts([2, 1, 2]), [2, 1, 2, 1]) == 3
    assert seq.spec is not None and seq.spec.depth == 3
    assert sp.verified(seq, Drafts([2, 1, 2]), [2, 7]) == 1
    assert seq.spec.depth == 2  # one more than accepted
    cooldowns = []
    for _ in range(8):  # misses in a row: 1, 2, 4, ... steps without proposals
        sp.verified(seq, Drafts([2]), [5])
        cooldowns.append(seq.spec.cooldown)
    assert cooldowns == [1, 2, 4, 8, 16, 32, 64, MAX_COOLDOWN]
    assert seq.spec.depth == 1
    skipped = sum(_propose(sp, seq, 8) is None for _ in range(MAX_COOLDOWN))
    assert skipped == MAX_COOLDOWN and _propose(sp, seq, 8) == Drafts([2])
    st = sp.stats
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (10, 14, 4)
    assert st.accepted_per_pos == [2, 1, 1]
    assert (seq.spec.drafted, seq.spec.accepted) == (14, 4)


def test_speculator_limits() -> None:
    sp = Speculator(SpeculativeConfig("ngram", 4, 1, 2, disable_by_batch_size=4))
    assert _propose(sp, _seq([1, 2, 1, 2, 1]), 2) == Drafts([2, 1])  # the limit
    assert _propose(sp, _seq([1, 2, 1, 2, 1]), 0) is None
    assert _propose(sp, _seq([1, 2, 1, 2, 1]), 8, 4) is None  # the batch is large: off
    assert _propose(sp, _seq([1, 2, 1, 2, 1], repetition_penalty=1.1), 8) is None
    assert _propose(sp, _seq([1, 2, 3]), 8) is None  # nothing to look up


def test_draft_model_proposals_are_counts_for_the_worker() -> None:
    cfg = parse_speculative_config(
        {"method": "draft_model", "model": "/m.gguf", "num_speculative_tokens": 3,
         "num_draft_layers": 4}
    )  # fmt: skip
    assert cfg is not None and cfg.proposed_by_worker
    assert (cfg.model, cfg.num_draft_layers) == ("/m.gguf", 4)
    assert parse_speculative_config(cfg.to_json()) == cfg
    sp = Speculator(cfg)
    seq = _seq([1, 2, 3])
    assert _propose(sp, seq, 8) == Drafts([], 3)
    assert _propose(sp, seq, 2) == Drafts([], 2)
    assert sp.verified(seq, Drafts([], 3), [9, 9, 9, 9]) == 3  # all three and the bonus
    assert sp.verified(seq, Drafts([], 3), [9, 9]) == 1
    assert sp.verified(seq, Drafts([], 3), [9]) == 0
    assert sp.stats.accepted_per_pos == [2, 1, 1]


def test_llm_takes_vllms_dict_and_refuses_what_it_cannot_serve(monkeypatch) -> None:
    import kvflow.llm

    with pytest.raises(ValueError, match="'eagle' is not served"):
        kvflow.llm.LLM(speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    seen = {}

    class Started(Exception):
        pass

    def start_pipeline(settings, workers):  # noqa: ANN001, ANN202
        seen["settings"] = settings
        raise Started

    monkeypatch.setattr(kvflow.llm, "start_pipeline", start_pipeline)
    with pytest.raises(Started):
        kvflow.llm.LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    cfg = parse_speculative_config(seen["settings"].model.speculative_config)
    assert cfg == SpeculativeConfig("ngram", 3, 5, 5, 0)


def _naive_propose(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """Among the latest ``MAX_CANDIDATES`` earlier occurrences of the suffix's last ``lo``
    tokens (the index bounds a lookup's work so), the one whose match reaches furthest back
    (at most ``hi`` tokens; the latest among equally long); its continuation, copied
    LZ77-style past the end."""
    end = len(tokens)
    if end < lo:
        return []
    cands = [e for e in range(lo, end) if tokens[e - lo : e] == tokens[end - lo :]]
    best, best_n = -1, 0
    for e in reversed(cands[-MAX_CANDIDATES:]):
        n = max(m for m in range(lo, hi + 1) if m <= e and tokens[e - m : e] == tokens[end - m :])
        if n > best_n:
            best, best_n = e, n
    if best < 0:
        return []
    out: list[int] = []
    for j in range(best, best + k):
        out.append(tokens[j] if j < end else out[j - end])
    return out


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=0, max_size=40),
    st.integers(1, 3),
    st.integers(0, 2),
    st.integers(1, 5),
)
def test_ngram_index_equals_a_naive_search(tokens: list[int], lo: int, extra: int, k: int) -> None:
    idx = NgramIndex(lo, lo + extra)
    for n in range(len(tokens) + 1):  # appended one by one, as a sequence grows
        assert idx.propose(tokens[:n], k) == _naive_propose(tokens[:n], lo, lo + extra, k)
