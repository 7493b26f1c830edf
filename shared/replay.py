"""Publishing again what a lost NATS node may have dropped.

Core NATS delivers at most once. When a node of a NATS cluster dies, its connections move to
another node within moments, but what was on its way through it is gone: messages it had taken
from its clients and not forwarded yet, and every message for its clients until they are back
(the cluster drops a message nobody listens for). Both ends know when this may have happened:
the connection that was on the lost node. So when a connection is back, its service publishes
again what it published in the last ``window_s`` seconds, and asks every other service to do
the same (``subjects.REPLAY``); each of them does so once per burst of asks.

Only subjects whose receivers take repeats and late arrivals are kept (``subjects.replayed``):
the scheduler runs a request id once and applies a step's result once, the detokenizer and the
clients of the pipeline drop token positions they have and hold back the ones past a gap until
it is filled (shared/in_order.py). What is kept is bounded in time and bytes."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from kvflow.shared.subjects import replayed

WINDOW_S = 5.0  # how far back a replay reaches: a reconnect takes well under a second
MAX_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Sent:
    at: float  # time.monotonic()
    subject: str
    data: bytes
    headers: dict[str, str] | None


class ReplayLog:
    """What one connection published lately on replayed subjects, oldest first."""

    def __init__(self, window_s: float = WINDOW_S, max_bytes: int = MAX_BYTES) -> None:
        self.window_s = window_s
        self.max_bytes = max_bytes
        self._sent: deque[Sent] = deque()
        self._bytes = 0
        self.replays = 0  # times this log was published again
        self.replayed_messages = 0

    def record(self, subject: str, data: bytes, headers: dict[str, str] | None) -> None:
        """Keep a message just published (if its subject is replayed)."""
        if not replayed(subject):
            return
        now = time.monotonic()
        self._sent.append(Sent(now, subject, data, headers))
        self._bytes += len(data)
        self._trim(now)

    def _trim(self, now: float) -> None:
        sent = self._sent
        while sent and (sent[0].at < now - self.window_s or self._bytes > self.max_bytes):
            self._bytes -= len(sent.popleft().data)

    def recent(self) -> list[Sent]:
        """Everything kept that is still inside the window, oldest first (counted as a replay)."""
        self._trim(time.monotonic())
        out = list(self._sent)
        self.replays += 1
        self.replayed_messages += len(out)
        return out
