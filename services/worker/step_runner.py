"""The one contract between the worker service and what runs its steps.

Three things run a worker's steps: the model runner (services/worker/runner.py), the simulated
runner (services/worker/sim_runner.py) and, with ``--tensor-parallel-size`` > 1, rank 0 of a
tensor-parallel group (services/worker/tp_group.py ``TPLeader``, which broadcasts each call to
the other ranks before running it on its own model runner). The worker service holds one
``StepRunner`` and calls it only on its model thread; every StepResult is built by
services/worker/step_output.py ``step_result``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from kvflow.shared.messages import StepPlan, StepResult

if TYPE_CHECKING:
    from kvflow.services.worker.lora import LoRACache


class StepRunner(Protocol):
    """What the worker service drives."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def kv_caches(self) -> list[Any]: ...

    @property
    def loras(self) -> LoRACache | None: ...

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one plan; never raises (a failure is ``StepResult.error``)."""
        ...

    def reset(self) -> None:
        """Forget every request (a new scheduler term)."""
        ...

    def forget_lora(self, name: str) -> None:
        """Drop an unloaded adapter from every cache that holds it."""
        ...

    def kv_shards(self) -> list[Any] | None:
        """Every rank's KV caches, when KV heads are split over processes (None: one)."""
        ...

    def weight_bytes(self) -> int:
        """Bytes this process's weights hold."""
        ...

    def take_expert_load(self) -> list[int] | None:
        """The last step's tokens per expert (None: no mixture of experts ran)."""
        ...

    def keepalive(self) -> None:
        """Called when idle: other ranks hear that this one is alive."""
        ...

    def close(self) -> None:
        """The worker exits: stop what the runner started."""
        ...
