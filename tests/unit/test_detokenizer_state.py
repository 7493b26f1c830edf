"""Incremental detokenization and stop strings with the model's real tokenizer (offline)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from services.detokenizer.state import DetokState
from shared.messages import FinishReason, SamplingParams

N = FinishReason.NONE


def feed(tokenizer, text: str, params: SamplingParams, last: FinishReason = FinishReason.LENGTH):
    ids = tokenizer(text)["input_ids"]
    st = DetokState("r", "inbox", params, prompt_tokens=3)
    deltas, stopped = [], False
    for i, t in enumerate(ids):
        d, by_stop = st.add_token(tokenizer.backend_tokenizer, t, last if i == len(ids) - 1 else N)
        deltas.append(d)
        stopped = stopped or by_stop
        if st.finished:
            break
    return deltas, stopped, st


def test_deltas_join_to_the_decoded_text(tokenizer) -> None:
    text = "Hello world! Ünïcödé and emoji 🙂 work, token by token."
    deltas, stopped, st = feed(tokenizer, text, SamplingParams())
    assert "".join(d.text for d in deltas) == text
    assert deltas[-1].finish_reason == "length" and not stopped
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert deltas[-1].completion_tokens == len(tokenizer(text)["input_ids"])
    assert deltas[-1].prompt_tokens == 3


def test_stop_string_ends_text_before_it_and_is_held_back(tokenizer) -> None:
    text = "The answer is 42. END of story"
    deltas, stopped, st = feed(tokenizer, text, SamplingParams(stop=["END"]))
    assert "".join(d.text for d in deltas) == "The answer is 42. "
    assert deltas[-1].finish_reason == "stop" and stopped
    # nothing of a partial "EN" was ever sent before the stop was seen
    assert not any("E" in d.text for d in deltas)


def test_stop_string_included_when_asked(tokenizer) -> None:
    deltas, _, _ = feed(
        tokenizer,
        "one two three four",
        SamplingParams(stop=[" three"], include_stop_str_in_output=True),
    )
    assert "".join(d.text for d in deltas) == "one two three"


def test_held_back_text_is_released_when_not_a_stop(tokenizer) -> None:
    deltas, stopped, _ = feed(tokenizer, "an ENd but no stop", SamplingParams(stop=["END!"]))
    assert "".join(d.text for d in deltas) == "an ENd but no stop"
    assert not stopped and deltas[-1].finish_reason == "length"


def test_special_tokens_are_skipped(tokenizer) -> None:
    st = DetokState("r", "inbox", SamplingParams(), prompt_tokens=1)
    eos = tokenizer.eos_token_id
    d1, _ = st.add_token(tokenizer.backend_tokenizer, tokenizer("Hi")["input_ids"][0], N)
    d2, _ = st.add_token(tokenizer.backend_tokenizer, eos, FinishReason.STOP)
    assert d1.text == "Hi" and d2.text == "" and d2.finish_reason == "stop"


def test_every_token_id_reaches_exactly_one_sent_delta(tokenizer) -> None:
    """Tokens whose text is held back (a possible stop string) or empty (a partial UTF-8
    character) have no delta of their own; their ids ride on the next delta sent."""
    text = "caf\u00e9 \U0001f642 END? no, ENDING here"
    ids = tokenizer(text)["input_ids"]
    for wanted in (True, False):
        st = DetokState("r", "inbox", SamplingParams(stop=["END!"]), 1, return_token_ids=wanted)
        sent: list[int] = []
        for i, t in enumerate(ids):
            last = FinishReason.LENGTH if i == len(ids) - 1 else N
            d, _ = st.add_token(tokenizer.backend_tokenizer, t, last)
            if d.text or d.finish_reason:  # what the service sends
                sent += d.token_ids
                st.sent_delta()
        # a client that did not ask for them (the HTTP API) gets none: bytes saved per token
        assert sent == (ids if wanted else [])


STOP_PARTS = ["END", "EN", "D!", "é", "\n\n", "🙂", " x"]


@given(
    words=hs.lists(
        hs.sampled_from(["END", "EN", "D", "!", "é", "\n", "🙂", " x", "ab", " "]), max_size=40
    ),
    stops=hs.lists(hs.sampled_from(STOP_PARTS), max_size=3),
    include=hs.booleans(),
)
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_sent_text_is_dropped_without_changing_any_delta(tokenizer, words, stops, include) -> None:
    """The state keeps only the unsent text and the longest stop string's length - 1 before
    it; every delta (text, finish, stop) equals a state's that keeps the whole text."""
    text = "".join(words) or "a"
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    ids = tokenizer(text)["input_ids"]
    trimmed = DetokState("r", "inbox", params, prompt_tokens=1)
    whole = DetokState("r", "inbox", params, prompt_tokens=1)
    whole.keep = 10**9  # never drops what it sent: the text as it was before trimming existed
    for i, t in enumerate(ids):
        last = FinishReason.LENGTH if i == len(ids) - 1 else N
        a, stop_a = trimmed.add_token(tokenizer.backend_tokenizer, t, last)
        b, stop_b = whole.add_token(tokenizer.backend_tokenizer, t, last)
        assert (a.text, a.finish_reason, stop_a) == (b.text, b.finish_reason, stop_b)
        assert len(trimmed.text) <= len(whole.text)
        if whole.finished:
            assert trimmed.finished
            break
