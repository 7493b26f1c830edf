"""Multi-LoRA kernels (kernels/triton_lora.py, through kernels/ops.py): the Triton shrink and
expand against the reference backend, and the reference against a plain per-row loop.

Without a GPU the kernels run on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py) in fp32 and fp16; not in bf16, whose ``tl.dot`` the interpreter (Triton 3.9)
computes on the raw uint16 bits. With a GPU they compile natively and run in bf16 and fp16 on
CUDA, checked against the reference computed in fp32 on the CPU from the same rounded inputs;
the interpreter cases are then skipped, because one process cannot hold both forms of a kernel.
Shapes are small so the interpreter stays quick.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.helpers.kernels import HAS_CUDA, TOL, close, f32, randn  # first: TRITON_INTERPRET

# isort: split
from kvflow.kernels import reference
from kvflow.kernels.ops import get_backend
from tests.helpers.paths import ROOT

REF = get_backend("reference")
TRI = get_backend("triton")

_INTERPRETER = pytest.mark.skipif(HAS_CUDA, reason="kernels compiled for CUDA in this process")
_CUDA = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
DEVICE_DTYPES = [
    pytest.param("cpu", torch.float32, id="cpu-fp32-interpreter", marks=_INTERPRETER),
    pytest.param("cpu", torch.float16, id="cpu-fp16-interpreter", marks=_INTERPRETER),
    pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=_CUDA),
    pytest.param("cuda", torch.float16, id="cuda-fp16", marks=_CUDA),
]

# (atol, rtol) against the fp32 reference: bf16 keeps 8 mantissa bits, fp16 11
NUM_SLOTS = 3


def mixed_slots(t: int, g: torch.Generator, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Slots in -1..NUM_SLOTS-1 for ``t`` rows: runs of one adapter (as a prefill has) and
    single rows, with -1 (no adapter) among them whenever there are two rows or more."""
    slots = torch.randint(-1, NUM_SLOTS, (t,), generator=g)
    if t >= 2:
        slots[1] = -1
        slots[0] = NUM_SLOTS - 1
    if t >= 20:
        slots[4:20] = 1  # a run that spans two 16-row blocks
    return slots.to(dtype)


def adapters(
    s: int, out_dim: int, in_dim: int, dtype: torch.dtype, device: str, g: torch.Generator
) -> torch.Tensor:
    """Stacked weights [s, out_dim, in_dim] scaled so that products stay of order one."""
    return (
        randn(s, out_dim, in_dim, dtype=torch.float32, device="cpu", g=g)
        .div(in_dim**0.5)
        .to(device, dtype)
    )


# --------------------------------------------------------------------------------------------
# Triton against the reference


SHAPES = [(t, k, r) for t in (1, 5, 33) for k in (64, 96) for r in (8, 24)]


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("t,k,r", SHAPES)
def test_lora_shrink(device, dtype, t, k, r):
    g = torch.Generator().manual_seed(t * 1000 + k + r)
    x = randn(t, k, dtype=dtype, device=device, g=g)
    a = adapters(NUM_SLOTS, r, k, dtype, device, g)
    slots = mixed_slots(t, g, torch.int32 if r == 8 else torch.int64)
    y = TRI.lora_shrink(x, a, slots.to(device))
    assert y.shape == (t, r) and y.dtype == dtype
    close(y, REF.lora_shrink(f32(x), f32(a), slots), dtype)
    assert torch.count_nonzero(y[slots.to(device) < 0]) == 0


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("t,n,r", SHAPES)
def test_lora_expand(device, dtype, t, n, r):
    """``out`` is a column slice of a wider buffer (row stride > N): rows without an adapter and
    the columns around the slice keep their exact bits."""
    g = torch.Generator().manual_seed(t * 1000 + n + r + 1)
    v = randn(t, r, dtype=dtype, device=device, g=g)
    b = adapters(NUM_SLOTS, n, r, dtype, device, g)
    slots = mixed_slots(t, g, torch.int64 if r == 8 else torch.int32)
    buf = randn(t, n + 24, dtype=dtype, device=device, g=g)
    before = buf.clone()
    out = buf[:, 8 : 8 + n]
    expected = f32(out).clone()
    REF.lora_expand(f32(v), f32(b), slots, expected)
    TRI.lora_expand(v, b, slots.to(device), out)
    close(out, expected, dtype)
    none = (slots < 0).to(device)
    assert torch.equal(buf[none], before[none])
    assert torch.equal(buf[:, :8], before[:, :8])  # the columns around the slice
    assert torch.equal(buf[:, 8 + n :], before[:, 8 + n :])


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_lora_shrink_split_k(device, dtype):
    """Any number of K splits (fp32 partials summed afterwards) gives the reference's result,
    including a split count that leaves the last split partly past K."""
    g = torch.Generator().manual_seed(9)
    t, k, r = 5, 320, 24
    x = randn(t, k, dtype=dtype, device=device, g=g)
    a = adapters(NUM_SLOTS, r, k, dtype, device, g)
    slots = mixed_slots(t, g)
    expected = REF.lora_shrink(f32(x), f32(a), slots)
    for split_k in (None, 1, 2, 3, 8):
        y = TRI.lora_shrink(x, a, slots.to(device), split_k)
        assert y.dtype == dtype
        close(y, expected, dtype)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_lora_rows_without_adapters(device, dtype):
    """A batch in which no row has an adapter (e.g. CUDA-graph padding): shrink gives exact
    zeros and expand writes nothing; then one live row changes only its own row."""
    g = torch.Generator().manual_seed(4)
    t, k, r = 6, 64, 16
    x = randn(t, k, dtype=dtype, device=device, g=g)
    a = adapters(NUM_SLOTS, r, k, dtype, device, g)
    b = adapters(NUM_SLOTS, k, r, dtype, device, g)
    slots = torch.full((t,), -1, dtype=torch.int32, device=device)
    assert torch.count_nonzero(TRI.lora_shrink(x, a, slots)) == 0
    out = randn(t, k, dtype=dtype, device=device, g=g)
    before = out.clone()
    TRI.lora_expand(randn(t, r, dtype=dtype, device=device, g=g), b, slots, out)
    assert torch.equal(out, before)
    slots[3] = 2
    TRI.lora_expand(randn(t, r, dtype=dtype, device=device, g=g), b, slots, out)
    changed = (out != before).any(-1).nonzero().view(-1).tolist()
    assert changed == [3]


