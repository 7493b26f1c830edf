"""The one LoRA residency rule (shared/lora_residency.py) that the worker's adapter cache and the
scheduler's view of each worker follow: least recently used first, a step's adapters used in
the order they first appear, none evicting another of the same step."""

from __future__ import annotations

from kvflow.services.scheduler.core import SchedulerCore
from kvflow.services.scheduler.limits import SchedulerLimits
from kvflow.shared.lora_residency import LoraResidency
from kvflow.shared.messages import LoRARef, SamplingParams, TokenizedRequest


def test_least_recently_used_goes_first_and_a_step_keeps_its_own() -> None:
    lru = LoraResidency(2)
    assert lru.step(["a", "b", "a"]) == []  # first appearances: a, then b (the most recent)
    assert lru.names() == ["a", "b"]
    assert lru.step(["c"]) == ["a"] and lru.names() == ["b", "c"]
    assert lru.use("b") == [] and lru.names() == ["c", "b"]
    # a step of three on two places keeps all three until a later step needs a place
    assert lru.step(["d", "c", "b"]) == [] and lru.names() == ["d", "c", "b"]
    assert lru.step(["e"]) == ["d", "c"] and lru.names() == ["b", "e"]
    lru.forget("b")
    assert "b" not in lru and len(lru) == 1 and lru.names() == ["e"]
    assert LoraResidency(0).capacity == 1  # LoRA off still holds one place


def test_the_scheduler_view_follows_the_plans_sent() -> None:
    core = SchedulerCore(SchedulerLimits(max_loras=2), model="m")
    ws = core.add_worker("w", 64, 4)
    for rid, name in (("r1", "a"), ("r2", "b"), ("r3", "a"), ("r4", None)):
        req = TokenizedRequest(rid, "", [1, 2, 3], SamplingParams(max_tokens=1))
        req.lora = LoRARef(name, 1, f"/{name}") if name else None
        core.add_request(req)
    plan, _ = core.schedule(ws)
    assert [s.request_id for s in plan.seqs] == ["r1", "r2", "r3", "r4"]
    assert ws.loras.names() == ["a", "b"]  # as the worker's cache orders that step
    assert ws.holds_lora(core.requests["r1"]) and ws.holds_lora(core.requests["r4"])
