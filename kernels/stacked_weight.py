"""A linear weight stacked by outputs from parts of different kinds: a fused projection (QKV,
gate/up) whose parts a GGUF file holds in different block types (a Q4_K_M file keeps Q and K
in Q4_K and V in Q6_K on some layers). Each part keeps its own blocks and kernel; ``w(x)`` is
the parts' products side by side, so it is batch invariant when every part is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(eq=False)
class StackedWeight:
    """``parts`` [N_i, K] (the ``kernels.reference.Weight`` protocol each), stacked along N."""

    parts: list[Any]

    def __post_init__(self) -> None:
        ks = {p.shape[1] for p in self.parts}
        if len(ks) != 1:
            raise ValueError(f"parts of one stacked weight must share K, got {sorted(ks)}")

    @classmethod
    def of(cls, parts: list[Any]) -> Any:
        """``parts`` stacked: runs of one kind and type fused by their own ``cat`` (one weight
        when all share it), the rest side by side."""
        runs: list[Any] = []
        for p in parts:
            if runs and type(runs[-1]) is type(p) and _same_type(runs[-1], p):
                runs[-1] = type(p).cat([runs[-1], p])
            else:
                runs.append(p)
        return runs[0] if len(runs) == 1 else cls(runs)

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])

    @property
    def batch_invariant(self) -> bool:
        return all(getattr(p, "batch_invariant", False) for p in self.parts)

    @property
    def max_invariant_rows(self) -> int:
        return min(getattr(p, "max_invariant_rows", 1 << 30) for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=1)


def _same_type(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` can be fused by their kind's ``cat`` (one block type)."""
    ta = getattr(a, "qtype", getattr(a, "type_name", None))
    tb = getattr(b, "qtype", getattr(b, "type_name", None))
    return ta == tb and a.shape[1] == b.shape[1]
