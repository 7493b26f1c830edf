"""A detokenizer that dies mid-stream (services/detokenizer/takeover.py), offline: the survivor
that watched its request takes it over within ORPHAN_S and the client's stream (the gateway's
RequestStreams, which drops deltas it has) ends with the very text one detokenizer alone sends,
wherever the first one stopped, whatever the stream interval; the orphan rules (who takes a
request over, when, and never while a holder lives or while draining)."""

from __future__ import annotations

import asyncio
import time
import types

import pytest

from kvflow.services.detokenizer.service import DetokenizerService
from kvflow.services.detokenizer.takeover import ORPHAN_S, Watch
from kvflow.shared import subjects as S
from kvflow.shared.config import Settings
from kvflow.shared.messages import (
    Delta,
    DeltaBatch,
    DetokenizerClaims,
    FinishReason,
    LiveRequests,
    RequestError,
    SamplingParams,
    StepResult,
    TokenizedRequest,
)
from kvflow.shared.request_streams import RequestStreams

RAW = types.SimpleNamespace(headers=None, subject=S.REQUESTS)


class _Bus:
    name = "detokenizer"

    def __init__(self) -> None:
        self.published: list[tuple[str, object]] = []

    async def publish(self, subject: str, msg: object, headers=None) -> None:  # noqa: ANN001
        self.published.append((subject, msg))


def _service(tokenizer, instance: str, stream_interval: int) -> DetokenizerService:  # noqa: ANN001
    svc = DetokenizerService(Settings.of(stream_interval=stream_interval), tokenizer)
    svc.bus = _Bus()  # type: ignore[assignment]
    svc.watch.instance = instance
    return svc


def _deltas(svc: DetokenizerService) -> list[DeltaBatch]:
    out = [m for s, m in svc.bus.published if isinstance(m, DeltaBatch)]  # type: ignore[attr-defined]
    svc.bus.published.clear()  # type: ignore[attr-defined]
    return out


def _read(streams: RequestStreams, rid: str) -> tuple[str, str | None, int]:
    """(text, finish reason, completion tokens) the client got."""
    q = streams._queues[rid]
    text, finish, tokens = "", None, 0
    while not q.empty():
        item = q.get_nowait()
        assert not isinstance(item, RequestError), item
        assert isinstance(item, Delta)
        text, finish, tokens = text + item.text, item.finish_reason, item.completion_tokens
    return text, finish, tokens


@pytest.mark.parametrize("stream_interval", [1, 3])
@pytest.mark.parametrize("dies_after", [0, 1, 4, 7, 11])
def test_a_survivor_takes_over_and_the_stream_ends_with_the_same_text(
    tokenizer, stream_interval: int, dies_after: int
) -> None:  # noqa: ANN001
    ids = tokenizer(" The river ran past the old stone mill, and then it was quiet again.")[
        "input_ids"
    ]
    params = SamplingParams(max_tokens=len(ids), stop=["quiet"])  # a stop string: held text
    req = TokenizedRequest("r1", "inbox.g", [1, 2, 3], params)
    N, L = int(FinishReason.NONE), int(FinishReason.LENGTH)

    def result(pos: int) -> StepResult:
        last = L if pos == len(ids) else N
        return StepResult("w", pos, ["r1"], [ids[pos - 1]], [last], num_output_tokens=[pos])

    async def go() -> tuple[tuple, tuple]:
        alone = _service(tokenizer, "c", stream_interval)
        await alone._register(req)
        for pos in range(1, len(ids) + 1):
            await alone._on_result(result(pos))
        reference = RequestStreams()
        reference.open("r1")
        for batch in _deltas(alone):
            reference.dispatch(batch)

        a, b = _service(tokenizer, "a", stream_interval), _service(tokenizer, "b", stream_interval)
        streams = RequestStreams()
        streams.open("r1")
        await a._register(req)  # the queue group gave it to a
        await b._on_watched(req, RAW)  # b sees it on its plain subscription
        b.watch.on_claims(DetokenizerClaims("a", ["r1"]), now=0.0)
        for pos in range(1, dies_after + 1):
            await a._on_result(result(pos))
            await b._on_result(result(pos))
        for batch in _deltas(a):  # a dies here: what it sent reached the gateway
            streams.dispatch(batch)
        for pos in range(dies_after + 1, len(ids) + 1):
            if pos == dies_after + 3:  # b takes over while tokens still come
                assert b.watch.orphans(False, now=ORPHAN_S * 0.9) == []  # not yet
                (orphan,) = b.watch.orphans(False, now=ORPHAN_S * 1.1)
                await b._take_over(orphan)
            await b._on_result(result(pos))
        if b.watch.requests:  # a died near the end: taken over after the last token
            (orphan,) = b.watch.orphans(False, now=ORPHAN_S * 1.1)
            await b._take_over(orphan)
        for batch in _deltas(b):
            streams.dispatch(batch)
        assert b.watch.taken_over == 1 and not b.states
        return _read(reference, "r1"), _read(streams, "r1")

    want, got = asyncio.run(go())
    assert want[0] and want[1] == "stop"  # the stop string ended it, its text held back
    assert got == want


