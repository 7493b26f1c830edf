"""How long a draining worker (SIGTERM) waits: until the scheduler releases it, or until no
scheduler has been heard from for DRAIN_SILENCE_S while nothing runs here (`docker compose stop`
stops the schedulers beside it), and never past --drain-timeout."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from kvflow.services.worker import service as worker_service
from kvflow.shared.config import Settings


def _worker(stepping: bool = False, queued: int = 0) -> SimpleNamespace:
    return SimpleNamespace(
        worker_id="w",
        draining=True,
        stopped=asyncio.Event(),
        idle=lambda: not stepping and queued == 0,
        last_heard=time.monotonic(),
    )


@pytest.fixture(autouse=True)
def short_silence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_service, "DRAIN_SILENCE_S", 0.3)


async def _elapsed(worker: SimpleNamespace, drain_timeout: float) -> float:
    t0 = time.monotonic()
    await asyncio.wait_for(
        worker_service._until_released(worker, Settings.of(drain_timeout=drain_timeout)), 10
    )
    return time.monotonic() - t0


async def test_a_release_ends_the_drain_at_once() -> None:
    worker = _worker()
    asyncio.get_running_loop().call_later(0.1, worker.stopped.set)
    assert await _elapsed(worker, drain_timeout=5) < 0.3 + 0.5


async def test_silence_while_idle_ends_the_drain_before_the_timeout() -> None:
    assert 0.3 <= await _elapsed(_worker(), drain_timeout=5) < 2.0


async def test_a_step_in_progress_is_not_silence() -> None:
    assert await _elapsed(_worker(stepping=True), drain_timeout=0.8) >= 0.8


async def test_queued_plans_are_not_silence() -> None:
    assert await _elapsed(_worker(queued=1), drain_timeout=0.8) >= 0.8
