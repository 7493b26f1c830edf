"""A tiny Llama with SmolLM2's head ratios for the tensor-parallel tests (unit: layouts and
shards; integration: process groups)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvflow.shared.models.config import ModelConfig

# SmolLM2's ratios, small: 9 heads over 3 KV heads (GQA 3), head_dim 8
CFG = ModelConfig(
    vocab_size=120,
    hidden_size=72,
    num_layers=2,
    num_heads=9,
    num_kv_heads=3,
    head_dim=8,
    intermediate_size=96,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=128,
    tie_word_embeddings=True,
    bos_token_id=None,
    eos_token_ids=(119,),
)
BLOCK, BLOCKS = 4, 32
PROMPTS = [[5, 17, 99, 3, 42, 8, 64, 21, 77, 1, 33], [11, 22, 33], [7]]
TOKENS = 12


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d, h = CFG.hidden_size, CFG.head_dim
    q, kv, i = CFG.num_heads * h, CFG.num_kv_heads * h, CFG.intermediate_size

    def mat(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.3

    w = {"model.embed_tokens.weight": mat(CFG.vocab_size, d), "model.norm.weight": 1 + mat(d) / 3}
    for n in range(CFG.num_layers):
        p = f"model.layers.{n}."
        w |= {
            p + "input_layernorm.weight": 1 + mat(d) / 3,
            p + "post_attention_layernorm.weight": 1 + mat(d) / 3,
            p + "self_attn.q_proj.weight": mat(q, d),
            p + "self_attn.k_proj.weight": mat(kv, d),
            p + "self_attn.v_proj.weight": mat(kv, d),
            p + "self_attn.o_proj.weight": mat(d, q),
            p + "mlp.gate_proj.weight": mat(i, d),
            p + "mlp.up_proj.weight": mat(i, d),
            p + "mlp.down_proj.weight": mat(d, i),
        }
    return w


def write_adapter(path: Path, rank: int = 4, seed: int = 1) -> None:
    """A PEFT LoRA directory for CFG: every attention and MLP projection, random A and B."""
    from safetensors.torch import save_file

    from kvflow.services.worker.lora_weights import module_shapes

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(CFG.num_layers):
        for module, (n_in, n_out) in module_shapes(CFG).items():
            part = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) * 0.3
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.3
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    conf = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": modules}
    (path / "adapter_config.json").write_text(json.dumps(conf))
