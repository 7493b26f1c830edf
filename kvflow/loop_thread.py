"""An asyncio loop on a daemon thread: ``LLM``'s synchronous methods run its coroutines there
(the NATS client lives on that loop for the LLM's whole life)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """An asyncio loop on a daemon thread: the LLM's synchronous methods run coroutines on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="kvflow-llm", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result()
        except KeyboardInterrupt:
            fut.cancel()
            raise

    def stop(self) -> None:
        """Stop the loop and close it (once its thread has ended: a loop left to the garbage
        collector closes itself from whatever thread collects it)."""
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
        if not self.thread.is_alive() and not self.loop.is_closed():
            self.loop.close()
