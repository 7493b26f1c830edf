"""Tiny random-weight checkpoints of every native family, made by transformers (no hub), with
each family's features switched on and weights large enough that they matter: sliding windows
shorter than the prompts, RoPE scaling active over the prompts' positions, soft-caps, biases,
q/k norms, multipliers. Weights are scaled up from the initializer's 0.02 so logits are far
from ties (greedy output is then a sharp test)."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from pathlib import Path

import torch
import transformers as tf

SHAPE = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 127,
    "pad_token_id": 0,
}
WINDOW = 6  # tokens: shorter than every prompt but one
ORIG = 16  # original_max_position_embeddings of the scaled RoPEs: prompts and outputs pass it


def _factors(seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return (1.0 + 3.0 * torch.rand(SHAPE["head_dim"] // 2, generator=g)).tolist()


def _rope(kind: str, **kw: float) -> dict:
    return {"rope_type": kind, "rope_theta": 10000.0, **kw}


CONFIGS: dict[str, Callable[[], tf.PretrainedConfig]] = {
    "llama3": lambda: tf.LlamaConfig(
        **SHAPE,
        attention_bias=True,
        mlp_bias=True,
        rope_parameters=_rope(
            "llama3",
            factor=4.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=ORIG,
        ),
    ),
    "llama-yarn": lambda: tf.LlamaConfig(
        **SHAPE, rope_parameters=_rope("yarn", factor=4.0, original_max_position_embeddings=ORIG)
    ),
    "llama-linear-gelu": lambda: tf.LlamaConfig(
        **SHAPE, hidden_act="gelu", rope_parameters=_rope("linear", factor=2.0)
    ),
    "mistral": lambda: tf.MistralConfig(**SHAPE, sliding_window=WINDOW),
    "qwen2": lambda: tf.Qwen2Config(
        **SHAPE, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    ),
    "qwen3": lambda: tf.Qwen3Config(
        **SHAPE, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    ),
    "gemma2": lambda: tf.Gemma2Config(
        **SHAPE,
        sliding_window=WINDOW,
        query_pre_attn_scalar=16,
        attn_logit_softcapping=20.0,
        final_logit_softcapping=15.0,
    ),
    "gemma3": lambda: tf.Gemma3TextConfig(
        **{**SHAPE, "num_hidden_layers": 3},
        sliding_window=WINDOW,
        query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": _rope("linear", factor=2.0),
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        },
    ),
    "phi3": lambda: tf.Phi3Config(
        **SHAPE,
        sliding_window=WINDOW + 2,
        original_max_position_embeddings=ORIG,
        rope_parameters=_rope(
            "longrope",
            short_factor=_factors(1),
            long_factor=_factors(2),
            original_max_position_embeddings=ORIG,
        ),
    ),
    "granite": lambda: tf.GraniteConfig(
        **SHAPE,
        embedding_multiplier=2.0,
        attention_multiplier=0.1,
        residual_multiplier=0.5,
        logits_scaling=4.0,
    ),
    "olmo2": lambda: tf.Olmo2Config(**SHAPE),
    "olmo3": lambda: tf.Olmo3Config(
        **SHAPE,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": _rope("yarn", factor=4.0, original_max_position_embeddings=ORIG),
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        },
    ),
    "starcoder2": lambda: tf.Starcoder2Config(
        **{k: v for k, v in SHAPE.items() if k != "rms_norm_eps"},
        norm_epsilon=1e-5,
        sliding_window=WINDOW,
        use_bias=True,
    ),
    # mixtures of experts: 4 experts, top-2; the windowed/dense-layer features on where the
    # family has them (Qwen2-MoE: its shared expert, a dense MLP on layer 1, no renormalising;
    # Qwen3-MoE: renormalised top-k)
    "mixtral": lambda: tf.MixtralConfig(
        **SHAPE, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW
    ),
    "qwen2_moe": lambda: tf.Qwen2MoeConfig(
        **SHAPE,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=80,
        mlp_only_layers=[1],
    ),
    "qwen3_moe": lambda: tf.Qwen3MoeConfig(
        **SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True
    ),
    "olmoe": lambda: tf.OlmoeConfig(
        **{k: v for k, v in SHAPE.items() if k != "head_dim"}, num_experts=4, num_experts_per_tok=2
    ),
}


TRANSFORMERS_ONLY: dict[str, Callable[[], tf.PretrainedConfig]] = {
    # architectures with no kvflow family file: served by --model-impl transformers
    "gpt_neox": lambda: tf.GPTNeoXConfig(
        **{k: v for k, v in SHAPE.items() if k not in ("head_dim", "num_key_value_heads")},
        rotary_pct=0.25,
        use_parallel_residual=True,
    ),
    "stablelm": lambda: tf.StableLmConfig(
        **{k: v for k, v in SHAPE.items() if k != "head_dim"},
        partial_rotary_factor=0.25,
        qk_layernorm=True,
        use_qkv_bias=True,
    ),
}


def family_of(name: str) -> str:
    """The kvflow family of ``CONFIGS[name]`` (``llama3`` and ``llama-yarn`` are Llama)."""
    return "llama" if name.startswith("llama") else name


def make_model(name: str, seed: int = 0, **overrides: object) -> torch.nn.Module:
    """The tiny model of ``CONFIGS[name]`` or ``TRANSFORMERS_ONLY[name]`` (``overrides``: config fields, e.g. a real
    tokenizer's vocabulary): 2-D weights x10, 1-D ones (norms, biases) with noise (a Gemma
    norm's weight is an offset from 1, so noise around 0 is a real scale)."""
    torch.manual_seed(seed)
    config = (CONFIGS | TRANSFORMERS_ONLY)[name]()
    for key, value in overrides.items():
        setattr(config, key, value)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(10.0) if p.dim() == 2 else p.add_(torch.randn_like(p) * 0.1)
    return model


def save_model(name: str, path: Path, seed: int = 0) -> torch.nn.Module:
    """``make_model`` saved as a Hugging Face directory at ``path``; returns the model."""
    model = make_model(name, seed)
    model.save_pretrained(path)
    return model


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy output: ``generate``, except for Phi-3 (see ``hf_greedy_stepped``)."""
    if model.config.model_type == "phi3":
        return hf_greedy_stepped(model, prompt, n)
    return hf_generate(model, prompt, n)


def hf_greedy_stepped(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """The model's own forward with its own KV cache, one token at a time (``generate``
    without its per-model hooks). Phi-3's hook (``prepare_inputs_for_generation``) drops the
    cache when a sequence first passes ``original_max_position_embeddings`` and recomputes it
    all with the long RoPE factors; kvflow, like vLLM, keeps the keys already computed, which
    is what the model's forward does step by step."""
    toks = list(prompt)
    # transformers 5.x renames the forward's past_key_values to cache
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = model(torch.tensor([toks]), use_cache=True)
        for _ in range(n):
            toks.append(int(out.logits[0, -1].argmax()))
            pos = torch.tensor([[len(toks) - 1]])
            kw = {key: out.past_key_values, "position_ids": pos, "use_cache": True}
            out = model(torch.tensor([[toks[-1]]]), **kw)
    return toks[len(prompt) :]


def hf_generate(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy ``generate`` (its KV cache, its masks): ``n`` new tokens, EOS
    neither ending it nor suppressed (as kvflow's ``ignore_eos``; ``min_new_tokens`` would
    mask EOS out of the argmax)."""
    gen = copy.deepcopy(model.generation_config)
    gen.eos_token_id = []  # None would fall back to the model's EOS
    gen.update(max_new_tokens=n, do_sample=False, pad_token_id=0)
    out = model.generate(torch.tensor([prompt]), generation_config=gen)
    return out[0, len(prompt) :].tolist()


PROMPTS = [
    [5, 17, 99, 3, 42, 8, 64, 21, 77, 1, 33],
    [120, 6, 6, 90, 12, 7, 7, 31],
    [11, 22, 33, 44, 55, 66, 77, 88, 99, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109],
    [9, 8],
]


NEW = 14  # prompts + outputs pass the windows (6) and the scaled RoPEs' original length (16)
