"""The worker service drives one StepRunner: the model runner, the simulated runner and a
tensor-parallel group's rank 0 all keep the contract (services/worker/step_runner.py), and a
step's result, failed or not, comes from the one builder."""

from __future__ import annotations

import inspect

from kvflow.services.worker.runner import ModelRunner
from kvflow.services.worker.sim_runner import SimRunner
from kvflow.services.worker.step_output import StepOut, step_result
from kvflow.services.worker.step_runner import StepRunner
from kvflow.services.worker.tp_group import TPLeader
from kvflow.shared.messages import SampleLogprobs, ScheduledSeq, StepPlan

METHODS = [n for n, v in vars(StepRunner).items() if inspect.isfunction(v) and n[0] != "_"]
PROPERTIES = [n for n, v in vars(StepRunner).items() if isinstance(v, property)]


def test_every_runner_has_the_contracts_methods_with_its_parameters() -> None:
    assert {"execute", "reset", "forget_lora", "keepalive", "close"} <= set(METHODS)
    for cls in (ModelRunner, SimRunner, TPLeader):
        for name in METHODS:
            want = list(inspect.signature(getattr(StepRunner, name)).parameters)
            got = list(inspect.signature(getattr(cls, name)).parameters)
            assert got[: len(want)] == want, (cls.__name__, name)


def test_the_simulated_runner_and_the_leader_expose_the_contracts_state() -> None:
    sim = SimRunner(range(10, 20), [2], 4, 8, 32)
    for name in PROPERTIES:
        assert hasattr(sim, name), name
    assert all(isinstance(getattr(TPLeader, n), property) for n in PROPERTIES)
    res = sim.execute(StepPlan(1, [ScheduledSeq("nobody", [1], 0, [0])]))
    assert res.error and "nobody" in res.error and res.request_ids == []  # the builder's shape


def test_one_builder_for_results_and_failures() -> None:
    plan = StepPlan(7, [], epoch=3)
    out = StepOut(num_computed=5)
    out.add("a", 11, 0, 1, None)
    out.add("b", 12, 1, 4, SampleLogprobs(-0.5, [12], [-0.5]))
    res = step_result("w", plan, out, 0.01)
    assert (res.step_id, res.epoch, res.request_ids, res.token_ids) == (7, 3, ["a", "b"], [11, 12])
    assert res.num_output_tokens == [1, 4] and len(res.logprobs) == 2
    res = step_result(
        "w", plan, StepOut(ids=["a"], tokens=[1], reasons=[0], counts=[1], logprobs=[None])
    )
    assert res.logprobs == []  # no entry asked: no column
    failed = step_result("w", plan, out, error="boom")
    assert failed.error == "boom" and failed.request_ids == [] and failed.num_computed_tokens == 0
