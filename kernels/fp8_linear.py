"""FP8 linear weights for the device path (``--quantization fp8``, as vLLM's dynamic fp8): each
weight rounded at load to float8 e4m3 with one fp32 scale per output channel, each call's
activations rounded to e4m3 with one scale per token (dynamic: from that row's absolute
maximum), and the product taken by ``torch._scaled_mm`` (cuBLASLt's fp8 GEMM on CUDA, which
needs compute capability 8.9: Ada or Hopper), rescaled to the activations' dtype.

Weights take half the bytes of bf16 and the GEMM runs at the tensor cores' fp8 rate. Rounding
both operands to 3 mantissa bits costs accuracy (``kvflow bench quality`` measures it); the
lm_head and the embedding stay in the model's dtype, as in vLLM.

torch also runs ``_scaled_mm`` on the CPU, but as a slow fallback (3-28x slower than an fp32
GEMM on this project's machine), so the CPU path refuses fp8 (services/worker/runner.py) and the
CPU runs of this module are the tests'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
_MIN_SCALE = 1e-12  # an all-zero row keeps a finite scale


def fp8_supported(device: torch.device) -> bool:
    """Whether ``device`` has fp8 GEMMs: CUDA with compute capability >= 8.9."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [R, K] as e4m3 [R, K] and fp32 scales [R, 1] with ``x ~= q * scale`` (one scale per
    row, from the row's absolute maximum)."""
    scale = x.abs().amax(dim=1, keepdim=True).float().clamp(min=_MIN_SCALE) / FP8_MAX
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


@dataclass(eq=False)
class Fp8Weight:
    """An [N, K] linear weight in e4m3 with per-output-channel scales; ``w(x) == x @ W.T`` (the
    ``kernels.reference.Weight`` protocol), activations quantized per token on the fly."""

    q: torch.Tensor  # e4m3 [N, K], row-major (so q.t() is the column-major operand cuBLASLt wants)
    scale: torch.Tensor  # fp32 [1, N]
    shape: tuple[int, int]

    @classmethod
    def quantize(cls, w: torch.Tensor) -> Fp8Weight:
        """Round a dense weight (any float dtype, any device) to e4m3 per output channel."""
        if w.dim() != 2 or w.shape[1] % 16 or w.shape[0] % 16:
            raise ValueError(f"fp8 weights need both dims multiples of 16, got {tuple(w.shape)}")
        q, scale = quantize_rows(w)
        return cls(q.contiguous(), scale.view(1, -1).contiguous(), (w.shape[0], w.shape[1]))

    @staticmethod
    def cat(parts: list[Fp8Weight]) -> Fp8Weight:
        """Outputs stacked (fused QKV or gate/up): each row keeps its own scale."""
        q = torch.cat([p.q for p in parts])
        scale = torch.cat([p.scale for p in parts], dim=1)
        return Fp8Weight(q, scale, (q.shape[0], parts[0].shape[1]))

    def to(self, device: torch.device | str) -> Fp8Weight:
        return Fp8Weight(self.q.to(device), self.scale.to(device), self.shape)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 4

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the GEMM computes with, as ``dtype`` [N, K]."""
        return (self.q.float() * self.scale.view(-1, 1)).to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.shape[1]:
            raise ValueError(f"x must be [M, {self.shape[1]}], got {tuple(x.shape)}")
        if x.shape[0] == 0:
            return x.new_empty(0, self.shape[0])
        xq, xs = quantize_rows(x)
        # cuBLASLt's row-wise scaled fp8 GEMM writes bf16; the CPU fallback writes any dtype
        out = x.dtype if x.device.type == "cpu" else torch.bfloat16
        y = torch._scaled_mm(xq, self.q.t(), scale_a=xs, scale_b=self.scale, out_dtype=out)
        return y.to(x.dtype)


def quantize_fp8(weights: dict[str, object], linear_names: frozenset[str]) -> dict[str, object]:
    """``--quantization fp8``: every dense weight whose module name (``...mlp.up_proj.weight`` ->
    ``up_proj``) is in ``linear_names`` as an Fp8Weight; the rest (norms, embedding, lm_head)
    unchanged."""
    out = dict(weights)
    for name, w in weights.items():
        parts = name.split(".")
        if isinstance(w, torch.Tensor) and len(parts) > 1 and parts[-2] in linear_names:
            out[name] = Fp8Weight.quantize(w)
    return out
