"""Compile every Triton kernel for a real NVIDIA GPU on any machine, GPU or not.

    python -m kvflow.kernels.compile_check [--arch 90] [--dtype bfloat16 float16]

The interpreter (what the CPU tests run) accepts code that the GPU compiler rejects (and the other
way round), so this runs each kernel wrapper in kernels/ops.py on CPU tensors of serving shapes
with the launches intercepted: each launch is compiled by Triton's NVIDIA backend (ptxas ships in
the triton wheel) for the given compute capability instead of being run. It prints, per kernel
and configuration, registers, spill stack and shared memory, and exits non-zero if a kernel
fails to compile, needs more shared memory than an H100 has, or spills registers (a bf16/fp16
kernel that spills is a tiling to fix, not a warning to ignore).

Needs TRITON_INTERPRET unset (a compiled launch, not an interpreted one).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import torch

_PTR_TYPES = {
    torch.float32: "*fp32",
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.int32: "*i32",
    torch.int64: "*i64",
    torch.int8: "*i8",
    torch.uint8: "*u8",
}
_H100_SHARED_BYTES = 227 * 1024


@dataclass
class Compiled:
    kernel: str
    config: str
    registers: int
    spill_stack: int
    shared_bytes: int


@contextlib.contextmanager
def _compile_instead_of_launch(arch: int, out: list[Compiled]) -> Iterator[None]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")

    def fake_run(self: JITFunction, *args: object, grid: object, warmup: bool, **kwargs: object):
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        bound = inspect.signature(self.fn).bind(*args, **kwargs)
        signature: dict[str, str] = {}
        constexprs: dict[str, object] = {}
        attrs: dict[tuple[int, ...], list[list[object]]] = {}
        for i, (param, (name, value)) in enumerate(
            zip(self.params, bound.arguments.items(), strict=True)
        ):
            if param.is_constexpr:
                signature[name], constexprs[name] = "constexpr", value
            elif isinstance(value, torch.Tensor):
                signature[name] = _PTR_TYPES[value.dtype]
                attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 16-byte aligned
            elif isinstance(value, bool):
                signature[name] = "i1"
            elif isinstance(value, int):
                signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
                if value % 16 == 0 and value != 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]  # as the launcher specialises
            elif isinstance(value, float):
                signature[name] = "fp32"
            else:
                raise TypeError(f"{self.fn.__name__}: cannot type argument {name}={value!r}")
        src = ASTSource(self, signature, constexprs, attrs)
        kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            usage = subprocess.run(
                [cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True
            ).stdout
        regs = re.search(r"REG:(\d+)", usage)
        stack = re.search(r"STACK:(\d+)", usage)
        config = ", ".join(
            [f"{k}={v}" for k, v in constexprs.items() if k.startswith(("BLOCK", "NUM_SPLITS"))]
            + [k for k, v in constexprs.items() if k.startswith("USE_") and v is True]
        )
        out.append(
            Compiled(
                self.fn.__name__,
                f"{config}, warps={options.get('num_warps', 4)}",
                int(regs.group(1)) if regs else -1,
                int(stack.group(1)) if stack else -1,
                int(kernel.metadata.shared),
            )
        )

    saved = JITFunction.run
    JITFunction.run = fake_run  # type: ignore[method-assign]
    try:
        yield
    finally:
        JITFunction.run = saved  # type: ignore[method-assign]


def launch_all(dtype: torch.dtype) -> None:
    """Call every Triton wrapper once per configuration family, on CPU tensors of Llama shapes
    (head_dim 64 and 128, GQA 4 and 3, short and long queries), the attentions also with a
    sliding window and logit soft-capping on (Mistral / Gemma 2)."""
    from kvflow.kernels import reference
    from kvflow.kernels.ops import get_backend

    ops = get_backend("triton")
    for d, h, hkv in ((128, 32, 8), (64, 9, 3)):
        cache = torch.empty(64, 16, hkv, d, dtype=dtype)
        tables = torch.zeros(8, 16, dtype=torch.int32)
        lens = torch.ones(8, dtype=torch.int32)
        qsl = torch.zeros(9, dtype=torch.int32)
        qd = torch.empty(8, h, d, dtype=dtype)
        ops.decode_attention(qd, cache, cache, tables, lens, 0.1, 4)
        ops.decode_attention(qd, cache, cache, tables, lens, 0.1, 4, window=4096, softcap=50.0)
        for max_q in (8, 512):  # a decode-sized and a prefill-sized query tile
            q = torch.empty(max_q, h, d, dtype=dtype)
            ops.extend_attention(q, cache, cache, tables, lens, qsl, max_q, 0.1)
            ops.extend_attention(
                q, cache, cache, tables, lens, qsl, max_q, 0.1, window=4096, softcap=50.0
            )
        kv = torch.empty(8, hkv, d, dtype=dtype)
        ops.write_kv_cache(kv, kv, cache, cache, lens)
        cos_sin = reference.build_cos_sin_cache(d, 64, 10000.0, dtype)
        positions = torch.zeros(8, dtype=torch.long)
        ops.rotary_embedding(positions, torch.empty(8, h, d, dtype=dtype), kv, cos_sin)
    for n in (2048, 576):
        x = torch.empty(8, n, dtype=dtype)
        ops.rms_norm(x, torch.empty(n, dtype=dtype), 1e-5, x)
        ops.rms_norm(x, torch.empty(n, dtype=dtype), 1e-5)
    ops.silu_and_mul(torch.empty(8, 2 * 8192, dtype=dtype))
    ops.gelu_tanh_and_mul(torch.empty(8, 2 * 8192, dtype=dtype))
    _launch_quant_matmuls(dtype)
    _launch_moe(dtype)


def _launch_moe(dtype: torch.dtype) -> None:
    """kernels/triton_moe.py's grouped expert GEMMs (8 experts of 1408, top-2, hidden 2048) at
    a decode and a prefill row count."""
    from kvflow.kernels.triton_moe import expert_slots

    e, h, i = 8, 2048, 1408
    up, down = torch.empty(e, 2 * i, h, dtype=dtype), torch.empty(e, h, i, dtype=dtype)
    for t in (8, 512):
        ids = torch.randint(0, e, (t, 2))
        x = torch.empty(t, h, dtype=dtype)
        expert_slots(x, torch.rand(t, 2), ids, up, down, lambda g: g[:, :i].contiguous())


def _launch_quant_matmuls(dtype: torch.dtype) -> None:
    """kernels/triton_quant.py for 8-bit, 4-bit and 4-bit-with-offset weights, at a decode
    and a prefill row count."""
    from kvflow.kernels.triton_quant import DeviceQuantWeight

    n, k = 1536, 576
    groups = torch.empty(n, k // 32, dtype=torch.float16)
    zeros = torch.empty(n, k // 32, dtype=torch.uint8)
    weights = [
        DeviceQuantWeight(
            torch.empty(n, k, dtype=torch.int8), groups, None, None, 8, (n, k), "Q8_0"
        ),
        DeviceQuantWeight(
            torch.empty(n, k // 2, dtype=torch.uint8), groups, zeros, None, 4, (n, k), "Q4_0"
        ),
        DeviceQuantWeight(
            torch.empty(n, k // 2, dtype=torch.uint8), groups, zeros, groups, 4, (n, k), "Q4_1"
        ),
    ]
    for w in weights:
        for rows in (8, 128):
            w(torch.empty(rows, k, dtype=dtype))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80, 90")
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float16"])
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_check needs TRITON_INTERPRET unset", file=sys.stderr)
        return 2
    results: list[Compiled] = []
    with _compile_instead_of_launch(args.arch, results):
        for name in args.dtype:
            launch_all(getattr(torch, name))
    bad = 0
    print(f"| kernel (sm_{args.arch}) | config | registers | spill stack B | shared B |")
    print("|---|---|---|---|---|")
    for r in results:
        flag = ""
        if r.spill_stack > 0 or r.shared_bytes > _H100_SHARED_BYTES or r.registers < 0:
            flag, bad = " **!**", bad + 1
        print(
            f"| {r.kernel} | {r.config} | {r.registers} | {r.spill_stack} | {r.shared_bytes}{flag} |"
        )
    print(f"{len(results)} kernels compiled, {bad} with spills or too much shared memory")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
