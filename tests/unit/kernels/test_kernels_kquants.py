"""Q5_0, Q5_1 and the K-quants (Q4_K, Q5_K, Q6_K) in their blocks on the CPU
(kernels/csrc/quant_matmul_cpu.c): decoding equal to gguf-py's ``dequantize`` bit for bit,
products equal to dequantize-then-matmul within fp32 rounding on the rows and the panel paths,
a row's bits independent of the batch, and a fused projection of mixed types kept in blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from kvflow.kernels import cpu_quant
from kvflow.kernels.cpu_quant import PANEL_ROWS, QuantWeight
from kvflow.kernels.stacked_weight import StackedWeight
from tests.helpers.kquants import UNIT_TYPES, random_blocks

pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason="no C compiler")
NAMES = list(UNIT_TYPES)


def _gguf(w: QuantWeight) -> torch.Tensor:
    raw = w.blocks.numpy()
    return torch.from_numpy(dequantize(raw, Q(w.qtype)).reshape(w.shape).copy())


@pytest.mark.parametrize("name", NAMES)
def test_decoding_equals_gguf_py_exactly(name: str) -> None:
    for seed in range(3):
        w = random_blocks(UNIT_TYPES[name], 24, 512, seed)
        assert torch.equal(w.dequantize(), _gguf(w))


@pytest.mark.parametrize("name", ["Q5_0", "Q5_1"])
def test_gguf_py_s_own_quantizer_round_trips(name: str) -> None:
    x = np.random.default_rng(1).standard_normal((8, 256)).astype(np.float32)
    raw = quantize(x, Q[name])
    w = QuantWeight.from_gguf(raw, int(Q[name]), (8, 256))
    assert torch.equal(w.dequantize(), torch.from_numpy(dequantize(raw, Q[name]).reshape(8, 256)))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    "rows", [1, 5, PANEL_ROWS, PANEL_ROWS + 8]
)  # decode rows, a tile, the panel path
def test_products_equal_dequantize_then_matmul(name: str, rows: int) -> None:
    w = random_blocks(UNIT_TYPES[name], 72, 768, seed=rows)
    x = torch.randn(rows, 768)
    want = x.double() @ _gguf(w).double().T
    got = w(x)
    assert got.shape == (rows, 72)
    tol = 1e-5 * (x.abs().double() @ _gguf(w).abs().double().T).max().item()
    assert (got.double() - want).abs().max().item() <= tol


@pytest.mark.parametrize("name", NAMES)
def test_a_rows_bits_do_not_depend_on_the_batch(name: str) -> None:
    w = random_blocks(UNIT_TYPES[name], 40, 512)
    x = torch.randn(PANEL_ROWS + 40, 512)
    tile = w(x[:PANEL_ROWS])  # the rows kernel: alone or in a tile, the same bits
    for i in (0, 3, PANEL_ROWS - 1):
        assert torch.equal(w(x[i : i + 1])[0], tile[i])
    assert torch.equal(w(x[:3]), tile[:3])
    chunk = w(x)  # the panel kernel (long chunks): the same bits for any M
    assert torch.equal(w(x[: PANEL_ROWS + 24])[:17], chunk[:17])
    assert torch.equal(w(x[20:])[:10], chunk[20:30])


def test_a_fused_projection_of_mixed_types_stays_in_blocks() -> None:
    """A Q4_K_M layer: q and k in Q4_K, v in Q6_K: one stacked weight, each part its own."""
    q, k, v = (random_blocks(t, n, 256, s) for t, n, s in ((12, 32, 0), (12, 16, 1), (14, 16, 2)))
    fused = StackedWeight.of([q, k, v])
    assert isinstance(fused, StackedWeight) and [p.type_name for p in fused.parts] == [
        "Q4_K",
        "Q6_K",
    ]
    assert fused.shape == (64, 256) and fused.nbytes == q.nbytes + k.nbytes + v.nbytes
    x = torch.randn(3, 256)
    assert torch.equal(fused(x), torch.cat([q(x), k(x), v(x)], dim=1))
    assert torch.equal(fused.dequantize(), torch.cat([_gguf(q), _gguf(k), _gguf(v)]))
    assert StackedWeight.of([q, k]).type_name == "Q4_K"  # one type: one weight


def test_k_quants_need_rows_of_whole_super_blocks() -> None:
    with pytest.raises(ValueError, match="multiple of Q4_K's 256"):
        QuantWeight(torch.zeros(2, 144, dtype=torch.uint8), 12, (2, 128))
