"""Steps the scheduler gave up (StepVoid): their results, should they still come (a worker that
was frozen, not dead), are dropped where results are applied: the detokenizer (nothing streamed)
and the standby schedulers' shadows (nothing resumed from them). Kept for ``ttl_s``: a frozen
worker's late result comes within seconds of its thaw."""

from __future__ import annotations

import time

from kvflow.shared.messages import StepResult, StepVoid


class VoidedSteps:
    """(worker id, scheduler term, step id) of the steps voided in the last ``ttl_s`` seconds."""

    def __init__(self, ttl_s: float = 600.0) -> None:
        self.ttl_s = ttl_s
        self._until: dict[tuple[str, int, int], float] = {}
        self.dropped = 0  # results dropped for it

    def add(self, msg: StepVoid) -> None:
        now = time.monotonic()
        for key in [k for k, t in self._until.items() if t < now]:
            del self._until[key]
        for step in msg.step_ids:
            self._until[(msg.worker_id, msg.epoch, step)] = now + self.ttl_s

    def drops(self, res: StepResult) -> bool:
        """Whether ``res`` is of a voided step (counted when it is)."""
        if not self._until or (res.worker_id, res.epoch, res.step_id) not in self._until:
            return False
        self.dropped += 1
        return True
