"""Triton kernels (kernels/triton_*.py, through kernels/ops.py) against the reference backend on
fresh random inputs.

Without a GPU the kernels run on CPU tensors in Triton's interpreter (fp32; TRITON_INTERPRET=1 is
set by tests/conftest.py before anything imports triton). With a GPU they compile natively and run in
bf16 and fp16 on CUDA, checked against the reference computed in fp32 on the CPU from the same
rounded inputs; the interpreter case is then skipped, because one process cannot hold both
forms of a kernel. Shapes are small so the interpreter stays quick: head dims 16-32, a few heads.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from dataclasses import astuple

import pytest
import torch

from tests.helpers.kernels import HAS_CUDA, TOL, close, f32, randn  # first: TRITON_INTERPRET

# isort: split
from kvflow.benchmarks.random_model import LlamaShape, random_llama
from kvflow.kernels.ops import get_backend, select_backend
from kvflow.services.worker.model import DecoderModel
from kvflow.services.worker.step_inputs import DeviceBatch
from tests.helpers.paths import ROOT

REF = get_backend("reference")
TRI = get_backend("triton")

DEVICE_DTYPES = [
    pytest.param(
        "cpu",
        torch.float32,
        id="cpu-fp32-interpreter",
        marks=pytest.mark.skipif(HAS_CUDA, reason="kernels compiled for CUDA in this process"),
    ),
    pytest.param(
        "cuda",
        torch.bfloat16,
        id="cuda-bf16",
        marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU"),
    ),
    pytest.param(
        "cuda",
        torch.float16,
        id="cuda-fp16",
        marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU"),
    ),
]

# (atol, rtol) against the fp32 reference: bf16 keeps 8 mantissa bits, fp16 11


# --------------------------------------------------------------------------------------------
# paged cache fixture


class Paged:
    """A paged KV cache filled with random values (stale slots included, so masking is
    tested), and sequences placed in it through shuffled, non-contiguous block tables."""

    def __init__(
        self,
        seq_lens: list[int],
        h: int,
        hkv: int,
        d: int,
        block_size: int,
        dtype: torch.dtype,
        device: str,
        seed: int,
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        need = [-(-n // block_size) for n in seq_lens]
        num_blocks = sum(need) + 4
        self.k_cache = randn(num_blocks, block_size, hkv, d, dtype=dtype, device=device, g=g)
        self.v_cache = randn(num_blocks, block_size, hkv, d, dtype=dtype, device=device, g=g)
        free = list(range(num_blocks))
        random.Random(seed).shuffle(free)
        width = max(need) + 2
        # a column slice of a wider table: the kernels must honour the row stride
        table = torch.full((len(seq_lens), width + 3), -1, dtype=torch.int32)
        for i, nb in enumerate(need):
            table[i, :nb] = torch.tensor([free.pop() for _ in range(nb)], dtype=torch.int32)
        self.block_tables = table.to(device)[:, :width]
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        self.h, self.hkv, self.d = h, hkv, d
        self.scale = d**-0.5

    def queries(self, t: int, g: torch.Generator) -> torch.Tensor:
        """q [t, H, D] as a strided view into a fused qkv-like buffer, as the model makes it."""
        width = (self.h + 2 * self.hkv) * self.d
        qkv = randn(t, width, dtype=self.k_cache.dtype, device=str(self.k_cache.device), g=g)
        return qkv[:, : self.h * self.d].view(t, self.h, self.d)


# --------------------------------------------------------------------------------------------
# attention


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize(
    "h,hkv,d,block_size,seq_lens,num_splits",
    [
        # GQA 1, one-token context, lengths off the block size, several splits
        (2, 2, 16, 5, [1, 7, 16, 33, 70], 4),
        # GQA 3, head_dim not a power of two, the default split count
        (6, 2, 24, 16, [45, 3, 16, 17], None),
        # GQA 8, block size 1, split-K with several key tiles per split (200 / 2 > 32 keys)
        (8, 1, 32, 1, [200, 9], 2),
        # a single split over everything, GQA 4 with 2 KV heads
        (8, 2, 16, 8, [130, 64, 1], 1),
        # a group of 80 heads per KV head: two head tiles of 64 per program row
        (80, 1, 16, 16, [20, 5], 2),
    ],
)
def test_decode_attention(device, dtype, h, hkv, d, block_size, seq_lens, num_splits):
    g = torch.Generator().manual_seed(len(seq_lens) * 100 + h)
    pc = Paged(seq_lens, h, hkv, d, block_size, dtype, device, seed=h + d)
    q = pc.queries(len(seq_lens), g)
    out = TRI.decode_attention(
        q, pc.k_cache, pc.v_cache, pc.block_tables, pc.seq_lens, pc.scale, num_splits
    )
    ref = REF.decode_attention(
        f32(q), f32(pc.k_cache), f32(pc.v_cache), pc.block_tables.cpu(), pc.seq_lens.cpu(), pc.scale
    )
    assert out.shape == q.shape and out.dtype == dtype
    close(out, ref, dtype)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_decode_attention_split_count_does_not_change_result(device, dtype):
    """Every split count gives the same answer, including more splits than a context has keys
    (empty splits must be skipped by the reduction)."""
    g = torch.Generator().manual_seed(7)
    pc = Paged([3, 40, 97], 4, 2, 16, 16, dtype, device, seed=7)
    q = pc.queries(3, g)
    args = (q, pc.k_cache, pc.v_cache, pc.block_tables, pc.seq_lens, pc.scale)
    base = TRI.decode_attention(*args, 1)
    for splits in (2, 5, 8):
        close(TRI.decode_attention(*args, splits), base, dtype)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize(
    "h,hkv,d,block_size,seq_lens,num_splits,window,softcap",
    [
        # GQA 2; a window across blocks, split 4 ways; contexts shorter than the window
        (4, 2, 16, 5, [1, 7, 33, 70], 4, 8, 0.0),
        # GQA 3, the default split count (sized by the window), window and soft-capping
        (6, 2, 16, 16, [45, 3, 17], None, 20, 2.0),
        # a window of one key: the new token attends only itself
        (4, 4, 16, 4, [40, 9, 1], 3, 1, 0.0),
        # soft-capping alone
        (4, 2, 16, 8, [30, 12], 2, 0, 1.5),
    ],
)
def test_decode_attention_window_and_softcap(
    device, dtype, h, hkv, d, block_size, seq_lens, num_splits, window, softcap
):
    g = torch.Generator().manual_seed(len(seq_lens) * 10 + window)
    pc = Paged(seq_lens, h, hkv, d, block_size, dtype, device, seed=h + window)
    q = pc.queries(len(seq_lens), g) * 3  # scores large enough for soft-capping to bite
    out = TRI.decode_attention(
        q, pc.k_cache, pc.v_cache, pc.block_tables, pc.seq_lens, pc.scale, num_splits,
        window=window, softcap=softcap,
    )  # fmt: skip
    ref = REF.decode_attention(
        f32(q), f32(pc.k_cache), f32(pc.v_cache), pc.block_tables.cpu(), pc.seq_lens.cpu(),
        pc.scale, window=window, softcap=softcap,
    )  # fmt: skip
    assert out.shape == q.shape and out.dtype == dtype
    close(out, ref, dtype)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_windowed_decode_split_count_does_not_change_result(device, dtype):
    """The splits divide the window, so more splits than the window has keys leave empty
    splits, which the reduction must skip by the same test; and block-table entries before
    the window are never read (garbage there changes nothing)."""
    g = torch.Generator().manual_seed(8)
    pc = Paged([3, 40, 97], 4, 2, 16, 8, dtype, device, seed=8)
    q = pc.queries(3, g)
    args = (q, pc.k_cache, pc.v_cache, pc.block_tables, pc.seq_lens, pc.scale)
    base = TRI.decode_attention(*args, 1, window=6)
    for splits in (2, 5, 8):
        close(TRI.decode_attention(*args, splits, window=6), base, dtype)
    tables = pc.block_tables.clone()
    tables[1, :4] = 10**6  # keys 0..31 of the 40; the window starts at key 34
    tables[2, :11] = -(10**6)  # keys 0..87 of the 97; the window starts at key 91
    moved = TRI.decode_attention(*args[:3], tables, *args[4:], 3, window=6)
    close(moved, base, dtype)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_decode_attention_padded_rows_are_zero(device, dtype, backend):
    """Rows with seq_len 0 (a CUDA-graph batch padded to its captured size) give zeros and
    leave the real rows' results unchanged."""
    if backend == "reference" and device == "cuda":
        pytest.skip("the reference backend runs on the CPU")
    ops = get_backend(backend)
    g = torch.Generator().manual_seed(3)
    pc = Paged([9, 1, 20], 4, 1, 16, 4, dtype, device, seed=3)
    q = pc.queries(3, g)
    args = (pc.k_cache, pc.v_cache)
    full = ops.decode_attention(q, *args, pc.block_tables, pc.seq_lens, pc.scale)
    lens = pc.seq_lens.clone()
    lens[1] = 0
    padded = ops.decode_attention(q, *args, pc.block_tables, lens, pc.scale)
    assert torch.count_nonzero(padded[1]) == 0
    torch.testing.assert_close(padded[[0, 2]], full[[0, 2]], atol=0, rtol=0)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize(
    "h,hkv,d,block_size",
    [(2, 2, 16, 5), (6, 2, 24, 16), (8, 1, 32, 3)],
    ids=["gqa1", "gqa3", "gqa8"],
)
def test_extend_attention(device, dtype, h, hkv, d, block_size):
    # (seq_len, query_len): plain prefills (one spans two query tiles), a cached prefix with a
    # short and a long chunk, a one-token row, a chunk that is most of its context
    seqs = [(9, 9), (40, 40), (37, 3), (20, 1), (50, 13), (23, 19)]
    g = torch.Generator().manual_seed(h * 10 + block_size)
    pc = Paged([n for n, _ in seqs], h, hkv, d, block_size, dtype, device, seed=block_size)
    qlens = [nq for _, nq in seqs]
    q = pc.queries(sum(qlens), g)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    out = TRI.extend_attention(
        q,
        pc.k_cache,
        pc.v_cache,
        pc.block_tables,
        pc.seq_lens,
        qsl.to(device),
        max(qlens),
        pc.scale,
    )
    ref = REF.extend_attention(
        f32(q),
        f32(pc.k_cache),
        f32(pc.v_cache),
        pc.block_tables.cpu(),
        pc.seq_lens.cpu(),
        qsl,
        max(qlens),
        pc.scale,
    )
    assert out.shape == q.shape and out.dtype == dtype
    close(out, ref, dtype)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize(
    "h,hkv,window,softcap",
    [(4, 2, 5, 0.0), (6, 2, 0, 2.0), (6, 2, 16, 1.5), (4, 4, 1, 0.0), (4, 2, 100, 0.0)],
    ids=["window5", "softcap", "window16-softcap", "window1", "window-past-all"],
)
def test_extend_attention_window_and_softcap(device, dtype, h, hkv, window, softcap):
    # (seq_len, query_len): a prefill over two query tiles (the second tile's key loop starts
    # inside the context with a window), cached prefixes with short and long chunks, one-token
    # rows, a context shorter than the window
    seqs = [(40, 40), (37, 3), (20, 1), (50, 13), (4, 4)]
    d, block_size = 16, 5
    g = torch.Generator().manual_seed(h * 10 + window)
    pc = Paged([n for n, _ in seqs], h, hkv, d, block_size, dtype, device, seed=window)
    qlens = [nq for _, nq in seqs]
    q = pc.queries(sum(qlens), g) * 3
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    out = TRI.extend_attention(
        q, pc.k_cache, pc.v_cache, pc.block_tables, pc.seq_lens, qsl.to(device), max(qlens),
        pc.scale, window=window, softcap=softcap,
    )  # fmt: skip
    ref = REF.extend_attention(
        f32(q), f32(pc.k_cache), f32(pc.v_cache), pc.block_tables.cpu(), pc.seq_lens.cpu(), qsl,
        max(qlens), pc.scale, window=window, softcap=softcap,
    )  # fmt: skip
    assert out.shape == q.shape and out.dtype == dtype
    close(out, ref, dtype)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_extend_attention_of_one_token_rows_equals_decode(device, dtype):
    g = torch.Generator().manual_seed(11)
    pc = Paged([5, 33, 1], 6, 2, 16, 8, dtype, device, seed=11)
    q = pc.queries(3, g)
    qsl = torch.arange(4, dtype=torch.int32, device=device)
    ext = TRI.extend_attention(
        q, pc.k_cache, pc.v_cache, pc.block_tables, pc.seq_lens, qsl, 1, pc.scale
    )
    dec = TRI.decode_attention(q, pc.k_cache, pc.v_cache, pc.block_tables, pc.seq_lens, pc.scale, 3)
    close(ext, dec, dtype)


