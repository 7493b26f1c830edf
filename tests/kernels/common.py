"""What the kernel tests share. Importing this module first sets TRITON_INTERPRET=1 on a machine
without a GPU (tests/conftest.py does too; this covers running a module without that conftest)
and checks that triton was not imported before it, so the Triton kernels run in Triton's
interpreter on CPU tensors; with a GPU nothing changes (``HAS_CUDA``). Also the tolerances per
dtype and the tensor helpers of the kernel-against-reference comparisons."""

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


TOL = {
    torch.float32: (2e-5, 1e-4),
    torch.bfloat16: (3e-2, 2e-2),
    torch.float16: (4e-3, 4e-3),
}


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)


def f32(x: torch.Tensor) -> torch.Tensor:
    """The same (already rounded) values in fp32 on the CPU, where the reference runs."""
    return x.detach().float().cpu()


def randn(*shape: int, dtype: torch.dtype, device: str, g: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
