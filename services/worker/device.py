"""Where the worker's model runs and in which dtype and kernel backend: the ``--device`` and
``--dtype`` settings turned into torch values.

- ``--device auto`` (the default) is ``cuda`` when torch sees a GPU, else ``cpu``; ``cuda`` or
  ``cuda:N`` without a GPU is an error rather than a silent fall back to the CPU.
- ``--dtype auto`` (the default) is bfloat16 on CUDA and float32 on the CPU (the CPU path's
  exactness, batch invariance and fast kernels are fp32). ``--dtype bfloat16`` on the CPU runs
  the dense linear layers through oneDNN's bf16 GEMM (kernels/cpu_gemm.py ``Bf16Weight``) and
  keeps the rest in fp32 (the lm_head in bf16 panels with fp32 sums where the linear layers
  use them, else fp32: kernels/cpu_gemm.py ``head_packing``); float16 is refused there.
- The kernel backend follows the device: the Triton kernels (kernels/ops.py ``"triton"``) on
  CUDA, in any dtype (bf16/fp16 for serving; fp32 works, with full-precision dots), and the CPU
  path (kernels/reference.py with the native C decode attention, oneDNN-packed GEMMs and
  calibrated batch invariance) on the CPU.
"""

from __future__ import annotations

import torch

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_device(name: str) -> torch.device:
    """``auto`` | ``cpu`` | ``cuda`` | ``cuda:N`` -> a torch device (``auto``: CUDA if any)."""
    name = (name or "auto").strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"unknown device {name!r} (expected auto, cpu, cuda or cuda:N)") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {name!r} asked for, but torch sees no CUDA GPU (torch "
                f"{torch.__version__}; a CPU-only build has '+cpu' in its version)"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} GPU(s) visible")
    elif dev.type != "cpu":
        raise ValueError(f"device {name!r} is not supported (cpu or cuda)")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` (bfloat16 on CUDA, float32 on CPU) or a dtype name (float32, bfloat16, float16
    and their short forms)."""
    name = (name or "auto").strip().lower().removeprefix("torch.")
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r} (expected auto, {', '.join(DTYPES)})")
    return DTYPES[name]


def kernel_backend(device: torch.device) -> str:
    """The kernel backend the worker runs on ``device``: ``"triton"`` on CUDA, ``"reference"``
    (the CPU path) on the CPU."""
    if device.type == "cuda":
        return "triton"
    if device.type == "cpu":
        return "reference"
    raise ValueError(f"no kernel backend for device {device}")
