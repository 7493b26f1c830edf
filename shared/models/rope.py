"""Rotary embeddings with their scalings, computed exactly as Hugging Face transformers computes
them (modeling_rope_utils.py), so a scaled model's rotations have the same bits as there:
``inv_freq`` (and the factor cos/sin are multiplied by) per ``RopeSpec``, and ``cos_sin_table``,
the ``[rows, head_dim]`` cos | sin table the kernels index.

Length-dependent scaling: longrope uses its short factors while a sequence is within
``original_max_position_embeddings`` and its long factors past it. transformers decides per
forward pass from the longest position in it: a prompt's tokens by the prompt's length, each
generated token by its own position + 1. kvflow decides per token by the same rule,
``max(position + 1, prompt length)``, so chunked prefill, prefix hits and recomputation after
a preemption rotate every token as transformers' ``generate`` did, whatever the batch. The
table holds the short rows, then the long rows; a long token's row is its position plus
``max_positions`` (``rope_rows``). ``dynamic`` (NTK) changes nothing up to ``max_position_embeddings`` in
transformers, and kvflow serves no position past it, so it is the default rotation here.
"""

from __future__ import annotations

import math

import torch

from kvflow.shared.models.config import RopeSpec


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))


def _yarn(spec: RopeSpec, dim: int) -> tuple[torch.Tensor, float]:
    factor, base = spec.factor, spec.theta

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention = spec.attention_factor
    if attention is None:
        if spec.mscale and spec.mscale_all_dim:
            attention = get_mscale(factor, spec.mscale) / get_mscale(factor, spec.mscale_all_dim)
        else:
            attention = get_mscale(factor)

    def correction_dim(rotations: float) -> float:
        orig = spec.original_max_position_embeddings
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention)


def _llama3(spec: RopeSpec, dim: int) -> torch.Tensor:
    inv_freq = _base_inv_freq(spec.theta, dim)
    factor, low, high = spec.factor, spec.low_freq_factor, spec.high_freq_factor
    old = spec.original_max_position_embeddings
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _longrope(spec: RopeSpec, dim: int, long: bool) -> tuple[torch.Tensor, float]:
    orig = spec.original_max_position_embeddings
    attention = spec.attention_factor
    if attention is None:
        f = spec.factor
        attention = 1.0 if f <= 1.0 else math.sqrt(1 + math.log(f) / math.log(orig))
    ext = torch.tensor(spec.long_factor if long else spec.short_factor, dtype=torch.float32)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * spec.theta**shape), float(attention)


def inv_freq(spec: RopeSpec, head_dim: int, long: bool = False) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2], the factor cos and sin are multiplied by)."""
    kind = spec.rope_type
    if kind == "linear":
        return _base_inv_freq(spec.theta, head_dim) / spec.factor, 1.0
    if kind == "yarn":
        return _yarn(spec, head_dim)
    if kind == "llama3":
        return _llama3(spec, head_dim), 1.0
    if kind == "longrope":
        return _longrope(spec, head_dim, long)
    freq = _base_inv_freq(spec.theta, head_dim)  # default, dynamic
    if spec.freq_factors:  # llama.cpp's rope_freqs (Llama 3.1+ GGUFs): theta / factor
        freq = freq / torch.tensor(spec.freq_factors, dtype=torch.float32)
    return freq, 1.0


def _table(freq: torch.Tensor, attention: float, max_positions: int) -> torch.Tensor:
    """cos | sin of ``position * freq`` (fp32, one multiply each, as transformers' outer
    product), times ``attention`` when it is not 1."""
    freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    if attention != 1.0:
        cos, sin = cos * attention, sin * attention
    return torch.cat([cos, sin], dim=-1)


def cos_sin_table(
    spec: RopeSpec, head_dim: int, max_positions: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The cos | sin rows the rotary kernels index: ``[max_positions, head_dim]``, or for a
    length-dependent spec the short rows then the long rows (``[2 * max_positions, ...]``)."""
    freq, attention = inv_freq(spec, head_dim)
    table = _table(freq, attention, max_positions)
    if spec.length_dependent:
        freq, attention = inv_freq(spec, head_dim, long=True)
        table = torch.cat([table, _table(freq, attention, max_positions)])
    return table.to(dtype)


def rope_rows(
    spec: RopeSpec, positions: torch.Tensor, prompt_lens: torch.Tensor, max_positions: int
) -> torch.Tensor:
    """Each token's row of ``cos_sin_table``: its position, moved to the long rows when
    ``max(position + 1, its sequence's prompt length)`` is past the original length."""
    if not spec.length_dependent:
        return positions
    length = torch.maximum(positions + 1, prompt_lens.to(positions.dtype))
    long = length > spec.original_max_position_embeddings
    return positions + long.to(positions.dtype) * max_positions
