"""The global queue of waiting sequences, in the order a scheduling policy gives them.

The core (core.py) owns it: it queues arrivals and the sequences a worker hands back
(preempted, failed, moved), and takes out the ones a worker admitted or an abort ended.
Workers only read it, in order (``in_order``), while they plan."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from kvflow.services.scheduler.policy import SchedulingPolicy
from kvflow.services.scheduler.sequence import Sequence

# [policy key, push number, sequence]; the sequence is None once the entry is removed (a
# sequence pushed again has the key it had: the push number keeps entries apart)
_Entry = list


class WaitingQueue:
    """Waiting sequences, smallest ``policy.queue_key`` first. A preempted sequence is pushed
    back with the key it had (its arrival ``order`` is kept), so it resumes before newer
    arrivals. Removal marks the entry; marked entries leave when they reach the head, or all
    at once when they are over half of the heap."""

    def __init__(self, policy: SchedulingPolicy) -> None:
        self.policy = policy
        self._heap: list[_Entry] = []
        self._live: dict[str, _Entry] = {}  # request id -> its entry
        self._pushes = itertools.count()

    def push(self, seq: Sequence) -> None:
        assert seq.request_id not in self._live, f"{seq.request_id} is waiting already"
        entry = [self.policy.queue_key(seq), next(self._pushes), seq]
        self._live[seq.request_id] = entry
        heapq.heappush(self._heap, entry)

    def remove(self, request_id: str) -> None:
        """``request_id`` waits no more (admitted somewhere, or ended); nothing if it did not."""
        entry = self._live.pop(request_id, None)
        if entry is None:
            return
        entry[2] = None
        heap = self._heap
        while heap and heap[0][2] is None:
            heapq.heappop(heap)
        if len(heap) > 2 * len(self._live) + 16:  # mostly removed entries: rebuild
            self._heap = [e for e in heap if e[2] is not None]
            heapq.heapify(self._heap)

    def peek(self) -> Sequence | None:
        """The sequence admitted next (the head)."""
        return self._heap[0][2] if self._heap else None

    def in_order(self) -> Iterator[Sequence]:
        """The waiting sequences, head first, visited lazily (a step looks at the first few):
        a walk of the heap that always goes to the smallest entry not yet visited. The queue
        must not change while it runs."""
        heap = self._heap
        if not heap:
            return
        n = len(heap)
        frontier = [(heap[0][0], heap[0][1], 0)]
        while frontier:
            *_, i = heapq.heappop(frontier)
            seq = heap[i][2]
            if seq is not None:
                yield seq
            for child in (2 * i + 1, 2 * i + 2):
                if child < n:
                    heapq.heappush(frontier, (heap[child][0], heap[child][1], child))

    def sequences(self) -> list[Sequence]:
        """The waiting sequences (a snapshot, in no particular order)."""
        return [seq for _, _, seq in list(self._heap) if seq is not None]

    def __len__(self) -> int:
        return len(self._live)
