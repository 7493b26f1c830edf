"""The worker's model thread runs what it is handed in order, steps (``post``) and other calls
(``run``) alike, all on one thread: a step queued behind another starts when it ends, and a
call such as ``forget_lora`` runs between the plans received before and after it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvflow.services.worker.service import ModelThread


async def test_posted_and_awaited_work_runs_in_order_on_one_thread() -> None:
    thread = ModelThread()
    seen: list[tuple[str, int]] = []

    def step(i: int) -> None:
        time.sleep(0.01)
        seen.append(("step", threading.get_ident()))

    thread.post(step, 0)
    thread.post(step, 1)
    await thread.run(lambda: seen.append(("call", threading.get_ident())))
    thread.post(step, 2)
    assert await thread.run(lambda: 7) == 7
    assert [k for k, _ in seen] == ["step", "step", "call", "step"]
    assert len({t for _, t in seen}) == 1 and seen[0][1] != threading.get_ident()


async def test_a_failed_post_is_logged_and_does_not_stop_the_thread(
    caplog: pytest.LogCaptureFixture,
) -> None:
    thread = ModelThread()

    def boom() -> None:
        raise RuntimeError("step crashed")

    thread.post(boom)
    assert await asyncio.wait_for(thread.run(lambda: "alive"), 5) == "alive"
    assert "step crashed" in caplog.text
