"""Reference kernels against straightforward formulas, HF's own Llama pieces and a naive dense
causal attention; plus the bitwise batch invariance the worker relies on."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import (
    LlamaConfig,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from kvflow.kernels import cpu_native
from kvflow.kernels import reference as K
from tests.helpers.kernels import BS, CASES, WINDOW_SOFTCAP, D, naive_attention, run_paged


@pytest.mark.parametrize("ratio", [1, 3, 8])
@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention_matches_dense(case: str, ratio: int) -> None:
    hkv = 2
    out, refs = run_paged(CASES[case], hkv * ratio, hkv)
    torch.testing.assert_close(out, torch.cat(refs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window,softcap", WINDOW_SOFTCAP)
@pytest.mark.parametrize("ratio", [2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention_with_window_and_softcap_matches_dense(
    case: str, ratio: int, window: int, softcap: float
) -> None:
    """Sliding windows and soft-capping on prefill (SDPA with a window mask, by hand with a
    softcap), chunked prefill on a cached prefix and decode rows (the chunked torch path, in
    32-key chunks too so that whole chunks fall outside a window), GQA 2 and 3."""
    for kv_chunk in (128, 32):
        out, refs = run_paged(
            CASES[case], 2 * ratio, 2, seed=ratio, kv_chunk=kv_chunk, window=window,
            softcap=softcap, q_gain=3.0,
        )  # fmt: skip
        torch.testing.assert_close(out, torch.cat(refs), rtol=1e-5, atol=1e-5)


def test_a_window_longer_than_every_context_changes_no_bit() -> None:
    """``window`` >= the context is plain causal attention, to the bit (the default 0 is the
    pre-window code itself)."""
    seqs = CASES["mixed_batch"] + CASES["decode_mixed_lengths"]
    plain, _ = run_paged(seqs, 6, 2, seed=5, kv_chunk=32)
    wide, _ = run_paged(seqs, 6, 2, seed=5, kv_chunk=32, window=301)
    assert torch.equal(wide, plain)


@pytest.mark.parametrize(
    "case,span", [("decode_mixed_lengths", (0, 6)), ("decodes_then_prefills", (0, 3))]
)
def test_consecutive_decode_rows_are_read_in_place_with_the_same_bits(case, span) -> None:  # noqa: ANN001
    """Decode rows that are consecutive in q (all of a decode step, or the decodes the scheduler
    puts before the prefills) are sliced, not gathered and scattered: the same bits."""
    seqs = CASES[case]
    g = torch.Generator().manual_seed(3)
    width = max(-(-n // BS) for n, _ in seqs + CASES["mixed_batch"])
    nb = len(seqs) * width
    kc, vc = torch.randn(nb, BS, 2, D, generator=g), torch.randn(nb, BS, 2, D, generator=g)
    tables = torch.randperm(nb, generator=g).view(len(seqs), width)
    seq_lens = torch.tensor([n for n, _ in seqs])
    query_lens = torch.tensor([nq for _, nq in seqs])
    q = torch.randn(int(query_lens.sum()), 6, D, generator=g)
    for decode_fn in (None, *([cpu_native.paged_decode_attention] if cpu_native.load() else [])):
        plan = K.plan_attention(tables, seq_lens, query_lens, BS, decode_fn=decode_fn)
        assert plan.decode_span == span
        gathered = dataclasses.replace(plan, decode_span=None, scratch={}, window_valid={})
        args = (q, kc, vc, None, None, None, D**-0.5)
        assert torch.equal(
            K.paged_attention(*args, plan=plan), K.paged_attention(*args, plan=gathered)
        )
    mixed = CASES["mixed_batch"]  # decode rows 0, 13 and 29: gathered
    plan = K.plan_attention(
        tables[: len(mixed)], torch.tensor([n for n, _ in mixed]),
        torch.tensor([nq for _, nq in mixed]), BS,
    )  # fmt: skip
    assert plan.decode_span is None


def test_paged_attention_without_plan() -> None:
    k = torch.randn(6, 1, D)
    kc, vc = torch.zeros(4, BS, 1, D), torch.zeros(4, BS, 1, D)
    K.write_kv_cache(k, k, kc, vc, K.context_slots(torch.tensor([3, 1]), 6, BS))
    q = torch.randn(2, 2, D)
    out = K.paged_attention(
        q, kc, vc, torch.tensor([[3, 1]]), torch.tensor([6]), torch.tensor([2]), D**-0.5
    )
    torch.testing.assert_close(out, naive_attention(q, k, k), rtol=1e-5, atol=1e-5)


def test_decode_attention_is_bitwise_batch_invariant() -> None:
    """A sequence's decode output does not change by one bit with other, longer sequences
    (more key chunks, more padding, larger bmm batches) beside it."""
    alone, _ = run_paged([(200, 1)], 6, 2, seed=3, kv_chunk=32)
    for others in ([(5, 1)], [(700, 1), (3, 1), (64, 1)], [(1, 1)] * 9):
        together, _ = run_paged([(200, 1)] + others, 6, 2, seed=3, kv_chunk=32)
        assert torch.equal(together[:1], alone)


@pytest.mark.parametrize("window,softcap", [(50, 0.0), (7, 0.0), (50, 2.0)])
def test_windowed_decode_attention_is_bitwise_batch_invariant(window: int, softcap: float) -> None:
    """As above with a sliding window (whole chunks of a long neighbour outside it) and
    soft-capping."""
    kw = {"seed": 3, "kv_chunk": 32, "window": window, "softcap": softcap}
    alone, _ = run_paged([(200, 1)], 6, 2, **kw)
    for others in ([(5, 1)], [(700, 1), (3, 1), (64, 1)], [(1, 1)] * 9):
        together, _ = run_paged([(200, 1)] + others, 6, 2, **kw)
        assert torch.equal(together[:1], alone)


def test_write_kv_cache_skips_minus_one() -> None:
    kc, vc = torch.zeros(3, 2, 1, 2), torch.zeros(3, 2, 1, 2)
    k = torch.arange(8.0).view(4, 1, 2)
    K.write_kv_cache(k, -k, kc, vc, torch.tensor([5, -1, 0, -1]))
    want = torch.zeros(6, 1, 2)
    want[5], want[0] = k[0], k[2]
    assert torch.equal(kc.view(6, 1, 2), want)
    assert torch.equal(vc.view(6, 1, 2), -want)


def test_rms_norm_matches_hf_and_fuses_residual() -> None:
    x, r, w = torch.randn(5, 32), torch.randn(5, 32), torch.randn(32)
    hf = LlamaRMSNorm(32, eps=1e-5)
    hf.weight.data.copy_(w)
    out, res = K.rms_norm(x, w, 1e-5)
    assert torch.equal(out, hf(x).detach()) and res is x
    out, res = K.rms_norm(x, w, 1e-5, residual=r)
    assert torch.equal(res, x + r) and torch.equal(out, hf(x + r).detach())


def test_rotary_matches_hf_bitwise() -> None:
    cfg = LlamaConfig(hidden_size=4 * D, num_attention_heads=4, rope_theta=500.0)
    pos = torch.tensor([0, 1, 7, 300, 2047])
    q, k = torch.randn(5, 4, D), torch.randn(5, 2, D)
    cos, sin = LlamaRotaryEmbedding(cfg)(q, pos[None])
    hq, hk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    cache = K.build_cos_sin_cache(D, 2048, 500.0)
    oq, ok = K.rotary_embedding(pos, q, k, cache)
    assert torch.equal(oq, hq[0].transpose(0, 1)) and torch.equal(ok, hk[0].transpose(0, 1))


def test_silu_and_mul() -> None:
    x = torch.randn(7, 2 * 48) * 4
    torch.testing.assert_close(K.silu_and_mul(x), F.silu(x[:, :48]) * x[:, 48:], rtol=1e-6, atol=0)


def test_gelu_tanh_and_mul() -> None:
    x = torch.randn(7, 2 * 48, generator=torch.Generator().manual_seed(0)) * 4
    g, u = x[:, :48], x[:, 48:]
    got = K.gelu_tanh_and_mul(x)
    # torch's own formula loses ~1e-7 of |g| to the cancellation in 1 + tanh(y) for g < 0
    torch.testing.assert_close(got, F.gelu(g, approximate="tanh") * u, rtol=1e-6, atol=1e-6)
    gd = g.double()
    exact = 0.5 * gd * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gd + 0.044715 * gd**3)))
    near = g.abs() < 6  # beyond, fp32's rounding of y grows the relative error in the tail
    torch.testing.assert_close(
        got.double()[near], (exact * u.double())[near], rtol=5e-6, atol=1e-30
    )
    assert K.gelu_tanh_and_mul(torch.randn(2, 3, 8)).shape == (2, 3, 4)
    # a row's bits do not depend on the other rows
    assert torch.equal(K.gelu_tanh_and_mul(x[3:4]), got[3:4])


def test_linear_layout_is_batch_invariant_and_correct() -> None:
    w, x = torch.randn(96, 40), torch.randn(23, 40)
    full = K.linear(x, w)
    torch.testing.assert_close(full, x @ w.T, rtol=1e-5, atol=1e-4)
    layout = K.RowLayout(num_single=11, segments=((11, 15), (15, 23)), tile=4)
    mixed = K.linear(x, w, layout)
    torch.testing.assert_close(mixed, full, rtol=1e-5, atol=1e-4)
    # a single-token row's bits do not depend on how many other single rows there are
    alone = K.linear(x[:1], w, K.RowLayout(1, (), 4))
    assert torch.equal(mixed[:1], alone)
    # a segment's bits do not depend on what else runs
    assert torch.equal(mixed[15:23], K.linear(x[15:23], w, K.RowLayout(0, ((0, 8),), 4)))


class _Invariant:
    """A weight whose kernel is batch invariant up to ``max_invariant_rows`` rows per call; counts
    its calls."""

    batch_invariant = True

    def __init__(self, w: torch.Tensor, max_rows: int | None) -> None:
        self.w, self.shape, self.calls = w, tuple(w.shape), []
        if max_rows is not None:
            self.max_invariant_rows = max_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(x.shape[0])
        return torch.stack([row @ self.w.T for row in x])  # each row alone: invariant


def test_linear_gives_an_invariant_kernel_the_whole_step_in_one_call() -> None:
    """Panels (no row limit) take a mixed step in one call; a kernel invariant up to 8 rows per
    call takes a 23-row step as the layout's calls; either way the bits are the layout's."""
    w, x = torch.randn(96, 40), torch.randn(23, 40)
    layout = K.RowLayout(num_single=11, segments=((11, 15), (15, 23)), tile=4)
    want = K.linear(x, _Invariant(w, 1 << 62), None)
    whole = _Invariant(w, None)
    assert torch.equal(K.linear(x, whole, layout), want) and whole.calls == [23]
    bounded = _Invariant(w, 8)
    assert torch.equal(K.linear(x, bounded, layout), want) and bounded.calls == [4, 4, 4, 4, 8]
    assert K.invariant_rows(w) == 0 and K.invariant_rows(bounded) == 8
