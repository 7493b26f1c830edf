"""Per-request queues fed by one inbox subscription, for every client of the pipeline (the
gateway, the Python API).

The detokenizer sends one ``DeltaBatch`` per step for all of a client's requests (per-token
traffic stays batched on NATS); here it is fanned out to each request's queue, the only place
where messages become per-request. A delta that repeats tokens already delivered (two
detokenizers held the request, or it was published again after a NATS node's loss) is dropped;
one that comes after a gap (the delta before it was lost and is published again) waits for it,
and a gap still open after ``GAP_TIMEOUT_S`` ends the request with an error rather than a text
with a hole. Any reply, or an ``Accepted``, marks the request acknowledged."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any

from kvflow.shared.in_order import InOrder, lost_in_transit
from kvflow.shared.messages import Accepted, Delta, DeltaBatch, Message, RequestError, ToolCallDelta

log = logging.getLogger("kvflow.streams")
GAP_TIMEOUT_S = 15.0  # a delta lost in transit is published again within a few seconds

Item = Delta | RequestError


def join_tool_calls(pieces: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Consecutive pieces of the same call as one (its id and name from the first, the
    arguments joined); the pieces are not changed."""
    out: list[ToolCallDelta] = []
    for p in pieces:
        last = out[-1] if out else None
        if last is not None and last.index == p.index and p.id is None and p.name is None:
            out[-1] = ToolCallDelta(last.index, last.id, last.name, last.arguments + p.arguments)
        else:
            out.append(p)
    return out


def merge_delta(into: Delta, later: Delta) -> None:
    """Fold ``later`` (the next delta of the same request) into ``into``, in place."""
    into.text += later.text
    into.num_new_tokens += later.num_new_tokens
    into.finish_reason = later.finish_reason
    into.prompt_tokens = max(into.prompt_tokens, later.prompt_tokens)
    into.completion_tokens = max(into.completion_tokens, later.completion_tokens)
    if later.logprobs:
        into.logprobs = [*into.logprobs, *later.logprobs]
    if later.prompt_logprobs and not into.prompt_logprobs:
        into.prompt_logprobs = later.prompt_logprobs
    if later.token_ids:
        into.token_ids = [*into.token_ids, *later.token_ids]
    if later.tool_calls:
        into.tool_calls = join_tool_calls([*into.tool_calls, *later.tool_calls])


class DeltaQueue:
    """What the pipeline sent back for one request, until its reader takes it. Deltas that
    arrive while an earlier one still waits are merged into it (as vLLM's
    RequestOutputCollector does): a reader that falls behind catches up with one read (one SSE
    event) instead of one per token, and never reads more items than it can keep up with.
    Errors are never merged."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[Item] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: Item) -> None:
        items = self._items
        if (
            items
            and isinstance(item, Delta)
            and isinstance(items[-1], Delta)
            and items[-1].finish_reason is None
        ):
            merge_delta(items[-1], item)
        else:
            items.append(item)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)

    def get_nowait(self) -> Item:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    async def get(self) -> Item:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


class RequestStreams:
    """request id -> queue of what the pipeline sent back for it."""

    def __init__(self) -> None:
        self._queues: dict[str, DeltaQueue] = {}
        self._accepted: dict[str, asyncio.Event] = {}  # set by Accepted, or any reply at all
        self._tokens: dict[str, int] = {}  # completion tokens delivered so far
        self._order: InOrder[Delta] = InOrder()
        self.unknown_deltas = 0  # deltas for requests no longer here (finished or aborted)
        self.lost_deltas = 0  # requests ended because a gap in their deltas never filled

    @property
    def duplicate_deltas(self) -> int:
        """Deltas dropped as repeats (two detokenizers had a request, or a replay)."""
        return self._order.repeats

    @property
    def held_deltas(self) -> int:
        """Deltas that came after a gap and waited for it to fill."""
        return self._order.held

    def open(self, request_id: str) -> DeltaQueue:
        q = DeltaQueue()
        self._queues[request_id] = q
        self._accepted[request_id] = asyncio.Event()
        return q

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self._accepted.pop(request_id, None)
        self._tokens.pop(request_id, None)
        self._order.forget(request_id)

    def accepted(self, request_id: str) -> asyncio.Event | None:
        """Set once the scheduler acknowledged the request (None: no longer open)."""
        return self._accepted.get(request_id)

    async def wait_accepted(self, request_id: str, timeout: float) -> bool:
        """Whether ``request_id`` was acknowledged within ``timeout`` (a request no longer open
        counts as settled): the ``acknowledged`` of shared.submission.until_acknowledged."""
        ev = self._accepted.get(request_id)
        if ev is None:
            return True
        try:
            async with asyncio.timeout(timeout):  # (wait_for costs a task more per request)
                await ev.wait()
        except TimeoutError:
            return request_id not in self._accepted
        return True

    def ids(self) -> list[str]:
        return list(self._queues)

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
                rid = delta.request_id
                self._ack(rid)
                if not delta.completion_tokens:  # no tokens to order by (an embedding)
                    q.put_nowait(delta)
                    continue
                seen = self._tokens.get(rid, 0)
                start = delta.after_tokens
                for d in self._order.push(rid, seen, start, delta.completion_tokens, delta):
                    self._tokens[rid] = d.completion_tokens
                    q.put_nowait(d)
                if self._order.waiting(rid) and start > seen:
                    self._watch_gap(rid)
        elif isinstance(msg, RequestError):
            q = self._queues.get(msg.request_id)
            if q is not None:
                self._ack(msg.request_id)
                q.put_nowait(msg)
        elif isinstance(msg, Accepted):
            self._ack(msg.request_id)
        else:
            log.debug("inbox: ignored %s", type(msg).__name__)

    def _watch_gap(self, request_id: str) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # dispatched outside a loop (tests): no deadline
            return
        loop.call_later(GAP_TIMEOUT_S, self._gap_open, request_id)

    def _gap_open(self, request_id: str) -> None:
        """A gap still open after its deadline: what filled it is lost; the request ends."""
        q = self._queues.get(request_id)
        if q is None or request_id not in self._order.gaps(GAP_TIMEOUT_S * 0.99):
            return
        self._order.forget(request_id)
        self.lost_deltas += 1
        log.error("request %s: a piece of its output was lost in transit", request_id)
        q.put_nowait(lost_in_transit(request_id))

    async def handler(self, msg: Message, _raw: Any) -> None:
        """The Bus subscription callback."""
        self.dispatch(msg)
