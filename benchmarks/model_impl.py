"""Native decoder vs ``--model-impl transformers``: ``python -m kvflow.benchmarks.model_impl``.

Decode throughput of the same random-weight Qwen2 checkpoint through ``ModelRunner`` twice:
once as kvflow's native ``DecoderModel`` (services/worker/model.py: fused QKV and gate/up,
native C layer ops), once as the Hugging Face model run by ``TransformersModel``
(services/worker/transformers_model.py: transformers' own modules, kvflow's paged attention
and packed GEMMs). The shape is Qwen2.5-0.5B's scaled down so it loads in seconds on 2 cores
(8 layers, hidden 896, 14 heads, 2 KV heads, intermediate 4864, vocab 32000; tied embeddings).

Per implementation: one ``--context``-token prompt's prefill (tokens/s; 3 timed runs after a
warm-up), then, per ``--batch`` size, greedy decode steps of sequences that already hold
``--context`` tokens (benchmarks/decode.py's ``decode_steps``: the cache's values do not change
a decode step's work), ``--new`` timed steps after 3 warm-up steps. Prints progress lines and a table with the
CPU's name; tokens/s = batch / median step time, and the cheapest step's process CPU time
(steadier on a shared machine; ``--threads 1`` steadier still).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers as tf

from kvflow.benchmarks.decode import decode_steps
from kvflow.kernels.batch_invariance import GemmRows
from kvflow.services.worker import machine
from kvflow.services.worker.runner import ModelRunner
from kvflow.shared.config import Settings
from kvflow.shared.messages import NewRequest, SamplingParams, ScheduledSeq, StepPlan
from kvflow.shared.model_source import ModelSource

BLOCK = 16


def cpu_name() -> str:
    """``lscpu``'s model name (or what is known without it)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown CPU"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def save_random_qwen2(path: Path, args: argparse.Namespace) -> None:
    """A random-weight Qwen2 (transformers' initializer, seed 0) saved at ``path``."""
    cfg = tf.Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    tf.Qwen2ForCausalLM(cfg).save_pretrained(path)


def transformers_runner(path: Path, num_blocks: int, gemm_rows: GemmRows | None) -> ModelRunner:
    """A runner of ``path`` through transformers' modules (``--model-impl transformers``)."""
    src = ModelSource("hf", path, path.name)
    return ModelRunner.create(
        src, BLOCK, num_blocks, gemm_rows=gemm_rows, model_impl="transformers"
    )


def prefill_time(runner: ModelRunner, context: int, first_block: int) -> tuple[float, float]:
    """Wall and process CPU seconds of one ``context``-token prompt's prefill (one step,
    one sampled token)."""
    prompt = [(7 * i + 3) % runner.config.vocab_size for i in range(context)]
    table = list(range(first_block, first_block + -(-context // BLOCK)))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    plan = StepPlan(0, [ScheduledSeq("p", prompt, 0, table)], [NewRequest("p", params, context)])
    t0, c0 = time.perf_counter(), time.process_time()
    res = runner.execute(plan)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    if res.error:
        raise RuntimeError(res.error)
    runner.execute(StepPlan(1, [], [], ["p"]))
    return wall, cpu


@dataclass
class Row:
    """One figure: ``tokens`` per step, the step's median wall and cheapest CPU seconds."""

    impl: str
    what: str
    tokens: int
    wall: float
    cpu: float


def measure(name: str, runner: ModelRunner, args: argparse.Namespace) -> list[Row]:
    """The rows of one implementation, with progress lines."""
    per_seq = -(-(args.context + 3 + args.new + 1) // BLOCK)
    runs = [prefill_time(runner, args.context, 0) for _ in range(4)][1:]  # after a warm-up
    wall, cpu = statistics.median(w for w, _ in runs), min(c for _, c in runs)
    rows = [Row(name, f"prefill {args.context}", args.context, wall, cpu)]
    print(f"  {name}: prefill {args.context} tokens in {wall:.2f}s", flush=True)
    first = per_seq
    for b in args.batch:
        walls, cpus = decode_steps(runner, b, args.context, args.new, 3, first)
        first += b * per_seq
        rows.append(Row(name, f"decode batch {b}", b, statistics.median(walls), min(cpus)))
        r = rows[-1]
        print(
            f"  {name}: batch {b}: {r.wall * 1e3:.1f} ms/step, {b / r.wall:.1f} tok/s", flush=True
        )
    return rows


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Native DecoderModel vs TransformersModel decode.")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=4864)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--new", type=int, default=64, help="timed decode steps (new tokens)")
    ap.add_argument("--context", type=int, default=256, help="tokens each sequence holds")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    machine.configure(Settings.from_env())  # before any kernel loads
    if args.threads:
        torch.set_num_threads(args.threads)
    per_seq = -(-(args.context + 3 + args.new + 1) // BLOCK)
    num_blocks = per_seq * (1 + sum(args.batch)) + 1
    print(f"{cpu_name()}, {torch.get_num_threads()} torch threads", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        t0 = time.perf_counter()
        save_random_qwen2(path, args)
        print(f"random Qwen2 checkpoint saved in {time.perf_counter() - t0:.1f}s", flush=True)
        t0 = time.perf_counter()
        src = ModelSource("hf", path, "qwen2-random")
        native = ModelRunner.create(src, BLOCK, num_blocks)
        print(f"native runner ready in {time.perf_counter() - t0:.1f}s", flush=True)
        rows += measure("native", native, args)
        gemm_rows = native.gemm_rows
        del native
        gc.collect()
        t0 = time.perf_counter()
        hf = transformers_runner(path, num_blocks, gemm_rows)
        print(f"transformers runner ready in {time.perf_counter() - t0:.1f}s", flush=True)
        rows += measure("transformers", hf, args)
    _table(rows)
    return 0


def _table(rows: list[Row]) -> None:
    """The figures side by side, the transformers backend as a fraction of native (by wall
    time and by CPU time: on a busy machine the CPU time is the steadier one)."""
    native = {r.what: r for r in rows if r.impl == "native"}
    print("\n| impl | step | wall ms | tokens/s | vs native | CPU ms (min) | vs native (CPU) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        n = native[r.what]
        print(
            f"| {r.impl} | {r.what} | {r.wall * 1e3:.1f} | {r.tokens / r.wall:.1f} | "
            f"{n.wall / r.wall:.2f}x | {r.cpu * 1e3:.1f} | {n.cpu / r.cpu:.2f}x |"
        )


if __name__ == "__main__":
    sys.exit(main())
