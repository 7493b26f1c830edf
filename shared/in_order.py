"""Putting a request's stream back in order after messages were lost and published again
(shared/replay.py): each item covers the positions ``(start, end]`` of its request (a token:
``(n-1, n]``; a delta: the completion tokens since the previous delta). Given what the reader
has (``seen``), an item is a repeat (``end <= seen``: dropped), next (delivered, with every
held item it lets through), or past a gap (held until the gap is filled). A gap that stays
open past a deadline is the reader's to report (``gaps``): what filled it is lost."""

from __future__ import annotations

import time
from typing import Generic, TypeVar

from kvflow.shared.messages import RequestError

T = TypeVar("T")


def lost_in_transit(request_id: str) -> RequestError:
    """What a reader sends or shows when a gap in a request's stream never filled."""
    return RequestError(
        request_id,
        "part of the output was lost in transit (a NATS server failed and it was not "
        "published again in time); retry the request",
        "ServiceUnavailableError",
        code=503,
    )


class InOrder(Generic[T]):
    """Held items per request id."""

    def __init__(self) -> None:
        self._held: dict[str, dict[int, tuple[int, T]]] = {}  # id -> start -> (end, item)
        self._since: dict[str, float] = {}  # id -> when its oldest gap opened (monotonic)
        self.repeats = 0  # items dropped as repeats
        self.held = 0  # items that waited for a gap to fill

    def push(self, key: str, seen: int, start: int, end: int, item: T) -> list[T]:
        """The items to deliver now, in order (none, ``item``, or ``item`` and the held items
        that follow it)."""
        if end <= seen:
            self.repeats += 1
            return []
        if start > seen:
            self._held.setdefault(key, {})[start] = (end, item)
            self._since.setdefault(key, time.monotonic())
            self.held += 1
            return []
        out = [item]
        held = self._held.get(key)
        while held:
            nxt = held.pop(end, None)
            if nxt is None:
                for s in [s for s, (e, _) in held.items() if e <= end]:  # covered meanwhile
                    del held[s]
                    self.repeats += 1
                break
            end, it = nxt
            out.append(it)
        if held is not None and not held:
            self.forget(key)
        elif held:
            self._since[key] = time.monotonic()  # a gap still open: its clock restarts
        return out

    def waiting(self, key: str) -> bool:
        return key in self._held

    def gaps(self, older_than_s: float) -> list[str]:
        """Ids whose gap has been open longer than ``older_than_s``."""
        cut = time.monotonic() - older_than_s
        return [k for k, t in self._since.items() if t < cut]

    def forget(self, key: str) -> None:
        self._held.pop(key, None)
        self._since.pop(key, None)

    def __len__(self) -> int:
        return len(self._held)
