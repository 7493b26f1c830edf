"""GPTQ and AWQ 4-bit checkpoints (services/worker/gptq_awq.py): a round-to-nearest quantizer
here writes each format's layout as its own tools do (the packing written from the formats'
definitions, not from the loader's code); the loader must give back exactly the weights the
quantizer meant, as Q4_Z blocks the CPU kernels read in place, and a whole tiny model served from
such a directory must compute what the same weights in fp32 compute."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvflow.kernels import cpu_native
from kvflow.kernels.cpu_quant import PANEL_ROWS, Q4_Z, QuantWeight
from kvflow.services.worker import gptq_awq as QC

pytestmark = pytest.mark.skipif(
    cpu_native._compiler() is None, reason="no C compiler: the worker uses the PyTorch path"
)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def rtn(w: torch.Tensor, group: int, g_idx: torch.Tensor | None = None):  # noqa: ANN201
    """Asymmetric 4-bit round-to-nearest per (group, output): q [N, K] int, zeros [G, N] int,
    scales [G, N] fp16, g_idx [K], and the weight they stand for (scale * (q - zero), fp32)."""
    n, k = w.shape
    group = k if group == -1 else group
    g = k // group
    g_idx = torch.arange(k) // group if g_idx is None else g_idx
    scales = torch.empty(g, n, dtype=torch.float16)
    zeros = torch.empty(g, n, dtype=torch.int32)
    for j in range(g):
        cols = w[:, g_idx == j]
        lo, hi = cols.min(1).values.clamp(max=0), cols.max(1).values.clamp(min=0)
        s = ((hi - lo) / 15).clamp(min=1e-6).half()
        scales[j] = s
        zeros[j] = torch.round(-lo / s.float()).clamp(0, 15).int()
    s_k, z_k = scales.t()[:, g_idx].float(), zeros.t()[:, g_idx]
    q = torch.round(w / s_k + z_k).clamp(0, 15).int()
    return q, zeros, scales, g_idx, s_k * (q - z_k).float()


def pack_gptq(q, zeros, scales, g_idx) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """GPTQ v1: qweight [K/8, N] (input k at bits 4*(k%8) of row k//8), qzeros [G, N/8] of
    zero - 1 (output n at bits 4*(n%8) of word n//8)."""
    qt = q.t().contiguous()  # [K, N]
    k, n = qt.shape
    qweight = torch.zeros(k // 8, n, dtype=torch.int64)
    for i in range(8):
        qweight |= qt[i::8].long() << (4 * i)
    zm1 = (zeros - 1).clamp(min=0) if bool((zeros == 0).any()) else zeros - 1
    qzeros = torch.zeros(zeros.shape[0], n // 8, dtype=torch.int64)
    for i in range(8):
        qzeros |= (zm1[:, i::8].long() & 0xF) << (4 * i)
    return {
        "qweight": qweight.to(torch.int32),  # bit 31 wraps, as GPTQ's int32 storage does
        "qzeros": qzeros.to(torch.int32),
        "scales": scales,
        "g_idx": g_idx.to(torch.int32),
    }


def pack_awq(q, zeros, scales) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """AutoAWQ GEMM: qweight [K, N/8], qzeros [G, N/8], nibble i of word c = output
    8c + AWQ_ORDER[i]."""

    def pack(x: torch.Tensor) -> torch.Tensor:  # [R, N] -> [R, N/8]
        out = torch.zeros(x.shape[0], x.shape[1] // 8, dtype=torch.int64)
        for i, j in enumerate(AWQ_ORDER):
            out |= x[:, j::8].long() << (4 * i)
        return out.to(torch.int32)

    return {"qweight": pack(q.t()), "qzeros": pack(zeros), "scales": scales}


def _weight(n: int = 48, k: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("group", [32, 128, -1])
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_packed_layers_read_back_as_exactly_the_quantized_weights(method: str, group: int) -> None:
    q, zeros, scales, g_idx, want = rtn(_weight(), group)
    if method == "gptq":
        zeros = zeros.clamp(min=1)  # v1 stores zero - 1: a zero point of 0 cannot be written
        want = scales.t()[:, g_idx].float() * (q - zeros.t()[:, g_idx]).float()
        tensors = pack_gptq(q, zeros, scales, g_idx)
    else:
        tensors = pack_awq(q, zeros, scales)
    w = QC.read_layer(method, tensors, {"group_size": group}, keep=True)
    assert isinstance(w, QuantWeight) and w.qtype == Q4_Z and w.shape == (48, 256)
    assert torch.equal(w.dequantize(), want)  # d * (q - z) is exact in fp32
    dense = QC.read_layer(method, tensors, {"group_size": group}, keep=False)
    assert torch.equal(dense, want)
    x = torch.randn(PANEL_ROWS * 2, 256, generator=torch.Generator().manual_seed(1))
    for rows in (x[:3], x):  # the rows kernel (decode) and the panel kernel (prefill)
        torch.testing.assert_close(w(rows), rows @ want.T, rtol=1e-5, atol=1e-5)


def test_act_order_layers_are_dequantized_exactly() -> None:
    k, group = 256, 32
    g_idx = torch.randperm(k, generator=torch.Generator().manual_seed(3)) // group  # act-order
    q, zeros, scales, g_idx, _ = rtn(_weight(seed=2), group, g_idx)
    zeros = zeros.clamp(min=1)
    want = scales.t()[:, g_idx].float() * (q - zeros.t()[:, g_idx]).float()
    w = QC.read_layer("gptq", pack_gptq(q, zeros, scales, g_idx), {"group_size": group}, True)
    assert isinstance(w, torch.Tensor) and torch.equal(w, want)


def test_gptq_v2_zeros_are_stored_without_the_offset() -> None:
    q, zeros, scales, g_idx, want = rtn(_weight(seed=4), 64)
    t = pack_gptq(q, zeros + 1, scales, g_idx)  # v2 writes zero itself where v1 writes zero - 1
    w = QC.read_layer("gptq", t, {"checkpoint_format": "gptq_v2"}, keep=True)
    assert torch.equal(w.dequantize(), want)


TINY = {
    "model_type": "llama",
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def _tiny_checkpoint(tmp: Path, method: str) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny random Llama as a 4-bit checkpoint of ``method`` (group 32); returns the directory
    and the fp32 weights it stands for."""
    gen = torch.Generator().manual_seed(5)
    d, i, kv = TINY["hidden_size"], TINY["intermediate_size"], 2 * 16
    shapes = {"q_proj": (d, d), "k_proj": (kv, d), "v_proj": (kv, d), "o_proj": (d, d)}
    shapes |= {"gate_proj": (i, d), "up_proj": (i, d), "down_proj": (d, i)}
    stored: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(96, d, generator=gen) * 0.5,
        "model.norm.weight": 1 + 0.1 * torch.randn(d, generator=gen),
        "lm_head.weight": torch.randn(96, d, generator=gen) * 0.2,
    }
    want = dict(stored)
    for layer in range(2):
        p = f"model.layers.{layer}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            stored[p + norm + ".weight"] = want[p + norm + ".weight"] = 1 + 0.1 * torch.randn(
                d, generator=gen
            )
        for name, shape in shapes.items():
            sub = (
                "self_attn." if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp."
            )
            w = torch.randn(*shape, generator=gen) * 0.2
            q, zeros, scales, g_idx, _ = rtn(w, 32)
            zeros = zeros.clamp(min=1)
            want[p + sub + name + ".weight"] = (
                scales.t()[:, g_idx].float() * (q - zeros.t()[:, g_idx]).float()
            )
            packed = (
                pack_gptq(q, zeros, scales, g_idx)
                if method == "gptq"
                else pack_awq(q, zeros, scales)
            )
            stored |= {f"{p}{sub}{name}.{k}": v for k, v in packed.items()}
    qcfg = {"quant_method": method, "bits": 4, "group_size": 32}
    qcfg |= {"desc_act": False, "sym": False} if method == "gptq" else {"version": "gemm"}
    (tmp / "config.json").write_text(json.dumps(TINY | {"quantization_config": qcfg}))
    save_file(stored, str(tmp / "model.safetensors"))
    return tmp, want


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_quantized_checkpoint_is_served_in_place_and_computes_its_weights(
    tmp_path: Path, method: str
) -> None:
    from kvflow.services.worker.model_setup import check_quantization
    from kvflow.services.worker.runner import ModelRunner
    from kvflow.shared.model_config import load_config
    from kvflow.shared.model_source import resolve_model

    path, want = _tiny_checkpoint(tmp_path, method)
    src = resolve_model(str(path))
    cpu = torch.device("cpu")
    assert check_quantization("", src, cpu, torch.float32) == method  # found, as vLLM does
    with pytest.raises(ValueError, match=f"a {method} checkpoint"):
        check_quantization("awq" if method == "gptq" else "gptq", src, cpu, torch.float32)
    with pytest.raises(ValueError, match="CPU in float32"):
        check_quantization(method, src, cpu, torch.bfloat16)
    served = ModelRunner.create(src, block_size=16, num_blocks=8)
    layer = served.model.layers[0]
    assert all(isinstance(getattr(layer, n), QuantWeight) for n in ("qkv", "o", "gate_up", "down"))
    reference = ModelRunner.from_weights(load_config(src), want, 16, 8)
    prompt = [1, 5, 9, 33, 60, 7, 2, 80] * 3  # 24 tokens: a prefill through the panel kernel
    got, ref = _greedy_logits(served, prompt), _greedy_logits(reference, prompt)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def _greedy_logits(runner, prompt: list[int], steps: int = 4) -> torch.Tensor:  # noqa: ANN001
    """The logits a greedy request samples from: after its prompt, then after each token."""
    from kvflow.shared.messages import NewRequest, SamplingParams, ScheduledSeq, StepPlan
    from tests.helpers.logits_spy import capture_logits

    rows = capture_logits(runner, "r")
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    new, tokens, pos = [NewRequest("r", params, len(prompt))], prompt, 0
    for k in range(steps + 1):
        res = runner.execute(StepPlan(k, [ScheduledSeq("r", tokens, pos, [0, 1, 2])], new))
        assert res.error is None, res.error
        new, pos, tokens = [], pos + len(tokens), res.token_ids
    return torch.stack(rows)
