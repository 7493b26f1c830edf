"""A spy on the logits a ModelRunner samples from (for tests of every tier; no transformers)."""

from __future__ import annotations

import torch

from kvflow.services.worker.runner import ModelRunner
from kvflow.shared.messages import ScheduledSeq


def capture_logits(runner: ModelRunner, request_id: str) -> list[torch.Tensor]:
    """Record the logits row ``request_id`` samples from at every step."""
    rows: list[torch.Tensor] = []
    sample = runner._sample

    def spy(logits: torch.Tensor, sampled: list[ScheduledSeq]) -> torch.Tensor:
        ids = [s.request_id for s in sampled]
        if request_id in ids:
            rows.append(logits[ids.index(request_id)].clone())
        return sample(logits, sampled)

    runner._sample = spy
    return rows
