"""shared/submission.py: a request is published again, with a doubling wait, until the
scheduler acknowledges it or the deadline passes (no bus: the acknowledgement is an Event)."""

from __future__ import annotations

import asyncio

import pytest

from kvflow.shared.submission import until_acknowledged


class Ack:
    """An acknowledgement set after ``after`` resubmissions (never when None)."""

    def __init__(self, after: int | None) -> None:
        self.after = after
        self.event = asyncio.Event()
        self.resubmits: list[float] = []
        self.waits: list[float] = []

    async def acknowledged(self, timeout: float) -> bool:
        self.waits.append(timeout)
        try:
            async with asyncio.timeout(timeout):
                await self.event.wait()
        except TimeoutError:
            return False
        return True

    async def resubmit(self) -> None:
        self.resubmits.append(asyncio.get_running_loop().time())
        if self.after is not None and len(self.resubmits) >= self.after:
            self.event.set()


@pytest.mark.asyncio
async def test_acknowledged_at_once_is_never_published_again() -> None:
    ack = Ack(after=None)
    ack.event.set()
    loop = asyncio.get_running_loop()
    assert await until_acknowledged(ack.acknowledged, ack.resubmit, loop.time() + 5, 0.01)
    assert ack.resubmits == [] and ack.waits == [0.01]


@pytest.mark.asyncio
async def test_published_again_with_a_doubling_wait_until_acknowledged() -> None:
    ack = Ack(after=3)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert await until_acknowledged(ack.acknowledged, ack.resubmit, t0 + 5, 0.02)
    assert len(ack.resubmits) == 3
    first, second, third = (t - t0 for t in ack.resubmits)
    # the first wait (0.02), then each attempt's wait plus tenacity's doubling sleep
    assert first >= 0.02 and second - first >= 0.02 + 0.02 and third - second >= 0.02 + 0.04


@pytest.mark.asyncio
async def test_gives_up_at_the_deadline() -> None:
    ack = Ack(after=None)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert not await until_acknowledged(ack.acknowledged, ack.resubmit, t0 + 0.2, 0.02)
    assert 1 <= len(ack.resubmits) and all(t < t0 + 0.2 for t in ack.resubmits)


@pytest.mark.asyncio
async def test_a_deadline_already_past_publishes_nothing_again() -> None:
    ack = Ack(after=None)
    loop = asyncio.get_running_loop()
    assert not await until_acknowledged(ack.acknowledged, ack.resubmit, loop.time(), 0.01)
    assert ack.resubmits == []
