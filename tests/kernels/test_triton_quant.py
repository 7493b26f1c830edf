"""The device path's quantized-weight kernel (kernels/triton_quant.py) against dequantize-then-
matmul: every block type (GGUF's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K and kvflow's
Q4_Z for GPTQ/AWQ) decodes to
exactly the CPU kernels' weights, and products agree with a dense matmul of those weights.

Without a GPU the kernel runs on CPU tensors in Triton's interpreter in fp32 (TRITON_INTERPRET=1,
set by tests/conftest.py); with one it runs natively in bf16, against the fp32 reference of the
same rounded inputs."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # as tests/conftest.py does

from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import quantize  # noqa: E402

from kvflow.kernels.cpu_quant import Q4_Z, QuantWeight  # noqa: E402
from kvflow.kernels.triton_quant import DeviceQuantWeight  # noqa: E402
from kvflow.services.worker.gptq_awq import to_blocks  # noqa: E402
from tests.helpers.kquants import UNIT_TYPES, random_blocks  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPE = torch.bfloat16 if HAS_CUDA else torch.float32


def _blocks(qtype: int, n: int, k: int, seed: int = 0) -> QuantWeight:
    rng = np.random.default_rng(seed)
    if qtype == Q4_Z:  # GPTQ/AWQ groups: integer zero points, fp16 scales, one group per 32
        q = torch.from_numpy(rng.integers(0, 16, (n, k))).to(torch.uint8)
        zeros = torch.from_numpy(rng.integers(0, 16, (k // 32, n))).to(torch.int32)
        scales = torch.from_numpy(rng.uniform(0.005, 0.02, (k // 32, n))).to(torch.float16)
        g_idx = torch.arange(k) // 32
        w = to_blocks(q, zeros, scales, g_idx)
        assert w is not None
        return w
    if qtype in UNIT_TYPES.values():  # gguf-py cannot quantize to K-quants: random blocks
        return random_blocks(qtype, n, k, seed)
    raw = quantize(rng.standard_normal((n, k)).astype(np.float32), Q(qtype))
    return QuantWeight.from_gguf(raw, qtype, (n, k))


TYPES = [int(Q.Q8_0), int(Q.Q4_0), int(Q.Q4_1), Q4_Z, *UNIT_TYPES.values()]
NAMES = ["Q8_0", "Q4_0", "Q4_1", "Q4_Z", *UNIT_TYPES]


@pytest.mark.parametrize("qtype", TYPES, ids=NAMES)
def test_planes_decode_to_exactly_the_cpu_kernels_weights(qtype: int) -> None:
    k = 256 if qtype in (12, 13, 14) else 96
    qw = _blocks(qtype, 40, k)
    dw = DeviceQuantWeight.from_blocks(qw, "cpu")
    assert dw.type_name == qw.type_name and dw.shape == (40, k)
    assert torch.equal(dw.dequantize(), qw.dequantize())
    assert dw.nbytes < 40 * k * 2  # fewer bytes than the weight in bf16


@pytest.mark.parametrize("qtype", TYPES, ids=NAMES)
@pytest.mark.parametrize("rows", [1, 5, 20])  # one decode row, a decode batch, a prefill chunk
def test_products_match_dequantize_then_matmul(qtype: int, rows: int) -> None:
    n, k = 72, 160  # a ragged last N tile and a K that is not a multiple of the K tile
    if qtype in (12, 13, 14):
        k = 512  # whole super-blocks (the K tile of 64 still splits them)
    qw = _blocks(qtype, n, k, seed=rows)
    dw = DeviceQuantWeight.from_blocks(qw, DEVICE)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(DTYPE)
    ref = x.float() @ qw.dequantize().to(DTYPE).float().T
    got = dw(x.to(DEVICE)).float().cpu()
    tol = dict(rtol=2e-2, atol=2e-2) if DTYPE == torch.bfloat16 else dict(rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got, ref, **tol)
    strided = torch.zeros(rows, k + 32, dtype=DTYPE, device=DEVICE)[:, 16 : 16 + k]
    strided.copy_(x.to(DEVICE))  # rows further apart than K
    torch.testing.assert_close(dw(strided).float().cpu(), got, rtol=0, atol=0)


def test_empty_and_misshapen_inputs() -> None:
    dw = DeviceQuantWeight.from_blocks(_blocks(int(Q.Q8_0), 8, 64), DEVICE)
    assert dw(torch.zeros(0, 64, dtype=DTYPE, device=DEVICE)).shape == (0, 8)
    with pytest.raises(ValueError, match=r"\[M, 64\]"):
        dw(torch.zeros(2, 32, dtype=DTYPE, device=DEVICE))
