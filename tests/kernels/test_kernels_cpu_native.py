"""The native CPU decode-attention kernel (kernels/csrc/paged_attention_cpu.c) against a naive
dense attention and the PyTorch reference, its batch invariance, and its input checks."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels import cpu_native
from kvflow.kernels import reference as K
from tests.helpers.kernels import CASES, WINDOW_SOFTCAP, D, run_paged

# Only a missing compiler skips; a kernel that fails to build fails these tests.
pytestmark = pytest.mark.skipif(
    cpu_native._compiler() is None, reason="no C compiler: the worker uses the PyTorch path"
)


def test_the_kernel_builds_and_loads() -> None:
    assert cpu_native.available()


def test_loading_the_kernel_leaves_subnormal_floats_alone(tmp_path) -> None:  # noqa: ANN001
    """-ffast-math at link time would make the library switch flush-to-zero on for the whole
    process that loads it (gcc's crtfastmath.o): a fresh process checks they survive."""
    import subprocess
    import sys

    code = (
        "import pathlib, struct, sys; from kvflow.kernels import cpu_native; "
        "cpu_native.configure(cpu_native.NativeSetup(pathlib.Path(sys.argv[1]))); "
        "assert cpu_native.available(); "
        "x = struct.unpack('d', struct.pack('Q', 1))[0]; "
        "print('ok' if x * 1.0 > 0.0 and x + 0.0 > 0.0 else 'flushed')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True
    )
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.parametrize("ratio", [1, 3, 8])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_dense_attention(case: str, ratio: int) -> None:
    """Decode rows through the native kernel, prefill rows through SDPA, in one batch: context
    of one token, lengths not a multiple of the block size, shuffled block tables, GQA 1/3/8."""
    out, refs = run_paged(
        CASES[case], h=2 * ratio, hkv=2, decode_fn=cpu_native.paged_decode_attention
    )
    torch.testing.assert_close(out, torch.cat(refs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window,softcap", WINDOW_SOFTCAP)
@pytest.mark.parametrize("ratio", [2, 3])
@pytest.mark.parametrize("case", ["decode_mixed_lengths", "mixed_batch"])
def test_window_and_softcap_match_dense_attention(
    case: str, ratio: int, window: int, softcap: float
) -> None:
    out, refs = run_paged(
        CASES[case], 2 * ratio, 2, seed=ratio, decode_fn=cpu_native.paged_decode_attention,
        window=window, softcap=softcap, q_gain=3.0,
    )  # fmt: skip
    torch.testing.assert_close(out, torch.cat(refs), rtol=1e-5, atol=1e-5)


def make_cache(
    lens: list[int], h: int, hkv: int, bs: int, seed: int, d: int = D
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in lens]
    nb = sum(need) + 4
    kc = torch.randn(nb, bs, hkv, d, generator=g)
    vc = torch.randn(nb, bs, hkv, d, generator=g)
    order = torch.randperm(nb, generator=g)
    width = max(need) + 2  # wider than needed: the tail must not be read
    tables = torch.full((len(lens), width), 10**6, dtype=torch.int32)
    i = 0
    for b, n in enumerate(need):
        tables[b, :n] = order[i : i + n].to(torch.int32)
        i += n
    q = torch.randn(len(lens), h, d, generator=g)
    return q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32)


def test_matches_the_torch_decode_path() -> None:
    q, kc, vc, tables, lens = make_cache([1, 16, 17, 250, 3], h=9, hkv=3, bs=16, seed=1)
    plan = K.plan_attention(
        tables.clamp(max=kc.shape[0] - 1).long(), lens.long(), torch.ones(5, dtype=torch.long), 16
    )
    ref = K.paged_attention(q, kc, vc, None, None, None, D**-0.5, plan=plan)
    out = cpu_native.paged_decode_attention(q, kc, vc, tables, lens, D**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d", [40, 64, 128])  # 64 and 128 have their own value loop
@pytest.mark.parametrize("window", [0, 21])  # a window that starts inside a block
def test_every_head_size_matches_the_torch_decode_path(d: int, window: int) -> None:
    q, kc, vc, tables, lens = make_cache([1, 16, 17, 90, 3], h=4, hkv=2, bs=8, seed=7, d=d)
    plan = K.plan_attention(
        tables.clamp(max=kc.shape[0] - 1).long(), lens.long(), torch.ones(5, dtype=torch.long), 8
    )
    ref = K.paged_attention(q, kc, vc, None, None, None, d**-0.5, plan=plan, window=window)
    out = cpu_native.paged_decode_attention(q, kc, vc, tables, lens, d**-0.5, window)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (50, 0.0), (9, 1.5), (0, 2.0)])
def test_window_and_softcap_match_the_torch_decode_path(window: int, softcap: float) -> None:
    q, kc, vc, tables, lens = make_cache([1, 16, 17, 250, 3, 60], h=9, hkv=3, bs=16, seed=5)
    q = q * 3  # scores large enough for soft-capping to bite
    plan = K.plan_attention(
        tables.clamp(max=kc.shape[0] - 1).long(), lens.long(), torch.ones(6, dtype=torch.long), 16
    )
    ref = K.paged_attention(
        q, kc, vc, None, None, None, D**-0.5, plan=plan, window=window, softcap=softcap
    )
    out = cpu_native.paged_decode_attention(q, kc, vc, tables, lens, D**-0.5, window, softcap)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_a_window_reads_no_block_before_it() -> None:
    """Block-table entries wholly before a sequence's window are never read: garbage there
    (a freed block's slot) neither fails the bounds check nor changes the result."""
    q, kc, vc, tables, lens = make_cache([40, 33], h=4, hkv=2, bs=8, seed=6)
    want = cpu_native.paged_decode_attention(q, kc, vc, tables, lens, 0.25, window=10)
    tables[0, :3] = -1  # keys 0..23; the window of 40 starts at key 30
    tables[1, :2] = 10**6  # keys 0..15; the window of 33 starts at key 23
    got = cpu_native.paged_decode_attention(q, kc, vc, tables, lens, 0.25, window=10)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="block id outside"):  # a window reaching into them
        cpu_native.paged_decode_attention(q, kc, vc, tables, lens, 0.25, window=20)


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (50, 0.0), (7, 0.0), (50, 2.0)])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_sequence_gets_the_same_bits_in_any_batch(
    threads: int, window: int, softcap: float
) -> None:
    """Alone, first of many, or last of many (the kernel splits work differently for small and
    large batches), with one or two threads, with or without a window and soft-capping: not one
    bit changes."""
    q, kc, vc, tables, lens = make_cache([1, 40, 7, 300, 65, 12, 2, 99], h=6, hkv=2, bs=8, seed=2)
    q = q * 3
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    kw = {"window": window, "softcap": softcap}
    try:
        full = cpu_native.paged_decode_attention(q, kc, vc, tables, lens, 0.25, **kw)
        for i in range(len(lens)):
            alone = cpu_native.paged_decode_attention(
                q[i : i + 1], kc, vc, tables[i : i + 1], lens[i : i + 1], 0.25, **kw
            )
            assert torch.equal(alone[0], full[i])
        rev = torch.arange(len(lens) - 1, -1, -1)
        flipped = cpu_native.paged_decode_attention(
            q[rev], kc, vc, tables[rev], lens[rev], 0.25, **kw
        )
        assert torch.equal(flipped, full[rev])
    finally:
        torch.set_num_threads(before)


