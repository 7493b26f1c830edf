"""kernels/triton_moe.py against kernels/moe.py's per-expert GEMMs (in Triton's interpreter on
a CPU): the slot alignment (every slot once, each tile one expert's, padding out of range), and
the grouped expert GEMMs over uneven loads with an expert that gets no token, top-1/2/3, one
token and many (its sm_90 compile: tests/kernels/test_kernels_triton.py, through
kernels.compile_check)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # as tests/conftest.py does

from kvflow.kernels.moe import MoEWeights, _per_expert, route, sum_slots  # noqa: E402
from kvflow.kernels.triton_moe import align, block_m, expert_slots  # noqa: E402

H, INTER, E = 32, 24, 6
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _act(gate_up: torch.Tensor) -> torch.Tensor:
    d = gate_up.shape[-1] // 2
    return F.silu(gate_up[:, :d]) * gate_up[:, d:]


def _routed(t: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(t, H, generator=g)
    router = torch.randn(E, H, generator=g)
    router[E - 1] = -5.0  # positive inputs: the last expert never makes a top-k
    weights, ids = route(x @ router.T, top_k, renormalize=True)
    return x, weights, ids


def test_align_groups_every_slot_once_by_expert() -> None:
    _, _, ids = _routed(37, 2, 0)
    bm = block_m(74)
    sorted_slots, block_expert = align(ids, E, bm)
    slots = sorted_slots[sorted_slots < 74]
    assert sorted(slots.tolist()) == list(range(74))  # every slot exactly once
    flat = ids.reshape(-1)
    for tile, e in enumerate(block_expert.tolist()):
        live = sorted_slots[tile * bm : (tile + 1) * bm]
        live = live[live < 74]
        if e == E:  # an unused tile at the end
            assert live.numel() == 0
        else:
            assert bool((flat[live.long()] == e).all())
    assert E - 1 not in block_expert.tolist()  # the expert with no token has no tile


@pytest.mark.parametrize(("t", "top_k"), [(1, 2), (37, 2), (9, 1), (20, 3)])
def test_grouped_gemms_equal_one_gemm_per_expert(t: int, top_k: int) -> None:
    g = torch.Generator().manual_seed(t)
    m = MoEWeights(
        router=torch.zeros(E, H),
        gate_up=[torch.randn(2 * INTER, H, generator=g) * 0.3 for _ in range(E)],
        down=[torch.randn(H, INTER, generator=g) * 0.3 for _ in range(E)],
        top_k=top_k,
        renormalize=True,
    )
    x, weights, ids = _routed(t, top_k, t)
    flat = ids.reshape(-1)
    want = _per_expert(x, weights, flat, torch.bincount(flat, minlength=E), m, F.linear, _act)
    assert m.stack()
    dev = torch.device(DEVICE)
    got = sum_slots(expert_slots(
        x.to(dev), weights.to(dev), ids.to(dev), m.gate_up_stacked.to(dev),
        m.down_stacked.to(dev), _act,
    ))  # fmt: skip
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)
