"""Random but well-formed GGUF blocks of the types gguf-py cannot quantize to (the K-quants),
and of Q5_0/Q5_1: every byte random except the fp16 scales (and mins), set to small finite
values, so any pattern of integers and sub-block scales a quantizer could write is covered."""

from __future__ import annotations

import numpy as np
import torch

from kvflow.kernels.cpu_quant import BLOCK_BYTES, BLOCK_WEIGHTS, QuantWeight

UNIT_TYPES = {"Q5_0": 6, "Q5_1": 7, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
_FP16_AT = {6: (0,), 7: (0, 2), 12: (0, 2), 13: (0, 2), 14: (208,)}  # byte offsets of fp16s
# the super-block scale's range: weights of about a trained layer's size (|w| <~ 0.5) once the
# 6-bit (K-quants) or int8 (Q6_K) sub-block scales multiply it
_SCALE = {6: 0.02, 7: 0.02, 12: 0.0005, 13: 0.0003, 14: 0.0001}


def random_blocks(qtype: int, n: int, k: int, seed: int = 0) -> QuantWeight:
    """An [n, k] weight of ``qtype`` blocks."""
    scale = _SCALE[qtype]
    rng = np.random.default_rng(seed)
    bb, nb = BLOCK_BYTES[qtype], k // BLOCK_WEIGHTS[qtype]
    raw = rng.integers(0, 256, (n, nb, bb), dtype=np.uint8)
    for at in _FP16_AT[qtype]:
        d = rng.uniform(-scale, scale, (n, nb)).astype(np.float16)
        raw[:, :, at : at + 2] = d.view(np.uint8).reshape(n, nb, 2)
    return QuantWeight(torch.from_numpy(raw.reshape(n, nb * bb)), qtype, (n, k))
