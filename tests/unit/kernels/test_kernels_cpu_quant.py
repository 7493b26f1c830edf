"""The GGUF block kernels (kernels/csrc/quant_matmul_cpu.c) against dequantize-then-matmul with
gguf's own reference code: exact decoding, products within fp32 summation noise, each row's
bits independent of the batch, and clear errors for what they cannot take."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from kvflow.kernels import cpu_native, cpu_quant
from kvflow.kernels.batch_invariance import GemmRows, calibrate
from kvflow.kernels.cpu_quant import QuantWeight

pytestmark = pytest.mark.skipif(
    cpu_native._compiler() is None, reason="no C compiler: --quantization gguf is refused"
)
TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1]


def _weight(qtype: Q, n: int = 80, k: int = 96, seed: int = 0) -> tuple[QuantWeight, torch.Tensor]:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw = quantize(w, qtype)
    dense = torch.from_numpy(dequantize(raw, qtype).reshape(n, k).copy())
    return QuantWeight.from_gguf(raw, int(qtype), (n, k)), dense


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_decoding_is_exact_and_products_match_dequantize_then_matmul(qtype: Q) -> None:
    qw, dense = _weight(qtype)
    assert torch.equal(qw.dequantize(), dense)
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(qw(x), x @ dense.T, rtol=1e-5, atol=1e-4)
    long = torch.randn(cpu_quant.PANEL_ROWS + 3, 96)  # the panel kernel of long chunks
    torch.testing.assert_close(qw(long), long @ dense.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_rows_bits_do_not_depend_on_the_batch(qtype: Q) -> None:
    qw, _ = _weight(qtype, n=64 + 13, k=128, seed=2)  # a ragged last panel tile
    tile = cpu_quant.PANEL_ROWS
    rows = 2 * tile + 8
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(3))
    decode = qw(x[:tile])  # the rows kernel: any subset of a decode tile, in any order
    for m in (1, 2, 5, tile - 1):
        idx = torch.randperm(tile)[:m]
        assert torch.equal(qw(x[:tile][idx]), decode[idx]), m
    chunk = qw(x)  # the panel kernel (long chunks): a row's bits do not depend on M either
    for m in (tile + 1, tile + 30):
        idx = torch.randperm(rows)[:m]
        assert torch.equal(qw(x[idx]), chunk[idx]), m
    strided = torch.randn(rows, 200)[:, :128].copy_(x)  # rows 200 floats apart
    assert torch.equal(qw(strided), chunk)
    assert torch.equal(qw(strided[:tile]), decode)
    # invariant by construction: calibration has nothing to test, and decode tiles stay within
    # the rows kernel
    assert calibrate([qw], max_rows=64) == GemmRows(1, tile, True)


def test_fused_and_permuted_weights_keep_their_blocks() -> None:
    a, da = _weight(Q.Q4_1, n=32, seed=4)
    b, db = _weight(Q.Q4_1, n=16, seed=5)
    fused = QuantWeight.cat([a, b])
    assert fused.shape == (48, 96) and torch.equal(fused.dequantize(), torch.cat([da, db]))
    order = torch.randperm(48)
    assert torch.equal(fused.rows(order).dequantize(), torch.cat([da, db])[order])
    c, _ = _weight(Q.Q8_0, n=16, seed=6)
    with pytest.raises(ValueError, match="one quantization type"):
        QuantWeight.cat([a, c])


def test_what_the_kernel_cannot_take_is_refused() -> None:
    qw, _ = _weight(Q.Q8_0)
    with pytest.raises(ValueError, match="fp32"):
        qw(torch.randn(2, 96, dtype=torch.float64))
    with pytest.raises(ValueError, match="fp32"):
        qw(torch.randn(2, 95))
    with pytest.raises(ValueError, match="no CPU kernel"):
        QuantWeight(torch.zeros(4, 40, dtype=torch.uint8), int(Q.Q3_K), (4, 256))
    with pytest.raises(ValueError, match="multiple of Q8_0.s 32"):
        QuantWeight(torch.zeros(4, 34, dtype=torch.uint8), int(Q.Q8_0), (4, 33))
    with pytest.raises(ValueError, match="blocks"):
        QuantWeight(torch.zeros(4, 33, dtype=torch.uint8), int(Q.Q8_0), (4, 32))
    assert qw(torch.empty(0, 96)).shape == (0, 80)


def test_quantization_settings_that_cannot_work_are_refused_with_what_to_change(
    tmp_path,  # noqa: ANN001
) -> None:
    from kvflow.services.worker.model_setup import check_quantization
    from kvflow.shared.model_source import ModelSource

    gguf = ModelSource(name="m", path=tmp_path / "m.gguf", kind="gguf")
    hf = ModelSource(name="m", path=tmp_path, kind="hf")
    cpu = torch.device("cpu")
    check_quantization("", hf, cpu, torch.bfloat16)  # nothing asked, nothing checked
    check_quantization("gguf", gguf, cpu, torch.float32)
    with pytest.raises(ValueError, match="must be one of"):
        check_quantization("fp4", gguf, cpu, torch.float32)
    with pytest.raises(ValueError, match="fp8 runs on CUDA GPUs.*use int8 or gguf"):
        check_quantization("fp8", gguf, cpu, torch.float32)  # the CPU path: no fast fp8 GEMM
    # the device path: fp8 where the GPU has fp8 GEMMs (Triton's interpreter in tests)
    assert check_quantization("fp8", gguf, cpu, torch.float32, backend="triton") == "fp8"
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="compute capability 8.9"):
            check_quantization("fp8", gguf, torch.device("cuda"), torch.bfloat16)
    with pytest.raises(ValueError, match="not quantized with awq"):
        check_quantization("awq", gguf, cpu, torch.float32)
    with pytest.raises(ValueError, match="needs a .gguf model"):
        check_quantization("gguf", hf, cpu, torch.float32)
    # integer blocks on CUDA: kernels/triton_quant.py, any activation dtype
    assert check_quantization("gguf", gguf, torch.device("cuda"), torch.bfloat16) == "gguf"
    with pytest.raises(ValueError, match="CPU in float32 or on CUDA"):
        check_quantization("gguf", gguf, cpu, torch.bfloat16)


def _cpu_has(*flags: str) -> bool:
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return False
    have = next(
        (line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")),
        [],
    )
    return all(f in have for f in flags)


def test_the_panel_kernel_is_used_for_long_chunks_and_agrees_with_the_rows_kernel() -> None:
    qw, dense = _weight(Q.Q4_1, n=100, k=320, seed=7)
    x = torch.randn(cpu_quant.PANEL_ROWS * 3, 320, generator=torch.Generator().manual_seed(8))
    if not _cpu_has("avx2", "fma", "f16c"):
        pytest.skip("the panel kernel needs AVX2, FMA and F16C; long chunks use the rows kernel")
    assert cpu_quant.panel_available()
    long, short = qw(x), torch.cat([qw(x[i : i + 4]) for i in range(0, x.shape[0], 4)])
    assert not torch.equal(long, short)  # two methods (another order of the sums) ...
    torch.testing.assert_close(long, short, rtol=1e-5, atol=1e-4)  # ... one product
    torch.testing.assert_close(long, x @ dense.T, rtol=1e-5, atol=1e-4)


def test_int8_rounds_every_linear_weight_to_q8_blocks_and_keeps_lookups_dense() -> None:
    from kvflow.services.worker.model_loader import quantize_int8

    g = torch.Generator().manual_seed(9)
    weights = {
        "model.embed_tokens.weight": torch.randn(100, 64, generator=g),
        "model.norm.weight": torch.ones(64),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64, generator=g),
        "model.layers.0.mlp.down_proj.weight": torch.randn(64, 96, generator=g),
        "model.layers.0.input_layernorm.weight": torch.ones(64),
    }
    out = quantize_int8(weights)
    assert out["model.embed_tokens.weight"] is weights["model.embed_tokens.weight"]
    assert out["model.norm.weight"] is weights["model.norm.weight"]
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        q, w = out[name], weights[name]
        assert isinstance(q, QuantWeight) and q.type_name == "Q8_0" and q.shape == w.shape
        # round to nearest with one scale per 32 weights: half a step, plus the fp16 rounding
        # of the scale times at most 127 (2**-11 relative)
        step = w.reshape(w.shape[0], -1, 32).abs().amax(-1, keepdim=True) / 127
        err = (q.dequantize() - w).reshape(w.shape[0], -1, 32).abs()
        assert bool((err <= step * (0.5 + 127 * 2**-11) + 1e-7).all())
        assert bool((err.amax(-1) > 0).any())  # it did round
    head = out["lm_head.weight"]  # tied: the embedding's quantized copy
    assert isinstance(head, QuantWeight) and head.shape == (100, 64)


def test_int8_works_from_any_checkpoint_on_the_cpu_and_on_cuda(tmp_path) -> None:  # noqa: ANN001
    from kvflow.services.worker.model_setup import check_quantization
    from kvflow.shared.model_source import ModelSource

    hf = ModelSource(name="m", path=tmp_path, kind="hf")
    assert check_quantization("int8", hf, torch.device("cpu"), torch.float32) == "int8"
    assert check_quantization("int8", hf, torch.device("cuda"), torch.bfloat16) == "int8"
    with pytest.raises(ValueError, match="int8 runs on the CPU in float32 or on CUDA"):
        check_quantization("int8", hf, torch.device("cpu"), torch.bfloat16)


def test_the_fp32_panels_give_the_same_bits_on_avx2_as_on_this_cpu() -> None:
    """Each output is one FMA chain over k, so the AVX-512 micro-kernel (16 + 8 outputs per k)
    and AVX2's (3 x 8) must agree bit for bit: built for Haswell, the library gives this CPU's
    own build's products."""
    import ctypes

    from kvflow.kernels.cpu_gemm import PanelWeight

    if not cpu_quant.panel_available():
        pytest.skip("no AVX2 here: the panels do not run")
    flags = [f for f in cpu_quant._COMPILE_FLAGS if f != "-march=native"] + ["-march=haswell"]
    avx2 = ctypes.CDLL(
        str(cpu_native.build(cpu_quant._SRC, flags, cache_dir=cpu_native.setup().cache_dir))
    )
    g = torch.Generator().manual_seed(9)
    pw = PanelWeight(torch.randn(100, 72, generator=g))
    for m in (1, 3, 4, 9):
        x = torch.randn(m, 72, generator=g)
        y = torch.empty(m, 100)
        rc = avx2.kvf_panel_matmul_f32(
            ctypes.c_void_p(x.data_ptr()), m, 72, 72, ctypes.c_void_p(pw.panels.data_ptr()),
            100, ctypes.c_void_p(y.data_ptr()), 100, 2,
        )  # fmt: skip
        assert rc == 0 and torch.equal(y, pw(x)), m