def test_a_survivor_that_never_saw_the_first_tokens_ends_the_request_with_an_error(
    tokenizer,
) -> None:  # noqa: ANN001
    """Never a text from a wrong position: the client gets an error."""
    ids = tokenizer(" one two three four")["input_ids"]
    req = TokenizedRequest("r1", "inbox.g", [1], SamplingParams(max_tokens=10))

    async def go() -> list:
        b = _service(tokenizer, "b", 1)
        await b._on_watched(req, RAW)
        b.watch.requests["r1"].tokens.clear()  # its first tokens never came here
        b.watch.requests["r1"].claimed = 0.0
        await b._on_result(StepResult("w", 3, ["r1"], [ids[2]], [0], num_output_tokens=[3]))
        (orphan,) = b.watch.orphans(False, now=ORPHAN_S * 3)
        await b._take_over(orphan)
        return b.bus.published  # type: ignore[attr-defined]

    published = asyncio.run(go())
    assert [type(m).__name__ for _, m in published] == ["RequestError", "Abort"]
    assert published[0][0] == "inbox.g" and published[0][1].code == 503


@pytest.mark.parametrize(("logprobs", "ended"), [(None, False), (0, False), (None, True)])
def test_the_only_detokenizer_restarted_takes_its_requests_over_from_the_live_ones(
    tokenizer, logprobs: int | None, ended: bool
) -> None:  # noqa: ANN001
    """The restarted process watches what the scheduler says runs (its tokens included; with
    ``ended``, the request ended at its worker while no detokenizer was there): the request is
    taken over with the same text, or, when it asked for logprobs (which the scheduler does not
    keep), ends with an error."""
    ids = tokenizer(" Paged attention keeps the cache in blocks, like pages of memory.")[
        "input_ids"
    ]
    params = SamplingParams(max_tokens=len(ids), logprobs=logprobs)
    req = TokenizedRequest("r1", "inbox.g", [1, 2, 3], params)

    def result(pos: int) -> StepResult:
        last = int(FinishReason.LENGTH if pos == len(ids) else FinishReason.NONE)
        return StepResult("w", pos, ["r1"], [ids[pos - 1]], [last], num_output_tokens=[pos])

    async def go() -> tuple[tuple, RequestStreams, list]:
        alone = _service(tokenizer, "c", 1)
        await alone._register(req)
        for pos in range(1, len(ids) + 1):
            await alone._on_result(result(pos))
        reference = RequestStreams()
        reference.open("r1")
        for batch in _deltas(alone):
            reference.dispatch(batch)
        a = _service(tokenizer, "a", 1)
        streams = RequestStreams()
        streams.open("r1")
        await a._register(req)
        for pos in range(1, 6):
            await a._on_result(result(pos))
        for batch in _deltas(a)[:-1]:  # it died with its last delta unsent
            streams.dispatch(batch)
        b = _service(tokenizer, "a2", 1)  # its restarted process
        if ended:  # every token went by before it started
            b.watch_live(LiveRequests([req], [ids], [int(FinishReason.LENGTH)]))
        else:
            for pos in (6, 7):  # results that came while it asked the scheduler
                await b._on_result(result(pos))
            b.watch_live(LiveRequests([req], [ids[:6]], [0]))
            for pos in range(8, len(ids) + 1):
                await b._on_result(result(pos))
        (orphan,) = b.watch.orphans(False, now=time.monotonic() + ORPHAN_S * 1.1)
        await b._take_over(orphan)
        published = list(b.bus.published)  # type: ignore[attr-defined]
        for batch in _deltas(b):
            streams.dispatch(batch)
        return _read(reference, "r1"), streams, published

    want, streams, published = asyncio.run(go())
    if logprobs is None:
        assert _read(streams, "r1") == want and want[1] == "length"
    else:
        assert [type(m).__name__ for _, m in published] == ["RequestError", "Abort"]