# --------------------------------------------------------------------------------------------
# KV cache write


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("hkv,d,block_size", [(2, 16, 5), (3, 24, 16)])
def test_write_kv_cache(device, dtype, hkv, d, block_size):
    g = torch.Generator().manual_seed(hkv * d)
    num_blocks, t = 6, 9
    k_cache = randn(num_blocks, block_size, hkv, d, dtype=dtype, device=device, g=g)
    v_cache = randn(num_blocks, block_size, hkv, d, dtype=dtype, device=device, g=g)
    # k and v as strided views of one fused buffer, like the model's qkv output
    kv = randn(t, 3 * hkv * d, dtype=dtype, device=device, g=g)
    k = kv[:, : hkv * d].view(t, hkv, d)
    v = kv[:, 2 * hkv * d :].view(t, hkv, d)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]
    slots[[1, 4, 8]] = -1  # padded rows
    slots = slots.to(device)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    TRI.write_kv_cache(k, v, k_cache, v_cache, slots)
    k_ref, v_ref = k_before.clone(), v_before.clone()
    REF.write_kv_cache(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)  # a copy: exact
    # only the live rows' slots changed; the padded rows wrote nowhere
    live = slots[slots >= 0].long().cpu()
    changed = (k_cache != k_before).view(num_blocks * block_size, -1).any(-1).cpu()
    assert changed.nonzero().view(-1).tolist() == sorted(live.tolist())


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_write_kv_cache_int32_slots_all_padded(device, dtype):
    g = torch.Generator().manual_seed(5)
    k_cache = randn(2, 4, 1, 16, dtype=dtype, device=device, g=g)
    before = k_cache.clone()
    k = randn(3, 1, 16, dtype=dtype, device=device, g=g)
    slots = torch.full((3,), -1, dtype=torch.int32, device=device)
    TRI.write_kv_cache(k, k, k_cache, k_cache, slots)
    assert torch.equal(k_cache, before)
    TRI.write_kv_cache(
        k, k, k_cache, k_cache, torch.tensor([7, 0, 2], dtype=torch.int32, device=device)
    )
    assert torch.equal(k_cache.view(8, 16)[[7, 0, 2]], k[:, 0])


