"""The CPU path's linear-layer kernels side by side: ``python -m kvflow.benchmarks.cpu_gemm``.

For each weight shape (default: SmolLM2-135M's, [N, K]) and row count, the best mean time of
``--reps`` calls over five rounds, and the rate in GFLOP/s (2 M N K per call), of:

- ``fp32 panels``: kernels/cpu_gemm.py ``PanelWeight`` (the fp32 default);
- ``oneDNN bf16``: ``Bf16Weight`` (``--dtype bfloat16`` without AVX512_BF16);
- ``bf16 panels``: ``Bf16PanelWeight`` (``--dtype bfloat16`` with AVX512_BF16), where this CPU
  has it.

With ``--gguf TYPE`` (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) the same table for a
GGUF block type instead: ``blocks`` (kernels/cpu_quant.py ``QuantWeight``, exact fp32 products:
``--quantization gguf``), ``int8 rows`` (its int8-activation kernel, Q8_0/Q4_0 only) and
``tiles`` (kernels/cpu_quant_tiles.py, int8 activations: ``--quantization gguf-a8``, ``w8a8``),
where this CPU runs them.

Random weights and inputs: the kernels' time does not depend on the values. Threads: torch's
(``--threads`` sets them).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from kvflow.kernels import cpu_gemm, cpu_quant, cpu_quant_tiles
from kvflow.services.worker import machine
from kvflow.shared.config import Settings

SMOLLM2 = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


def best_ms(fn: Callable[[], object], reps: int) -> float:
    """The best of five rounds' mean time per call, in ms (after ten warm-up calls)."""
    for _ in range(10):
        fn()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return best * 1e3


def kinds() -> dict[str, type]:
    got: dict[str, type] = {"fp32 panels": cpu_gemm.PanelWeight, "oneDNN bf16": cpu_gemm.Bf16Weight}
    if cpu_gemm.bf16_panel_available():
        got["bf16 panels"] = cpu_gemm.Bf16PanelWeight
    return got


def gguf_kinds(qtype: int) -> dict[str, Callable[[torch.Tensor], object]]:
    """Makers of a dense weight's stand-in in ``qtype`` blocks (random block bytes: the time does
    not depend on them), one per kernel."""

    def blocks(w: torch.Tensor, int8: bool = False) -> cpu_quant.QuantWeight:
        n, k = w.shape
        per_row = k // cpu_quant.BLOCK_WEIGHTS[qtype] * cpu_quant.BLOCK_BYTES[qtype]
        g = torch.Generator().manual_seed(n * k)
        raw = torch.randint(0, 256, (n, per_row), generator=g, dtype=torch.uint8)
        return cpu_quant.QuantWeight(raw, qtype, (n, k), int8_activations=int8)

    got: dict[str, Callable[[torch.Tensor], object]] = {"blocks": blocks}
    if qtype in cpu_quant.INT8_ACTIVATION_TYPES and cpu_quant.panel_available():
        got["int8 rows"] = lambda w: blocks(w, int8=True)
    if cpu_quant_tiles.available():
        got["tiles"] = lambda w: cpu_quant_tiles.TiledQuantWeight.from_blocks(blocks(w))
    return got


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--shapes", nargs="+", default=[f"{n}x{k}" for n, k in SMOLLM2], help="NxK")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--gguf", default="", help="a GGUF block type: its kernels instead (Q4_K...)")
    args = p.parse_args(argv)
    machine.configure(Settings.from_env())  # before any kernel loads
    types = {name: t for t, name in cpu_quant.TYPE_NAMES.items() if t != cpu_quant.Q4_Z}
    if args.gguf and args.gguf not in types:
        p.error(f"--gguf must be one of {', '.join(types)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_gemm.panel_available():
        print("the fp32 panel kernel does not run here (AVX2/FMA and a C compiler needed)")
        return 1
    g = torch.Generator().manual_seed(0)
    makers = gguf_kinds(types[args.gguf]) if args.gguf else kinds()
    names = list(makers)
    what = f"{args.gguf} blocks, " if args.gguf else ""
    print(f"{what}threads {torch.get_num_threads()}; ms per call (GFLOP/s)")
    print("| weight [N, K] | rows | " + " | ".join(names) + " |")
    print("|---|---:|" + "---:|" * len(names))
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        w = torch.randn(n, k, generator=g)
        packed = [make(w) for make in makers.values()]
        for m in args.rows:
            x = torch.randn(m, k, generator=g)
            reps = max(3, args.reps * 576 * 960 // (n * k))
            cells = []
            for weight in packed:
                ms = best_ms(lambda weight=weight, x=x: weight(x), reps)
                cells.append(f"{ms:.3f} ({2 * m * n * k / ms / 1e6:.0f})")
            print(f"| {n} x {k} | {m} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
