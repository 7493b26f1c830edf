"""Per-request queues fed by the gateway's one inbox subscription.

The detokenizer sends one ``DeltaBatch`` per step for all of a gateway's requests (per-token
traffic stays batched on NATS); here it is fanned out to each request's queue, the only place
where messages become per-request. A ``RequestHandle`` is what a route holds while it serves
one request: it reads deltas with the request's deadline and, when closed before the final
delta arrived, publishes an ``Abort`` so the request's KV blocks are freed at once."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from services.gateway.errors import APIError
from shared.messages import Accepted, Delta, DeltaBatch, Message, RequestError

log = logging.getLogger("kvflow.gateway")

Item = Delta | RequestError


class RequestStreams:
    """request id -> queue of what the pipeline sent back for it."""

    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[Item]] = {}
        self._accepted: dict[str, asyncio.Event] = {}  # set by Accepted, or any reply at all
        self._tokens: dict[str, int] = {}  # completion tokens delivered so far
        self.duplicate_deltas = 0  # deltas dropped as repeats (two detokenizers had a request)
        self.unknown_deltas = 0  # deltas for requests no longer here (finished or aborted)

    def open(self, request_id: str) -> asyncio.Queue[Item]:
        q: asyncio.Queue[Item] = asyncio.Queue()
        self._queues[request_id] = q
        self._accepted[request_id] = asyncio.Event()
        return q

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self._accepted.pop(request_id, None)
        self._tokens.pop(request_id, None)

    def accepted(self, request_id: str) -> asyncio.Event | None:
        """Set once the scheduler acknowledged the request (None: no longer open)."""
        return self._accepted.get(request_id)

    def _ack(self, request_id: str) -> None:
        ev = self._accepted.get(request_id)
        if ev is not None:
            ev.set()

    def __len__(self) -> int:
        return len(self._queues)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._queues

    def dispatch(self, msg: Message) -> None:
        """Route one inbox message; ids that are not (or no longer) here are dropped, since a
        request that was aborted may still have deltas in flight."""
        if isinstance(msg, DeltaBatch):
            for delta in msg.deltas:
                q = self._queues.get(delta.request_id)
                if q is None:
                    self.unknown_deltas += 1
                    continue
                self._ack(delta.request_id)
                seen = self._tokens.get(delta.request_id, 0)
                if delta.completion_tokens and delta.completion_tokens <= seen:
                    self.duplicate_deltas += 1  # each delta counts one more token than the last
                    continue
                self._tokens[delta.request_id] = delta.completion_tokens
                q.put_nowait(delta)
        elif isinstance(msg, RequestError):
            q = self._queues.get(msg.request_id)
            if q is not None:
                self._ack(msg.request_id)
                q.put_nowait(msg)
        elif isinstance(msg, Accepted):
            self._ack(msg.request_id)
        else:
            log.debug("gateway inbox: ignored %s", type(msg).__name__)

    async def handler(self, msg: Message, _raw: Any) -> None:
        """The Bus subscription callback."""
        self.dispatch(msg)


class RequestHandle:
    """One submitted request, from publish to its final delta (or abort)."""

    def __init__(
        self,
        request_id: str,
        queue: asyncio.Queue[Item],
        deadline: float,
        timeout_s: float,
        on_close: Callable[[str, bool], None],
    ) -> None:
        self.request_id = request_id
        self.queue = queue
        self.deadline = deadline  # in loop.time() terms
        self.timeout_s = timeout_s
        self.finished = False  # the final delta arrived: nothing to abort
        self.closed = False
        self._on_close = on_close

    async def next(self) -> Delta:
        """The next delta; a RequestError or the deadline raise APIError (the caller closes the
        handle, which aborts the request)."""
        try:
            async with asyncio.timeout_at(self.deadline):
                item = await self.queue.get()
        except TimeoutError:
            raise APIError(
                504, f"request timed out after {self.timeout_s:g} s", "TimeoutError"
            ) from None
        if isinstance(item, RequestError):
            raise APIError(item.code, item.message, item.type, item.param)
        if item.finish_reason is not None:
            self.finished = True
        return item

    def close(self) -> None:
        """Idempotent and never awaits, so it is safe in ``finally`` blocks of cancelled
        tasks; the abort itself is published by a background task."""
        if self.closed:
            return
        self.closed = True
        self._on_close(self.request_id, self.finished)
