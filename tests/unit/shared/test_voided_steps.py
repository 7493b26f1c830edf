"""StepVoid bookkeeping (shared/voided_steps.py): a voided step's late result is dropped and
counted; others pass; entries expire."""

from __future__ import annotations

from kvflow.shared.messages import StepResult, StepVoid, decode, encode
from kvflow.shared.voided_steps import VoidedSteps


def _result(worker: str, step: int, epoch: int = 1) -> StepResult:
    return StepResult(worker, step, ["r"], [7], [0], epoch=epoch)


def test_a_voided_steps_result_is_dropped_and_counted() -> None:
    voided = VoidedSteps()
    assert not voided.drops(_result("w", 5))  # nothing voided yet
    voided.add(decode(encode(StepVoid("w", 1, [5, 6]))))  # as it comes over the bus
    assert voided.drops(_result("w", 5)) and voided.drops(_result("w", 6))
    assert not voided.drops(_result("w", 7))  # a later step of the worker that came back
    assert not voided.drops(_result("other", 5))
    assert not voided.drops(_result("w", 5, epoch=2))  # another scheduler term's step 5
    assert voided.dropped == 2


def test_entries_expire() -> None:
    voided = VoidedSteps(ttl_s=0.0)
    voided.add(StepVoid("w", 1, [1]))
    voided.add(StepVoid("w", 1, [2]))  # adding prunes what expired
    assert not voided.drops(_result("w", 1))
