"""``Family``: what a family file (shared/models/families/) declares: the architectures and
model types it serves, how its config.json becomes a ``ModelConfig`` (``read``), the names of
its layers' norms in its checkpoints, how fused checkpoint tensors are cut into kvflow's
projections (``split``), and what a GGUF file of it needs (its llama.cpp architecture names,
whether llama.cpp permuted Q/K rows, whether it stored norms as ``1 + w``).

Linear weights always carry Hugging Face Llama's names (``self_attn.q_proj``, ...,
``mlp.down_proj``, with ``.bias`` where a family has one): tensor parallelism, LoRA and
quantization find them by those names for every family."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvflow.shared.models.config import ConfigReader

NORM_ROLES = ("attn_norm", "attn_out_norm", "mlp_norm", "mlp_out_norm", "q_norm", "k_norm")
"""A layer's norms by role: before attention, after it, before the MLP, after it, and the q/k
norms (services/worker/model.py runs the ones a family has)."""

LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    read: Callable[[ConfigReader], dict[str, Any]]  # family fields of ModelConfig
    norms: dict[str, str]  # role (NORM_ROLES) -> checkpoint name within a layer
    gguf_archs: tuple[str, ...] = ()
    gguf_permute_qk: bool = False  # llama.cpp's convert permuted Q/K rows (llama-style)
    gguf_norm_offset: float = 0.0  # llama.cpp stored norm weights as offset + w (Gemma)
    split: Callable[[dict[str, Any], Any], dict[str, Any]] | None = None  # fused -> Llama names
    ignored: frozenset[str] = field(default_factory=frozenset)  # fields with no effect here

    def layer_weight_names(self, cfg: Any, layer: int = 0) -> list[str]:
        """The names of layer ``layer``'s tensors (suffixes after ``model.layers.N.``) that
        ``cfg`` needs: an MoE layer has a router (``mlp.gate``) and experts
        (``mlp.experts.E.gate_proj`` ...; a shared expert and its gate where the family has
        them) in place of the MLP's projections."""
        mlp = ("gate", "up", "down") if cfg.gated_mlp else ("up", "down")
        names = [f"{n}.weight" for n in LINEARS if cfg.gated_mlp or n != "mlp.gate_proj"]
        if cfg.is_moe(layer):
            names = [n for n in names if not n.startswith("mlp.")] + ["mlp.gate.weight"]
            names += [
                f"mlp.experts.{e}.{p}_proj.weight"
                for e in range(cfg.num_experts)
                for p in ("gate", "up", "down")
            ]
            if cfg.shared_expert_size:
                names += [f"mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")]
                names.append("mlp.shared_expert_gate.weight")
        if cfg.qkv_bias:
            names += [f"self_attn.{p}_proj.bias" for p in "qkv"]
        if cfg.o_bias:
            names.append("self_attn.o_proj.bias")
        if cfg.mlp_bias:
            names += [f"mlp.{p}_proj.bias" for p in mlp]
        for role, name in self.norms.items():
            if role in ("q_norm", "k_norm") and not cfg.qk_norm:
                continue
            names.append(f"{name}.weight")
            if cfg.norm_kind == "layer":
                names.append(f"{name}.bias")
        return names


LLAMA_NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
QK_NORMS = {"q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
