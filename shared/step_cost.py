"""How long a worker step takes, as a function of its plan: the cost model that ``kvflow
simulate`` drives the scheduler with and that the simulated worker (``--worker-backend sim``)
sleeps for instead of running a model."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvflow.shared.messages import StepPlan


@dataclass
class StepCostModel:
    """Seconds one worker step takes: a fixed overhead, a cost per decode token and per prefill
    token, and attention's cost per context token a decode reads. Defaults are fitted to
    SmolLM2-135M in fp32 inside a whole `kvflow serve` stack on this project's 2-core machine
    (docs/benchmarks.md: steps of 80 ms at batch 1, 128 ms at batch 16 / context ~100, 267 ms at
    batch 32 / context ~300; prefill about 1.3 ms per token). The worker alone is faster (its
    other processes share the cores); fit your own with --cost-model."""

    overhead_s: float = 0.0775
    per_decode_token_s: float = 0.00177
    per_prefill_token_s: float = 0.0013
    per_context_token_s: float = 1.38e-5

    def step_time(self, plan: StepPlan) -> float:
        t = self.overhead_s
        for s in plan.seqs:
            n = len(s.token_ids)
            if n == 1:
                t += self.per_decode_token_s + self.per_context_token_s * (s.start_pos + 1)
            else:
                t += self.per_prefill_token_s * n
        return t

    @classmethod
    def from_json(cls, path: str | Path) -> StepCostModel:
        return cls(**json.loads(Path(path).read_text()))
