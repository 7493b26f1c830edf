"""Embedding requests in the scheduler, offline: a prefill-only job that ends with its vector
(its blocks freed, counted as finished), chunked under the token budget, batched with
generation, computing its whole prompt for MEAN (no prefix-cache hit) while LAST may hit,
never handed to a decode worker, recomputed once after a failed step, and ended in the
standby's shadow by its vector."""

from __future__ import annotations

from kvflow.services.scheduler.core import SchedulerCore
from kvflow.services.scheduler.limits import SchedulerLimits
from kvflow.services.scheduler.shadow import ShadowState
from kvflow.shared.messages import (
    FinishReason,
    PooledOutput,
    PoolingParams,
    SamplingParams,
    StepPlan,
    StepResult,
    TokenizedRequest,
)

BS = 4
PROMPT = list(range(100, 130))  # 30 tokens: 7 full blocks and a partial one


class StandIn:
    """A worker stand-in: records each request's computed positions and NewRequests; samples
    token 7 for generating sequences and sends a vector for pooling ones whose chunk ends
    their prompt (``sample``)."""

    def __init__(self, wid: str = "w") -> None:
        self.wid = wid
        self.pooling: dict[str, PoolingParams | None] = {}
        self.left: dict[str, int] = {}  # tokens each generating request may still sample
        self.positions: dict[str, list[int]] = {}
        self.announced: list[str] = []
        self.vectors: list[str] = []  # requests whose vector was sent

    def execute(self, plan: StepPlan) -> StepResult:
        for rid in plan.finished_request_ids:
            self.pooling.pop(rid, None)
        for nr in plan.new_requests:
            self.pooling[nr.request_id] = nr.pooling
            self.left[nr.request_id] = nr.params.max_tokens - nr.num_output_tokens
            self.announced.append(nr.request_id)
        res = StepResult(self.wid, plan.step_id, [], [], [])
        for s in plan.seqs:
            assert s.request_id in self.pooling, "announced before it runs"
            self.positions.setdefault(s.request_id, []).extend(
                range(s.start_pos, s.start_pos + len(s.token_ids))
            )
            if not s.sample:
                continue
            if self.pooling[s.request_id] is not None:
                res.embeddings.append(PooledOutput(s.request_id, b"\0\0\x80?", 1))
                self.vectors.append(s.request_id)
            else:
                res.request_ids.append(s.request_id)
                res.token_ids.append(7)
                self.left[s.request_id] -= 1
                done = self.left[s.request_id] == 0
                res.finish_reasons.append(int(FinishReason.LENGTH if done else FinishReason.NONE))
        return res


def embed_req(rid: str, prompt: list[int], kind: str = "LAST") -> TokenizedRequest:
    params = SamplingParams(max_tokens=1)
    return TokenizedRequest(rid, "inbox", prompt, params, pooling=PoolingParams(kind))


def gen_req(rid: str, prompt: list[int], max_tokens: int = 1) -> TokenizedRequest:
    return TokenizedRequest(rid, "inbox", prompt, SamplingParams(max_tokens=max_tokens))


def core_with(roles: dict[str, str], **limits: int) -> tuple[SchedulerCore, dict[str, StandIn]]:
    core = SchedulerCore(SchedulerLimits(**limits), model="m")
    for wid, role in roles.items():
        core.add_worker(wid, 64, BS, role=role)
    return core, {wid: StandIn(wid) for wid in roles}


def run(core: SchedulerCore, workers: dict[str, StandIn]) -> list[StepPlan]:
    """Step every worker until nothing runs; returns the plans in order."""
    plans = []
    for _ in range(100):
        progressed = False
        for wid, w in workers.items():
            plan = core.schedule(core.workers[wid])[0]
            if plan is None:
                continue
            progressed = True
            plans.append(plan)
            core.on_result(w.execute(plan))
        if not progressed:
            return plans
    raise AssertionError("did not finish")


def all_free(core: SchedulerCore) -> bool:
    return all(w.bm.num_free_blocks == w.bm.num_blocks for w in core.workers.values())


def test_an_embedding_is_prefill_only_and_frees_its_blocks() -> None:
    core, workers = core_with({"w": "both"})
    core.add_request(embed_req("e", PROMPT))
    plan = core.schedule(core.workers["w"])[0]
    assert plan is not None
    assert [(s.request_id, len(s.token_ids), s.sample) for s in plan.seqs] == [("e", 30, True)]
    assert plan.new_requests[0].pooling == PoolingParams("LAST")
    assert core.workers["w"].bm.num_free_blocks == 64 - 8
    out = core.on_result(workers["w"].execute(plan))
    assert [(s.request_id, r) for s, r in out.finished] == [("e", FinishReason.STOP)]
    assert all_free(core) and core.requests == {} and core.num_finished == 1
    stats = core.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    nxt = core.schedule(core.workers["w"])[0]  # the worker is told to drop the request's state
    assert nxt is not None and nxt.seqs == [] and nxt.finished_request_ids == ["e"]


