"""The scheduler core without a model: a stand-in worker whose 'model' is a pure function of every
K/V slot it reads (so a wrong block, a lost token or a repeated one changes the output), and a
cluster of them with KV transfers that really copy slots between workers."""

from __future__ import annotations

from kvflow.services.scheduler.core import SchedulerCore
from kvflow.services.scheduler.limits import SchedulerLimits
from kvflow.services.worker.block_tables import BlockTables
from kvflow.shared.messages import (
    FinishReason,
    KvPull,
    KvTransferDone,
    SamplingParams,
    StepPlan,
    StepResult,
    TokenizedRequest,
)
from kvflow.shared.sampling import needs_token_history


class FakeWorker:
    """A stand-in worker with a real paged 'KV cache': each slot holds the token computed there.
    A sequence's history is read back through its block table, and the 'sampled' token depends
    on all of it, so a wrong block, a lost token or a repeated one changes the output."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[int, int] = {}
        self.params: dict[str, tuple[int, int]] = {}  # rid -> (max_tokens, outputs so far)
        self.computed = 0
        self.history: dict[str, list[int]] = {}  # rid -> NewRequest.token_history + sampled
        self.tables = BlockTables(num_blocks=1 << 20)

    def _slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, plan: StepPlan) -> StepResult:
        self.tables.apply(plan)  # plans carry block-table differences, as the worker's
        for rid in plan.finished_request_ids:
            self.params.pop(rid, None)
        for nr in plan.new_requests:
            self.params[nr.request_id] = (nr.params.max_tokens, nr.num_output_tokens)
            if needs_token_history(nr.params):  # as the real worker: all tokens so far
                self.history[nr.request_id] = list(nr.token_history)
            else:
                assert nr.token_history == []  # sent only when sampling needs it
        rids, toks, reasons = [], [], []
        for s in plan.seqs:
            assert s.request_id in self.params, "a sequence must be announced before it runs"
            assert len(s.block_table) * self.block_size >= s.start_pos + len(s.token_ids)
            for i, t in enumerate(s.token_ids):
                self.slots[self._slot(s.block_table, s.start_pos + i)] = t
            self.computed += len(s.token_ids)
            if s.sample:
                n = s.start_pos + len(s.token_ids)
                hist = [self.slots[self._slot(s.block_table, p)] for p in range(n)]
                tok = (sum(t * (p + 1) for p, t in enumerate(hist)) * 31 + n) % 97
                if s.request_id in self.history:
                    assert self.history[s.request_id] == hist  # what penalties would see
                    self.history[s.request_id].append(tok)
                max_t, n_out = self.params[s.request_id]
                n_out += 1
                self.params[s.request_id] = (max_t, n_out)
                rids.append(s.request_id)
                toks.append(tok)
                reasons.append(FinishReason.LENGTH if n_out >= max_t else FinishReason.NONE)
        return StepResult("w", plan.step_id, rids, toks, reasons)


def run_all(
    core: SchedulerCore, worker: FakeWorker, max_steps: int = 10_000
) -> dict[str, list[int]]:
    ws = core.workers["w"]
    outputs: dict[str, list[int]] = {rid: [] for rid in core.requests}
    for _ in range(max_steps):
        plan = core.schedule(ws)[0]
        if plan is None:
            break
        res = worker.execute(plan)
        for rid, tok in zip(res.request_ids, res.token_ids, strict=True):
            outputs[rid].append(tok)
        core.on_result(res)
    return outputs


def make_core(
    num_blocks: int = 256, block_size: int = 4, **limits: int
) -> tuple[SchedulerCore, FakeWorker]:
    core = SchedulerCore(SchedulerLimits(**limits), model="m")
    core.add_worker("w", num_blocks, block_size)
    return core, FakeWorker(block_size)


def req(rid: str, prompt: list[int], max_tokens: int) -> TokenizedRequest:
    return TokenizedRequest(rid, "inbox", prompt, SamplingParams(max_tokens=max_tokens))


PROMPTS = {f"r{i}": [(i * 7 + j) % 50 for j in range(5 + i * 9)] for i in range(8)}


def reference_outputs() -> dict[str, list[int]]:
    out = {}
    for rid, p in PROMPTS.items():
        core, w = make_core()
        core.add_request(req(rid, p, 12))
        out[rid] = run_all(core, w)[rid]
    return out


BS = 4


class Cluster:
    def __init__(self, roles: dict[str, str], num_blocks: int = 256, **limits: int) -> None:
        self.core = SchedulerCore(SchedulerLimits(**limits), model="m")
        self.fakes: dict[str, FakeWorker] = {}
        for wid, role in roles.items():
            self.core.add_worker(wid, num_blocks, BS, role=role, kv_address=f"kv.{wid}")
            self.fakes[wid] = FakeWorker(BS)
        self.outputs: dict[str, list[int]] = {}
        self.pending: list[tuple[str, KvPull]] = []  # transfers not yet carried out
        self.copied_blocks = 0
        self.fail_next_transfer = False

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        self.core.add_request(req(rid, prompt, max_tokens))
        self.outputs[rid] = []

    def step_all(self) -> bool:
        """One step on every worker that has something to run; returns whether any did."""
        progressed = False
        for wid in list(self.core.workers):
            ws = self.core.workers.get(wid)
            if ws is None:
                continue
            plan = self.core.schedule(ws)[0]
            if plan is None:
                continue
            progressed = True
            res = self.fakes[wid].execute(plan)
            res.worker_id = wid
            for rid, tok in zip(res.request_ids, res.token_ids, strict=True):
                self.outputs[rid].append(tok)
            out = self.core.on_result(res)
            self.pending += out.pulls
        return progressed

    def deliver(self) -> None:
        """Carry out the pending transfers: copy slots, then report done."""
        pending, self.pending = self.pending, []
        for dst, pull in pending:
            ok = not self.fail_next_transfer
            self.fail_next_transfer = False
            if ok:
                src_fake, dst_fake = self.fakes[pull.src_worker], self.fakes[dst]
                for sb, db in zip(pull.src_blocks, pull.dst_blocks, strict=True):
                    for off in range(BS):
                        v = src_fake.slots.get(sb * BS + off)
                        if v is not None:
                            dst_fake.slots[db * BS + off] = v
                    self.copied_blocks += 1
            self.core.on_transfer_done(
                KvTransferDone(pull.transfer_id, pull.request_id, dst, ok, num_bytes=1)
            )

    def run(self, max_rounds: int = 10_000) -> dict[str, list[int]]:
        for _ in range(max_rounds):
            progressed = self.step_all()
            had_pending = bool(self.pending)
            self.deliver()
            if not progressed and not had_pending:
                break
        return self.outputs

    def all_free(self) -> bool:
        return all(w.bm.num_free_blocks == w.bm.num_blocks for w in self.core.workers.values())