def test_rejects_block_ids_outside_the_cache() -> None:
    q, kc, vc, tables, lens = make_cache([20, 5], h=4, hkv=2, bs=8, seed=3)
    tables[1, 0] = kc.shape[0]  # one past the end
    with pytest.raises(ValueError, match="block id outside"):
        cpu_native.paged_decode_attention(q, kc, vc, tables, lens, 0.25)
    tables[1, 0] = -1
    with pytest.raises(ValueError, match="block id outside"):
        cpu_native.paged_decode_attention(q, kc, vc, tables, lens, 0.25)


@pytest.mark.parametrize(("d", "window", "softcap"), [(64, 0, 0.0), (128, 21, 0.0), (40, 0, 30.0)])
def test_a_bf16_cache_reads_as_its_values_widened_to_fp32(
    d: int, window: int, softcap: float
) -> None:
    """--dtype bfloat16's KV cache: the kernel on bf16 K/V computes what it computes on an fp32
    cache holding the same values (each element widened as it is loaded; the two builds may
    order a dot product's vector sums differently, so not bit for bit), a sequence gets the
    same bits alone as in the batch, and the torch path on the bf16 cache agrees."""
    q, kc, vc, tables, lens = make_cache([1, 16, 17, 90, 3], h=6, hkv=2, bs=8, seed=d, d=d)
    kb, vb = kc.bfloat16(), vc.bfloat16()
    out = cpu_native.paged_decode_attention(q, kb, vb, tables, lens, d**-0.5, window, softcap)
    wide = cpu_native.paged_decode_attention(
        q, kb.float(), vb.float(), tables, lens, d**-0.5, window, softcap
    )
    torch.testing.assert_close(out, wide, rtol=2e-6, atol=2e-6)
    for b in (0, 3):
        alone = cpu_native.paged_decode_attention(
            q[b : b + 1], kb, vb, tables[b : b + 1], lens[b : b + 1], d**-0.5, window, softcap
        )
        assert torch.equal(alone[0], out[b])
    plan = K.plan_attention(
        tables.clamp(max=kc.shape[0] - 1).long(), lens.long(), torch.ones(5, dtype=torch.long), 8
    )
    ref = K.paged_attention(q, kb, vb, None, None, None, d**-0.5, plan, window, softcap)
    assert ref.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="bf16"):  # K and V of one dtype
        cpu_native.paged_decode_attention(q, kb, vc, tables, lens, 0.25)


