"""What kvflow knows of a model: ``ModelConfig`` (the shape every family has, and
the features in which families differ: activation, biases, norm placement, q/k norms, sliding
windows, soft-caps, multipliers, RoPE per layer), ``RopeSpec`` (one rotary embedding with its
scaling), and ``ConfigReader``, which reads a config.json while recording every field read, so
a field that nothing reads is found and named instead of silently ignored (shared/models/
registry.py).

A family file (shared/models/families/) fills a ``ModelConfig`` from a reader; the worker's one
decoder (services/worker/model.py) runs whatever the features say.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu": "gelu",
}
"""config.json's activation names -> the kernel kvflow runs (``gelu_new`` and ``gelu_fast`` are
the same tanh approximation as ``gelu_pytorch_tanh``, in other words)."""

NORM_LAYOUTS = ("pre", "sandwich", "post")
"""Where a layer's norms sit: ``pre`` (Llama: before attention and before the MLP), ``sandwich``
(Gemma 2/3: before and after each), ``post`` (OLMo 2: after each, none before)."""


class ModelConfigError(ValueError):
    """A model kvflow cannot run natively; the message names the field, the value and what to
    do instead."""


@dataclass(frozen=True)
class RopeSpec:
    """One rotary embedding: ``rope_type`` default | linear | dynamic | yarn | llama3 | longrope,
    its base and scaling parameters (HF's names). ``inv_freq``/``attention_factor``:
    shared/models/rope.py."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    freq_factors: tuple[float, ...] = ()  # GGUF rope_freqs: each frequency divided by its own

    @property
    def length_dependent(self) -> bool:
        """Whether a token's rotation depends on its sequence's length (longrope: the long
        factors once a sequence passes ``original_max_position_embeddings``)."""
        return self.rope_type == "longrope" and self.long_factor != self.short_factor


@dataclass(frozen=True)
class ModelConfig:
    """A transformer as kvflow runs it. The first fields are every family's; the rest say how a
    family differs from Llama (defaults: Llama's), as the decoder (services/worker/model.py)
    reads them. What only another kind of model reads is in that kind's subclass, declared by
    its family (``Family.config``: an encoder's in shared/models/families/bert.py)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    family: str = "llama"  # shared/models/registry.py: which family file (weight names, GGUF)
    hidden_act: str = "silu"  # silu | gelu_tanh | gelu (ACTIVATIONS' values)
    qkv_bias: bool = False  # q/k/v projections have biases (Qwen2; Llama's attention_bias)
    o_bias: bool = False  # the output projection has one (Llama's attention_bias)
    mlp_bias: bool = False  # gate/up/down have biases (Llama's mlp_bias)
    qk_norm: str = ""  # "" | "head" (RMSNorm per head: Qwen3, Gemma 3) | "full" (OLMo 2)
    norm_offset: float = 0.0  # RMSNorm scales by (offset + w): Gemma's (1 + w)
    norm_layout: str = "pre"  # NORM_LAYOUTS
    norm_kind: str = "rms"  # "rms" (RMSNorm) | "layer" (LayerNorm with a bias: StarCoder2)
    gated_mlp: bool = True  # act(gate) * up, then down; False: act(up), then down (StarCoder2)
    layer_windows: tuple[int, ...] = ()  # per layer: sliding window in tokens, 0 = full
    attn_softcap: float = 0.0  # attention scores s -> c * tanh(s / c) (Gemma 2)
    final_softcap: float = 0.0  # logits likewise (Gemma 2)
    embed_scale: float = 1.0  # embeddings times this (Gemma: sqrt(hidden); Granite)
    attn_scale: float = 0.0  # softmax scale; 0: head_dim ** -0.5
    residual_multiplier: float = 1.0  # a block's output times this before the add (Granite)
    logits_divisor: float = 1.0  # logits / this (Granite's logits_scaling)
    rope: RopeSpec = None  # type: ignore[assignment]  # None: default RoPE at rope_theta
    rope_local: RopeSpec | None = None  # sliding-window layers' own RoPE (Gemma 3); None: rope
    # a sequence-classification head's classes (0: none): the tasks it serves follow
    # (shared/models/tasks.py); the head itself is its kind's (an encoder's: families/bert.py)
    num_labels: int = 0
    # mixtures of experts (shared/models/families/moe.py): 0 experts is a dense model
    num_experts: int = 0  # routed experts per MoE layer
    experts_per_token: int = 0  # top-k
    moe_intermediate_size: int = 0  # each expert's intermediate features
    moe_renormalize: bool = False  # the top-k probabilities rescaled to sum to 1
    shared_expert_size: int = 0  # a sigmoid-gated expert every token takes (Qwen2-MoE); 0: none
    moe_layers: tuple[bool, ...] = ()  # per layer: an MoE (True) or a dense MLP; (): all MoE

    def is_moe(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is a mixture of experts."""
        if not self.num_experts:
            return False
        return self.moe_layers[layer] if self.moe_layers else True

    def __post_init__(self) -> None:
        if self.rope is None:
            object.__setattr__(self, "rope", RopeSpec(theta=self.rope_theta))

    def window(self, layer: int) -> int:
        """Layer ``layer``'s sliding window (0: attends to the whole context)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def layer_rope(self, layer: int) -> RopeSpec:
        """The rotary embedding of layer ``layer``."""
        if self.rope_local is not None and self.window(layer):
            return self.rope_local
        return self.rope

    @property
    def scale(self) -> float:
        """The attention softmax scale."""
        return self.attn_scale or self.head_dim**-0.5

    @property
    def max_window(self) -> int:
        """The widest sliding window; 0 when some layer attends to the whole context."""
        if not self.layer_windows or not all(self.layer_windows):
            return 0
        return max(self.layer_windows)


# config.json fields that do not change what a model computes at inference (training knobs,
# bookkeeping, tokens the tokenizer reads, things transformers adds to every config)
INFERENCE_IRRELEVANT = frozenset(
    {
        "architectures",
        "model_type",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "use_cache",
        "initializer_range",
        "attention_dropout",
        "hidden_dropout",
        "resid_pdrop",
        "embd_pdrop",
        "output_hidden_states",
        "output_attentions",
        "return_dict",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "id2label",
        "label2id",
        "problem_type",
        "pad_token_id",
        "_name_or_path",
        "tokenizer_class",
        "quantization_config",  # read by shared/quantized_checkpoints.py
        "pretraining_tp",  # a training-time split of the same matmuls
        "_sliding_window_pattern",  # derived: layer_types is read
        "sliding_window_pattern",  # read only where layer_types is absent (Gemma 3)
    }
)


class ConfigReader:
    """config.json's fields, recording which were read (``unread``)."""

    def __init__(self, raw: dict[str, Any], where: str = "config.json") -> None:
        self.raw = raw
        self.where = where
        self.read: set[str] = set()

    def has(self, key: str) -> bool:
        return self.raw.get(key) is not None

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        value = self.raw.get(key)
        return default if value is None else value

    def require(self, key: str) -> Any:
        self.read.add(key)
        if self.raw.get(key) is None:
            raise ModelConfigError(f"{self.where}: {key!r} is missing")
        return self.raw[key]

    def refuse(self, key: str, why: str) -> ModelConfigError:
        """An error naming ``key``'s value and why it cannot be served."""
        return ModelConfigError(f"{self.where}: {key} = {self.raw.get(key)!r}: {why}")

    def unread(self, ignored: frozenset[str] = frozenset()) -> list[str]:
        """Fields present that nothing read and that are not known to be irrelevant."""
        skip = INFERENCE_IRRELEVANT | ignored | self.read
        return sorted(k for k in self.raw if k not in skip and not k.endswith("_token_id"))


def activation(r: ConfigReader, *keys: str) -> str:
    """The MLP activation from the first of ``keys`` present, as a kernel name."""
    key = next((k for k in keys if r.has(k)), keys[0])
    name = r.get(key, "silu")
    for k in keys:
        r.get(k)
    if name not in ACTIVATIONS:
        raise r.refuse(key, f"not a supported activation ({', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def common_fields(r: ConfigReader, eos_extra: list[int]) -> dict[str, Any]:
    """The fields every decoder family has, under kvflow's names."""
    heads = int(r.require("num_attention_heads"))
    hidden = int(r.require("hidden_size"))
    eos = _ids(r.get("eos_token_id")) + eos_extra
    bos = r.get("bos_token_id")
    return {
        "vocab_size": int(r.require("vocab_size")),
        "hidden_size": hidden,
        "num_layers": int(r.require("num_hidden_layers")),
        "num_heads": heads,
        "num_kv_heads": int(r.get("num_key_value_heads") or heads),
        "head_dim": int(r.get("head_dim") or hidden // heads),
        "intermediate_size": int(r.require("intermediate_size")),
        "rms_norm_eps": float(r.get("rms_norm_eps", 1e-6)),
        "max_position_embeddings": int(r.get("max_position_embeddings", 2048)),
        "tie_word_embeddings": bool(r.get("tie_word_embeddings", False)),
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_ids": tuple(dict.fromkeys(eos)),
    }


def _ids(x: Any) -> list[int]:
    if x is None:
        return []
    return [int(i) for i in x] if isinstance(x, list) else [int(x)]


def rope_parameters(r: ConfigReader, layer_type: str = "") -> dict[str, Any]:
    """The RoPE parameters as one dict in transformers v5's form, from either form a
    config.json has: v5's ``rope_parameters`` (per layer type when ``layer_type`` keys it) or
    v4's ``rope_theta`` + ``rope_scaling``."""
    params = r.get("rope_parameters")
    if isinstance(params, dict) and layer_type and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    out: dict[str, Any] = dict(params) if isinstance(params, dict) else {}
    scaling = r.get("rope_scaling")
    if isinstance(scaling, dict) and not layer_type:
        out = {**scaling, **out}
    if "rope_theta" not in out:
        out["rope_theta"] = r.get("rope_theta", 10000.0)
    else:
        r.get("rope_theta")
    return out


def layer_type_rope_parameters(r: ConfigReader) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """transformers v5's ``rope_parameters`` keyed by layer type: (those of the full-attention
    layers, those of the sliding-window layers); None when they are not keyed so."""
    params = r.get("rope_parameters")
    if not (isinstance(params, dict) and "full_attention" in params):
        return None
    return rope_parameters(r, "full_attention"), rope_parameters(r, "sliding_attention")


def rope_spec(
    r: ConfigReader, params: dict[str, Any], key: str = "rope_scaling", max_positions: int = 0
) -> RopeSpec:
    """A ``RopeSpec`` from v5-style ``params``; an unknown type or a partial rotary factor is
    refused naming ``key``."""
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    kind = {"su": "longrope", "mrope": "default"}.get(kind, kind)
    known = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
    if kind not in known:
        raise r.refuse(key, f"rope type {kind!r} is not supported ({', '.join(known)})")
    partial = float(params.get("partial_rotary_factor", 1.0) or 1.0)
    if partial != 1.0 or r.get("partial_rotary_factor", 1.0) != 1.0:
        raise r.refuse(
            key, "a partial rotary factor is not supported natively: use --model-impl transformers"
        )
    top = r.get("original_max_position_embeddings")  # Phi-3 keeps it beside rope_scaling
    orig = params.get("original_max_position_embeddings") or top
    factor = params.get("factor")
    if factor is None and kind in ("yarn", "longrope") and orig:
        factor = max_positions / int(orig)
    spec = RopeSpec(
        rope_type=kind,
        theta=float(params["rope_theta"]),
        factor=float(factor if factor is not None else 1.0),
        original_max_position_embeddings=int(orig or (max_positions if kind != "default" else 0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=None
        if params.get("attention_factor") is None
        else float(params["attention_factor"]),
        truncate=bool(params.get("truncate", True)),
        short_factor=tuple(float(x) for x in params.get("short_factor") or ()),
        long_factor=tuple(float(x) for x in params.get("long_factor") or ()),
        freq_factors=tuple(float(x) for x in params.get("freq_factors") or ()),
    )
    if kind in ("linear", "dynamic", "yarn", "llama3") and not math.isfinite(spec.factor):
        raise r.refuse(key, "the scaling factor is not a number")
    return spec
