"""Plain-PyTorch reference kernels: the CPU path of kvflow (a Triton port will sit beside them).

Pure functions of tensors. Besides being correct, they are *batch invariant*: the result for one
token row never depends on which other rows share the step. fp32 GEMMs on CPU are not (MKL picks
kernels, K-blocking and thread splits from the matrix shape, so a row's bits change with M), and
greedy decoding must not change when requests are batched together. So:

* ``linear`` pads the rows of single-token sequences to a row count for which the BLAS gives
  every row the same bits whatever the count and the row's position (found by
  ``kernels.batch_invariance.calibrate`` on the machine at hand; fixed 16-row tiles otherwise)
  and runs each multi-token sequence as its own GEMM;
* decode attention splits every context into fixed-size key chunks, so each GEMM has a fixed
  shape, padded chunks add exact zeros, and chunk partials are summed in a fixed order;
* ``silu_and_mul`` is written with ``exp`` (whose vector and scalar paths agreed in our checks),
  not ``F.silu`` (whose scalar tail path differs in the last bit from its vector body).

The batch-invariance tests (tests/kernels/test_kernels_reference.py, tests/models/
test_runner_tiny.py and the SmolLM2 integration test) compare logits bit for bit, so a BLAS or
torch change that breaks this shows up there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

# --------------------------------------------------------------------------------------------
# elementwise / normalisation


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm with vLLM's fused residual add: with ``residual``, normalise ``x + residual`` and
    also return that sum (the next residual). Same op order as HF's LlamaRMSNorm."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    out = weight * (xf * torch.rsqrt(var + eps)).to(x.dtype)
    return out, x


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for the fused gate/up projection output."""
    d = x.shape[-1] // 2
    gate, up = x[..., :d], x[..., d:]
    return gate / (1.0 + torch.exp(-gate)) * up