def test_the_avx2_build_computes_what_the_avx512_one_does() -> None:
    """Head sizes 64 and 128 take their own AVX-512 path (K/V rows shared by the query heads,
    scores summed 16 keys at a time); an AVX2 build runs the generic loops. Both on one CPU:
    the same results up to the order of the sums, each batch invariant."""
    import ctypes

    flags = [f for f in cpu_native._COMPILE_FLAGS if f != "-march=native"] + ["-march=haswell"]
    path = cpu_native.build(cpu_native._SRC, flags, cache_dir=cpu_native.setup().cache_dir)
    assert path is not None and cpu_native.pool() is not None
    avx2 = ctypes.CDLL(str(path))
    for d, dtype, window in (
        (64, torch.float32, 0),
        (128, torch.bfloat16, 21),
        (64, torch.bfloat16, 0),
    ):
        q, kc, vc, tables, lens = make_cache([1, 16, 17, 90, 3], h=6, hkv=2, bs=8, seed=d, d=d)
        kc, vc = kc.to(dtype), vc.to(dtype)
        want = cpu_native.paged_decode_attention(q, kc, vc, tables, lens, d**-0.5, window)
        got = torch.empty_like(q)
        rc = avx2.kvf_paged_decode_attention(
            ctypes.c_void_p(q.data_ptr()), ctypes.c_void_p(kc.data_ptr()),
            ctypes.c_void_p(vc.data_ptr()), ctypes.c_void_p(tables.data_ptr()),
            ctypes.c_void_p(lens.data_ptr()), ctypes.c_void_p(got.data_ptr()), 5, 6, 2, d, 8,
            tables.shape[1], kc.shape[0], ctypes.c_float(d**-0.5), window, ctypes.c_float(0.0),
            int(dtype == torch.bfloat16), 2,
        )  # fmt: skip
        assert rc == 0
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


