"""The scheduler's own work per token, alone: ``python -m kvflow.benchmarks.scheduler``.

Runs ``services/scheduler/core.py`` (planning with two plans in flight, applying results) for
``--seqs`` requests of ``--prompt-len`` tokens, each generating ``--output-len`` tokens
(``ignore_eos``), against a stand-in worker that answers every plan at once. No bus, no
telemetry: what is left is the planner, the block manager and the result bookkeeping, the part
of the scheduler's CPU that grows with the batch and the context. Prints microseconds per
generated token spent planning and applying results, the best of ``--rounds`` runs (the
figure least disturbed by other processes on a shared machine).
"""

from __future__ import annotations

import argparse
import time
from collections import deque

from kvflow.services.scheduler.core import SchedulerCore
from kvflow.services.scheduler.limits import SchedulerLimits
from kvflow.shared.messages import (
    FinishReason,
    SamplingParams,
    StepPlan,
    StepResult,
    TokenizedRequest,
)


def run_once(
    seqs: int, prompt_len: int, output_len: int, block_size: int, in_flight: int
) -> tuple[float, float, int]:
    """(plan us per token, result us per token, steps) of one run to the end."""
    limits = SchedulerLimits(
        max_num_seqs=seqs, max_num_batched_tokens=8192, max_plans_in_flight=in_flight
    )
    core = SchedulerCore(limits)
    blocks = seqs * (-(-(prompt_len + output_len) // block_size) + 1)
    ws = core.add_worker("w", blocks, block_size)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i in range(seqs):
        prompt = [(i * 7 + j) % 1000 for j in range(prompt_len)]
        core.add_request(TokenizedRequest(f"r{i}", "", prompt, params))
    counts: dict[str, int] = {}

    def answer(plan: StepPlan) -> StepResult:
        ids, toks, reasons = [], [], []
        for s in plan.seqs:
            if s.sample:
                n = counts[s.request_id] = counts.get(s.request_id, 0) + 1
                ids.append(s.request_id)
                toks.append(5 + n % 100)
                reasons.append(int(FinishReason.LENGTH if n >= output_len else FinishReason.NONE))
        return StepResult("w", plan.step_id, ids, toks, reasons)

    flight: deque[StepPlan] = deque()
    t_plan = t_result = 0.0
    steps = tokens = 0
    while core.requests or flight:
        while ws.can_plan():
            t = time.perf_counter()
            plan, _ = core.schedule(ws)
            t_plan += time.perf_counter() - t
            if plan is None:
                break
            flight.append(plan)
        result = answer(flight.popleft())
        tokens += len(result.request_ids)
        t = time.perf_counter()
        core.on_result(result)
        t_result += time.perf_counter() - t
        steps += 1
    return t_plan / tokens * 1e6, t_result / tokens * 1e6, steps


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=str, default="256,1024", help="comma-separated")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--plans-in-flight", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    print(f"{args.seqs} sequences, {args.prompt_len}-token prompts, block size {args.block_size}")
    print(f"{'output':>7} {'steps':>6} {'plan us/tok':>12} {'result us/tok':>14}")
    for out in (int(x) for x in args.output_len.split(",")):
        runs = []
        for r in range(args.rounds):
            print(f"  output {out}: round {r + 1}/{args.rounds} ...", end="\r", flush=True)
            runs.append(
                run_once(args.seqs, args.prompt_len, out, args.block_size, args.plans_in_flight)
            )
        plan = min(r[0] for r in runs)
        result = min(r[1] for r in runs)
        print(f"\r{out:>7} {runs[0][2]:>6} {plan:>12.2f} {result:>14.2f}      ")


if __name__ == "__main__":
    main()
