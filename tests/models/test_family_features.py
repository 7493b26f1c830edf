"""Features beyond the plain model on families other than Llama (Qwen2: q/k/v biases and a
sliding-window layer; Gemma 2: sandwich norms, soft-caps, GELU, windows): int8 weights equal
transformers running the same rounded weights, and LoRA adapters equal transformers + peft, both
through the real scheduler core and runner, batched under chunked prefill."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model

from kvflow.kernels import cpu_quant
from kvflow.services.worker.lora import LoRASpec
from kvflow.services.worker.model_loader import load_weights
from kvflow.services.worker.runner import ModelRunner
from kvflow.shared.messages import LoRARef, SamplingParams
from kvflow.shared.model_config import load_config
from kvflow.shared.model_source import ModelSource
from tests.helpers.engine import new_core, run
from tests.helpers.families import NEW, PROMPTS, hf_greedy, save_model

FAMILIES = ["qwen2", "gemma2"]
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.skipif(not cpu_quant.available(), reason="no C compiler: int8 runs in C kernels")
@pytest.mark.parametrize("family", FAMILIES)
def test_int8_equals_transformers_on_the_rounded_weights(family: str, tmp_path: Path) -> None:
    hf = save_model(family, tmp_path)
    src = ModelSource("hf", tmp_path, family)
    cfg = load_config(src)
    rounded = load_weights(src, cfg, quantization="int8")
    assert isinstance(rounded["model.layers.0.self_attn.q_proj.weight"], cpu_quant.QuantWeight)
    state = hf.state_dict()
    with torch.no_grad():  # transformers with the weights kvflow's int8 kernels multiply by
        for name, w in rounded.items():
            if isinstance(w, cpu_quant.QuantWeight) and name in state:
                state[name].copy_(w.dequantize())
        if "lm_head.weight" in rounded and cfg.tie_word_embeddings is False:
            state["lm_head.weight"].copy_(rounded["lm_head.weight"].dequantize())
    want = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    runner = ModelRunner.create(
        src, block_size=4, num_blocks=64, worker_id="w", quantization="int8"
    )
    got, _ = run(new_core(max_num_batched_tokens=8), runner, [(p, None) for p in PROMPTS], GREEDY)
    assert got == want


def _adapter(hf: torch.nn.Module, path: Path, seed: int) -> torch.nn.Module:
    """A PEFT adapter on every projection with random non-zero A and B (large enough to change
    the output), saved at ``path``; returns the peft model."""
    torch.manual_seed(seed)
    conf = LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False)
    model = get_peft_model(copy.deepcopy(hf), conf)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    model.save_pretrained(str(path))
    return model.eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_equals_transformers_peft(family: str, tmp_path: Path) -> None:
    hf = save_model(family, tmp_path / "model")
    peft_model = _adapter(hf, tmp_path / "adapter", seed=3)
    ref = LoRARef("a", 1, str(tmp_path / "adapter"))
    src = ModelSource("hf", tmp_path / "model", family)
    runner = ModelRunner.create(
        src, block_size=4, num_blocks=64, worker_id="w", lora=LoRASpec(2, 16)
    )
    want = [hf_greedy(peft_model, p, NEW) for p in PROMPTS]
    base = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    assert want != base  # the adapter changes the output: the comparison has teeth
    jobs = [(p, ref) for p in PROMPTS] + [(p, None) for p in PROMPTS]  # adapter and base mixed
    got, _ = run(new_core(max_num_batched_tokens=8), runner, jobs, GREEDY)
    assert got == want + base


# K-quants need rows of whole 256-weight super-blocks: every input dimension a multiple of 256
KQ_SHAPE = dict(hidden_size=256, intermediate_size=512, head_dim=64, num_attention_heads=4)


@pytest.mark.skipif(not cpu_quant.available(), reason="no C compiler: the blocks run in C kernels")
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1"])
def test_gguf_blocks_equal_transformers_on_their_values(family: str, qtype: str) -> None:
    """Every linear weight in GGUF blocks of ``qtype`` (random blocks: gguf-py cannot write
    K-quants), multiplied in place, beside transformers running the blocks' dequantized
    values: the same greedy tokens, batched under chunked prefill."""
    from kvflow.shared.models.registry import hf_config
    from tests.helpers.families import make_model
    from tests.helpers.kquants import UNIT_TYPES, random_blocks

    hf = make_model(family, **KQ_SHAPE)
    state = hf.state_dict()
    weights: dict[str, object] = {}
    with torch.no_grad():
        for i, (name, w) in enumerate(state.items()):
            if name.endswith("_proj.weight"):
                blocks = random_blocks(UNIT_TYPES[qtype], *w.shape, seed=i)
                w.copy_(blocks.dequantize())
                weights[name] = blocks
            else:
                weights[name] = w.clone()
    cfg = hf_config(hf.config.to_dict())
    want = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    runner = ModelRunner.from_weights(cfg, weights, 4, 64, worker_id="w")  # type: ignore[arg-type]
    assert isinstance(runner.model.layers[0].gate_up, cpu_quant.QuantWeight)
    got, _ = run(new_core(max_num_batched_tokens=8), runner, [(p, None) for p in PROMPTS], GREEDY)
    assert got == want
