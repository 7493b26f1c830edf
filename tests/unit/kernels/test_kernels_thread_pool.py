"""The native kernels' one thread pool (kernels/csrc/thread_pool.c): every task runs exactly once,
a call never waits for a pool thread that has not started (the property that keeps steps fast
with other processes on the cores), concurrent callers both finish, and the kernels that run on it
give the same bits whatever the thread count."""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest
import torch

from kvflow.kernels import cpu_gemm, cpu_layer_ops, cpu_native, cpu_quant

pytestmark = pytest.mark.skipif(
    cpu_native.pool() is None, reason="no C compiler: the native kernels are not built"
)


def run(n: int, threads: int, task_us: int = 0, stall_us: int = 0) -> tuple[int, np.ndarray]:
    workers = np.empty(max(n, 1), dtype=np.int32)
    rc = cpu_native.pool().kvf_pool_selftest(
        n, threads, workers.ctypes.data_as(ctypes.c_void_p), task_us, stall_us
    )
    return rc, workers[:n]


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("n", [0, 1, 2, 7, 64, 1000])
def test_every_task_runs_exactly_once(threads: int, n: int) -> None:
    for _ in range(20):  # back to back: pool threads spinning, sleeping and waking late
        rc, workers = run(n, threads)
        assert rc == 0
        assert ((workers >= 0) & (workers < threads)).all(), workers  # 1000+: run twice
    if threads > 1 and n >= 2:
        assert cpu_native.pool().kvf_pool_threads() >= threads - 1


def test_a_call_does_not_wait_for_a_pool_thread_that_has_not_started() -> None:
    """The pool threads pause half a second before claiming (as a descheduled thread would): the
    caller runs all 40 tasks itself and returns while they are still paused (an OpenMP region,
    which ends in a barrier for its whole team, would wait)."""
    rc, workers = run(40, 2, task_us=200, stall_us=500_000)
    assert rc == 1
    assert (workers == 0).all()
    rc, workers = run(40, 2)  # the paused thread, when it goes on, claims nothing of later jobs
    assert rc == 0 and ((workers == 0) | (workers == 1)).all()


def test_two_callers_at_once_both_finish() -> None:
    """One holds the pool; the other's call runs on its own thread; every task of both once."""
    results: list[np.ndarray] = []

    def caller() -> None:
        for _ in range(50):
            rc, workers = run(200, 2, task_us=5)
            assert rc == 0
            results.append(workers.copy())

    ts = [threading.Thread(target=caller) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(results) == 100
    for workers in results:
        assert ((workers == 0) | (workers == 1)).all()


def _with_threads(threads: int, fn):  # noqa: ANN001, ANN202
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 5, 70])
def test_kernels_give_the_same_bits_on_any_number_of_threads(rows: int) -> None:
    """Products (blocks: rows and panel kernels; fp32 panels), RMSNorm and SiLU-and-multiply
    computed on 1, 2 and 4 threads: not one bit differs."""
    g = torch.Generator().manual_seed(0)
    k, n = 256, 200
    x = torch.randn(rows, k, generator=g)
    dense = torch.randn(n, k, generator=g)
    # Q4_K blocks with random scales and quants (any bytes decode; fp16 scales kept finite)
    blocks = torch.randint(0, 256, (n, k // 256 * 144), dtype=torch.uint8, generator=g)
    blocks.view(n, -1, 144)[:, :, :4] = torch.tensor([0, 0x2C, 0, 0x28], dtype=torch.uint8)
    q4k = cpu_quant.QuantWeight(blocks, 12, (n, k))
    panel = cpu_gemm.PanelWeight(dense) if cpu_gemm.panel_available() else None
    hidden = 1024  # 70 rows of it: enough floats that the layer ops use threads
    h = torch.randn(rows, hidden, generator=g)
    gate_up = torch.randn(rows, 2 * hidden, generator=g)
    w = torch.randn(hidden, generator=g)

    def compute() -> list[torch.Tensor]:
        res = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(1))
        norm, res = cpu_layer_ops.add_rms_norm(h, w, 1e-6, res)
        out = [q4k(x), norm, res, cpu_layer_ops.silu_and_mul(gate_up)]
        return out + ([panel(x)] if panel is not None else [])

    want = _with_threads(1, compute)
    for threads in (2, 4):
        got = _with_threads(threads, compute)
        for a, b in zip(want, got, strict=True):
            assert torch.equal(a, b)
