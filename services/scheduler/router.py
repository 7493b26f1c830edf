"""Where sequences go among workers: routing an admission, the prefill -> decode hand-off of
disaggregated serving (with the KV transfer it orders), and the KV tiers (which prefix blocks a
worker's host tier or Redis holds, and the loads that fill blocks from them).

Routing (as Dynamo's KV router): among the workers that can take a sequence now, the cost of a
worker is the blocks it would have to compute (prefill) or receive (decode), i.e. the prompt's
blocks minus those already in its prefix cache, plus the blocks it has in use (its load). The
cheapest wins, so a shared prefix pulls requests to the worker that holds it, while unrelated
requests spread by load. A ``both`` worker decodes what it prefills.

The router owns its own books (transfers and tier loads in flight, each worker's KV layout and
host tier, the totals) and reads the core's workers; every change to a worker or to a sequence
on it goes through that worker's WorkerState. A sequence a hand-off or a transfer sends back to
wait is returned (``Moves.requeued``) for the core to queue.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvflow.services.scheduler.block_manager import BlockHash
from kvflow.services.scheduler.decision import Route
from kvflow.services.scheduler.sequence import (
    RequeueReason,
    Reservation,
    Sequence,
    TierLoad,
    Transfer,
)
from kvflow.services.scheduler.worker_state import WorkerState
from kvflow.shared.kv_connectors import KvConnectorScheduler
from kvflow.shared.kv_tier import tier_key
from kvflow.shared.messages import BlockRef, KvLoad, KvLoadDone, KvPull, KvTransferDone, StepPlan

Candidate = tuple[tuple[int, str], WorkerState, int]  # (cost, worker), worker, cached blocks


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


@dataclass
class Moves:
    """What a hand-off, a transfer's end or their expiry changed that the core acts on: KV
    pulls to send (decode worker id, order), sequences sent back to wait, and the workers that
    may have work now."""

    pulls: list[tuple[str, KvPull]] = field(default_factory=list)
    requeued: list[Sequence] = field(default_factory=list)
    woken: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Load:
    """A tier load ordered: the sequence, its load (the sequence's ``load`` while it runs), the
    worker filling it and when it was ordered."""

    seq: Sequence
    load: TierLoad
    worker_id: str
    started: float


class Router:
    """Routing, hand-offs and tier loads over the core's ``workers`` (read only)."""

    def __init__(
        self, workers: Mapping[str, WorkerState], kv: KvConnectorScheduler | None = None
    ) -> None:
        self.workers = workers
        self.kv = kv or KvConnectorScheduler()  # the KV connector's half: workers' addresses
        self.kv_layout: dict[str, str] = {}  # worker id -> KV block layout
        self.host_hashes: dict[str, set[bytes]] = {}  # worker -> blocks in its host tier
        self.transfers: dict[str, Sequence] = {}  # transfer id -> sequence (aborted ones too)
        # transfer id -> the source worker holding its blocks: that very WorkerState (a worker
        # given up and back under its id is another, whose blocks are not the transfer's)
        self._sources: dict[str, WorkerState] = {}
        self.loads: dict[str, _Load] = {}  # tier load id -> its load (aborted ones too)
        self.transfer_totals = TransferTotals()
        self.tier_totals = TierTotals()
        self._ids = itertools.count(1)

    def add_worker(self, worker_id: str, kv_address: str, kv_layout: str) -> None:
        self.host_hashes[worker_id] = set()
        self.kv.add_worker(worker_id, kv_address)
        self.kv_layout[worker_id] = kv_layout

    def remove_worker(self, worker_id: str) -> None:
        self.kv.remove_worker(worker_id)
        self.kv_layout.pop(worker_id, None)
        self.host_hashes.pop(worker_id, None)
        # its loads will not be reported (their sequences wait again, to be recomputed)
        for load_id in [i for i, e in self.loads.items() if e.worker_id == worker_id]:
            del self.loads[load_id]

    def busy_source(self, ws: WorkerState) -> bool:
        """Whether a transfer still copies blocks from ``ws``."""
        return any(src is ws for src in self._sources.values())

    # -- routing --------------------------------------------------------------------------------

    def _cost(self, ws: WorkerState, seq: Sequence, cached: int) -> tuple[int, str]:
        """Blocks to compute plus blocks in use; a worker without the sequence's LoRA adapter
        in memory (it would load it, perhaps evicting another) counts 1/16 of its blocks more,
        so requests of one adapter gather where it is loaded until that worker is busier."""
        new = ws.bm.blocks_needed(seq.num_tokens) - cached
        used = ws.bm.num_blocks - ws.bm.num_free_blocks
        load = 0 if ws.holds_lora(seq) else max(1, ws.bm.num_blocks // 16)
        return new + used + load, ws.worker_id

    def _candidates(self, seq: Sequence, prefill: bool) -> list[Candidate]:
        out = []
        for ws in self.workers.values():
            if ws.draining or not ws.has_room_for_one_more() or not ws.lora_fits(seq):
                continue
            if not (ws.can_prefill if prefill else ws.can_decode):
                continue
            hits: list[int] = []
            if not (prefill and seq.computes_whole_prompt):
                limit = None if prefill else seq.num_tokens // ws.bm.block_size
                hits = ws.bm.lookup_prefix(seq.token_ids, limit, seq.cache_salt)
            # cached hits that sit in the free list stop being free once taken
            if not ws.bm.can_allocate(ws.bm.blocks_needed(seq.num_tokens) - len(hits), hits):
                continue
            out.append((self._cost(ws, seq, len(hits)), ws, len(hits)))
        return out

    def route(self, seq: Sequence, here: WorkerState) -> Route | None:
        """Admit ``seq`` on ``here`` now? Only if ``here`` is the cheapest prefill worker that
        can take it (when none can take the whole prompt, any may start it) and, for a
        prefill-only worker, a decode worker has room (its blocks are reserved when the
        admission is applied: ``reserve``). An embedding request ends with its prefill: it
        never goes to a decode worker. Decides only."""
        prefill = self._candidates(seq, prefill=True)
        if prefill and min(prefill, key=lambda c: c[0])[1] is not here:
            return None
        if here.can_decode or seq.pooling is not None:
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
        return Route(dst.worker_id)

    def reserve(self, seq: Sequence, worker_id: str) -> Reservation:
        """Blocks on ``worker_id`` (the decode worker routing chose) for ``seq``'s K/V."""
        return self.workers[worker_id].reserve(seq)

    def unreserve(self, res: Reservation) -> None:
        """A decode reservation is not needed any more (its worker may be gone already)."""
        ws = self.workers.get(res.worker_id)
        if ws is not None:
            ws.unreserve(res)

    def drop_transfer(self, t: Transfer) -> None:
        """A transfer is given up (its sequence ended or moved): the source blocks are free."""
        self.transfers.pop(t.transfer_id, None)
        self._release_source(t)

    def _release_source(self, t: Transfer) -> None:
        """The source blocks of ``t`` are free again, if its source worker is still there
        (the one the transfer started from: not a new process that took its id)."""
        src = self._sources.pop(t.transfer_id, None)
        if src is not None and self.workers.get(t.src_worker) is src:
            src.release_held(t.held_blocks)

    # -- disaggregation: prefill -> decode -------------------------------------------------------

    def hand_off(self, src: WorkerState, seq: Sequence) -> Moves:
        """``seq``'s prefill on ``src`` sampled its first token: move it to its decode worker
        and order the copy of the blocks that worker does not hold yet (the pull returned, with
        the id of the worker to send it to)."""
        res = seq.reservation
        assert res is not None
        dst = self.workers.get(res.worker_id)
        if dst is None:  # the decode worker left meanwhile: start over
            src.requeue(seq, RequeueReason.WORKER_LEFT)
            return Moves(requeued=[seq])
        nb = src.bm.blocks_needed(seq.num_computed)  # blocks of the K/V the prefill computed
        held = src.hand_off(seq)
        src_blocks, dst_blocks = held[res.num_cached : nb], res.blocks[res.num_cached : nb]
        if not src_blocks:  # every block was cached there already
            dst.receive(seq, None)
            src.release_held(held)
            return Moves()
        tid = f"{seq.request_id}#{next(self._ids)}"
        t = Transfer(
            tid,
            seq.request_id,
            src.worker_id,
            dst.worker_id,
            held,
            src_blocks,
            dst_blocks,
            time.monotonic(),
        )
        dst.receive(seq, t)
        self.transfers[tid] = seq
        self._sources[tid] = src
        pull = KvPull(
            transfer_id=tid,
            request_id=seq.request_id,
            src_worker=src.worker_id,
            src_address=self.kv.source_address(src.worker_id),
            src_blocks=src_blocks,
            dst_blocks=dst_blocks,
        )
        return Moves(pulls=[(dst.worker_id, pull)])

    def on_transfer_done(self, msg: KvTransferDone) -> Moves:
        """A decode worker finished (or gave up) copying a sequence's K/V; ``woken`` names the
        worker that may now have work, if any."""
        seq = self.transfers.pop(msg.transfer_id, None)
        if seq is None or seq.transfer is None or seq.transfer.transfer_id != msg.transfer_id:
            return Moves()  # late news of a transfer already given up
        t = seq.transfer
        self._release_source(t)
        totals = self.transfer_totals
        if msg.ok:
            totals.done += 1
            totals.num_bytes += msg.num_bytes
            totals.seconds += msg.seconds
        else:
            totals.failed += 1
        dst = self.workers.get(t.dst_worker)
        if dst is None or seq not in dst.running:
            return Moves()
        requeued = [seq] if dst.transfer_ended(seq, msg.ok) else []
        return Moves(requeued=requeued, woken=[dst.worker_id])

    # -- KV tiers -------------------------------------------------------------------------------

    def tier_lookup(self, seq: Sequence, ws: WorkerState, first: int) -> list[BlockHash]:
        """Hashes of the prompt's full blocks from ``first`` on that ``ws``'s host tier holds,
        or that Redis held when the request arrived (leaving one token to compute)."""
        host = self.host_hashes.get(ws.worker_id, set())
        if not (host or seq.redis_prefix_blocks > first and ws.store_enabled):
            return []
        limit = (seq.num_tokens - 1) // ws.bm.block_size
        if first >= limit:
            return []
        hashes = ws.bm.block_hashes(seq.token_ids[: limit * ws.bm.block_size], seq.cache_salt)
        out: list[BlockHash] = []
        for j in range(first, limit):
            in_redis = ws.store_enabled and j < seq.redis_prefix_blocks
            if hashes[j] not in host and not in_redis:
                break
            out.append(hashes[j])
        return out

    def redis_keys_for(self, token_ids: list[int], cache_salt: str | None = None) -> list[str]:
        """Redis keys of the full blocks of a prompt (leaving one token to compute; hashed with
        the request's ``cache_salt``), in the layout of a worker that stores blocks there (a
        cell's workers share one layout; with none, no keys)."""
        for wid, ws in self.workers.items():
            if ws.store_enabled:
                bs = ws.bm.block_size
                ids = token_ids[: (len(token_ids) - 1) // bs * bs]
                hashes = ws.bm.block_hashes(ids, cache_salt)
                return [tier_key(self.kv_layout.get(wid, ""), h) for h in hashes]
        return []

    def planned(self, ws: WorkerState, plan: StepPlan | None) -> list[KvLoad]:
        """Note what ``ws``'s new plan offloads to its host tier; returns the tier load orders
        its admissions made (to send to the same worker)."""
        host = self.host_hashes.setdefault(ws.worker_id, set())
        if plan is not None:
            host.update(ref.hash for ref in plan.offload)
            self.tier_totals.offloaded += len(plan.offload)
        loads = []
        for seq in ws.take_loads():
            load = seq.load
            assert load is not None
            load_id = f"load-{next(self._ids)}"
            self.loads[load_id] = _Load(seq, load, ws.worker_id, time.monotonic())
            refs = [BlockRef(b, h) for b, h in load.blocks]
            loads.append(KvLoad(load_id, seq.request_id, refs))
        return loads

    def host_evicted(self, worker_id: str, hashes: list[bytes]) -> None:
        """Blocks ``worker_id``'s host tier dropped."""
        host = self.host_hashes.get(worker_id)
        if host is not None:
            host.difference_update(hashes)

    def on_load_done(self, msg: KvLoadDone) -> str | None:
        """A worker filled (some of) a sequence's blocks from the tiers; returns the worker
        that may now have work."""
        entry = self.loads.pop(msg.load_id, None)
        if entry is None or entry.seq.load is not entry.load:
            return None  # late news of a load given up (or of a sequence since requeued)
        seq, load = entry.seq, entry.load
        t = self.tier_totals
        t.loads += 1
        t.host_hits += msg.host_hits
        t.redis_hits += msg.redis_hits
        t.misses += len(load.blocks) - msg.num_loaded
        t.num_bytes += msg.num_bytes
        t.seconds += msg.seconds
        ws = self.workers.get(msg.worker_id)
        if ws is None or seq not in ws.running:
            return None
        ws.load_ended(seq, msg.num_loaded)
        return ws.worker_id

    def expire(self, timeout_s: float, now: float | None = None) -> Moves:
        """Give up on transfers and tier loads older than ``timeout_s`` (their report was
        lost): the blocks are computed instead."""
        now = time.monotonic() if now is None else now
        out = Moves()
        for load_id, entry in list(self.loads.items()):
            seq = entry.seq
            if seq.load is entry.load and now - entry.started > timeout_s and seq.worker_id:
                wid = self.on_load_done(KvLoadDone(load_id, seq.request_id, seq.worker_id, 0))
                if wid:
                    out.woken.append(wid)
        for tid, seq in list(self.transfers.items()):
            t = seq.transfer
            if t is not None and now - t.started > timeout_s:
                moves = self.on_transfer_done(
                    KvTransferDone(tid, seq.request_id, t.dst_worker, False, error="timed out")
                )
                out.requeued += moves.requeued
                out.woken += moves.woken
        return out
