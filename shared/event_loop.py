"""The event loop every kvflow service runs on: uvloop when it is installed (it is a dependency
on Linux and macOS), which makes socket writes, timers and callbacks several times cheaper than
the standard library's loop on the per-token path; the standard loop otherwise."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)`` on uvloop where available."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)
