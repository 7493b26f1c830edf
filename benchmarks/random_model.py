"""A random-weight Llama (or, with ``experts``, a Mixtral-like mixture of experts) of a given
shape, under Hugging Face weight names, for the benchmarks
that time the worker's model (benchmarks/decode.py, benchmarks/kernels.py) and for tests of
their code paths: ``LlamaShape`` (default: a 1B-class model, Llama-3.2-1B without its 128k
vocabulary) and ``random_llama``, whose config and weights ``DecoderModel`` and ``ModelRunner``
take as they are."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvflow.shared.models.config import ModelConfig


@dataclass(frozen=True)
class LlamaShape:
    """Dimensions of a Llama decoder (defaults: a 1B-class model, Llama-3.2-1B without its
    128k vocabulary)."""

    vocab: int = 32000
    hidden: int = 2048
    layers: int = 16
    heads: int = 32
    kv_heads: int = 8
    intermediate: int = 8192
    rope_theta: float = 500000.0
    eps: float = 1e-5
    max_position: int = 8192
    experts: int = 0  # > 0: every MLP a mixture of this many experts of ``intermediate`` each
    top_k: int = 2  # experts per token

    @property
    def active_intermediate(self) -> int:
        """The intermediate features a token goes through (an MoE's top-k experts' total)."""
        return self.intermediate * (self.top_k if self.experts else 1)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def num_params(self) -> int:
        d, kv = self.hidden, self.kv_heads * self.head_dim
        mlp = 3 * d * self.intermediate * max(self.experts, 1) + self.experts * d
        per_layer = d * (d + 2 * kv) + d * d + mlp + 2 * d
        return self.layers * per_layer + 2 * self.vocab * d + d


def random_llama(
    dtype: torch.dtype, device: torch.device, seed: int = 0, shape: LlamaShape | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A random-weight Llama under HF weight names, drawn on ``device`` (N(0, 0.02), norms
    N(1, 0.1)); by default of the 1B-class ``LlamaShape``."""
    s = shape or LlamaShape()
    cfg = ModelConfig(
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        num_layers=s.layers,
        num_heads=s.heads,
        num_kv_heads=s.kv_heads,
        head_dim=s.head_dim,
        intermediate_size=s.intermediate,
        rms_norm_eps=s.eps,
        rope_theta=s.rope_theta,
        max_position_embeddings=s.max_position,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_ids=(s.vocab - 1,),
        family="mixtral" if s.experts else "llama",
        num_experts=s.experts,
        experts_per_token=s.top_k if s.experts else 0,
        moe_intermediate_size=s.intermediate if s.experts else 0,
        moe_renormalize=bool(s.experts),
    )
    g = torch.Generator(device=device).manual_seed(seed)

    def w(*dims: int, mean: float = 0.0, std: float = 0.02) -> torch.Tensor:
        x = torch.randn(*dims, generator=g, device=device, dtype=torch.float32)
        return (x * std + mean).to(dtype)

    d, kv, i = s.hidden, s.kv_heads * s.head_dim, s.intermediate
    weights = {
        "model.embed_tokens.weight": w(s.vocab, d),
        "model.norm.weight": w(d, mean=1.0, std=0.1),
        "lm_head.weight": w(s.vocab, d),
    }
    for n in range(s.layers):
        p = f"model.layers.{n}."
        weights |= {
            p + "input_layernorm.weight": w(d, mean=1.0, std=0.1),
            p + "post_attention_layernorm.weight": w(d, mean=1.0, std=0.1),
            p + "self_attn.q_proj.weight": w(d, d),
            p + "self_attn.k_proj.weight": w(kv, d),
            p + "self_attn.v_proj.weight": w(kv, d),
            p + "self_attn.o_proj.weight": w(d, d),
        }
        experts = [f"{p}mlp.experts.{e}." for e in range(s.experts)] or [p + "mlp."]
        for e in experts:
            weights |= {
                e + "gate_proj.weight": w(i, d),
                e + "up_proj.weight": w(i, d),
                e + "down_proj.weight": w(d, i),
            }
        if s.experts:
            weights[p + "mlp.gate.weight"] = w(s.experts, d, std=1.0)  # sharp, uneven routes
    return cfg, weights