def test_the_scheduler_says_which_requests_run_with_their_tokens() -> None:
    from kvflow.services.scheduler.service import SchedulerService

    svc = SchedulerService(Settings.of(), "m", 512)
    reqs = [TokenizedRequest(f"r{i}", "inbox", [1, 2, 3], SamplingParams()) for i in range(3)]
    for req in reqs:
        svc.core.add_request(req)
        svc.shadow.add(req)
    svc.core.requests["r1"].token_ids += [7, 8]
    svc.core.abort("r2")
    svc.shadow.end("r2")  # aborted: not kept
    live = svc.live_requests()
    assert [r.request_id for r in live.requests] == ["r0", "r1"] and live.output_ids == [[], [7, 8]]
    assert live.finish_reasons == [0, 0]
    svc.core.abort("r0")
    svc.shadow.end("r0", [4, 5, 6], int(FinishReason.LENGTH))  # ended at its worker
    assert [r.request_id for r in svc.live_requests().requests] == ["r1"]
    lately = svc.live_requests(ended_lately=True)
    assert [r.request_id for r in lately.requests] == ["r1", "r0"]
    assert lately.output_ids[1] == [4, 5, 6] and lately.finish_reasons == [0, 2]


def _watched(watch: Watch, rid: str, t: float = 0.0) -> None:
    req = TokenizedRequest(rid, "inbox", [1], SamplingParams())
    watch.add(req, None, [])
    watch.requests[rid].claimed = t


def test_orphans_only_once_their_holder_is_gone_and_by_one_chosen_survivor() -> None:
    b, c = Watch("b"), Watch("c")
    for w in (b, c):
        for i in range(40):
            _watched(w, f"r{i}")
        for who in ("a", "b", "c"):
            w.on_claims(DetokenizerClaims(who, [f"r{i}" for i in range(40)] if who == "a" else []))
    for w in (b, c):  # a alive and holding: nothing to take over, however long ago it came
        for who in ("a", "b", "c"):
            w.on_claims(
                DetokenizerClaims(who, [f"r{i}" for i in range(40)] if who == "a" else []), now=10.0
            )
        assert w.orphans(False, now=10.0 + ORPHAN_S) == []
    for w in (b, c):  # a is gone (no claims since 10.0); b and c still say they are there
        for who in ("b", "c"):
            w.on_claims(DetokenizerClaims(who, []), now=10.0 + ORPHAN_S)
    taken_b = {o.request.request_id for o in b.orphans(False, now=10.0 + ORPHAN_S * 1.1)}
    taken_c = {o.request.request_id for o in c.orphans(False, now=10.0 + ORPHAN_S * 1.1)}
    assert taken_b.isdisjoint(taken_c) and len(taken_b | taken_c) == 40
    assert taken_b and taken_c  # shared out, each request once


def test_a_holder_that_stops_claiming_ended_it_and_nobody_takes_it_over() -> None:
    b = Watch("b")
    _watched(b, "r1")
    b.on_claims(DetokenizerClaims("a", ["r1"]), now=1.0)
    b.on_claims(DetokenizerClaims("a", []), now=1.5)  # finished there
    assert b.requests == {} and b.orphans(False, now=100.0) == []


def test_a_request_nobody_registered_is_taken_over_and_a_draining_one_takes_none() -> None:
    b = Watch("b")
    _watched(b, "r1", t=0.0)
    assert b.orphans(True, now=ORPHAN_S * 5) == []  # draining: takes over nothing
    assert [o.request.request_id for o in b.orphans(False, now=ORPHAN_S * 1.1)] == ["r1"]


def test_one_not_chosen_takes_over_after_twice_the_wait() -> None:
    """The survivor chosen may have started after the request came (it has no record)."""
    b = Watch("b")
    rids = [f"r{i}" for i in range(20)]
    for rid in rids:
        _watched(b, rid)
    b.on_claims(DetokenizerClaims("c", []), now=ORPHAN_S * 1.1)  # c lives, b does not hold any
    first = b.orphans(False, now=ORPHAN_S * 1.2)
    b.on_claims(DetokenizerClaims("c", []), now=ORPHAN_S * 2.1)
    later = b.orphans(False, now=ORPHAN_S * 2.2)
    assert 0 < len(first) < 20 and len(first) + len(later) == 20
