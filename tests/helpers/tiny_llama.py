"""A tiny random-weight Llama (the `tiny_llama` fixture of tests/conftest.py builds it) and a
ModelRunner over its weights, for the runner, beam-search, LoRA, speculative and pooling tests."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvflow.services.worker.runner import ModelRunner
from kvflow.shared.models.config import ModelConfig

BLOCK = 4


NUM_BLOCKS = 64


PROMPTS = [
    [5, 17, 99, 3, 42, 8, 64, 21, 77, 1, 33],  # 11 tokens: not a multiple of the block size
    [120, 6, 6, 90, 12],
    [7],  # a one-token prompt: context of 1
    [11, 22, 33, 44, 55, 66, 77, 88, 99, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109],
]


def build_tiny_llama() -> LlamaForCausalLM:
    """A 2-layer random-weight Llama (vocab 128), weights scaled up so logits are not near-ties."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=127,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger weights than the init's 0.02 so logits are not near-ties
        for p in model.parameters():
            p.mul_(10.0) if p.dim() == 2 else p.add_(torch.randn_like(p) * 0.1)
    return model


def make_runner(hf: LlamaForCausalLM, **kw) -> ModelRunner:
    c = hf.config
    cfg = ModelConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        num_layers=c.num_hidden_layers,
        num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads,
        head_dim=c.hidden_size // c.num_attention_heads,
        intermediate_size=c.intermediate_size,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_parameters["rope_theta"],
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_ids=(127,),
    )
    weights = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    return ModelRunner.from_weights(cfg, weights, BLOCK, NUM_BLOCKS, **kw)
