"""Mixtures of experts: Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE. Each is a dense family's
attention (Mistral's, Qwen2's with q/k/v biases, Qwen3's per-head q/k norms, OLMo's q/k norms
over the whole projection) with an MoE block in place of the MLP: a router picks
``experts_per_token`` of ``num_experts`` experts per token (softmax, then top-k, the top-k
renormalised where the config says: always for Mixtral, ``norm_topk_prob`` elsewhere) and the
token's output is their outputs weighted by those probabilities; Qwen2-MoE adds a shared expert
every token takes, scaled by ``sigmoid(x . w)``. Qwen2/3-MoE may keep dense MLPs on some layers
(``mlp_only_layers``, ``decoder_sparse_step``).

Checkpoints hold one tensor per expert (Mixtral's ``block_sparse_moe.experts.E.w1/w3/w2``,
the others' ``mlp.experts.E.gate_proj/up_proj/down_proj``), with the router at
``mlp.gate.weight``; ``_mixtral_names`` brings Mixtral's to the others' names, under which the
worker (services/worker/model.py) builds each layer's experts."""

from __future__ import annotations

import re
from typing import Any

from kvflow.shared.models.config import ConfigReader
from kvflow.shared.models.families.llama import read_llama, read_mistral
from kvflow.shared.models.families.qwen import read_qwen2, read_qwen3
from kvflow.shared.models.family import LLAMA_NORMS, QK_NORMS, Family


def _experts(r: ConfigReader, size_key: str, renormalize: bool | None) -> dict:
    """The MoE fields every family has; ``renormalize`` None: from ``norm_topk_prob``. The
    expert count is ``num_experts`` or ``num_local_experts`` (Mixtral's name, which
    transformers 5 also writes for the others)."""
    key = "num_experts" if r.has("num_experts") else "num_local_experts"
    r.get("num_experts")
    experts = int(r.require(key))
    top_k = int(r.require("num_experts_per_tok"))
    if not 0 < top_k <= experts:
        raise r.refuse("num_experts_per_tok", f"want 1..{experts} (the experts there are)")
    for training_only in ("router_aux_loss_coef", "output_router_logits", "router_jitter_noise"):
        r.get(training_only)
    return {
        "num_experts": experts,
        "experts_per_token": top_k,
        "moe_intermediate_size": int(r.require(size_key)),
        "moe_renormalize": bool(r.get("norm_topk_prob", False))
        if renormalize is None
        else renormalize,
    }


def _sparse_layers(r: ConfigReader) -> tuple[bool, ...]:
    """Qwen2/3-MoE: which layers are MoE (``mlp_only_layers`` and ``decoder_sparse_step``);
    () when all are."""
    n = int(r.require("num_hidden_layers"))
    dense = {int(i) for i in r.get("mlp_only_layers") or ()}
    step = int(r.get("decoder_sparse_step", 1) or 1)
    layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(n))
    return () if all(layers) else layers


def read_mixtral(r: ConfigReader) -> dict[str, Any]:
    out = read_mistral(r)
    return out | _experts(r, "intermediate_size", renormalize=True)


def read_qwen2_moe(r: ConfigReader) -> dict[str, Any]:
    out = read_qwen2(r, qkv_bias=bool(r.get("qkv_bias", True)))
    out |= _experts(r, "moe_intermediate_size", renormalize=None)
    out["shared_expert_size"] = int(r.get("shared_expert_intermediate_size", 0) or 0)
    out["moe_layers"] = _sparse_layers(r)
    return out


def read_qwen3_moe(r: ConfigReader) -> dict[str, Any]:
    out = read_qwen3(r)
    out |= _experts(r, "moe_intermediate_size", renormalize=None)
    out["moe_layers"] = _sparse_layers(r)
    return out


def read_olmoe(r: ConfigReader) -> dict[str, Any]:
    if r.get("clip_qkv") is not None:
        raise r.refuse("clip_qkv", "clamping q/k/v is not supported natively")
    out = read_llama(r)
    out["qk_norm"] = "full"
    return out | _experts(r, "intermediate_size", renormalize=None)


_MIXTRAL = re.compile(r"\.block_sparse_moe\.(gate|experts\.(\d+)\.(w1|w2|w3))\.weight$")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _mixtral_names(weights: dict[str, Any], cfg: Any) -> dict[str, Any]:
    """Mixtral's MoE tensors under the names the other families use (idempotent)."""
    del cfg
    out: dict[str, Any] = {}
    for name, w in weights.items():
        m = _MIXTRAL.search(name)
        if m is None:
            out[name] = w
        elif m.group(1) == "gate":
            out[name[: m.start()] + ".mlp.gate.weight"] = w
        else:
            proj = _MIXTRAL_PROJ[m.group(3)]
            out[name[: m.start()] + f".mlp.experts.{m.group(2)}.{proj}.weight"] = w
    return out


FAMILIES = (
    Family(  # a GGUF of it says "llama" with an expert count (registry.family_for_gguf)
        "mixtral",
        ("MixtralForCausalLM",),
        ("mixtral",),
        read_mixtral,
        LLAMA_NORMS,
        gguf_permute_qk=True,
        split=_mixtral_names,
        ignored=frozenset({"layer_types"}),
    ),
    Family(
        "qwen2_moe",
        ("Qwen2MoeForCausalLM",),
        ("qwen2_moe",),
        read_qwen2_moe,
        LLAMA_NORMS,
        gguf_archs=("qwen2moe",),
    ),
    Family(
        "qwen3_moe",
        ("Qwen3MoeForCausalLM",),
        ("qwen3_moe",),
        read_qwen3_moe,
        LLAMA_NORMS | QK_NORMS,
        gguf_archs=("qwen3moe",),
    ),
    Family(
        "olmoe",
        ("OlmoeForCausalLM",),
        ("olmoe",),
        read_olmoe,
        LLAMA_NORMS | QK_NORMS,
        gguf_archs=("olmoe",),
    ),
)
