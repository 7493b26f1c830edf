"""GPTQ and AWQ 4-bit checkpoints (HF directories with a ``quantization_config``): which method
a checkpoint is quantized with, refused when kvflow cannot read it, from config.json alone
(torch-free: the worker's check of ``--quantization`` reads it before loading). The worker reads
their packed tensors into the CPU kernel's blocks (services/worker/gptq_awq.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

METHODS = ("gptq", "awq")


def checkpoint_method(path: Path) -> str:
    """``"gptq"`` or ``"awq"`` for an HF directory whose config.json says so, else ``""``;
    ValueError for a quantized checkpoint kvflow cannot read (another method, not 4-bit)."""
    cfg = path / "config.json"
    if not cfg.is_file():
        return ""
    q = json.loads(cfg.read_text()).get("quantization_config") or {}
    method = str(q.get("quant_method", "")).lower()
    if not method:
        return ""
    if method not in METHODS:
        raise ValueError(f"{path}: quant_method {method!r} is not supported (gptq, awq 4-bit)")
    if int(q.get("bits", 4)) != 4:
        raise ValueError(f"{path}: {method} with {q.get('bits')} bits is not supported (4 only)")
    if method == "awq" and str(q.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"{path}: AWQ version {q.get('version')!r} is not supported (gemm)")
    return method


def quantization_config(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text()).get("quantization_config") or {}