# sqrt(2 / pi) of the tanh approximation of GELU
_GELU_TANH_C = 0.7978845608028654


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(x[..., :d]) * x[..., d:]`` (Gemma's fused gate/up; torch's
    ``F.gelu(approximate="tanh")``, HF's ``gelu_pytorch_tanh``). Written as
    ``0.5 * g * (1 + tanh(y)) == g / (1 + exp(-2y))``, ``y = sqrt(2/pi) * (g + 0.044715 g^3)``:
    one ``exp`` like ``silu_and_mul`` (batch invariant for the same reason), and without the
    cancellation of ``1 + tanh(y)`` for negative ``g``, so it is closer to the exact value than
    ``F.gelu`` is there (which loses up to ~1e-7 of |g| absolute)."""
    d = x.shape[-1] // 2
    gate, up = x[..., :d], x[..., d:]
    y2 = (2.0 * _GELU_TANH_C) * (gate + 0.044715 * (gate * gate * gate))
    return gate / (1.0 + torch.exp(-y2)) * up


def build_cos_sin_cache(
    head_dim: int, max_position: int, base: float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``[max_position, head_dim]``: cos of the half-dim frequencies, then sin. Computed exactly
    as HF's LlamaRotaryEmbedding does (fp32 ``position * inv_freq``), so the bits agree."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    freqs = torch.arange(max_position, dtype=torch.float)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` [T, H, D] and ``k`` [T, Hkv, D] (HF Llama "rotate_half", not interleaved)."""
    half = cos_sin_cache.shape[-1] // 2
    cs = cos_sin_cache[positions]
    cos, sin = cs[:, None, :half], cs[:, None, half:]

    def rot(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    return rot(q), rot(k)


# --------------------------------------------------------------------------------------------
# linear layers


@dataclass(frozen=True)
class RowLayout:
    """How a step's rows go through GEMMs: rows ``[0, num_single)`` belong to single-token
    sequences; they are zero-padded to a multiple of ``pad`` rows and run in GEMMs of at most
    ``tile`` rows (``tile`` a multiple of ``pad``). Each ``segments`` range is one multi-token
    sequence and runs as its own GEMM. With ``pad`` and ``tile`` from
    ``kernels.batch_invariance.calibrate`` (or ``pad == tile``: fixed tiles), a row's result
    depends only on its own sequence, never on the rest of the batch."""

    num_single: int
    segments: tuple[tuple[int, int], ...] = ()
    tile: int = 16
    pad: int = 0  # 0: the same as tile (fixed tiles)


class Weight(Protocol):
    """A linear weight in another layout (e.g. ``kernels.cpu_gemm.PackedWeight``):
    ``w(x) == x @ W.T`` and ``w.shape == (N, K)``."""

    shape: tuple[int, ...]

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


def matmul_fn(weight: torch.Tensor | Weight) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> x @ weight.T`` for a dense or packed weight."""
    if isinstance(weight, torch.Tensor):
        return lambda x: F.linear(x, weight)
    return weight


def invariant_rows(weight: torch.Tensor | Weight) -> int:
    """How many rows one call of ``weight`` may take with each row's bits independent of the
    others: 0 unless its kernel is batch invariant by construction."""
    if not getattr(weight, "batch_invariant", False):
        return 0
    return getattr(weight, "max_invariant_rows", 1 << 62)


def linear(
    x: torch.Tensor, weight: torch.Tensor | Weight, layout: RowLayout | None = None
) -> torch.Tensor:
    """``x @ weight.T`` ([T, K] -> [T, N]), batch invariant when a ``layout`` is given. A kernel
    batch invariant by construction (``batch_invariant``) takes the whole step in one call when
    it has no more rows than it stays invariant for (``max_invariant_rows``, unbounded for the
    panels): its rows' bits are what the layout's calls would give, without the calls and the
    concatenation."""
    mm = matmul_fn(weight)
    if layout is None or x.shape[0] <= invariant_rows(weight):
        return mm(x)
    parts = []
    ns, tile = layout.num_single, layout.tile
    if ns:
        xs = x[:ns]
        extra = -ns % (layout.pad or tile)
        if extra:
            xs = torch.cat([xs, xs.new_zeros(extra, xs.shape[1])])
        for s in range(0, xs.shape[0], tile):
            parts.append(mm(xs[s : s + tile]))
        if extra:
            parts[-1] = parts[-1][: parts[-1].shape[0] - extra]
    for a, b in layout.segments:
        parts.append(mm(x[a:b]))
    if not parts:
        return x.new_empty(0, weight.shape[0])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


# --------------------------------------------------------------------------------------------
# paged KV cache


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``k``/``v`` [T, Hkv, D] into caches [num_blocks, block_size, Hkv, D] at flat slots
    ``block_id * block_size + offset``; rows whose slot is -1 (padding) are skipped."""
    kf = k_cache.view(-1, *k_cache.shape[2:])
    vf = v_cache.view(-1, *v_cache.shape[2:])
    keep = slot_mapping >= 0
    if bool(keep.all()):
        kf.index_copy_(0, slot_mapping, k.to(kf.dtype))
        vf.index_copy_(0, slot_mapping, v.to(vf.dtype))
    else:
        idx = slot_mapping[keep]
        kf.index_copy_(0, idx, k[keep].to(kf.dtype))
        vf.index_copy_(0, idx, v[keep].to(vf.dtype))


def context_slots(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Flat cache slots of positions ``0..length-1`` of one sequence."""
    pos = torch.arange(length)
    return block_table[pos // block_size].long() * block_size + pos % block_size


DecodeFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, int, float],
    torch.Tensor,
]
"""``(q [Bd, H, D], k_cache, v_cache, block_tables [Bd, max_blocks] int32, seq_lens [Bd] int32,
scale, window, softcap) -> [Bd, H, D]``: a native decode-attention kernel (e.g.
kernels.cpu_native's); ``window`` and ``softcap`` as in ``paged_attention`` (0: off)."""


@dataclass
class AttentionPlan:
    """Index work for ``paged_attention`` done once per step instead of once per layer."""

    decode_rows: torch.Tensor  # [Bd] q rows of sequences with one new token
    decode_tables: torch.Tensor  # [Bd, max_blocks] int32 block tables of those sequences
    decode_lens: torch.Tensor  # [Bd] int32 their context lengths
    prefills: list[tuple[int, int, torch.Tensor]]  # (row_start, row_end, slots of the context)
    decode_fn: DecodeFn | None = None  # a native decode kernel; None: the chunked torch path
    # the decode rows as a slice of q when they are consecutive (the scheduler puts decodes
    # first): read and written in place instead of gathered and scattered in every layer
    decode_span: tuple[int, int] | None = None
    # the chunked torch decode path (unset when decode_fn is given)
    decode_blocks: torch.Tensor | None = None  # [Bd, Lp // block_size] (pads: own first block)
    decode_valid: torch.Tensor | None = None  # [Bd, Lp] bool: position < seq_len
    decode_pad_rows: torch.Tensor | None = None  # flat [Bd*Lp] indices of invalid positions
    kv_chunk: int = 128  # keys per attention chunk, a multiple of the block size
    # decode_valid narrowed to a sliding window, per window size (made by the first layer that
    # asks, reused by the others of the step)
    window_valid: dict[int, torch.Tensor] = field(default_factory=dict)
    # gather buffers shared by the layers of one step: tens of MB that malloc would otherwise
    # map and page-fault afresh in every layer
    scratch: dict[str, torch.Tensor] = field(default_factory=dict)

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        buf = self.scratch.get(name)
        if buf is None or buf.shape != shape or buf.dtype != dtype:
            buf = self.scratch[name] = torch.empty(shape, dtype=dtype)
        return buf


def plan_attention(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    block_size: int,
    kv_chunk: int = 128,
    decode_fn: DecodeFn | None = None,
) -> AttentionPlan:
    """Precompute gathers for ``paged_attention`` (block_tables [B, max_blocks], padded with
    anything; seq_lens/query_lens [B]). ``kv_chunk`` is rounded up to whole blocks. With a
    ``decode_fn``, single-token sequences go to it instead of the chunked torch path."""
    sl, ql = seq_lens.tolist(), query_lens.tolist()
    starts = [0]
    for n in ql:
        starts.append(starts[-1] + n)
    dec = [i for i, n in enumerate(ql) if n == 1]
    prefills = [
        (starts[i], starts[i + 1], context_slots(block_tables[i], sl[i], block_size))
        for i, n in enumerate(ql)
        if n > 1
    ]
    lens = seq_lens[dec]
    rows = [starts[i] for i in dec]
    consecutive = bool(rows) and rows == list(range(rows[0], rows[0] + len(rows)))
    plan = AttentionPlan(
        decode_rows=torch.tensor(rows, dtype=torch.long),
        decode_tables=block_tables[dec].to(torch.int32),
        decode_lens=lens.to(torch.int32),
        prefills=prefills,
        decode_fn=decode_fn,
        decode_span=(rows[0], rows[0] + len(rows)) if consecutive else None,
    )
    if decode_fn is not None or not dec:
        return plan
    c = -(-kv_chunk // block_size) * block_size
    lp = -(-max(sl[i] for i in dec) // c) * c
    tables = block_tables[dec].long()
    nb = lp // block_size
    if tables.shape[1] < nb:
        tables = torch.cat([tables, tables[:, :1].expand(-1, nb - tables.shape[1])], dim=1)
    used = torch.arange(nb)[None, :] < (lens[:, None] + block_size - 1) // block_size
    valid = torch.arange(lp)[None, :] < lens[:, None]
    plan.decode_blocks = torch.where(used, tables[:, :nb], tables[:, :1])
    plan.decode_valid = valid
    plan.decode_pad_rows = (~valid).view(-1).nonzero().view(-1)
    plan.kv_chunk = c
    return plan


def _softcap(s: torch.Tensor, softcap: float) -> torch.Tensor:
    """``softcap * tanh(s / softcap)``: Gemma 2's attention logit soft-capping."""
    return torch.tanh(s / softcap) * softcap


def _window_valid(plan: AttentionPlan, window: int) -> torch.Tensor:
    """``plan.decode_valid`` and, with a ``window``, only the last ``window`` positions of each
    context (``position >= len - window``)."""
    assert plan.decode_valid is not None
    if window <= 0:
        return plan.decode_valid
    valid = plan.window_valid.get(window)
    if valid is None:
        pos = torch.arange(plan.decode_valid.shape[1])[None, :]
        first = plan.decode_lens.long()[:, None] - window
        valid = plan.window_valid[window] = plan.decode_valid & (pos >= first)
    return valid


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """One new token per sequence, all sequences at once, in fixed-size key chunks: every GEMM
    is [G, D] x [D, c] or [G, c] x [c, D] whatever the batch, padded keys get probability 0
    (exact zeros in every sum), and chunk partials are added in a fixed order. Keys outside a
    sliding ``window`` are masked like padding (score -inf, probability exactly 0); their V
    rows are real cache rows, so 0 * v is 0 without zeroing them."""
    assert plan.decode_blocks is not None and plan.decode_valid is not None
    assert plan.decode_pad_rows is not None
    bd, h, d = q.shape
    hkv, c = k_cache.shape[2], plan.kv_chunk
    g, nch = h // hkv, plan.decode_valid.shape[1] // c
    blocks = plan.decode_blocks.view(-1)
    shape = (blocks.numel(), *k_cache.shape[1:])
    k = torch.index_select(k_cache, 0, blocks, out=plan.buffer("k", shape, k_cache.dtype))
    v = torch.index_select(v_cache, 0, blocks, out=plan.buffer("v", shape, v_cache.dtype))
    k, v = k.view(bd * nch, c, hkv, d), v.view(bd * nch, c, hkv, d)  # whole-block gathers
    v.view(-1, hkv * d).index_fill_(0, plan.decode_pad_rows, 0.0)  # stale slots: 0 * v must be 0
    k, v = k.to(q.dtype), v.to(q.dtype)  # a bf16 cache under fp32 compute (CPU bf16): widened
    qs = (q * scale).view(bd, 1, hkv, g, d).expand(bd, nch, hkv, g, d).reshape(bd * nch, hkv, g, d)
    # per KV head, K/V are strided views [bd*nch, c, D]: no copy into a head-major layout
    s = torch.stack([torch.bmm(qs[:, j], k[:, :, j].transpose(1, 2)) for j in range(hkv)], 1)
    if softcap > 0:
        s = _softcap(s, softcap)
    valid = _window_valid(plan, window).view(bd, nch, 1, 1, c)
    s = torch.where(valid, s.view(bd, nch, hkv, g, c), float("-inf"))
    p = torch.exp(s - s.amax(dim=(1, 4), keepdim=True)).view(bd * nch, hkv, g, c)
    lsum = p.sum(-1).view(bd, nch, hkv, g, 1)
    o = torch.stack([torch.bmm(p[:, j], v[:, :, j]) for j in range(hkv)], 1)
    o = o.view(bd, nch, hkv, g, d)
    acc, den = o[:, 0], lsum[:, 0]
    for j in range(1, nch):  # fixed order; all-padding chunks add exact zeros
        acc, den = acc + o[:, j], den + lsum[:, j]
    return (acc / den).reshape(bd, h, d)


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int,
    softcap: float,
) -> torch.Tensor:
    """One sequence's new tokens: ``q`` [1, H, nq, D] are the last nq of the nk positions of
    ``k``/``v`` [1, Hkv, nk, D]; bottom-right aligned causal mask, narrowed to a sliding
    ``window`` (0: none). SDPA where it can (no softcap); by hand, fp32 softmax, with one."""
    h, nq, hkv, nk = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    if window >= nk:  # the window holds the whole context: plain causal attention
        window = 0
    mask = None
    if nq != nk or window or softcap > 0:
        # new tokens continue a cached prefix: bottom-right aligned causal mask
        mask = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
        if window:  # query at position p sees keys p - window < j <= p
            mask &= ~torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq - window)
    if softcap <= 0:
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=hkv != h,
        )
    assert mask is not None
    g = h // hkv
    qg = q.reshape(hkv, g * nq, q.shape[3])  # the query heads of one KV head together
    s = _softcap(torch.bmm(qg, k[0].transpose(1, 2)) * scale, softcap).view(hkv, g, nq, nk)
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s.float(), dim=-1).to(v.dtype).view(hkv, g * nq, nk)
    return torch.bmm(p, v[0]).view(1, h, nq, v.shape[3])


def _decode_rows(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    window: int,
    softcap: float,
) -> torch.Tensor:
    """Attention of the plan's single-token rows of ``q`` (a slice when they are consecutive,
    else gathered) through its native ``decode_fn`` or the chunked torch path."""
    span = plan.decode_span
    qd = q[span[0] : span[1]] if span else q[plan.decode_rows]
    if plan.decode_fn is not None:
        return plan.decode_fn(
            qd, k_cache, v_cache, plan.decode_tables, plan.decode_lens, scale, window, softcap
        )
    return _decode_attention(qd, k_cache, v_cache, plan, scale, window, softcap)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor | None,
    seq_lens: torch.Tensor | None,
    query_lens: torch.Tensor | None,
    scale: float,
    plan: AttentionPlan | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of a varlen batch over a paged KV cache.

    ``q`` [total_new_tokens, H, D] holds the sequences' new tokens back to back; sequence i's
    ``query_lens[i]`` tokens are the last ones of its ``seq_lens[i]`` (their K/V already written),
    so prefill, chunked prefill and decode are the same call. Any H / Hkv ratio (GQA). Sequences
    with one new token are batched together; longer ones use one SDPA call each. A ``plan`` from
    ``plan_attention`` replaces the three metadata tensors (pass None for them).

    ``window`` > 0: sliding-window attention (Mistral, Qwen2, Gemma): the query at position i
    sees keys ``i - window < j <= i`` only (HF's ``kv_idx > q_idx - sliding_window``).
    ``softcap`` > 0: scores (after ``scale``) become ``softcap * tanh(score / softcap)`` before
    masking and softmax (Gemma 2's ``attn_logit_softcapping``). Both 0 by default: off, the
    same bits as without them."""
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    if plan is None:
        assert block_tables is not None and seq_lens is not None and query_lens is not None
        plan = plan_attention(block_tables, seq_lens, query_lens, k_cache.shape[1])
    kf, vf = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    span = plan.decode_span
    if span == (0, q.shape[0]):  # a pure decode step: the kernel's result is the output
        return _decode_rows(q, k_cache, v_cache, plan, scale, window, softcap)
    out = torch.empty_like(q)
    if plan.decode_rows.numel():
        od = _decode_rows(q, k_cache, v_cache, plan, scale, window, softcap)
        if span is None:
            out[plan.decode_rows] = od
        else:
            out[span[0] : span[1]] = od
    for a, b, slots in plan.prefills:
        qs = q[a:b].transpose(0, 1)[None]
        k = kf[slots].to(q.dtype).transpose(0, 1)[None]  # (a bf16 cache widened for fp32 q)
        v = vf[slots].to(q.dtype).transpose(0, 1)[None]
        o = _prefill_attention(qs, k, v, scale, window, softcap)
        out[a:b] = o[0].transpose(0, 1)
    return out


# --------------------------------------------------------------------------------------------
# multi-LoRA (Punica-style gather GEMMs: each token row through its own adapter)


def _rows_by_slot(slots: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """``(slot, row indices)`` for each distinct slot >= 0 in ``slots`` [T], ascending."""
    return [(s, (slots == s).nonzero().view(-1)) for s in torch.unique(slots).tolist() if s >= 0]


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Each row of ``x`` [T, K] through its adapter's down projection ``a`` [S, R, K]: row t of
    the [T, R] result is ``x[t] @ a[slots[t]].T``, zeros where ``slots[t] < 0`` (no adapter).
    One fp32 GEMM per distinct slot (memory O(T * R)); the result has x's dtype.

    Not batch invariant: a row's bits can depend on how many rows share its adapter (the GEMM's
    row count), as for ``linear`` without a layout."""
    out = torch.zeros(x.shape[0], a.shape[1], dtype=x.dtype, device=x.device)
    for s, rows in _rows_by_slot(slots):
        y = F.linear(x.index_select(0, rows).float(), a[s].float())
        out.index_copy_(0, rows, y.to(x.dtype))
    return out


def lora_expand(v: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None:
    """In place, ``out[t] += v[t] @ b[slots[t]].T`` for the rows with ``slots[t] >= 0`` (``v``
    [T, R], ``b`` [S, N, R] the adapters' up projections, ``out`` [T, N], any strides); the
    other rows of ``out`` are not written. One fp32 GEMM per distinct slot, the sum rounded once
    to ``out``'s dtype."""
    for s, rows in _rows_by_slot(slots):
        y = F.linear(v.index_select(0, rows).float(), b[s].float())
        out.index_copy_(0, rows, (out.index_select(0, rows).float() + y).to(out.dtype))
