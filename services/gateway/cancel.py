"""Client-disconnect detection by racing work against the ASGI ``http.disconnect`` message, as
vLLM's ``with_cancellation`` does: ``request.is_disconnected()`` only polls and is unreliable
behind middleware, and a non-streamed request would otherwise run (and hold KV blocks) to its
end for a client that left long ago."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

log = logging.getLogger("kvflow.gateway")

T = TypeVar("T")


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the client has gone (the request body must already be read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_or_disconnect(request: Request, work: Awaitable[T]) -> tuple[bool, T | None]:
    return await race_disconnect(request.receive, work)


async def race_disconnect(receive: Receive, work: Awaitable[T]) -> tuple[bool, T | None]:
    """``(False, result)`` if ``work`` finished first; ``(True, None)`` if the client went away
    first, in which case ``work`` is cancelled and its cleanup has run when this returns."""
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return True, None
    return False, task.result()  # re-raises the work's exception


class SSEResponse(StreamingResponse):
    """A ``text/event-stream`` response that stops streaming as soon as the client goes away.

    The body is raced against ``http.disconnect`` on every ASGI server and spec version
    (Starlette only does so below ASGI spec 2.4), and ``on_close`` always runs once, even if
    the body never started, so the caller can abort the request there."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(
            body,
            status_code=200,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            media_type=self.media_type,
        )
        self.on_close = on_close
        self.client_disconnected = False

    async def _stream(self, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the server noticed the peer went away while sending
            self.client_disconnected = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            disconnected, _ = await race_disconnect(receive, self._stream(send))
            if disconnected:
                self.client_disconnected = True
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
            self.on_close()
