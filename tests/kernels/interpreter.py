"""The kernel tests' set-up on a machine without a GPU: importing this module first sets
TRITON_INTERPRET=1 (tests/conftest.py does too; this covers running a module without that
conftest) and checks that triton was not imported before it, so the Triton kernels run in
Triton's interpreter on CPU tensors. With a GPU nothing changes (``HAS_CUDA``)."""

from __future__ import annotations

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton.language as tl  # noqa: E402

if not HAS_CUDA and type(tl.cdiv).__name__ != "InterpretedFunction":
    raise RuntimeError(
        "triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot run on "
        "this GPU-less machine: set TRITON_INTERPRET=1 before triton is first imported"
    )
