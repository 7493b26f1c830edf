"""Scheduling policies: the order in which waiting requests are admitted and which running
sequence gives its blocks back when memory runs out. Nothing else lives here, so a new policy is
one class here and one name in ``POLICIES`` (chosen by the ``scheduling_policy`` setting).

Both policies keep a preempted sequence's place in the queue (its arrival ``order`` does not
change), so it resumes before newer arrivals, as vLLM's scheduler does.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Protocol

from kvflow.services.scheduler.sequence import SeqStatus, Sequence


class SchedulingPolicy(Protocol):
    """Queue order and preemption victim; the rest of the scheduler asks only these two."""

    name: str

    def queue_key(self, seq: Sequence) -> tuple[int, ...]:
        """Sort key of a waiting sequence: the smallest is admitted first."""
        ...

    def choose_victim(self, running: Seq[Sequence]) -> Sequence | None:
        """The sequence to preempt among ``running`` (admission order, the last the newest),
        or None when none may be preempted."""
        ...


def _preemptible(running: Seq[Sequence]) -> list[Sequence]:
    """Running sequences whose blocks may be taken back, newest first: not one whose K/V a
    transfer or a tier load is writing."""
    return [s for s in reversed(running) if s.status is SeqStatus.RUNNING]


class FcfsPolicy:
    """First come, first served: arrival order, request priorities ignored; the newest running
    sequence is preempted."""

    name = "fcfs"

    def queue_key(self, seq: Sequence) -> tuple[int, ...]:
        return (seq.order,)

    def choose_victim(self, running: Seq[Sequence]) -> Sequence | None:
        candidates = _preemptible(running)
        return candidates[0] if candidates else None


class PriorityPolicy:
    """Lower ``priority`` values first, arrival order within a priority; the victim is the
    lowest-priority (largest value) running sequence, the newest among equals (vLLM's priority
    scheduler). With equal priorities it plans exactly as FCFS."""

    name = "priority"

    def queue_key(self, seq: Sequence) -> tuple[int, ...]:
        return (seq.priority, seq.order)

    def choose_victim(self, running: Seq[Sequence]) -> Sequence | None:
        candidates = _preemptible(running)
        # max() keeps the first of equals: candidates are newest first
        return max(candidates, key=lambda s: s.priority) if candidates else None


POLICIES: dict[str, Callable[[], SchedulingPolicy]] = {
    FcfsPolicy.name: FcfsPolicy,
    PriorityPolicy.name: PriorityPolicy,
}


def make_policy(name: str) -> SchedulingPolicy:
    """The policy the ``scheduling_policy`` setting names."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown scheduling policy {name!r} (one of {', '.join(POLICIES)})"
        ) from None
