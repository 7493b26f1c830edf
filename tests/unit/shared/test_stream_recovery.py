"""What keeps a stream whole when a NATS node is lost (no network here): the replay log each
connection keeps (shared/replay.py), items put back in order (shared/in_order.py) by the
clients' request streams, the detokenizer and the scheduler's shadow, and the scheduler telling
a lost plan from a slow one by the worker's heartbeats."""

from __future__ import annotations

import asyncio
import time

import pytest

import kvflow.shared.request_streams as request_streams
from kvflow.services.detokenizer.service import DetokenizerService
from kvflow.services.scheduler.plan_loop import lost_in_transit
from kvflow.services.scheduler.shadow import ShadowState
from kvflow.shared import subjects as S
from kvflow.shared.config import Settings
from kvflow.shared.in_order import InOrder
from kvflow.shared.messages import (
    Delta,
    DeltaBatch,
    FinishReason,
    RequestError,
    SamplingParams,
    StepResult,
    TokenizedRequest,
    WorkerHeartbeat,
)
from kvflow.shared.replay import ReplayLog
from kvflow.shared.request_streams import RequestStreams


def test_in_order_drops_repeats_and_holds_what_follows_a_gap() -> None:
    o: InOrder[str] = InOrder()
    assert o.push("r", 0, 0, 1, "t1") == ["t1"]
    assert o.push("r", 1, 0, 1, "t1 again") == [] and o.repeats == 1
    assert o.push("r", 1, 2, 3, "t3") == [] and o.waiting("r")  # t2 lost: t3 waits
    assert o.push("r", 1, 3, 5, "t4-5") == []
    assert o.push("r", 1, 1, 2, "t2") == ["t2", "t3", "t4-5"]  # the gap fills: all in order
    assert not o.waiting("r") and len(o) == 0 and o.held == 2


def test_in_order_reports_a_gap_left_open_and_forgets() -> None:
    o: InOrder[str] = InOrder()
    o.push("a", 0, 1, 2, "late")
    assert o.gaps(older_than_s=0.0) == ["a"] and o.gaps(older_than_s=60) == []
    o.forget("a")
    assert o.gaps(0.0) == [] and not o.waiting("a")


def test_replay_log_keeps_replayed_subjects_inside_its_window() -> None:
    assert S.replayed(S.RESULTS) and S.replayed(S.gateway_inbox("g1")) and S.replayed(S.ABORT)
    assert not S.replayed(S.worker_step("w")) and not S.replayed(S.HEARTBEAT)
    log = ReplayLog(window_s=0.2, max_bytes=10)
    log.record(S.worker_step("w"), b"plan", None)  # a plan is never published again
    log.record(S.RESULTS, b"12345", None)
    log.record(S.gateway_inbox("g"), b"678", {"h": "1"})
    assert [(m.subject, m.data) for m in log.recent()] == [
        (S.RESULTS, b"12345"),
        (S.gateway_inbox("g"), b"678"),
    ]
    log.record(S.RESULTS, b"abcdef", None)  # over 10 bytes: the oldest goes
    assert [m.data for m in log.recent()] == [b"678", b"abcdef"]
    time.sleep(0.25)
    assert log.recent() == [] and log.replays == 3 and log.replayed_messages == 4


def _delta(n: int, after: int, text: str, done: str | None = None) -> Delta:
    return Delta("r", text, 1, done, 3, n, token_ids=[n], after_tokens=after)


def test_request_streams_put_deltas_back_in_order() -> None:
    streams = RequestStreams()
    q = streams.open("r")
    streams.dispatch(DeltaBatch([_delta(1, 0, "a")]))
    streams.dispatch(DeltaBatch([_delta(4, 2, "d")]))  # the delta of tokens 2 (b c) was lost
    streams.dispatch(DeltaBatch([_delta(5, 4, "e", "length")]))
    assert q.get_nowait().text == "a" and q.empty()
    streams.dispatch(DeltaBatch([_delta(1, 0, "a"), _delta(2, 1, "bc")]))  # published again
    out = q.get_nowait()
    assert (out.text, out.completion_tokens, out.finish_reason) == ("bcde", 5, "length")
    assert streams.duplicate_deltas == 1 and streams.held_deltas == 2


def test_a_gap_that_never_fills_ends_the_request_with_a_clear_error(monkeypatch) -> None:
    monkeypatch.setattr(request_streams, "GAP_TIMEOUT_S", 0.05)

    async def main() -> list:
        streams = RequestStreams()
        q = streams.open("r")
        streams.dispatch(DeltaBatch([_delta(1, 0, "a")]))
        streams.dispatch(DeltaBatch([_delta(3, 2, "c", "stop")]))
        return [await asyncio.wait_for(q.get(), 1), await asyncio.wait_for(q.get(), 1)]

    first, err = asyncio.run(main())
    assert first.text == "a"
    assert isinstance(err, RequestError) and err.code == 503 and "lost in transit" in err.message


class _Bus:
    def __init__(self) -> None:
        self.published: list[tuple[str, object]] = []

    async def publish(self, subject: str, msg: object, headers=None) -> None:
        self.published.append((subject, msg))


