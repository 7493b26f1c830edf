"""KV tiers in the scheduler, offline: evicted blocks go to a worker's host tier (the plan names
them), a later request with that prefix loads them instead of recomputing, a tier that lost a
block falls back to recompute, and outputs never change. The stand-in worker's 'KV' is its slot
dict (tests.helpers.scheduler.FakeWorker), so a wrong copy shows in the output."""

from __future__ import annotations

from kvflow.services.scheduler.core import SchedulerCore
from kvflow.services.scheduler.limits import SchedulerLimits
from kvflow.shared.messages import KvLoadDone
from tests.helpers.scheduler import FakeWorker, req

BS = 4


class TierWorker:
    """FakeWorker plus a host tier: {hash: the block's slot values}."""

    def __init__(self, core: SchedulerCore, wid: str = "w") -> None:
        self.core, self.wid = core, wid
        self.fake = FakeWorker(BS)
        self.host: dict[bytes, list[int | None]] = {}
        self.lose: set[bytes] = set()  # hashes the tier 'lost'
        self.loaded_blocks = 0

    def step(self) -> bool:
        ws = self.core.workers[self.wid]
        plan, loads = self.core.schedule(ws)
        for load in loads:
            n = 0
            for ref in load.blocks:
                vals = self.host.get(ref.hash)
                if vals is None or ref.hash in self.lose:
                    break
                for off, v in enumerate(vals):
                    if v is not None:
                        self.fake.slots[ref.block * BS + off] = v
                n += 1
            self.loaded_blocks += n
            self.core.on_load_done(
                KvLoadDone(load.load_id, load.request_id, self.wid, n, host_hits=n)
            )
        if plan is None:
            return bool(loads)
        for ref in plan.offload:  # before the step overwrites them
            self.host[ref.hash] = [self.fake.slots.get(ref.block * BS + o) for o in range(BS)]
        res = self.fake.execute(plan)
        res.worker_id = self.wid
        self.core.on_result(res)
        self.outputs.update(
            {
                r: self.outputs.get(r, []) + [t]
                for r, t in zip(res.request_ids, res.token_ids, strict=True)
            }
        )
        return True

    outputs: dict[str, list[int]]

    def run(self) -> dict[str, list[int]]:
        while self.step():
            pass
        return self.outputs


def make(num_blocks: int) -> TierWorker:
    core = SchedulerCore(SchedulerLimits(max_num_batched_tokens=64), model="m")
    core.add_worker("w", num_blocks, BS, host_tier=True)
    tw = TierWorker(core)
    tw.outputs = {}
    return tw


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    tw = make(256)
    tw.core.add_request(req("x", prompt, max_tokens))
    return tw.run()["x"]


PREFIX = list(range(40))  # 10 full blocks


def test_evicted_prefix_is_loaded_from_the_host_tier_not_recomputed() -> None:
    tw = make(num_blocks=16)
    tw.core.add_request(req("a", PREFIX + [1, 2], 2))
    tw.run()
    # unrelated requests take every block: the prefix's cached blocks are evicted
    for i in range(3):
        tw.core.add_request(req(f"u{i}", [100 + i] * 50, 2))
        tw.run()
    assert tw.core.stats().tier_offloaded_blocks >= 10
    computed = tw.fake.computed
    tw.core.add_request(req("b", PREFIX + [7, 8, 9], 3))
    out = tw.run()["b"]
    assert out == reference(PREFIX + [7, 8, 9], 3)
    assert tw.loaded_blocks == 10
    assert tw.fake.computed - computed == 3 + 2  # the 3 new prompt tokens, then 2 decodes
    s = tw.core.stats()
    assert s.tier_host_hits == 10 and s.tier_misses == 0
    assert s.num_free_blocks == 16


def test_a_block_the_tier_lost_is_recomputed_with_the_same_output() -> None:
    tw = make(num_blocks=16)
    tw.core.add_request(req("a", PREFIX + [1, 2], 2))
    tw.run()
    for i in range(3):
        tw.core.add_request(req(f"u{i}", [100 + i] * 50, 2))
        tw.run()
    hashes = tw.core.workers["w"].bm.block_hashes(PREFIX)
    tw.lose.add(hashes[4])  # blocks 0-3 load, block 4 is gone: 4..9 are computed
    computed = tw.fake.computed
    tw.core.add_request(req("b", PREFIX + [7, 8, 9], 3))
    assert tw.run()["b"] == reference(PREFIX + [7, 8, 9], 3)
    assert tw.loaded_blocks == 4
    assert tw.fake.computed - computed == (43 - 16) + 2
    assert tw.core.stats().tier_misses == 6
    assert tw.core.stats().num_free_blocks == 16


def test_abort_while_loading_frees_the_blocks_when_the_load_ends() -> None:
    tw = make(num_blocks=16)
    tw.core.add_request(req("a", PREFIX + [1, 2], 2))
    tw.run()
    for i in range(3):
        tw.core.add_request(req(f"u{i}", [100 + i] * 50, 2))
        tw.run()
    tw.core.add_request(req("b", PREFIX + [7], 3))
    ws = tw.core.workers["w"]
    plan, loads = tw.core.schedule(ws)
    assert loads and plan is None
    assert tw.core.abort("b")
    assert ws.bm.num_free_blocks < 16  # the load may still be writing them
    tw.core.on_load_done(KvLoadDone(loads[0].load_id, "b", "w", len(loads[0].blocks)))
    assert ws.bm.num_free_blocks == 16 and not ws.running


def test_redis_prefix_known_at_arrival_is_loaded_on_any_worker() -> None:
    """A request whose blocks Redis holds (checked when it arrives) loads them even on a
    worker that never computed them (another worker, or this one after a restart)."""
    core = SchedulerCore(SchedulerLimits(), model="m")
    core.add_worker("w", 64, BS, redis_tier=True)
    tw = TierWorker(core)
    tw.outputs = {}
    # fill the 'Redis' with the prefix's blocks computed by another worker
    other = make(256)
    other.core.add_request(req("a", PREFIX + [1], 1))
    other.run()
    bm = other.core.workers["w"].bm
    for h in bm.block_hashes(PREFIX):
        block = bm.cached[h]
        tw.host[h] = [other.fake.slots.get(block * BS + o) for o in range(BS)]
    core.add_request(req("b", PREFIX + [7, 8], 2), redis_prefix_blocks=10)  # as Redis said
    assert len(core.redis_keys_for(PREFIX + [7, 8])) == 10
    assert tw.run()["b"] == reference(PREFIX + [7, 8], 2)
    assert tw.loaded_blocks == 10
