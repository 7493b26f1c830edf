"""The gateway's RequestHandle (services/gateway/streams.py): one deadline timer per request,
armed once; what arrived before the deadline is still read, then the read fails with the
OpenAI-shaped 504; a request that finished or closed first never times out."""

from __future__ import annotations

import asyncio

import pytest

from kvflow.services.gateway.errors import APIError
from kvflow.services.gateway.streams import RequestHandle
from kvflow.shared.messages import Delta
from kvflow.shared.request_streams import DeltaQueue


def handle(deadline_in: float, closed: list[tuple[str, bool]]) -> RequestHandle:
    loop = asyncio.get_running_loop()
    return RequestHandle(
        "r", DeltaQueue(), loop.time() + deadline_in, 0.05, lambda r, f: closed.append((r, f))
    )


def test_deltas_before_the_deadline_are_read_then_the_read_times_out_with_504() -> None:
    async def main() -> tuple[list[str], APIError]:
        closed: list[tuple[str, bool]] = []
        h = handle(0.05, closed)
        h.queue.put_nowait(Delta("r", "a", num_new_tokens=1, completion_tokens=1))
        got = [(await h.next()).text]
        with pytest.raises(APIError) as e:
            await h.next()  # nothing more comes: the deadline ends the wait
        h.close()
        assert closed == [("r", False)]  # not finished: the close aborts it
        return got, e.value

    got, err = asyncio.run(main())
    assert got == ["a"]
    assert (err.status, err.type) == (504, "TimeoutError")
    assert "timed out after 0.05 s" in err.message


def test_a_finished_request_never_times_out_and_close_disarms_the_timer() -> None:
    async def main() -> tuple[bool, bool, int]:
        closed: list[tuple[str, bool]] = []
        done = handle(0.02, closed)
        done.queue.put_nowait(Delta("r", "x", finish_reason="stop", completion_tokens=1))
        final = await done.next()
        early = handle(0.02, closed)
        early.close()
        await asyncio.sleep(0.05)  # past both deadlines
        done.close()
        return (
            final.finish_reason == "stop",
            done.finished,
            done.queue.qsize() + early.queue.qsize(),
        )

    stopped, finished, left = asyncio.run(main())
    assert stopped and finished
    assert left == 0  # neither timer fired: no timeout error was queued