def test_lora_kernels_compile_for_h100_without_spills():
    """The LoRA kernels, at decode and prefill shapes, compile for sm_90 with Triton's own ptxas
    (no GPU needed; kernels.compile_check's launch interception) without spilling registers or
    exceeding an H100's shared memory: the interpreter accepts code the GPU compiler rejects."""
    script = textwrap.dedent(
        """
        import torch
        from kvflow.kernels import triton_lora
        from kvflow.kernels.compile_check import _H100_SHARED_BYTES, _compile_instead_of_launch

        done = []
        with _compile_instead_of_launch(90, done):
            for dtype in (torch.bfloat16, torch.float16):
                for t, k, r in ((8, 2048, 16), (4096, 14336, 192)):
                    x = torch.empty(t, k, dtype=dtype)
                    slots = torch.zeros(t, dtype=torch.int32)
                    triton_lora.lora_shrink(x, torch.empty(4, r, k, dtype=dtype), slots)
                    v = torch.empty(t, r, dtype=dtype)
                    triton_lora.lora_expand(v, torch.empty(4, k, r, dtype=dtype), slots, x)
        for c in done:
            print(c)
            assert c.spill_stack == 0 and c.registers > 0, c
            assert c.shared_bytes <= _H100_SHARED_BYTES, c
        print(len(done), "compiled")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "8 compiled" in proc.stdout, proc.stdout


# --------------------------------------------------------------------------------------------
# the reference against a per-row loop


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_reference_lora_matches_per_row_loop(dtype, slot_dtype):
    g = torch.Generator().manual_seed(2)
    t, k, n, r = 23, 40, 72, 12
    x = randn(t, k, dtype=dtype, device="cpu", g=g)
    a = adapters(NUM_SLOTS, r, k, dtype, "cpu", g)
    b = adapters(NUM_SLOTS, n, r, dtype, "cpu", g)
    slots = mixed_slots(t, g, slot_dtype)
    y = reference.lora_shrink(x, a, slots)
    assert y.shape == (t, r) and y.dtype == dtype
    buf = randn(t, n + 5, dtype=dtype, device="cpu", g=g)
    before = buf.clone()
    out = buf[:, 2 : 2 + n]  # row stride > N
    reference.lora_expand(y, b, slots, out)
    tol = TOL[dtype]
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            assert torch.count_nonzero(y[i]) == 0
            assert torch.equal(buf[i], before[i])
            continue
        want_y = x[i].float() @ a[s].float().T
        torch.testing.assert_close(y[i].float(), want_y, atol=tol[0], rtol=tol[1])
        want_out = before[i, 2 : 2 + n].float() + y[i].float() @ b[s].float().T
        torch.testing.assert_close(out[i].float(), want_out, atol=tol[0], rtol=tol[1])
    assert torch.equal(buf[:, :2], before[:, :2])  # the columns around the slice
    assert torch.equal(buf[:, 2 + n :], before[:, 2 + n :])


def test_reference_lora_empty_and_backend_signature():
    """No rows, and no row with an adapter; the backend's shrink takes (and ignores) split_k."""
    a = torch.randn(2, 4, 8)
    b = torch.randn(2, 8, 4)
    assert REF.lora_shrink(torch.empty(0, 8), a, torch.empty(0, dtype=torch.long)).shape == (0, 4)
    x = torch.randn(3, 8)
    none = torch.full((3,), -1)
    assert torch.equal(REF.lora_shrink(x, a, none, split_k=4), torch.zeros(3, 4))
    out = torch.randn(3, 8)
    before = out.clone()
    REF.lora_expand(torch.randn(3, 4), b, none, out)
    assert torch.equal(out, before)
