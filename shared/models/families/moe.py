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
from kvflow.shared.models.families.olmo2 import WHOLE_QK_NORMS
from kvflow.shared.models.families.qwen import read_qwen2, read_qwen3
from kvflow.shared.models.family import LLAMA_NORMS, QK_NORMS, Family, Gguf, GgufFile

NO_LORA = "yet for mixtures of experts: serve it without adapters"


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


def _gguf_experts(
    g: GgufFile, renormalize: bool | None = None, width: bool = False, shared: bool = False
) -> dict[str, Any]:
    """A mixture of experts' fields from llama.cpp's keys: the expert count and top-k; with
    ``width``, each expert's intermediate features (``expert_feed_forward_length``, else
    ``feed_forward_length``; the families whose config names them apart); with ``shared``, the
    shared expert's; whether the top-k is renormalised (``renormalize``; None: the family's
    reader fixes it). llama.cpp hardcodes that per architecture instead of writing it
    (``build_moe_ffn``'s ``norm_w`` in src/models/llama.cpp, qwen2moe.cpp, qwen3moe.cpp,
    olmoe.cpp: Mixtral and Qwen3-MoE yes, Qwen2-MoE and OLMoE no). Every layer is MoE
    (llama.cpp's tensor tables have no dense MLP for these architectures)."""
    out: dict[str, Any] = {
        "num_experts": int(g.get("expert_count")),
        "num_experts_per_tok": int(g.get("expert_used_count")),
    }
    if renormalize is not None:
        out["norm_topk_prob"] = renormalize
    if width:
        out["moe_intermediate_size"] = int(
            g.get("expert_feed_forward_length") or g.first("feed_forward_length")
        )
    if shared:
        out["shared_expert_intermediate_size"] = int(
            g.get("expert_shared_feed_forward_length", 0) or 0
        )
    return out


def gguf_mixtral(g: GgufFile, raw: dict[str, Any]) -> dict[str, Any]:
    return _gguf_experts(g)  # always renormalised (read_mixtral)


def gguf_qwen2_moe(g: GgufFile, raw: dict[str, Any]) -> dict[str, Any]:
    return _gguf_experts(g, renormalize=False, width=True, shared=True)


def gguf_qwen3_moe(g: GgufFile, raw: dict[str, Any]) -> dict[str, Any]:
    return _gguf_experts(g, renormalize=True, width=True)


def gguf_olmoe(g: GgufFile, raw: dict[str, Any]) -> dict[str, Any]:
    return _gguf_experts(g, renormalize=False)


FAMILIES = (
    Family(  # a GGUF of it says "llama" with an expert count
        "mixtral",
        ("MixtralForCausalLM",),
        ("mixtral",),
        read_mixtral,
        LLAMA_NORMS,
        gguf=Gguf(("llama",), experts=True, permute_qk=True, config=gguf_mixtral),
        split=_mixtral_names,
        ignored=frozenset({"layer_types"}),
        no_lora=NO_LORA,
    ),
    Family(
        "qwen2_moe",
        ("Qwen2MoeForCausalLM",),
        ("qwen2_moe",),
        read_qwen2_moe,
        LLAMA_NORMS,
        gguf=Gguf(("qwen2moe",), experts=True, config=gguf_qwen2_moe),
        no_lora=NO_LORA,
    ),
    Family(
        "qwen3_moe",
        ("Qwen3MoeForCausalLM",),
        ("qwen3_moe",),
        read_qwen3_moe,
        LLAMA_NORMS | QK_NORMS,
        gguf=Gguf(("qwen3moe",), experts=True, config=gguf_qwen3_moe),
        no_lora=NO_LORA,
    ),
    Family(
        "olmoe",
        ("OlmoeForCausalLM",),
        ("olmoe",),
        read_olmoe,
        LLAMA_NORMS | QK_NORMS,
        gguf=Gguf(("olmoe",), experts=True, config=gguf_olmoe),
        no_tensor_parallel=WHOLE_QK_NORMS,
        no_lora=NO_LORA,
    ),
)
