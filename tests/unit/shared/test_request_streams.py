"""Per-request queues (shared/request_streams.py): a reader that falls behind gets the deltas it
missed merged into one, in order, with nothing lost; errors and finishes are never merged."""

from __future__ import annotations

import asyncio

from kvflow.shared.messages import Delta, DeltaBatch, RequestError, TokenLogprob
from kvflow.shared.request_streams import DeltaQueue, RequestStreams


def delta(text: str, n: int, done: str | None = None, ids: list[int] | None = None) -> Delta:
    return Delta(
        "r",
        text,
        num_new_tokens=1,
        finish_reason=done,
        prompt_tokens=3,
        completion_tokens=n,
        logprobs=[TokenLogprob(text, -0.5, token_id=n)],
        token_ids=ids if ids is not None else [n],
    )


def test_unread_deltas_merge_in_order() -> None:
    q = DeltaQueue()
    q.put_nowait(delta("a", 1))
    q.put_nowait(delta("b", 2, ids=[]))  # a delta without ids of its own (text held back)
    q.put_nowait(delta("c", 3, ids=[3, 4]))
    assert q.qsize() == 1
    d = q.get_nowait()
    assert isinstance(d, Delta)
    assert (d.text, d.num_new_tokens, d.completion_tokens, d.prompt_tokens) == ("abc", 3, 3, 3)
    assert d.token_ids == [1, 3, 4]
    assert [lp.token for lp in d.logprobs] == ["a", "b", "c"]
    assert q.empty()


def test_finish_and_errors_are_not_merged_into() -> None:
    q = DeltaQueue()
    q.put_nowait(delta("a", 1, done="length"))
    q.put_nowait(delta("late", 2))  # after a final delta (a duplicate): kept apart
    q.put_nowait(RequestError("r", "boom"))
    q.put_nowait(delta("x", 3))
    items = [q.get_nowait() for _ in range(q.qsize())]
    assert [type(i).__name__ for i in items] == ["Delta", "Delta", "RequestError", "Delta"]
    assert items[0].text == "a" and items[0].finish_reason == "length"


def test_a_waiting_reader_is_woken_and_a_keeping_up_reader_sees_every_delta() -> None:
    async def main() -> list[str]:
        streams = RequestStreams()
        q = streams.open("r")
        got: list[str] = []

        async def reader() -> None:
            while True:
                d = await q.get()
                got.append(d.text)
                if d.finish_reason:
                    return

        task = asyncio.ensure_future(reader())
        for n, text in enumerate(["x", "y", "z"], 1):
            await asyncio.sleep(0)  # the reader takes each before the next arrives
            streams.dispatch(DeltaBatch([delta(text, n, "stop" if n == 3 else None)]))
        await asyncio.wait_for(task, 5)
        return got

    assert asyncio.run(main()) == ["x", "y", "z"]
