"""A ``RequestHandle`` is what a route holds while it serves one request (its queue comes from
shared/request_streams.py, fed by the gateway's one inbox subscription): it reads deltas until
the request's deadline and, when closed before the final delta arrived, publishes an ``Abort``
so the request's KV blocks are freed at once. The deadline is one timer per request, armed
once, that queues a timeout error behind whatever was already delivered (not a timer armed and
cancelled around every read: at 256 streams that was a tenth of the gateway's time)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kvflow.services.gateway.errors import APIError
from kvflow.shared.messages import Delta, RequestError
from kvflow.shared.request_streams import DeltaQueue

log = logging.getLogger("kvflow.gateway")


class RequestHandle:
    """One submitted request, from publish to its final delta (or abort)."""

    def __init__(
        self,
        request_id: str,
        queue: DeltaQueue,
        deadline: float,
        timeout_s: float,
        on_close: Callable[[str, bool], None],
    ) -> None:
        self.request_id = request_id
        self.queue = queue
        self.timeout_s = timeout_s
        self.finished = False  # the final delta arrived: nothing to abort
        self.closed = False
        self._on_close = on_close
        # the deadline, in loop.time() terms
        self._timer = asyncio.get_running_loop().call_at(deadline, self._time_out)

    def _time_out(self) -> None:
        self.queue.put_nowait(
            RequestError(
                self.request_id,
                f"request timed out after {self.timeout_s:g} s",
                "TimeoutError",
                code=504,
            )
        )

    async def next(self) -> Delta:
        """The next delta; a RequestError or the deadline raise APIError (the caller closes the
        handle, which aborts the request)."""
        q = self.queue
        item = q.get_nowait() if not q.empty() else await q.get()
        if isinstance(item, RequestError):
            self._timer.cancel()
            raise APIError(item.code, item.message, item.type, item.param)
        if item.finish_reason is not None:
            self.finished = True
            self._timer.cancel()
        return item

    def close(self) -> None:
        """Idempotent and never awaits, so it is safe in ``finally`` blocks of cancelled
        tasks; the abort itself is published by a background task."""
        if self.closed:
            return
        self.closed = True
        self._timer.cancel()
        self._on_close(self.request_id, self.finished)
