"""What the scheduler may put in one worker's step (its settings, read once by the service)."""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("both", "prefill", "decode")  # a worker's role: what it computes of a sequence


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    max_loras: int = 0  # distinct LoRA adapters running on a worker at most (0: LoRA off)
    max_plans_in_flight: int = 1  # 2: async scheduling (the service's default)