def test_detokenizer_takes_tokens_in_position_order(tokenizer) -> None:
    svc = DetokenizerService(Settings(), tokenizer)
    svc.bus = _Bus()  # type: ignore[assignment]
    ids = tokenizer(" one two three four")["input_ids"]
    req = TokenizedRequest("r1", "inbox.1", [1, 2, 3], SamplingParams(max_tokens=len(ids)))
    N, L = int(FinishReason.NONE), int(FinishReason.LENGTH)

    def result(step: int, pos: int) -> StepResult:
        last = L if pos == len(ids) else N
        return StepResult("w", step, ["r1"], [ids[pos - 1]], [last], num_output_tokens=[pos])

    async def go() -> None:
        await svc._register(req)
        await svc._on_result(result(1, 1))
        for pos in range(3, len(ids) + 1):  # the result of token 2 was lost
            await svc._on_result(result(pos, pos))
        await svc._on_result(result(1, 1))  # published again
        await svc._on_result(result(2, 2))  # the lost one, published again

    asyncio.run(go())
    deltas = [d for _, b in svc.bus.published if isinstance(b, DeltaBatch) for d in b.deltas]
    assert "".join(d.text for d in deltas) == tokenizer.decode(ids)
    assert [d.after_tokens for d in deltas] == [d.completion_tokens - 1 for d in deltas]
    assert deltas[-1].finish_reason == "length" and svc.duplicates_dropped == 1


def test_a_request_known_late_is_taken_only_with_every_token(tokenizer) -> None:
    """Tokens of a request not known here yet are kept with their positions: registered after
    them, the request's text is whole and in order (a replayed result counted once); when what
    was kept starts past the first token, the request is another detokenizer's (a replay of
    its request landed here) and is left alone: no delta from a wrong position."""
    ids = tokenizer(" one two three four five")["input_ids"]
    N, L = int(FinishReason.NONE), int(FinishReason.LENGTH)

    def result(rid: str, pos: int) -> StepResult:
        last = L if pos == len(ids) else N
        return StepResult("w", pos, [rid], [ids[pos - 1]], [last], num_output_tokens=[pos])

    def request(rid: str) -> TokenizedRequest:
        return TokenizedRequest(rid, f"inbox.{rid}", [1, 2], SamplingParams(max_tokens=len(ids)))

    svc = DetokenizerService(Settings(), tokenizer)
    svc.bus = _Bus()  # type: ignore[assignment]

    async def go() -> None:
        for pos in (1, 3, 2, 3, 4):  # before the registration: out of order, one repeat
            await svc._on_result(result("mine", pos))
        for pos in (3, 4):  # another's request: its first tokens went by before
            await svc._on_result(result("other", pos))
        await svc._register(request("mine"))
        await svc._register(request("other"))
        for pos in range(5, len(ids) + 1):
            await svc._on_result(result("mine", pos))
            await svc._on_result(result("other", pos))

    asyncio.run(go())
    sent = [
        (subj, d) for subj, b in svc.bus.published if isinstance(b, DeltaBatch) for d in b.deltas
    ]
    assert {subj for subj, _ in sent} == {"inbox.mine"}
    deltas = [d for _, d in sent]
    assert "".join(d.text for d in deltas) == tokenizer.decode(ids)
    assert [d.after_tokens for d in deltas] == [d.completion_tokens - 1 for d in deltas]
    assert deltas[-1].finish_reason == "length" and "other" not in svc.states


def test_shadow_counts_a_replayed_step_once_and_waits_for_a_lost_one() -> None:
    shadow = ShadowState()
    shadow.add(TokenizedRequest("r", "inbox", [1], SamplingParams()))
    N = int(FinishReason.NONE)
    shadow.apply(StepResult("w", 1, ["r"], [10], [N], num_output_tokens=[1]))
    shadow.apply(StepResult("w", 3, ["r"], [30], [N], num_output_tokens=[3]))
    shadow.apply(StepResult("w", 1, ["r"], [10], [N], num_output_tokens=[1]))
    assert shadow.live["r"].output_ids == [10]
    shadow.apply(StepResult("w", 2, ["r"], [20], [N], num_output_tokens=[2]))
    assert shadow.live["r"].output_ids == [10, 20, 30]


@pytest.mark.parametrize(
    ("heard_after_s", "step_id", "queued", "missed"),
    [
        (3.0, 0, 0, True),  # idle, nothing queued, well after the plan went out: lost
        (1.0, 0, 0, False),  # too soon to tell (the plan may be on its way)
        (3.0, 7, 0, False),  # computing (another step)
        (3.0, 0, 1, False),  # a plan waits in its queue
    ],
)
def test_a_lost_plan_is_told_from_a_slow_one(heard_after_s, step_id, queued, missed) -> None:
    sent = time.monotonic()
    hb = WorkerHeartbeat("w", "both", 64, 16, "m", "s", step_id=step_id, queued_plans=queued)
    assert lost_in_transit(hb, sent + heard_after_s, sent) is missed


def test_detokenizer_ends_a_request_whose_gap_never_fills(tokenizer, monkeypatch) -> None:
    import kvflow.services.detokenizer.service as detok

    monkeypatch.setattr(detok, "GAP_TIMEOUT_S", 0.0)
    svc = DetokenizerService(Settings(), tokenizer)
    svc.bus = _Bus()  # type: ignore[assignment]
    req = TokenizedRequest("r1", "inbox.1", [1, 2, 3], SamplingParams(max_tokens=8))
    N = int(FinishReason.NONE)

    async def go() -> None:
        await svc._register(req)
        await svc._on_result(StepResult("w", 1, ["r1"], [42], [N], num_output_tokens=[1]))
        await svc._on_result(StepResult("w", 3, ["r1"], [43], [N], num_output_tokens=[3]))

    asyncio.run(go())
    sent = {type(m).__name__: (subj, m) for subj, m in svc.bus.published}
    assert sent["RequestError"][0] == "inbox.1" and sent["RequestError"][1].code == 503
    assert sent["Abort"][0] == S.ABORT and "r1" not in svc.states
