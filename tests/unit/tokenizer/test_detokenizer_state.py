"""Incremental detokenization and stop strings with the model's real tokenizer (offline)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from kvflow.services.detokenizer.state import DetokState
from kvflow.shared.messages import FinishReason, SampleLogprobs, SamplingParams

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
            ready = st.release(d)  # what the service sends
            if ready is not None:
                sent += ready.token_ids
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


def released(
    tokenizer, ids: list[int], params: SamplingParams, interval: int, final_only: bool = False
) -> list:
    """The deltas the service sends for ``ids`` (the last ends by length) at ``interval``."""
    st = DetokState(
        "r", "inbox", params, prompt_tokens=2, return_token_ids=True, final_only=final_only
    )
    out = []
    for i, t in enumerate(ids):
        last = FinishReason.LENGTH if i == len(ids) - 1 else N
        lp = SampleLogprobs(-float(i), [t], [-float(i)])
        d, _ = st.add_token(tokenizer.backend_tokenizer, t, last, lp)
        ready = st.release(d, interval)
        if ready is not None:
            out.append(ready)
        if st.finished:
            break
    assert st.held is None  # nothing is left behind once the request ends
    return out


def test_stream_interval_sends_the_first_token_then_every_n_and_the_last(tokenizer) -> None:
    """vLLM's --stream-interval: the same text, token ids and logprobs in fewer deltas, each
    starting where the one before ended (the gateway orders deltas by those counts)."""
    text = "caf\u00e9 \U0001f642 END? no, ENDING here, then a few more words to stream out"
    ids = tokenizer(text)["input_ids"]
    params = SamplingParams(stop=["END!"], logprobs=1)
    every = released(tokenizer, ids, params, 1)
    for n in (1, 2, 3, 4, 7, 100):
        deltas = released(tokenizer, ids, params, n)
        assert "".join(d.text for d in deltas) == "".join(d.text for d in every) == text
        assert [t for d in deltas for t in d.token_ids] == ids
        assert [lp.logprob for d in deltas for lp in d.logprobs] == [
            -float(i) for i in range(len(ids))
        ]
        assert sum(d.num_new_tokens for d in deltas) == len(ids)
        ends = [d.completion_tokens for d in deltas]
        assert [d.after_tokens for d in deltas] == [0, *ends[:-1]]
        assert deltas[-1].finish_reason == "length" and ends[-1] == len(ids)
        assert all(d.finish_reason is None for d in deltas[:-1])
        # the first delta with text goes at once; then none before n more tokens came
        assert deltas[0].completion_tokens == every[0].completion_tokens
        assert all(b - a >= n for a, b in zip(ends[:-2], ends[1:-1], strict=True))
        if n == 1:
            assert len(deltas) == len(every)
        else:
            assert len(deltas) <= 2 + (len(ids) - 1) // n < len(every)


def test_a_stop_string_ends_a_held_interval_at_once(tokenizer) -> None:
    ids = tokenizer("one two three four five six seven")["input_ids"]
    deltas = released(tokenizer, ids, SamplingParams(stop=[" four"]), 50)
    assert "".join(d.text for d in deltas) == "one two three"
    assert deltas[-1].finish_reason == "stop" and len(deltas) == 2


def test_a_request_not_streamed_gets_its_first_and_final_deltas_only(tokenizer) -> None:
    """final_only (vLLM's FINAL_ONLY output kind, for requests not streamed): the first delta
    (the gateway's time to first token), then the rest of the output in the final one."""
    ids = tokenizer("caf\u00e9 \U0001f642 and a few more words, then the end")["input_ids"]
    params = SamplingParams(logprobs=1)
    first, final = released(tokenizer, ids, params, 1, final_only=True)
    assert first.completion_tokens == 1 and final.after_tokens == 1
    assert first.text + final.text == "".join(d.text for d in released(tokenizer, ids, params, 1))
    assert first.token_ids + final.token_ids == ids and final.finish_reason == "length"
    assert len(first.logprobs) + len(final.logprobs) == len(ids) == final.completion_tokens