def test_rejects_wrong_dtypes_and_lengths() -> None:
    q, kc, vc, tables, lens = make_cache([20, 5], h=4, hkv=2, bs=8, seed=4)
    with pytest.raises(TypeError):
        cpu_native.paged_decode_attention(q, kc, vc, tables.long(), lens, 0.25)
    with pytest.raises(TypeError):
        cpu_native.paged_decode_attention(q.double(), kc, vc, tables, lens, 0.25)
    with pytest.raises(ValueError, match="context length"):
        cpu_native.paged_decode_attention(
            q, kc, vc, tables, torch.tensor([20, 0], dtype=torch.int32), 0.25
        )
    with pytest.raises(ValueError, match="context length"):
        too_long = torch.tensor([20, tables.shape[1] * 8 + 1], dtype=torch.int32)
        cpu_native.paged_decode_attention(q, kc, vc, tables, too_long, 0.25)
    with pytest.raises(ValueError, match=">= 0"):
        cpu_native.paged_decode_attention(q, kc, vc, tables, lens, 0.25, window=-1)
    with pytest.raises(ValueError, match=">= 0"):
        cpu_native.paged_decode_attention(q, kc, vc, tables, lens, 0.25, softcap=-1.0)


def test_the_library_is_cached_by_source_hash(tmp_path) -> None:  # noqa: ANN001
    first = cpu_native.build(cache_dir=tmp_path)
    assert first is not None and first.parent == tmp_path / "kernels"
    mtime = first.stat().st_mtime_ns
    assert cpu_native.build(cache_dir=tmp_path) == first  # reused
    assert first.stat().st_mtime_ns == mtime
    changed = tmp_path / "changed.c"
    changed.write_text(cpu_native._SRC.read_text() + "\n/* changed */\n")
    other = cpu_native.build(changed, cache_dir=tmp_path)
    assert other is not None and other != first


def test_a_missing_source_falls_back_with_a_warning(tmp_path, caplog) -> None:  # noqa: ANN001
    """An install without the package data must not crash the worker."""
    with caplog.at_level("WARNING", logger=cpu_native.log.name):
        assert cpu_native.build(tmp_path / "absent.c", cache_dir=tmp_path) is None
    assert "absent.c is missing" in caplog.text


def test_a_process_sets_its_native_kernels_up_once(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """Before ``configure`` a load says what to call; once a library has loaded, another setup
    is refused (it cannot be unloaded); the same one again is fine."""
    current = cpu_native.setup()
    assert cpu_native.pool() is not None  # loaded
    cpu_native.configure(current)
    with pytest.raises(RuntimeError, match="already loaded"):
        cpu_native.configure(cpu_native.NativeSetup(tmp_path))
    monkeypatch.setattr(cpu_native, "_setup", None)
    with pytest.raises(RuntimeError, match=r"cpu_native.configure\(NativeSetup"):
        cpu_native.setup()


def test_the_native_kernels_setting_reaches_the_kernels(tmp_path) -> None:  # noqa: ANN001
    """``KVFLOW_NATIVE_KERNELS=0`` (``--native-kernels false``) through the worker's settings:
    no native library loads, nothing is built in the machine cache, the reference runs."""
    import os
    import subprocess
    import sys

    code = (
        "from kvflow.kernels import cpu_layer_ops, cpu_native, cpu_quant; "
        "from kvflow.services.worker import machine; from kvflow.shared.config import Settings; "
        "machine.configure(Settings.from_env()); "
        "print(cpu_native.available(), cpu_layer_ops.available(), cpu_quant.available())"
    )
    env = os.environ | {"KVFLOW_NATIVE_KERNELS": "0", "KVFLOW_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.split() == ["False", "False", "False"], out.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []
