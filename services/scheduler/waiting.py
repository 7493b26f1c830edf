"""The global queue of waiting sequences, in the order a scheduling policy gives them."""

from __future__ import annotations

import heapq

from kvflow.services.scheduler.policy import SchedulingPolicy
from kvflow.services.scheduler.sequence import Sequence


class WaitingQueue:
    """Waiting sequences, smallest ``policy.queue_key`` first. A preempted sequence is pushed
    back with the key it had (its arrival ``order`` is kept), so it resumes before newer
    arrivals. Removal is lazy: an aborted sequence is skipped when it reaches the head."""

    def __init__(self, policy: SchedulingPolicy) -> None:
        self.policy = policy
        self._heap: list[tuple[tuple[int, ...], Sequence]] = []
        self._removed: set[str] = set()

    def push(self, seq: Sequence) -> None:
        self._removed.discard(seq.request_id)
        heapq.heappush(self._heap, (self.policy.queue_key(seq), seq))

    def peek(self) -> Sequence | None:
        self._drop_removed()
        return self._heap[0][1] if self._heap else None

    def pop(self) -> Sequence:
        self._drop_removed()
        return heapq.heappop(self._heap)[1]

    def remove(self, request_id: str) -> None:
        self._removed.add(request_id)

    def _drop_removed(self) -> None:
        while self._heap and self._heap[0][1].request_id in self._removed:
            self._removed.discard(heapq.heappop(self._heap)[1].request_id)

    def sequences(self) -> list[Sequence]:
        """The waiting sequences (a snapshot, in no particular order)."""
        return [seq for _, seq in list(self._heap) if seq.request_id not in self._removed]

    def __len__(self) -> int:
        return len(self._heap) - len(self._removed)
