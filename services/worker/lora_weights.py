"""LoRA adapter weights for the worker: a PEFT directory read and checked against the model
(``load_adapter``: every tensor's layer, projection and shape, the rank against
``--max-lora-rank``; a LoRAError names what is wrong), fused as the model fuses its projections:
one (A, B) pair per group, ``qkv`` (q, k and v: A stacked by rows, B block-diagonal), ``o``,
``gate_up`` (gate and up, the same way) and ``down``, PEFT's scale folded into B
(``LoRAWeights``; services/worker/lora.py applies them)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from kvflow.shared.lora import ADAPTER_WEIGHTS, LoRAError, check_rank, read_adapter_config
from kvflow.shared.messages import LoRARef
from kvflow.shared.models.config import ModelConfig
from kvflow.shared.models.registry import family

GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each adaptable projection of a Llama layer."""
    q, kv, h, i = (
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.hidden_size,
        (cfg.intermediate_size),
    )
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


class AdapterShard(Protocol):
    """A tensor-parallel rank's part of every adapter (services/worker/tensor_parallel.py
    ``LoRAShard``): each projection's (in, out) features on the rank, and how a pair is cut."""

    shapes: dict[str, tuple[int, int]]

    def cut(self, module: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]: ...


@dataclass
class LoRAWeights:
    """One adapter's fused pairs: ``layers[i][group] = (A [R, in], B [out, R])`` (B scaled);
    a group the adapter leaves alone is absent."""

    ref: LoRARef
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]
    # per layer and group: each projection's rank (0: not adapted), in GROUPS' order, and out
    # features: where its block sits in A's rows and B's rows and columns
    blocks: list[dict[str, tuple[tuple[int, int], ...]]] = field(default_factory=list)


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    st, bin_ = (path / w for w in ADAPTER_WEIGHTS)
    try:
        if st.is_file():
            from safetensors.torch import load_file

            return load_file(str(st))
        return torch.load(str(bin_), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the adapter's fault
        raise LoRAError(f"{path}: the adapter's weights cannot be read: {e}", "lora_path") from e


def load_adapter(
    ref: LoRARef,
    cfg: ModelConfig,
    max_rank: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    shard: AdapterShard | None = None,
) -> LoRAWeights:
    """Read ``ref``'s PEFT directory and check every tensor against the model ``cfg``; raises
    LoRAError naming what is wrong (and nothing is kept). ``shard``: keep a tensor-parallel
    rank's part (``cfg`` is then the whole model)."""
    refused = family(cfg.family).refusal(lora=True)
    if refused:
        raise LoRAError(f"{ref.path}: {refused}", "lora_path")
    conf = read_adapter_config(ref.path)
    tensors = _read_tensors(Path(ref.path))
    shapes = module_shapes(cfg)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in shapes:
            raise LoRAError(
                f"{ref.path}: tensor {key!r} adapts something other than the attention and "
                "MLP projections of a Llama layer (not served)",
                "lora_path",
            )
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if layer >= cfg.num_layers:
            raise LoRAError(
                f"{ref.path}: {key!r} is for layer {layer}; the model has {cfg.num_layers}",
                "lora_path",
            )
        found.setdefault((layer, module), {})[ab] = t
    if not found:
        raise LoRAError(f"{ref.path}: the adapter holds no LoRA weights", "lora_path")
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), ab in found.items():
        a, b = ab.get("A"), ab.get("B")
        n_in, n_out = shapes[module]
        r = a.shape[0] if a is not None and a.dim() == 2 else -1
        if a is None or b is None or tuple(a.shape) != (r, n_in) or tuple(b.shape) != (n_out, r):
            got = {k: tuple(v.shape) for k, v in ab.items()}
            raise LoRAError(
                f"{ref.path}: layer {layer} {module}: lora_A/lora_B shapes {got} do not fit the "
                f"model (want A [r, {n_in}], B [{n_out}, r]): an adapter for another model?",
                "lora_path",
            )
        check_rank(r, max_rank, ref.name)
        scale = conf.scaling(r)
        pairs[(layer, module)] = (a.float(), b.float() * scale)
    if shard is not None:
        pairs = {(i, m): shard.cut(m, a, b) for (i, m), (a, b) in pairs.items()}
        shapes = shard.shapes
    layers = [_fuse(pairs, i, shapes, dtype, device) for i in range(cfg.num_layers)]
    blocks = [
        {
            g: tuple(
                (pairs[(i, m)][0].shape[0] if (i, m) in pairs else 0, shapes[m][1]) for m in mods
            )
            for g, mods in GROUPS.items()
            if g in layers[i]
        }
        for i in range(cfg.num_layers)
    ]
    return LoRAWeights(ref, layers, blocks)


def _fuse(
    pairs: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
    layer: int,
    shapes: Mapping[str, tuple[int, int]],
    dtype: torch.dtype,
    device: torch.device | str,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Layer ``layer``'s pairs fused by group: A stacked, B block-diagonal."""
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for group, modules in GROUPS.items():
        if not any((layer, m) in pairs for m in modules):
            continue
        n_in = shapes[modules[0]][0]
        ranks = [pairs[(layer, m)][0].shape[0] if (layer, m) in pairs else 0 for m in modules]
        outs = [shapes[m][1] for m in modules]
        a = torch.zeros(sum(ranks), n_in)
        b = torch.zeros(sum(outs), sum(ranks))
        r0 = o0 = 0
        for m, r, n in zip(modules, ranks, outs, strict=True):
            if r:
                a[r0 : r0 + r] = pairs[(layer, m)][0]
                b[o0 : o0 + n, r0 : r0 + r] = pairs[(layer, m)][1]
            r0, o0 = r0 + r, o0 + n
        out[group] = (a.to(device, dtype), b.to(device, dtype))
    return out
