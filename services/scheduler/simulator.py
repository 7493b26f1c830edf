"""``kvflow simulate``: the real scheduler (SchedulerCore, WorkerState, BlockManager) driven
by a cost model of a worker instead of a model, on a virtual clock. Capacity questions (the
highest request rate that keeps TTFT under a target with N workers) are answered in seconds
without hardware, and scheduler-policy tests use it."""

from __future__ import annotations

import argparse
import heapq
import json
import random
from dataclasses import asdict, dataclass, field

from kvflow.services.scheduler.core import SchedulerCore
from kvflow.services.scheduler.limits import SchedulerLimits
from kvflow.shared.messages import FinishReason, SamplingParams, StepResult, TokenizedRequest
from kvflow.shared.step_cost import StepCostModel


@dataclass
class Workload:
    num_requests: int = 200
    rate: float = 1.0  # requests per second (Poisson arrivals); inf = all at once
    prompt_len: tuple[int, int] = (10, 300)
    output_len: tuple[int, int] = (32, 256)
    seed: int = 0

    def requests(self) -> list[tuple[float, int, int]]:
        """(arrival time, prompt length, output length), deterministic for a seed."""
        rng = random.Random(self.seed)
        t, out = 0.0, []
        for _ in range(self.num_requests):
            if self.rate != float("inf"):
                t += rng.expovariate(self.rate)
            out.append((t, rng.randint(*self.prompt_len), rng.randint(*self.output_len)))
        return out


@dataclass
class SimConfig:
    workers: int = 1
    num_blocks: int = 1456
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    cost: StepCostModel = field(default_factory=StepCostModel)


@dataclass
class SimResult:
    rate: float
    requests: int
    duration_s: float
    output_tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    preemptions: int
    peak_kv_usage: float
    free_blocks_at_end: int
    total_blocks: int
    output_tokens: dict[str, int] = field(repr=False, default_factory=dict)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] if xs else float("nan")


def simulate(workload: Workload, cfg: SimConfig) -> SimResult:
    limits = SchedulerLimits(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len)
    core = SchedulerCore(limits, max_waiting=10**9, model="sim")
    for w in range(cfg.workers):
        core.add_worker(f"w{w}", cfg.num_blocks, cfg.block_size)
    events: list[tuple[float, int, str, object]] = []
    seq_no = 0
    for i, (t, plen, olen) in enumerate(workload.requests()):
        # distinct prompts (no accidental prefix sharing between requests)
        prompt = [(i * 7919 + j * 31) % 50000 + 1 for j in range(plen)]
        req = TokenizedRequest(f"r{i}", "", prompt, SamplingParams(max_tokens=olen), arrival_time=t)
        events.append((t, seq_no, "arrive", req))
        seq_no += 1
    heapq.heapify(events)
    busy: set[str] = set()
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    produced: dict[str, int] = {}
    arrival: dict[str, float] = {}
    peak = 0.0
    now = 0.0

    def dispatch() -> None:
        nonlocal seq_no, peak
        for wid, ws in core.workers.items():
            if wid in busy:
                continue
            plan = core.schedule(ws)[0]
            if plan is None:
                continue
            used = 1 - ws.bm.num_free_blocks / ws.bm.num_blocks
            peak = max(peak, used)
            busy.add(wid)
            heapq.heappush(events, (now + cfg.cost.step_time(plan), seq_no, "step", (wid, plan)))
            seq_no += 1

    while events:
        now, _, kind, data = heapq.heappop(events)
        if kind == "arrive":
            assert isinstance(data, TokenizedRequest)
            arrival[data.request_id] = now
            core.add_request(data)
        else:
            wid, plan = data  # type: ignore[misc]
            busy.discard(wid)
            rids, toks, reasons = [], [], []
            for s in plan.seqs:
                if not s.sample or s.request_id not in core.requests:
                    continue
                n = produced.get(s.request_id, 0) + 1
                produced[s.request_id] = n
                first.setdefault(s.request_id, now)
                finished = n >= core.requests[s.request_id].params.max_tokens
                rids.append(s.request_id)
                toks.append(1)
                reasons.append(FinishReason.LENGTH if finished else FinishReason.NONE)
                if finished:
                    done[s.request_id] = now
            computed = sum(len(s.token_ids) for s in plan.seqs)
            core.on_result(StepResult(wid, plan.step_id, rids, toks, reasons, computed))
        dispatch()

    ttft = [first[r] - arrival[r] for r in done]
    tpot = [(done[r] - first[r]) / max(1, produced[r] - 1) for r in done]
    stats = core.stats()
    return SimResult(
        rate=workload.rate,
        requests=len(done),
        duration_s=now,
        output_tokens_per_s=sum(produced.values()) / now if now else 0.0,
        ttft_p50_s=_pct(ttft, 50),
        ttft_p99_s=_pct(ttft, 99),
        tpot_p50_s=_pct(tpot, 50),
        tpot_p99_s=_pct(tpot, 99),
        preemptions=stats.num_preemptions,
        peak_kv_usage=peak,
        free_blocks_at_end=stats.num_free_blocks,
        total_blocks=stats.num_total_blocks,
        output_tokens=produced,
    )


