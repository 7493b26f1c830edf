"""The worker's host work per decode step, without a model:
``python -m kvflow.benchmarks.step_host``.

What a decode step costs the host before the device computes anything, for ``--batch``
sequences of ``--context`` tokens each: the plan's block-table differences applied
(``BlockTables.apply``), the rows laid out (``step_rows.lay_out``), the step's tables gathered
(``BlockTables.used``) and written into a decode graph's static buffer (``DecodeBuffers.fill``,
tables ``ceil(--max-model-len / block size)`` wide). On a GPU the device waits for this work
between two steps unless it is hidden; it is the part of the decode step that grew with the
contexts' length. Prints milliseconds per step for each part (the best of ``--rounds`` runs of
``--steps`` steps: the figure least disturbed by other processes on a shared machine).
"""

from __future__ import annotations

import argparse
import time

import torch

from kvflow.services.worker.block_tables import BlockTables
from kvflow.services.worker.cuda_graphs import DecodeBuffers
from kvflow.services.worker.runner import RequestState
from kvflow.services.worker.step_rows import lay_out
from kvflow.shared.messages import SamplingParams, ScheduledSeq, StepPlan

PARTS = ("apply", "lay_out", "tables", "fill")


def run_once(
    batch: int, context: int, block_size: int, max_model_len: int, steps: int
) -> dict[str, float]:
    """Milliseconds per step of each part, over ``steps`` decode steps."""
    per_seq = -(-(context + steps) // block_size)
    tables = BlockTables(batch * per_seq)
    params = SamplingParams(max_tokens=steps + 1)
    state = RequestState(params, context, 0, frozenset(), frozenset(), keeps_history=False)
    requests = {f"r{i}": state for i in range(batch)}
    held = [-(-context // block_size) for _ in range(batch)]
    first = [
        ScheduledSeq(f"r{i}", [1], context - 1, list(range(i * per_seq, i * per_seq + held[i])))
        for i in range(batch)
    ]
    tables.apply(StepPlan(0, first))
    buffers = DecodeBuffers(batch, -(-max_model_len // block_size), torch.device("cpu"))
    spent = dict.fromkeys(PARTS, 0.0)
    for step in range(1, steps + 1):
        seqs = []
        for i in range(batch):
            pos = context - 1 + step
            new = []
            if pos // block_size >= held[i]:  # a block filled: the plan adds one
                new = [i * per_seq + held[i]]
                held[i] += 1
            seqs.append(ScheduledSeq(f"r{i}", [1], pos, new, block_table_from=held[i] - len(new)))
        plan = StepPlan(step, seqs)
        t0 = time.perf_counter()
        tables.apply(plan)
        t1 = time.perf_counter()
        rows = lay_out(plan.seqs, requests, block_size, max_model_len)
        t2 = time.perf_counter()
        ends = [s.start_pos + 1 for s in rows.seqs]
        step_tables = tables.used(rows.seqs, ends, block_size)
        t3 = time.perf_counter()
        buffers.fill(rows.ids, rows.pos, rows.slots, ends, step_tables, batch)
        t4 = time.perf_counter()
        for part, dt in zip(PARTS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            spent[part] += dt
    return {part: s / steps * 1e3 for part, s in spent.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--context", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    print(f"block size {args.block_size}, decode-graph tables for {args.max_model_len} tokens")
    print(
        f"{'batch':>6} {'context':>8} "
        + " ".join(f"{p + ' ms':>11}" for p in PARTS)
        + "   total ms"
    )
    for b in args.batch:
        for ctx in args.context:
            runs = []
            for r in range(args.rounds):
                print(f"  batch {b}, context {ctx}: round {r + 1}/{args.rounds} ...", end="\r")
                runs.append(run_once(b, ctx, args.block_size, args.max_model_len, args.steps))
            best = min(runs, key=lambda x: sum(x.values()))
            cols = " ".join(f"{best[p]:11.3f}" for p in PARTS)
            print(f"{b:6d} {ctx:8d} {cols} {sum(best.values()):10.3f}" + " " * 20)


if __name__ == "__main__":
    main()
