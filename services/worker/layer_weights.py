"""A layer's weights as the worker's models hold them: one dataclass per kind of layer with typed
fields (``DecoderLayer``: attention, a dense MLP or a mixture of experts, and the norms a family
has; ``EncoderLayer``: a BERT block; ``ClassifierHead``: a sequence classifier over pooled
vectors), and how they are made and packed alike for every kind: projections fused by output
rows (``fuse``: Q/K/V and gate/up in one GEMM each, as in vLLM; quantized weights stay
quantized), biases with them (``cat_bias``), and the CPU path's packing (``packer``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch

from kvflow.kernels import cpu_quant_tiles
from kvflow.kernels import reference as K
from kvflow.kernels.cpu_gemm import linear_packing
from kvflow.kernels.cpu_quant import QuantWeight
from kvflow.kernels.moe import MoEWeights
from kvflow.kernels.stacked_weight import StackedWeight

Linear = torch.Tensor | K.Weight
"""A projection's weight [N, K]: dense, packed for the CPU (kernels/cpu_gemm.py), in quantized
blocks (kernels/cpu_quant.py, triton_quant.py, fp8_linear.py) or a stack of such."""

Norm = torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]
"""A norm's scale as the kernels multiply by it (RMSNorm), or LayerNorm's (weight, bias)."""


class Weights:
    """Iteration over a layer's weights (each field that holds one), for what walks them all
    (the weights' bytes: model_setup.weight_bytes)."""

    __slots__ = ()

    def weights(self) -> Iterator[Any]:
        for f in fields(self):  # type: ignore[arg-type]
            w = getattr(self, f.name)
            if w is not None:
                yield w


@dataclass(slots=True)
class DecoderLayer(Weights):
    """One decoder layer (services/worker/model.py): fused q | k | v and the output projection,
    then either a dense MLP (fused gate | up, or up alone where the MLP is not gated, and down)
    or a mixture of experts (``moe``), with the biases and norms its family has (None where it
    has none)."""

    qkv: Linear
    o: Linear
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    gate_up: Linear | None = None  # None: an MoE layer
    gate_up_bias: torch.Tensor | None = None
    down: Linear | None = None
    down_bias: torch.Tensor | None = None
    moe: MoEWeights | None = None
    attn_norm: Norm | None = None  # before attention
    attn_out_norm: Norm | None = None  # after it
    mlp_norm: Norm | None = None  # before the MLP
    mlp_out_norm: Norm | None = None  # after it
    q_norm: Norm | None = None
    k_norm: Norm | None = None

    def pack(self, pack: Callable[[Any], Any]) -> None:
        """Every projection as ``pack`` makes it (an MoE layer's router and experts too)."""
        self.qkv, self.o = pack(self.qkv), pack(self.o)
        if self.gate_up is not None:
            self.gate_up = pack(self.gate_up)
        if self.down is not None:
            self.down = pack(self.down)
        m = self.moe
        if m is not None:
            m.gate_up = [pack(w) for w in m.gate_up]
            m.down = [pack(w) for w in m.down]
            for name in ("router", "shared_gate_up", "shared_down", "shared_gate"):
                w = getattr(m, name)
                if w is not None:
                    setattr(m, name, pack(w))

    def linears(self) -> list[Any]:
        """Its projections (an MoE layer's router, first expert and shared expert)."""
        ws = [self.qkv, self.o, self.gate_up, self.down]
        m = self.moe
        if m is not None:
            ws += [m.router, m.gate_up[0], m.down[0], m.shared_gate_up, m.shared_down]
            ws.append(m.shared_gate)
        return [w for w in ws if w is not None]


@dataclass(slots=True)
class EncoderLayer(Weights):
    """One BERT block (services/worker/encoder_model.py): fused query | key | value, the output
    projection, LayerNorm after attention, the MLP (up, down) and LayerNorm after it; biases
    everywhere."""

    qkv: Linear
    qkv_bias: torch.Tensor
    o: Linear
    o_bias: torch.Tensor
    attn_norm: tuple[torch.Tensor, torch.Tensor]
    up: Linear
    up_bias: torch.Tensor
    down: Linear
    down_bias: torch.Tensor
    mlp_norm: tuple[torch.Tensor, torch.Tensor]

    def pack(self, pack: Callable[[Any], Any]) -> None:
        self.qkv, self.o = pack(self.qkv), pack(self.o)
        self.up, self.down = pack(self.up), pack(self.down)

    def linears(self) -> list[Any]:
        return [self.qkv, self.o, self.up, self.down]


@dataclass(slots=True)
class ClassifierHead(Weights):
    """A sequence classifier over a pooled vector: ``dense`` + tanh, then ``out`` (the classes)."""

    dense: torch.Tensor
    dense_bias: torch.Tensor
    out: torch.Tensor
    out_bias: torch.Tensor


def fuse(parts: list[Any], dtype: torch.dtype) -> Linear:
    """Linear weights stacked by output rows (fused QKV, gate/up); quantized ones stay
    quantized when they are of one kind (QuantWeight, DeviceQuantWeight, Fp8Weight: each has
    ``cat``): one weight when they share a block type, else a ``StackedWeight`` of the runs
    that do (a Q4_K_M file's Q4_K q/k beside its Q6_K v); a mix of kinds is dequantized to
    ``dtype``."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)
    kind = type(parts[0])
    if all(type(p) is kind for p in parts):
        try:
            return kind.cat(parts)
        except ValueError:
            if hasattr(parts[0], "qtype") or hasattr(parts[0], "type_name"):
                return StackedWeight.of(parts)
    return torch.cat(
        [p if isinstance(p, torch.Tensor) else p.dequantize().to(dtype) for p in parts]
    )


def cat_bias(weights: dict[str, Any], names: list[str]) -> torch.Tensor | None:
    """The biases of ``names`` (fused projections) in one tensor; None without them."""
    got = [weights.get(n) for n in names]
    return None if got[0] is None else torch.cat(got)


def tiled(w: Any) -> Any:
    """Blocks multiplied with int8 activations (``--quantization gguf-a8``, ``w8a8``) as the
    tiled kernel's layout where this CPU runs it (kernels/cpu_quant_tiles.py); anything else
    as it is."""
    if isinstance(w, StackedWeight):
        return StackedWeight([tiled(p) for p in w.parts])
    if isinstance(w, QuantWeight) and w.int8_activations:
        return cpu_quant_tiles.pack(w)
    return w


def packer(dtype: torch.dtype) -> tuple[Callable[[Any], Any], str]:
    """How the CPU path packs a projection for ``dtype`` GEMMs (kernels/cpu_gemm.py
    ``linear_packing``: fp32 in kvflow's panels, batch invariant by construction, or oneDNN's
    layout; bf16 in kvflow's bf16 panels or for oneDNN's bf16 GEMM), quantized blocks as
    ``tiled`` makes them; and the packing's name."""
    dense, name = linear_packing(dtype)

    def pack(w: Any) -> Any:
        return dense(w) if isinstance(w, torch.Tensor) else tiled(w)

    return pack, name
