"""The scheduling policy interface: FCFS and priority queue order, and which running sequence
each preempts when blocks run out (priority: the lowest priority, the newest among equals),
with outputs unchanged and every block back at the end."""

from __future__ import annotations

import pytest

from kvflow.services.scheduler.core import SchedulerCore
from kvflow.services.scheduler.limits import SchedulerLimits
from kvflow.services.scheduler.policy import FcfsPolicy, PriorityPolicy, make_policy
from kvflow.shared.messages import FinishReason, StepPlan, StepResult
from tests.helpers.scheduler import PROMPTS, FakeWorker, reference_outputs, req, run_all


def make_core(policy: str, num_blocks: int = 64, **limits: int) -> SchedulerCore:
    core = SchedulerCore(SchedulerLimits(**limits), make_policy(policy), model="m")
    core.add_worker("w", num_blocks, 4)
    return core


def decode_one(core: SchedulerCore, plan: StepPlan) -> None:
    """Every sampled sequence of ``plan`` gets token 1 and goes on."""
    rids = [s.request_id for s in plan.seqs if s.sample]
    core.on_result(StepResult("w", plan.step_id, rids, [1] * len(rids), [0] * len(rids)))


def test_the_factory_knows_both_policies_and_refuses_others() -> None:
    assert isinstance(make_policy("fcfs"), FcfsPolicy)
    assert isinstance(make_policy("priority"), PriorityPolicy)
    with pytest.raises(ValueError, match="fcfs"):
        make_policy("lifo")


@pytest.mark.parametrize(
    ("policy", "order"),
    [("fcfs", ["a", "b", "c", "d"]), ("priority", ["b", "d", "c", "a"])],
)
def test_queue_order(policy: str, order: list[str]) -> None:
    """FCFS ignores priorities; priority takes lower values first, arrival order within."""
    core = make_core(policy, max_num_seqs=1)
    for rid, prio in (("a", 2), ("b", 0), ("c", 1), ("d", 0)):
        core.add_request(req(rid, [1, 2, 3], 1), priority=prio)
    admitted = []
    while (plan := core.schedule(core.workers["w"])[0]) is not None:
        admitted += [s.request_id for s in plan.seqs]
        rids = [s.request_id for s in plan.seqs]
        done = [FinishReason.LENGTH] * len(rids)
        core.on_result(StepResult("w", plan.step_id, rids, [1] * len(rids), done))
    assert admitted == order


def _two_low_then_one_high(policy: str) -> tuple[SchedulerCore, StepPlan]:
    """Six blocks of 4 tokens: b and c (priority 5, two blocks each) run first, then d
    (priority 0) joins with the last two; at the next step b needs a third block."""
    core = make_core(policy, num_blocks=6)
    ws = core.workers["w"]
    core.add_request(req("b", list(range(7)), 20), priority=5)
    core.add_request(req("c", list(range(10, 17)), 20), priority=5)
    decode_one(core, core.schedule(ws)[0])
    core.add_request(req("d", list(range(20, 27)), 20), priority=0)
    decode_one(core, core.schedule(ws)[0])
    assert [s.request_id for s in ws.running] == ["b", "c", "d"]
    assert ws.bm.num_free_blocks == 0
    return core, core.schedule(ws)[0]


def test_fcfs_preempts_the_newest() -> None:
    core, plan = _two_low_then_one_high("fcfs")
    assert [s.request_id for s in plan.seqs] == ["b", "c"]
    assert core.requests["d"].num_preemptions == 1 and core.waiting.peek() is core.requests["d"]


def test_priority_preempts_the_lowest_priority_newest_among_equals() -> None:
    core, plan = _two_low_then_one_high("priority")
    assert [s.request_id for s in plan.seqs] == ["b", "d"]
    assert core.requests["c"].num_preemptions == 1 and core.waiting.peek() is core.requests["c"]
    assert core.stats().num_preemptions == 1


def test_a_victim_already_planned_in_the_step_is_taken_out_of_it() -> None:
    """The low-priority c comes before the high-priority d in the running list: when d needs a
    block, c is preempted although this step already gave it a token; c leaves the plan, and
    the block that token was to complete is not left in the prefix cache."""
    core = make_core("priority", num_blocks=4)
    ws = core.workers["w"]
    core.add_request(req("c", list(range(6)), 20), priority=5)
    decode_one(core, core.schedule(ws)[0])  # c: 7 tokens, 6 computed, 2 blocks
    core.add_request(req("d", list(range(20, 28)), 20), priority=0)
    decode_one(core, core.schedule(ws)[0])  # c: 8 tokens, 7 computed; d: 9 tokens, 8 computed
    assert [s.request_id for s in ws.running] == ["c", "d"] and ws.bm.num_free_blocks == 0
    c = core.requests["c"]
    second = ws.bm.block_hashes(c.token_ids[:8])[1]  # what c's next token completes
    plan = core.schedule(ws)[0]  # c is planned first (no new block); then d needs a third block
    assert [s.request_id for s in plan.seqs] == ["d"]
    assert c.status.value == "waiting" and c.num_preemptions == 1
    assert second not in ws.bm.cached and not ws.in_flight[-1].cached
    assert plan.finished_request_ids == ["c"]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_keeps_outputs_and_frees_every_block(policy: str) -> None:
    ref = reference_outputs()
    core = SchedulerCore(SchedulerLimits(max_num_batched_tokens=64), make_policy(policy))
    core.add_worker("w", 24, 4)
    for i, (rid, p) in enumerate(PROMPTS.items()):
        core.add_request(req(rid, p, 12), priority=(i * 5) % 3)
    assert run_all(core, FakeWorker(4)) == ref
    assert core.stats().num_preemptions > 0
    assert core.stats().num_free_blocks == 24 and not core.workers["w"].running


@pytest.mark.parametrize("name", ["fcfs", "priority"])
def test_the_service_builds_its_core_with_the_configured_policy(name: str) -> None:
    from kvflow.services.scheduler.service import SchedulerService
    from kvflow.shared.config import Settings

    svc = SchedulerService(Settings.of(scheduling_policy=name), "m", 512)
    assert svc.core.policy.name == name and svc.core.waiting.policy is svc.core.policy
    # the one core, which a leader (a standby that takes over included) plans and queues with
    assert svc.plan_loop.core is svc.core and svc.intake.core is svc.core
