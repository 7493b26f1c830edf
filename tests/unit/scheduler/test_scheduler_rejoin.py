"""A worker given up and heard from again (a frozen or overloaded machine): its sequences wait
again, and when it rejoins it numbers its steps on from where it was given up, so a late result
of a step planned before (the scheduler matches results by worker, term and step id) can never
be taken for a step planned after."""

from __future__ import annotations

from kvflow.services.scheduler.core import SchedulerCore
from kvflow.services.scheduler.limits import SchedulerLimits
from kvflow.shared.messages import SamplingParams, StepResult, TokenizedRequest


def _core() -> SchedulerCore:
    core = SchedulerCore(SchedulerLimits())
    core.add_worker("w", 64, 4)
    return core


def test_a_rejoined_worker_numbers_its_steps_on() -> None:
    core = _core()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    core.add_request(TokenizedRequest("r", "", [5, 6, 7], params))
    ws = core.workers["w"]
    first, _ = core.schedule(ws)
    core.on_result(StepResult("w", first.step_id, ["r"], [9], [0]))
    lost, _ = core.schedule(ws)  # in flight when the worker is given up
    assert lost.step_id == first.step_id + 1
    moved = core.remove_worker("w")
    assert [s.request_id for s in moved] == ["r"]
    back = core.add_worker("w", 64, 4)  # the same worker, heard from again
    again, _ = core.schedule(back)
    assert again is not None and again.step_id > lost.step_id
    # the recompute carries the token the scheduler accepted, not the lost step's
    [seq] = again.seqs
    assert seq.token_ids[-1] == 9 and seq.start_pos == 0