# --------------------------------------------------------------------------------------------
# layers


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm(device, dtype, with_residual):
    g = torch.Generator().manual_seed(int(with_residual))
    t, n = 7, 80  # hidden size not a power of two
    x = randn(t, n, dtype=dtype, device=device, g=g)
    w = (1 + 0.1 * randn(n, dtype=torch.float32, device="cpu", g=g)).to(device, dtype)
    r = randn(t, n, dtype=dtype, device=device, g=g) if with_residual else None
    out, res = TRI.rms_norm(x, w, 1e-5, r)
    ref_out, ref_res = REF.rms_norm(f32(x), f32(w), 1e-5, None if r is None else f32(r))
    assert out.dtype == dtype and res.dtype == dtype
    close(out, ref_out, dtype)
    if r is None:
        assert res is x
    else:
        # the sum is rounded once to the storage dtype, as torch's x + residual is
        torch.testing.assert_close(res, x + r, atol=0, rtol=0)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_silu_and_mul(device, dtype):
    g = torch.Generator().manual_seed(0)
    x = 3 * randn(2, 5, 2 * 48, dtype=dtype, device=device, g=g)
    out = TRI.silu_and_mul(x)
    assert out.shape == (2, 5, 48) and out.dtype == dtype
    close(out, REF.silu_and_mul(f32(x)), dtype)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_gelu_tanh_and_mul(device, dtype):
    g = torch.Generator().manual_seed(1)
    x = 3 * randn(2, 5, 2 * 48, dtype=dtype, device=device, g=g)
    out = TRI.gelu_tanh_and_mul(x)
    assert out.shape == (2, 5, 48) and out.dtype == dtype
    close(out, REF.gelu_tanh_and_mul(f32(x)), dtype)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("h,hkv,d", [(4, 4, 16), (6, 2, 32), (8, 1, 24)])
