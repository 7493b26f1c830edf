"""What the kernel tests share. Importing this module first sets TRITON_INTERPRET=1 on a machine
without a GPU (tests/conftest.py does too; this covers running a module without that conftest)
and checks that triton was not imported before it, so the Triton kernels run in Triton's
interpreter on CPU tensors; with a GPU nothing changes (``HAS_CUDA``). Also the tolerances per
dtype and the tensor helpers of the kernel-against-reference comparisons."""

from __future__ import annotations

import os
import random

import torch
import triton.language as tl  # noqa: E402

from kvflow.kernels import reference as K

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


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


D = 16


BS = 5  # block size deliberately not a power of two


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0, softcap: float = 0.0
) -> torch.Tensor:
    """q [nq, H, D] are the last nq of the nk positions in k/v [nk, Hkv, D]; fp64, dense. With
    ``window``, query position i sees keys ``i - window < j <= i`` only (HF's semantics); with
    ``softcap``, scores become ``softcap * tanh(score / softcap)`` before the mask."""
    nq, h, _ = q.shape
    nk, hkv, _ = k.shape
    rep = h // hkv
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * D**-0.5
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    kpos, qpos = torch.arange(nk)[None, :], torch.arange(nk - nq, nk)[:, None]
    allowed = kpos <= qpos
    if window:
        allowed &= kpos > qpos - window
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v).float()


def run_paged(
    seqs: list[tuple[int, int]],
    h: int,
    hkv: int,
    seed: int = 0,
    kv_chunk: int = 128,
    decode_fn: K.DecodeFn | None = None,
    window: int = 0,
    softcap: float = 0.0,
    q_gain: float = 1.0,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Write K/V of sequences (seq_len, query_len) into a paged cache through shuffled block
    tables, run paged_attention (decode rows through ``decode_fn`` when given) with ``window``
    and ``softcap``, and return it with the naive answers. ``q_gain`` scales the queries (large
    scores, for soft-capping to bite)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // BS) for n, _ in seqs) + 3
    kc, vc = torch.zeros(num_blocks, BS, hkv, D), torch.zeros(num_blocks, BS, hkv, D)
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    tables, qs, refs = [], [], []
    for n, nq in seqs:
        table = [free.pop() for _ in range(-(-n // BS))]
        k, v = torch.randn(n, hkv, D, generator=g), torch.randn(n, hkv, D, generator=g)
        slots = K.context_slots(torch.tensor(table), n, BS)
        K.write_kv_cache(k, v, kc, vc, slots)
        q = torch.randn(nq, h, D, generator=g) * q_gain
        tables.append(table)
        qs.append(q)
        refs.append(naive_attention(q, k, v, window, softcap))
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [-1] * (width - len(t)) for t in tables])
    seq_lens = torch.tensor([n for n, _ in seqs])
    query_lens = torch.tensor([nq for _, nq in seqs])
    plan = K.plan_attention(bt, seq_lens, query_lens, BS, kv_chunk, decode_fn=decode_fn)
    out = K.paged_attention(
        torch.cat(qs), kc, vc, None, None, None, D**-0.5, plan=plan, window=window, softcap=softcap
    )
    return out, refs


CASES = {
    "context_of_one": [(1, 1)],
    "prefill_odd_lengths": [(7, 7), (13, 13), (1, 1)],
    "chunked_prefill_on_cached_prefix": [(23, 9), (11, 4)],
    "decode_mixed_lengths": [(1, 1), (4, 1), (5, 1), (17, 1), (301, 1), (42, 1)],
    "mixed_batch": [(30, 1), (12, 12), (9, 1), (40, 15), (2, 1)],
    "decodes_then_prefills": [(30, 1), (9, 1), (2, 1), (12, 12), (40, 15)],  # the scheduler's order
}


# (window, softcap): windows of one key, shorter than every context, longer than some (42 of
# 301 keys spans chunk boundaries), longer than all; soft-capping alone and with a window
WINDOW_SOFTCAP = [(1, 0.0), (3, 0.0), (8, 0.0), (42, 0.0), (1000, 0.0), (0, 2.0), (5, 1.5)]
