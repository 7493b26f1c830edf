"""kernels/moe.py: the router's top-k and the expert-grouped block against a per-token
reference (every token through its own experts, one at a time), over uneven loads with an
expert that gets no token, with and without renormalising, with a shared expert; and a token's
bits do not depend on the other tokens of the step (the CPU path's row layout)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvflow.kernels import reference as K
from kvflow.kernels.cpu_gemm import PanelWeight, panel_available
from kvflow.kernels.moe import MoEWeights, moe_block, route

H, INTER, E = 32, 24, 6


def _act(gate_up: torch.Tensor) -> torch.Tensor:
    d = gate_up.shape[-1] // 2
    return F.silu(gate_up[:, :d]) * gate_up[:, d:]


def _weights(top_k: int, renormalize: bool, shared: bool, seed: int = 0) -> MoEWeights:
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(E, H, generator=g)
    router[E - 1] = -5.0  # inputs are positive below: the last expert never makes a top-k
    return MoEWeights(
        router=router,
        gate_up=[torch.randn(2 * INTER, H, generator=g) * 0.3 for _ in range(E)],
        down=[torch.randn(H, INTER, generator=g) * 0.3 for _ in range(E)],
        top_k=top_k,
        renormalize=renormalize,
        shared_gate_up=torch.randn(2 * INTER, H, generator=g) * 0.3 if shared else None,
        shared_down=torch.randn(H, INTER, generator=g) * 0.3 if shared else None,
        shared_gate=torch.randn(1, H, generator=g) if shared else None,
    )


def _reference(x: torch.Tensor, m: MoEWeights) -> torch.Tensor:
    """Token by token: softmax over all experts, the top-k, each chosen expert's MLP."""
    out = []
    for t in range(x.shape[0]):
        xt = x[t : t + 1]
        probs = torch.softmax(xt @ m.router.T, dim=-1)[0]
        w, ids = torch.topk(probs, m.top_k)
        if m.renormalize:
            w = w / w.sum()
        y = torch.zeros(1, H)
        for wj, e in zip(w, ids.tolist(), strict=True):
            y += wj * (_act(xt @ m.gate_up[e].T) @ m.down[e].T)
        if m.shared_gate_up is not None:
            shared = _act(xt @ m.shared_gate_up.T) @ m.shared_down.T
            y += torch.sigmoid(xt @ m.shared_gate.T) * shared
        out.append(y)
    return torch.cat(out)


def test_route_takes_the_softmax_top_k_in_order() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0], [0.0, 0.0, 5.0, 4.0]])
    w, ids = route(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 2], [2, 3]]
    torch.testing.assert_close(w, torch.softmax(logits, -1).gather(1, ids))
    w, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(w.sum(-1), torch.ones(2))


@pytest.mark.parametrize(
    ("top_k", "renormalize", "shared"), [(2, True, False), (2, False, True), (1, False, False), (3, True, True)]
)  # fmt: skip
def test_grouped_experts_equal_the_per_token_reference(
    top_k: int, renormalize: bool, shared: bool
) -> None:
    m = _weights(top_k, renormalize, shared)
    x = torch.rand(37, H, generator=torch.Generator().manual_seed(1))
    y, load = moe_block(x, m, F.linear, F.linear, _act)
    torch.testing.assert_close(y, _reference(x, m), rtol=1e-4, atol=1e-4)
    assert load.sum().item() == 37 * top_k  # every token went to top_k experts
    assert load[E - 1].item() == 0  # an expert with no token is skipped
    assert len(set(load.tolist())) > 2  # uneven loads


def test_a_tokens_bits_do_not_depend_on_the_step() -> None:
    """The CPU path's GEMMs: each expert's tokens as single rows in fixed tiles (kvflow's panel
    kernel where it runs: invariant by construction; else 16-row tiles)."""
    m = _weights(2, True, True)
    if panel_available():
        for name in ("router", "shared_gate_up", "shared_down", "shared_gate"):
            setattr(m, name, PanelWeight(getattr(m, name)))
        m.gate_up = [PanelWeight(w) for w in m.gate_up]
        m.down = [PanelWeight(w) for w in m.down]
    tile = 16

    def rows(x: torch.Tensor, w: object) -> torch.Tensor:
        return K.linear(x, w, K.RowLayout(x.shape[0], (), tile, tile))

    x = torch.rand(29, H, generator=torch.Generator().manual_seed(2))
    full, _ = moe_block(x, m, rows, rows, _act)
    for idx in ([3], [0, 5, 28], list(range(10, 25))):
        part, _ = moe_block(x[idx], m, rows, rows, _act)
        assert torch.equal(part, full[idx])
