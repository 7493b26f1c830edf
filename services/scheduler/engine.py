"""The scheduler's state across workers: the global waiting queue, every live request, and one
WorkerScheduler per worker. Plain Python (no NATS), so tests can drive it offline."""

from __future__ import annotations

from services.scheduler.block_manager import BlockManager
from services.scheduler.policy import SchedulerLimits, StepOutcome, WorkerScheduler
from services.scheduler.sequence import SeqStatus, Sequence, WaitingQueue
from shared.messages import SchedulerStats, StepResult, TokenizedRequest


class QueueFullError(RuntimeError):
    pass


class SchedulerCore:
    def __init__(self, limits: SchedulerLimits, max_waiting: int = 1024, model: str = "") -> None:
        self.limits = limits
        self.max_waiting = max_waiting
        self.model = model
        self.waiting = WaitingQueue()
        self.requests: dict[str, Sequence] = {}
        self.workers: dict[str, WorkerScheduler] = {}
        self.num_finished = 0
        self.num_computed_tokens = 0  # as reported by the workers' StepResults

    def add_worker(self, worker_id: str, num_blocks: int, block_size: int) -> WorkerScheduler:
        salt = f"{self.model}|{block_size}".encode()
        ws = WorkerScheduler(worker_id, BlockManager(num_blocks, block_size, salt), self.limits)
        self.workers[worker_id] = ws
        return ws

    def remove_worker(self, worker_id: str) -> list[Sequence]:
        """A worker left: its sequences wait again, to be recomputed elsewhere."""
        ws = self.workers.pop(worker_id, None)
        return ws.on_failed_step(self.waiting) if ws else []

    def add_request(self, req: TokenizedRequest, priority: int = 0) -> Sequence:
        if len(self.waiting) >= self.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests)")
        if req.request_id in self.requests:
            return self.requests[req.request_id]  # a resubmission of the same request: run once
        seq = Sequence(
            request_id=req.request_id,
            token_ids=list(req.prompt_token_ids),
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
        elif seq.worker_id in self.workers:
            self.workers[seq.worker_id].finish(seq)
        return True

    def on_result(self, result: StepResult) -> StepOutcome:
        self.num_computed_tokens += result.num_computed_tokens
        ws = self.workers.get(result.worker_id)
        if ws is None:
            return StepOutcome()
        if result.error:
            ws.on_failed_step(self.waiting)
            return StepOutcome()
        outcome = ws.on_result(result)
        for seq, _reason in outcome.finished:
            self.requests.pop(seq.request_id, None)
            self.num_finished += 1
        return outcome

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_workers=len(self.workers),
            num_total_blocks=sum(w.bm.num_blocks for w in self.workers.values()),
            num_free_blocks=sum(w.bm.num_free_blocks for w in self.workers.values()),
            num_running=sum(len(w.running) for w in self.workers.values()),
            num_waiting=len(self.waiting),
            num_finished=self.num_finished,
            num_preemptions=sum(w.num_preemptions for w in self.workers.values()),
            model=self.model,
            max_model_len=self.limits.max_model_len,
            num_computed_tokens=self.num_computed_tokens,
            prefix_cache_queries=sum(w.bm.prefix_queries for w in self.workers.values()),
            prefix_cache_hits=sum(w.bm.prefix_hits for w in self.workers.values()),
        )
