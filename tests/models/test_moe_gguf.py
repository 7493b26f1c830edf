"""Mixtures of experts from GGUF files and quantized. GGUFs are laid out as llama.cpp's
converter writes them (Mixtral as a ``llama`` with experts and its q/k rows permuted;
``qwen2moe`` with a shared expert; ``qwen3moe``; ``olmoe``): every expert's projection stacked
in one 3-D tensor (``ffn_*_exps``), the router ``ffn_gate_inp``. kvflow's greedy output equals
transformers' on the same weights, batched under chunked prefill; with ``--quantization gguf``
each expert keeps its rows of Q8_0 blocks, and ``--quantization int8`` rounds the experts
(transformers then runs the blocks' or the rounded values)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import MODEL_ARCH, MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFWriter, get_tensor_name_map
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file

from kvflow.kernels import cpu_quant
from kvflow.services.worker.runner import ModelRunner
from kvflow.shared.messages import SamplingParams
from kvflow.shared.model_source import ModelSource
from tests.helpers.engine import new_core, run
from tests.helpers.families import NEW, PROMPTS, hf_greedy, make_model

GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}
PROJ = {"w1": "gate", "w3": "up", "w2": "down"}  # Mixtral's expert names


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's Q/K row order for ``llama`` (convert_hf_to_gguf.py)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_gguf(
    src: Path, path: Path, family: str, q8_experts: bool = False
) -> dict[str, torch.Tensor]:
    """The saved HF model at ``src`` as a GGUF at ``path``; returns the HF weights with the
    experts' values as written (Q8_0-rounded when ``q8_experts``)."""
    cfg = __import__("json").loads((src / "config.json").read_text())
    state = load_file(src / "model.safetensors")
    arch = ARCH[family]
    code = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch and k in MODEL_ARCH)
    layers, heads, kv = (
        cfg["num_hidden_layers"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
    )
    table = get_tensor_name_map(code, layers)
    w = GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(float(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]))
    w.add_eos_token_id(cfg["eos_token_id"])
    experts = cfg.get("num_local_experts") or cfg["num_experts"]
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("moe_intermediate_size"):
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    values = dict(state)
    stacked: dict[tuple[int, str], list[tuple[int, str, torch.Tensor]]] = {}
    for name, t in state.items():
        parts = name.split(".")
        if "experts" in parts:  # model.layers.L.(mlp|block_sparse_moe).experts.E.P.weight
            layer, proj = int(parts[2]), PROJ.get(parts[-2], parts[-2].removesuffix("_proj"))
            stacked.setdefault((layer, proj), []).append((int(parts[5]), name, t))
            continue
        if name.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight")):
            w.add_tensor(f"blk.{parts[2]}.ffn_gate_inp.weight", t.float().numpy())
            continue
        if name.endswith("shared_expert_gate.weight"):
            w.add_tensor(f"blk.{parts[2]}.ffn_gate_inp_shexp.weight", t.float().numpy().reshape(-1))
            continue
        if ".shared_expert." in name:
            proj = parts[-2].removesuffix("_proj")
            w.add_tensor(f"blk.{parts[2]}.ffn_{proj}_shexp.weight", t.float().numpy())
            continue
        if arch == "llama" and name.endswith("q_proj.weight"):
            t = _permute(t, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            t = _permute(t, kv)
        gname = table.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, name
        w.add_tensor(gname, t.float().numpy())
    for (layer, proj), ts in sorted(stacked.items()):
        ts.sort()  # expert order (checkpoints list experts 0, 1, 10, 11, 2, ... by name)
        arr = torch.stack([t for _, _, t in ts]).float().numpy()
        name = f"blk.{layer}.ffn_{proj}_exps.weight"
        if q8_experts:
            raw = quantize(arr, GGMLQuantizationType.Q8_0)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=GGMLQuantizationType.Q8_0)
            arr = dequantize(raw, GGMLQuantizationType.Q8_0).reshape(arr.shape)
        else:
            w.add_tensor(name, arr)
        for (_, key, _), a in zip(ts, arr, strict=True):  # the values the file holds
            values[key] = torch.from_numpy(np.array(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return values


def _save(family: str, path: Path, **overrides: object) -> torch.nn.Module:
    """The family's tiny model, every layer MoE (llama.cpp's GGUFs have no dense layers)."""
    hf = make_model(
        family, **({"mlp_only_layers": []} if family == "qwen2_moe" else {}), **overrides
    )
    hf.save_pretrained(path)
    return hf


@pytest.mark.parametrize("family", sorted(ARCH))
def test_a_gguf_mixture_of_experts_equals_transformers(family: str, tmp_path: Path) -> None:
    hf = _save(family, tmp_path / "hf")
    write_gguf(tmp_path / "hf", tmp_path / "m.gguf", family)
    want = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    runner = ModelRunner.create(
        ModelSource("gguf", tmp_path / "m.gguf", "m"), block_size=4, num_blocks=64, worker_id="w"
    )
    assert runner.config.family == family and runner.config.num_experts == 4
    got, _ = run(new_core(max_num_batched_tokens=8), runner, [(p, None) for p in PROMPTS], GREEDY)
    assert got == want


@pytest.mark.skipif(not cpu_quant.available(), reason="no C compiler: the blocks run in C kernels")
def test_experts_keep_their_blocks(tmp_path: Path) -> None:
    """``--quantization gguf``: each expert's rows of Q8_0 blocks, read in place."""
    from transformers import AutoModelForCausalLM

    _save("qwen2_moe", tmp_path / "hf", moe_intermediate_size=64)  # rows of whole blocks
    values = write_gguf(tmp_path / "hf", tmp_path / "m.gguf", "qwen2_moe", q8_experts=True)
    save_file(values, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    want = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    runner = ModelRunner.create(
        ModelSource("gguf", tmp_path / "m.gguf", "m"),
        block_size=4,
        num_blocks=64,
        worker_id="w",
        quantization="gguf",
    )
    moe = runner.model.layers[0].moe
    assert all(isinstance(w, cpu_quant.QuantWeight) for w in (*moe.gate_up, *moe.down))
    got, _ = run(new_core(max_num_batched_tokens=8), runner, [(p, None) for p in PROMPTS], GREEDY)
    assert got == want


@pytest.mark.skipif(not cpu_quant.available(), reason="no C compiler: int8 runs in C kernels")
def test_int8_experts_equal_transformers_on_the_rounded_weights(tmp_path: Path) -> None:
    """``--quantization int8`` rounds every expert's projections like any other (those whose K
    is a multiple of 32); transformers then runs the rounded values."""
    from transformers import AutoModelForCausalLM

    from kvflow.services.worker.model_loader import load_weights
    from kvflow.shared.model_config import load_config

    _save("qwen2_moe", tmp_path, moe_intermediate_size=64)
    src = ModelSource("hf", tmp_path, "m")
    rounded = load_weights(src, load_config(src), quantization="int8")
    experts = [w for n, w in rounded.items() if ".experts." in n]
    assert experts and all(isinstance(w, cpu_quant.QuantWeight) for w in experts)
    values = load_file(tmp_path / "model.safetensors")
    for name, w in rounded.items():
        if isinstance(w, cpu_quant.QuantWeight) and name in values:
            values[name] = w.dequantize()
    save_file(values, tmp_path / "model.safetensors", metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    want = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    runner = ModelRunner.create(
        src, block_size=4, num_blocks=64, worker_id="w", quantization="int8"
    )
    got, _ = run(new_core(max_num_batched_tokens=8), runner, [(p, None) for p in PROMPTS], GREEDY)
    assert got == want
