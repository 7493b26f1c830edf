"""The scheduler's state across workers: the global waiting queue, every live request, one
WorkerScheduler per worker, the router that decides where a request is prefilled and decoded,
and the KV transfers between workers. Plain Python (no NATS), so tests can drive it offline.

Routing (as Dynamo's KV router): among the workers that can take a sequence now, the cost of a
worker is the blocks it would have to compute (prefill) or receive (decode), i.e. the prompt's
blocks minus those already in its prefix cache, plus the blocks it has in use (its load). The
cheapest wins, so a shared prefix pulls requests to the worker that holds it, while unrelated
requests spread by load. A ``both`` worker decodes what it prefills.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from services.scheduler.block_manager import BlockHash, BlockManager
from services.scheduler.policy import Route, SchedulerLimits, StepOutcome, WorkerScheduler
from services.scheduler.sequence import Reservation, SeqStatus, Sequence, Transfer, WaitingQueue
from shared.kv_tier import tier_key
from shared.messages import (
    BlockRef,
    KvLoad,
    KvLoadDone,
    KvPull,
    KvTransferDone,
    SchedulerStats,
    StepPlan,
    StepResult,
    TokenizedRequest,
    WorkerStats,
)


class QueueFullError(RuntimeError):
    pass


@dataclass
class CoreOutcome(StepOutcome):
    """A StepOutcome plus the KV pulls the service must send (to the decode workers)."""

    pulls: list[tuple[str, KvPull]] = field(default_factory=list)  # (decode worker id, order)


@dataclass
class TransferTotals:
    done: int = 0
    failed: int = 0
    num_bytes: int = 0
    seconds: float = 0.0


@dataclass
class TierTotals:
    loads: int = 0
    host_hits: int = 0
    redis_hits: int = 0
    misses: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
    offloaded: int = 0


class SchedulerCore:
    def __init__(self, limits: SchedulerLimits, max_waiting: int = 1024, model: str = "") -> None:
        self.limits = limits
        self.max_waiting = max_waiting
        self.model = model
        self.waiting = WaitingQueue()
        self.requests: dict[str, Sequence] = {}
        self.workers: dict[str, WorkerScheduler] = {}
        self.kv_subject: dict[str, str] = {}  # worker id -> where it serves its blocks
        self.kv_layout: dict[str, str] = {}  # worker id -> KV block layout
        self.transfers: dict[str, Sequence] = {}  # transfer id -> sequence (aborted ones too)
        self.transfer_totals = TransferTotals()
        self.loads: dict[str, Sequence] = {}  # tier load id -> sequence (aborted ones too)
        self.tier_totals = TierTotals()
        self.host_hashes: dict[str, set[bytes]] = {}  # worker -> blocks in its host tier
        self.num_finished = 0
        self.num_computed_tokens = 0  # as reported by the workers' StepResults
        self._transfer_ids = itertools.count(1)

    # -- workers ----------------------------------------------------------------------------

    def add_worker(
        self,
        worker_id: str,
        num_blocks: int,
        block_size: int,
        role: str = "both",
        kv_subject: str = "",
        kv_layout: str = "",
        host_tier: bool = False,
        redis_tier: bool = False,
    ) -> WorkerScheduler:
        salt = f"{self.model}|{block_size}".encode()
        ws = WorkerScheduler(
            worker_id, BlockManager(num_blocks, block_size, salt), self.limits, role=role
        )
        ws.router = self._route
        ws.release_elsewhere = self._release_elsewhere
        ws.tier_lookup = self._tier_lookup
        ws.offload_enabled = host_tier
        ws.store_enabled = redis_tier
        self.host_hashes[worker_id] = set()
        self.workers[worker_id] = ws
        self.kv_subject[worker_id] = kv_subject
        self.kv_layout[worker_id] = kv_layout
        return ws

    def remove_worker(self, worker_id: str) -> list[Sequence]:
        """A worker left: its sequences wait again, to be recomputed elsewhere; sequences
        prefilling elsewhere for a decode here are re-queued too (their reservation is gone)."""
        ws = self.workers.pop(worker_id, None)
        self.kv_subject.pop(worker_id, None)
        self.kv_layout.pop(worker_id, None)
        self.host_hashes.pop(worker_id, None)
        if ws is None:
            return []
        moved = ws.on_failed_step(self.waiting, removing=True)
        for other in self.workers.values():
            for seq in list(other.running):
                if seq.reservation is not None and seq.reservation.worker_id == worker_id:
                    seq.reservation = None  # nothing to free there any more
                    other._preempt(seq, self.waiting)
                    other.num_preemptions -= 1
                    moved.append(seq)
        for seq in moved:
            if seq.request_id not in self.requests:  # aborted while its K/V was in flight
                self.waiting.remove(seq.request_id)
                seq.status = SeqStatus.FINISHED
        return moved

    def set_draining(self, worker_id: str) -> None:
        ws = self.workers.get(worker_id)
        if ws is not None:
            ws.draining = True

    def drained(self, worker_id: str) -> bool:
        """A draining worker with nothing running, reserved or being copied from it."""
        ws = self.workers.get(worker_id)
        if ws is None or not ws.draining or ws.running or ws.num_reserved or ws.in_flight:
            return False
        return not any(
            s.transfer and s.transfer.src_worker == worker_id for s in self.transfers.values()
        )

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self, req: TokenizedRequest, priority: int = 0, output_ids: list[int] | None = None
    ) -> Sequence:
        """Queue a request; ``output_ids`` are tokens it generated before (a takeover resumes
        requests from their prompt plus those, by recompute)."""
        if req.request_id in self.requests:
            return self.requests[req.request_id]  # a resubmission of the same request: run once
        if len(self.waiting) >= self.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests)")
        seq = Sequence(
            request_id=req.request_id,
            token_ids=list(req.prompt_token_ids) + list(output_ids or []),
            prompt_len=len(req.prompt_token_ids),
            params=req.params,
            eos_token_ids=list(req.eos_token_ids),
            arrival_time=req.arrival_time,
            priority=priority,
        )
        self.requests[seq.request_id] = seq
        self.waiting.push(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(request_id)
            seq.status = SeqStatus.FINISHED
        elif seq.status is SeqStatus.TRANSFERRING:
            seq.aborted = True  # its blocks are being written: freed when the transfer ends
        elif seq.worker_id in self.workers:
            self.workers[seq.worker_id].finish(seq)
        return True

    # -- routing ----------------------------------------------------------------------------

    def _cost(self, ws: WorkerScheduler, seq: Sequence, cached: int) -> tuple[int, str]:
        new = ws.bm.blocks_needed(seq.num_tokens) - cached
        used = ws.bm.num_blocks - ws.bm.num_free_blocks
        return new + used, ws.worker_id

    def _candidates(
        self, seq: Sequence, prefill: bool
    ) -> list[tuple[tuple[int, str], WorkerScheduler, int]]:
        out = []
        for ws in self.workers.values():
            if ws.draining or not ws.has_room_for_one_more():
                continue
            if not (ws.can_prefill if prefill else ws.can_decode):
                continue
            if prefill and seq.params.prompt_logprobs is not None:
                cached = 0
            else:
                limit = None if prefill else seq.num_tokens // ws.bm.block_size
                cached = len(ws.bm.lookup_prefix(seq.token_ids, limit))
            if ws.bm.num_free_blocks < ws.bm.blocks_needed(seq.num_tokens) - cached:
                continue
            out.append((self._cost(ws, seq, cached), ws, cached))
        return out

    def _route(self, seq: Sequence, here: WorkerScheduler) -> Route | None:
        """Admit ``seq`` on ``here`` now? Only if ``here`` is the cheapest prefill worker that
        can take it (when none can take the whole prompt, any may start it) and, for a
        prefill-only worker, a decode worker has room: its blocks are reserved now."""
        prefill = self._candidates(seq, prefill=True)
        if prefill and min(prefill, key=lambda c: c[0])[1] is not here:
            return None
        if here.can_decode:
            return Route()
        layout = self.kv_layout.get(here.worker_id, "")
        decode = [
            c
            for c in self._candidates(seq, prefill=False)
            if self.kv_layout[c[1].worker_id] == layout
        ]
        if not decode:
            return None
        _, dst, _ = min(decode, key=lambda c: c[0])
        limit = seq.num_tokens // dst.bm.block_size
        cached = dst.bm.lookup_prefix(seq.token_ids, limit)
        dst.bm.prefix_queries += limit  # blocks it need not receive count as hits
        dst.bm.prefix_hits += len(cached)
        dst.bm.take_cached(cached)
        blocks = cached + dst.bm.allocate(dst.bm.blocks_needed(seq.num_tokens) - len(cached))
        dst.num_reserved += 1
        return Route(Reservation(dst.worker_id, blocks, len(cached)))

    def _release_elsewhere(self, seq: Sequence) -> None:
        """Free what ``seq`` holds on other workers: its decode reservation, or the source
        blocks of its transfer."""
        res, seq.reservation = seq.reservation, None
        if res is not None and res.worker_id in self.workers:
            dst = self.workers[res.worker_id]
            dst.bm.free_blocks(res.blocks)
            dst.num_reserved -= 1
        t, seq.transfer = seq.transfer, None
        if t is not None:
            self.transfers.pop(t.transfer_id, None)
            if t.src_worker in self.workers:
                self.workers[t.src_worker].bm.free_blocks(t.held_blocks)

    # -- KV tiers ---------------------------------------------------------------------------

    def _tier_lookup(self, seq: Sequence, ws: WorkerScheduler, first: int) -> list[BlockHash]:
        """Hashes of the prompt's full blocks from ``first`` on that ``ws``'s host tier holds,
        or that Redis held when the request arrived (leaving one token to compute)."""
        host = self.host_hashes.get(ws.worker_id, set())
        if not (host or seq.redis_prefix_blocks > first and ws.store_enabled):
            return []
        limit = (seq.num_tokens - 1) // ws.bm.block_size
        if first >= limit:
            return []
        hashes = ws.bm.block_hashes(seq.token_ids[: limit * ws.bm.block_size])
        out: list[BlockHash] = []
        for j in range(first, limit):
            in_redis = ws.store_enabled and j < seq.redis_prefix_blocks
            if hashes[j] not in host and not in_redis:
                break
            out.append(hashes[j])
        return out

    def redis_keys_for(self, token_ids: list[int]) -> list[str]:
        """Redis keys of the full blocks of a prompt (leaving one token to compute), in the
        layout of a worker that stores blocks there (a cell's workers share one layout; with
        none, no keys)."""
        for wid, ws in self.workers.items():
            if ws.store_enabled:
                bs = ws.bm.block_size
                hashes = ws.bm.block_hashes(token_ids[: (len(token_ids) - 1) // bs * bs])
                return [tier_key(self.kv_layout.get(wid, ""), h) for h in hashes]
        return []

    def schedule(self, ws: WorkerScheduler) -> tuple[StepPlan | None, list[KvLoad]]:
        """``ws``'s next plan, and the tier loads it ordered (to send to the same worker)."""
        plan = ws.schedule(self.waiting)
        host = self.host_hashes.setdefault(ws.worker_id, set())
        if plan is not None:
            host.update(ref.hash for ref in plan.offload)
            self.tier_totals.offloaded += len(plan.offload)
        loads = []
        for load in ws.loads:
            load.load_id = f"load-{next(self._transfer_ids)}"
            load.started = time.monotonic()
            seq = next(s for s in ws.running if s.load is load)
            self.loads[load.load_id] = seq
            refs = [BlockRef(b, h) for b, h in load.blocks]
            loads.append(KvLoad(load.load_id, seq.request_id, refs))
        ws.loads = []
        return plan, loads

    def on_load_done(self, msg: KvLoadDone) -> str | None:
        """A worker filled (some of) a sequence's blocks from the tiers; returns the worker
        that may now have work."""
        seq = self.loads.pop(msg.load_id, None)
        if seq is None or seq.load is None or seq.load.load_id != msg.load_id:
            return None
        t = self.tier_totals
        t.loads += 1
        t.host_hits += msg.host_hits
        t.redis_hits += msg.redis_hits
        t.misses += len(seq.load.blocks) - msg.num_loaded
        t.num_bytes += msg.num_bytes
        t.seconds += msg.seconds
        ws = self.workers.get(msg.worker_id)
        if ws is None or seq not in ws.running:
            return None
        if seq.aborted:
            seq.load = None
            ws.finish(seq)
        else:
            ws.loaded(seq, msg.num_loaded)
        return ws.worker_id

    # -- results ----------------------------------------------------------------------------

    def on_result(self, result: StepResult) -> CoreOutcome:
        self.num_computed_tokens += result.num_computed_tokens
        host = self.host_hashes.get(result.worker_id)
        if host is not None:
            host.difference_update(result.host_tier_evicted)
        ws = self.workers.get(result.worker_id)
        if ws is None:
            return CoreOutcome()
        if result.error:
            ws.on_failed_step(self.waiting)
            return CoreOutcome()
        step = ws.on_result(result)
        outcome = CoreOutcome(finished=step.finished, prefilled=step.prefilled)
        for seq, _reason in step.finished:
            self.requests.pop(seq.request_id, None)
            self.num_finished += 1
        for seq in step.prefilled:
            pull = self._hand_off(ws, seq)
            if pull is not None:
                outcome.pulls.append(pull)
        return outcome

    def _hand_off(self, src: WorkerScheduler, seq: Sequence) -> tuple[str, KvPull] | None:
        """``seq``'s prefill on ``src`` sampled its first token: move it to its decode worker
        and order the copy of the blocks that worker does not hold yet."""
        res = seq.reservation
        assert res is not None
        dst = self.workers.get(res.worker_id)
        if dst is None:  # the decode worker left meanwhile: start over
            seq.reservation = None
            src._preempt(seq, self.waiting)
            src.num_preemptions -= 1
            return None
        n = seq.num_computed  # tokens whose K/V the prefill computed
        nb = src.bm.blocks_needed(n)
        held = src.hand_off(seq)
        dst.receive(seq)
        src_blocks, dst_blocks = held[res.num_cached : nb], res.blocks[res.num_cached : nb]
        if not src_blocks:  # every block was cached there already
            src.bm.free_blocks(held)
            dst.kv_arrived(seq)
            return None
        tid = f"{seq.request_id}#{next(self._transfer_ids)}"
        seq.transfer = Transfer(
            tid,
            seq.request_id,
            src.worker_id,
            dst.worker_id,
            held,
            src_blocks,
            dst_blocks,
            time.monotonic(),
        )
        self.transfers[tid] = seq
        pull = KvPull(
            transfer_id=tid,
            request_id=seq.request_id,
            src_worker=src.worker_id,
            src_subject=self.kv_subject.get(src.worker_id, ""),
            src_blocks=src_blocks,
            dst_blocks=dst_blocks,
        )
        return dst.worker_id, pull

    def on_transfer_done(self, msg: KvTransferDone) -> str | None:
        """A decode worker finished (or gave up) copying a sequence's K/V. Returns the id of
        the worker that may now have work, if any."""
        seq = self.transfers.pop(msg.transfer_id, None)
        if seq is None or seq.transfer is None or seq.transfer.transfer_id != msg.transfer_id:
            return None  # late news of a transfer already given up
        t, seq.transfer = seq.transfer, None
        if t.src_worker in self.workers:
            self.workers[t.src_worker].bm.free_blocks(t.held_blocks)
        totals = self.transfer_totals
        dst = self.workers.get(t.dst_worker)
        if msg.ok:
            totals.done += 1
            totals.num_bytes += msg.num_bytes
            totals.seconds += msg.seconds
        else:
            totals.failed += 1
        if dst is None or seq not in dst.running:
            return None
        if seq.aborted:
            dst.finish(seq)
        elif msg.ok:
            dst.kv_arrived(seq)
        else:  # recompute from its tokens, like a preemption
            dst._preempt(seq, self.waiting)
            dst.num_preemptions -= 1
        return dst.worker_id

    def expire_transfers(self, timeout_s: float, now: float | None = None) -> list[str]:
        """Give up on transfers and tier loads older than ``timeout_s`` (their report was
        lost): the blocks are computed instead."""
        now = time.monotonic() if now is None else now
        woken = []
        for load_id, seq in list(self.loads.items()):
            if seq.load is not None and now - seq.load.started > timeout_s and seq.worker_id:
                wid = self.on_load_done(KvLoadDone(load_id, seq.request_id, seq.worker_id, 0))
                if wid:
                    woken.append(wid)
        for tid, seq in list(self.transfers.items()):
            t = seq.transfer
            if t is not None and now - t.started > timeout_s:
                wid = self.on_transfer_done(
                    KvTransferDone(tid, seq.request_id, t.dst_worker, False, error="timed out")
                )
                if wid:
                    woken.append(wid)
        return woken

    # -- stats ------------------------------------------------------------------------------

    def stats(self) -> SchedulerStats:
        ws = self.workers.values()
        t = self.transfer_totals
        return SchedulerStats(
            num_workers=len(self.workers),
            num_total_blocks=sum(w.bm.num_blocks for w in ws),
            num_free_blocks=sum(w.bm.num_free_blocks for w in ws),
            num_running=sum(len(w.running) for w in ws),
            num_waiting=len(self.waiting),
            num_finished=self.num_finished,
            num_preemptions=sum(w.num_preemptions for w in ws),
            model=self.model,
            max_model_len=self.limits.max_model_len,
            num_computed_tokens=self.num_computed_tokens,
            prefix_cache_queries=sum(w.bm.prefix_queries for w in ws),
            prefix_cache_hits=sum(w.bm.prefix_hits for w in ws),
            workers=[
                WorkerStats(
                    worker_id=w.worker_id,
                    role=w.role,
                    num_blocks=w.bm.num_blocks,
                    num_free_blocks=w.bm.num_free_blocks,
                    num_running=len(w.running),
                    prefix_cache_queries=w.bm.prefix_queries,
                    prefix_cache_hits=w.bm.prefix_hits,
                    num_prefills=w.num_prefills,
                    num_decodes=w.num_decodes,
                    draining=w.draining,
                )
                for w in ws
            ],
            kv_transfers=t.done,
            kv_transfer_failures=t.failed,
            kv_transfer_bytes=t.num_bytes,
            kv_transfer_seconds=t.seconds,
            tier_loads=self.tier_totals.loads,
            tier_host_hits=self.tier_totals.host_hits,
            tier_redis_hits=self.tier_totals.redis_hits,
            tier_misses=self.tier_totals.misses,
            tier_bytes=self.tier_totals.num_bytes,
            tier_load_seconds=self.tier_totals.seconds,
            tier_offloaded_blocks=self.tier_totals.offloaded,
        )