def test_rotary_embedding(device, dtype, h, hkv, d):
    from kvflow.kernels.reference import build_cos_sin_cache

    g = torch.Generator().manual_seed(h + d)
    t = 6
    cos_sin = build_cos_sin_cache(d, 256, 10000.0).to(device, dtype)
    qkv = randn(t, (h + 2 * hkv) * d, dtype=dtype, device=device, g=g)
    q = qkv[:, : h * d].view(t, h, d)
    k = qkv[:, h * d : (h + hkv) * d].view(t, hkv, d)
    positions = torch.randint(0, 256, (t,), generator=g).to(device)
    q_before, k_before = q.clone(), k.clone()
    rq, rk = TRI.rotary_embedding(positions, q, k, cos_sin)
    eq, ek = REF.rotary_embedding(positions.cpu(), f32(q), f32(k), f32(cos_sin))
    assert rq.shape == q.shape and rk.shape == k.shape and rq.dtype == dtype
    close(rq, eq, dtype)
    close(rk, ek, dtype)
    assert torch.equal(q, q_before) and torch.equal(k, k_before)  # inputs untouched


# --------------------------------------------------------------------------------------------
# dispatch and composition


def test_select_backend():
    assert select_backend("cpu", torch.float32) == "reference"
    assert select_backend("cpu", torch.bfloat16) == "reference"
    assert select_backend("cuda", torch.float32) == "reference"
    assert select_backend("cuda", torch.bfloat16) == "triton"
    assert select_backend(torch.device("cuda", 0), torch.float16) == "triton"
    with pytest.raises(ValueError, match="unknown kernel backend"):
        get_backend("cuda")


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_llama_prefill_then_decode_matches_reference(device, dtype):
    """A tiny random Llama through the worker's own decoder (``DecoderModel.forward_device``,
    what the bench times): a prefix-hit extend step, then decode steps with a padded row,
    through both backends: the kernels compose."""
    shape = LlamaShape(
        vocab=64, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=96, max_position=128
    )
    bs, num_blocks = 4, 24
    cfg, weights = random_llama(dtype, torch.device(device), seed=1, shape=shape)
    model = DecoderModel(cfg, weights)
    ref_model = DecoderModel(cfg, {n: f32(t) for n, t in weights.items()})
    caches = model.make_kv_caches(num_blocks, bs)
    ref_caches = ref_model.make_kv_caches(num_blocks, bs)
    tables = torch.tensor([[3, 9, 1, 17, 5], [20, 2, 11, 0, 8]], dtype=torch.int32)
    g = torch.Generator().manual_seed(2)
    prompt_lens = [11, 6]

    def slots(seq: int, positions: list[int]) -> list[int]:
        return [int(tables[seq, p // bs]) * bs + p % bs for p in positions]

    def run(step: DeviceBatch) -> None:
        on_dev = DeviceBatch(
            *(None if x is None else x.to(device) for x in astuple(step)[:6]),
            step.max_query_len,
            None if step.sample_rows is None else step.sample_rows.to(device),
        )
        got = model.forward_device(TRI, on_dev, caches)
        want = ref_model.forward_device(REF, step, ref_caches)
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(got.cpu(), want, atol=atol * 20, rtol=rtol * 20)

    # step 1: both prompts, as if the first 4 tokens of sequence 0 had been a prefix-cache hit
    # (written by an earlier step: here a first extend step of 4 tokens)
    toks = torch.randint(0, shape.vocab, (sum(prompt_lens),), generator=g)
    run(DeviceBatch(
        toks[:4], torch.arange(4), torch.tensor(slots(0, list(range(4)))),
        tables[:1], torch.tensor([4], dtype=torch.int32),
        torch.tensor([0, 4], dtype=torch.int32), 4, None,
    ))  # fmt: skip
    rest = list(range(4, 11))
    run(DeviceBatch(
        torch.cat([toks[4:11], toks[11:]]),
        torch.tensor(rest + list(range(6))),
        torch.tensor(slots(0, rest) + slots(1, list(range(6)))),
        tables, torch.tensor(prompt_lens, dtype=torch.int32),
        torch.tensor([0, 7, 13], dtype=torch.int32), 7, torch.tensor([6, 12]),
    ))  # fmt: skip
    # decode steps with a padded third row (slot -1, seq_len 0), as a CUDA-graph batch has
    lens = list(prompt_lens)
    padded_tables = torch.cat([tables, tables[:1]])
    for _ in range(2):
        pos = [lens[0], lens[1], 0]
        run(DeviceBatch(
            torch.randint(0, shape.vocab, (3,), generator=g),
            torch.tensor(pos),
            torch.tensor(slots(0, [pos[0]]) + slots(1, [pos[1]]) + [-1]),
            padded_tables,
            torch.tensor([lens[0] + 1, lens[1] + 1, 0], dtype=torch.int32),
            None, 1, torch.tensor([0, 1]),
        ))  # fmt: skip
        lens = [n + 1 for n in lens]


def test_kernels_compile_for_h100_without_spills():
    """Every kernel, in the configurations the wrappers pick for Llama shapes, compiles for
    sm_90 with Triton's own ptxas (no GPU needed) without spilling registers: the interpreter
    above accepts code that the GPU compiler would reject."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvflow.kernels.compile_check",
            "--arch",
            "90",
            "--dtype",
            "bfloat16",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # 26 attention/layer configurations (8 with a sliding window and soft-capping on) + the
    # quantized matmul (3 weight kinds x 2 row tiles) + the MoE grouped GEMM (kernels/
    # triton_moe.py: gate_up and down x a decode and a prefill row tile)
    assert "36 kernels compiled, 0 with spills" in proc.stdout, proc.stdout
    assert proc.stdout.count("| _quant_matmul_kernel |") == 6, proc.stdout
    assert proc.stdout.count("| _grouped_gemm_kernel |") == 4, proc.stdout


@pytest.mark.skipif(HAS_CUDA, reason="with a GPU the bench runs instead of refusing")
def test_bench_refuses_without_a_gpu(capsys):
    from kvflow.benchmarks import kernels as bench

    assert bench.main(["--skip-e2e"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