def find_max_rate(
    workload: Workload, cfg: SimConfig, ttft_target_s: float, pct: int = 99, iters: int = 12
) -> tuple[float, SimResult]:
    """The highest Poisson rate whose TTFT p50/p99 stays under the target (bisection)."""

    def ok(rate: float) -> tuple[bool, SimResult]:
        w = Workload(**{**asdict(workload), "rate": rate})
        r = simulate(w, cfg)
        return (r.ttft_p99_s if pct == 99 else r.ttft_p50_s) <= ttft_target_s, r

    lo, hi = 0.0, 1.0
    best: SimResult | None = None
    while (res := ok(hi))[0]:
        lo, best, hi = hi, res[1], hi * 2
    for i in range(iters):
        mid = (lo + hi) / 2
        good, r = ok(mid)
        print(
            f"\r  search {i + 1}/{iters}: {mid:.3f} req/s {'ok' if good else 'too slow'}   ",
            end="",
            flush=True,
        )
        if good:
            lo, best = mid, r
        else:
            hi = mid
    print()
    if best is None:
        best = (
            ok(lo)[1] if lo > 0 else simulate(Workload(**{**asdict(workload), "rate": 1e-3}), cfg)
        )
    return lo, best


def _span(s: str) -> tuple[int, int]:
    a, _, b = s.partition(":")
    return int(a), int(b or a)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``kvflow simulate``'s arguments."""
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--rate", type=float, default=1.0, help="requests/s (Poisson); 0 = all at once")
    p.add_argument(
        "--find-max-rate", action="store_true", help="search the highest rate under --ttft-target"
    )
    p.add_argument("--ttft-target", type=float, default=2.0, help="seconds")
    p.add_argument("--percentile", type=int, choices=(50, 99), default=99)
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--prompt-len", default="10:300")
    p.add_argument("--output-len", default="32:256")
    p.add_argument("--num-kv-blocks", type=int, default=1456)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--cost-model", default="", help="JSON file with StepCostModel coefficients")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def main(args) -> int:  # noqa: ANN001
    cost = StepCostModel.from_json(args.cost_model) if args.cost_model else StepCostModel()
    cfg = SimConfig(
        workers=args.workers,
        num_blocks=args.num_kv_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        cost=cost,
    )
    wl = Workload(
        num_requests=args.num_requests,
        rate=args.rate if args.rate > 0 else float("inf"),
        prompt_len=_span(args.prompt_len),
        output_len=_span(args.output_len),
        seed=args.seed,
    )
    if args.find_max_rate:
        rate, res = find_max_rate(wl, cfg, args.ttft_target, args.percentile)
        print(
            f"highest rate with TTFT p{args.percentile} <= {args.ttft_target:g} s on {args.workers} worker(s): {rate:.3f} req/s"
        )
    else:
        res = simulate(wl, cfg)
    if args.json:
        out = asdict(res)
        out.pop("output_tokens")
        print(json.dumps(out))
        return 0
    print(f"rate {res.rate:g} req/s, {res.requests} requests in {res.duration_s:.1f} s (simulated)")
    print(f"  output tokens/s  {res.output_tokens_per_s:.1f}")
    print(f"  TTFT p50 / p99   {res.ttft_p50_s:.2f} / {res.ttft_p99_s:.2f} s")
    print(f"  TPOT p50 / p99   {res.tpot_p50_s * 1000:.0f} / {res.tpot_p99_s * 1000:.0f} ms")
    print(f"  preemptions      {res.preemptions}")
    print(f"  peak KV usage    {res.peak_kv_usage:.0%}")
    return 0