def test_chunked_under_the_budget_and_batched_with_generation() -> None:
    core, workers = core_with({"w": "both"}, max_num_batched_tokens=12)
    core.add_request(gen_req("g", [1, 2, 3]))
    core.add_request(embed_req("e", PROMPT, "MEAN"))
    plans = run(core, workers)
    chunks = [[(s.request_id, len(s.token_ids), s.sample) for s in p.seqs] for p in plans]
    assert chunks[0] == [("g", 3, True), ("e", 9, False)]  # one step: a prompt and a chunk
    assert [c for p in chunks[1:] for c in p] == [("e", 12, False), ("e", 9, True)]
    assert workers["w"].positions["e"] == list(range(30))
    assert all_free(core) and core.num_finished == 2


def test_mean_computes_its_whole_prompt_and_last_may_hit_the_prefix_cache() -> None:
    core, workers = core_with({"w": "both"})
    core.add_request(gen_req("warm", PROMPT))  # its 7 full blocks stay cached
    run(core, workers)
    core.add_request(embed_req("mean", PROMPT, "MEAN"))
    core.add_request(embed_req("cls", PROMPT, "CLS"))
    run(core, workers)
    assert workers["w"].positions["mean"] == list(range(30))
    assert workers["w"].positions["cls"] == list(range(30))
    queries = core.stats().prefix_cache_queries
    core.add_request(embed_req("last", PROMPT, "LAST"))
    run(core, workers)
    assert workers["w"].positions["last"] == [28, 29]  # 7 blocks hit: only the rest computed
    assert core.stats().prefix_cache_queries > queries
    assert all_free(core) and core.num_finished == 4


def test_never_handed_to_a_decode_worker() -> None:
    core, workers = core_with({"p": "prefill", "d": "decode"})
    core.add_request(embed_req("e", PROMPT))
    first = core.schedule(core.workers["p"])[0]
    assert first is not None and [s.request_id for s in first.seqs] == ["e"]
    d = core.workers["d"]  # nothing reserved on the decode worker for it
    assert d.num_reserved == 0 and d.bm.num_free_blocks == 64
    core.on_result(workers["p"].execute(first))
    core.add_request(gen_req("g", [1, 2, 3, 4, 5], max_tokens=3))
    run(core, workers)  # no KV transfer is carried out here: g stops on its way to d
    assert "e" in workers["p"].announced and workers["p"].vectors == ["e"]
    assert "e" not in workers["d"].announced and "e" not in workers["d"].positions
    by_id = {w.worker_id: w for w in core.stats().workers}
    assert by_id["p"].num_prefills == 2 and by_id["d"].num_decodes == 1
    assert list(core.requests) == ["g"]  # handed to d, waiting for its K/V
    assert [s.request_id for s in core.workers["d"].running] == ["g"]
    assert [t.request_id for t in core.router.transfers.values()] == ["g"]
    assert core.workers["p"].bm.num_free_blocks == 64 - 2  # g's source blocks, held
    assert core.num_finished == 1


def test_a_failed_step_recomputes_and_the_vector_comes_once() -> None:
    core, workers = core_with({"w": "both"}, max_num_batched_tokens=16)
    core.add_request(embed_req("e", PROMPT, "MEAN"))
    ws = core.workers["w"]
    plan = core.schedule(ws)[0]
    assert plan is not None and plan.seqs[0].start_pos == 0
    core.on_result(StepResult("w", plan.step_id, [], [], [], error="boom"))
    assert ws.bm.num_free_blocks == 64 and len(core.waiting) == 1
    workers["w"].positions.clear()
    plans = run(core, workers)
    assert plans[0].finished_request_ids == ["e"] and plans[0].new_requests[0].request_id == "e"
    assert workers["w"].positions["e"] == list(range(30))  # from the start again
    assert workers["w"].vectors == ["e"]
    assert core.num_finished == 1 and all_free(core)


def test_the_shadow_ends_a_request_on_its_vector() -> None:
    shadow = ShadowState()
    shadow.add(embed_req("e", PROMPT))
    shadow.apply(StepResult("w", 1, [], [], [], embeddings=[PooledOutput("e", b"", 0)]))
    assert "e" not in shadow.live and shadow.is_finished("e")
