"""``Family``: everything kvflow knows of one model family, declared in its file
(shared/models/families/): the architectures and model types it serves, how its config.json
becomes a config (``read``, into ``config``: ``ModelConfig`` or a kind's own subclass of it),
which of the worker's model kinds runs it (``kind``) and what that serves, the names of its
layers' norms and of the checkpoint tensors it names otherwise than Llama (cut into kvflow's
projections by ``split``), what it cannot be served with (``no_tensor_parallel``, ``no_lora``:
refused before anything starts), and what a GGUF file of it needs (``Gguf``).

Linear weights always carry Hugging Face Llama's names (``self_attn.q_proj``, ...,
``mlp.down_proj``, with ``.bias`` where a family has one): tensor parallelism, LoRA and
quantization find them by those names for every family."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvflow.shared.models.config import ConfigReader, ModelConfig

if TYPE_CHECKING:
    from kvflow.shared.gguf_header import GGUFHeader

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
class GgufFile:
    """A GGUF file's header as a family's ``Gguf.config`` hook reads it."""

    header: GGUFHeader
    arch: str  # general.architecture: the prefix of the model's own keys

    def get(self, key: str, default: Any = None) -> Any:
        """The model key ``{arch}.{key}`` (``default`` when absent)."""
        return self.header.fields.get(f"{self.arch}.{key}", default)

    def first(self, key: str, default: Any = None) -> int:
        """A number, or the first of a per-layer array (some GGUFs list e.g. widths per layer)."""
        x = self.get(key, default)
        return int(x[0]) if isinstance(x, list) else int(x)

    def has(self, tensor: str) -> bool:
        return tensor in self.header.tensors


@dataclass(frozen=True)
class Gguf:
    """What a GGUF file of a family needs (shared/models/gguf_config.py reads its header as the
    config.json the family reads; services/worker/gguf_weights.py its tensors)."""

    archs: tuple[str, ...]  # general.architecture values of its files
    experts: bool = False  # its files hold experts ({arch}.expert_count): Mixtral's is a llama
    permute_qk: bool = False  # llama.cpp's convert permuted Q/K rows (llama-style)
    norm_offset: float = 0.0  # llama.cpp stored norm weights as offset + w (Gemma)
    eot_text: str = ""  # the end-of-turn token's text, a stop token where the file names none
    # config.json fields llama.cpp hardcodes for it, or writes under keys of its own: merged
    # over the mapping every family shares (a None value drops the field)
    config: Callable[[GgufFile, dict[str, Any]], dict[str, Any]] | None = None


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    read: Callable[[ConfigReader], dict[str, Any]]  # its fields of ``config``
    norms: dict[str, str]  # role (NORM_ROLES) -> checkpoint name within a layer
    gguf: Gguf | None = None  # None: no GGUF of it is read
    split: Callable[[dict[str, Any], Any], dict[str, Any]] | None = None  # fused -> Llama names
    # layer tensors its checkpoints name otherwise than Llama's projections (``split`` cuts or
    # renames them): looked up first in a GGUF's name table
    checkpoint_names: tuple[str, ...] = ()
    checkpoint_prefix: str = ""  # before every tensor name in a head model's checkpoint
    ignored: frozenset[str] = field(default_factory=frozenset)  # fields with no effect here
    config: type[ModelConfig] = ModelConfig
    kind: str = "decoder"  # the worker's model kind that runs it (services/worker/model_kinds.py)
    # attends both ways over each whole input (an encoder): served for pooling tasks only, by
    # default pooling the first token, and takes text pairs (shared/models/tasks.py)
    bidirectional: bool = False
    no_tensor_parallel: str = ""  # why --tensor-parallel-size > 1 is refused ("": served)
    no_lora: str = ""  # why --enable-lora is refused ("": served)

    def refusal(self, tensor_parallel: bool = False, lora: bool = False) -> str:
        """Why a model of this family cannot be served with tensor parallelism or LoRA
        adapters as asked ("" when it can)."""
        if tensor_parallel and self.no_tensor_parallel:
            return (
                f"--tensor-parallel-size > 1 is not served {self.no_tensor_parallel} ({self.name})"
            )
        if lora and self.no_lora:
            return f"--enable-lora is not served {self.no_lora} ({self.name})"
        return ""

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
