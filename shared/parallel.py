"""Which parallel settings a worker can serve (``--tensor-parallel-size``,
``--pipeline-parallel-size``): checked by ``kvflow serve``, ``LLM()`` and the worker before
anything loads. The group itself is services/worker/tp_group.py."""

from __future__ import annotations

from shared.config import Settings
from shared.speculative import parse_speculative_config


def check_parallel_settings(settings: Settings) -> None:
    """ValueError (saying what to do) for parallel settings this stack cannot serve."""
    w, ms = settings.worker, settings.model
    if w.pipeline_parallel_size != 1:
        raise ValueError(
            "--pipeline-parallel-size is not supported yet (only 1): split a model over "
            "devices with --tensor-parallel-size, or serve more with more workers"
        )
    tp = w.tensor_parallel_size
    if tp < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, not {tp}")
    if tp == 1:
        return
    refusals = [
        (w.worker_backend != "model", "the simulated worker (--worker-backend sim)"),
        (
            ms.quantization in ("gguf", "gptq", "awq"),
            f"--quantization {ms.quantization} (a checkpoint's own blocks; int8 and fp8 are cut "
            "per rank)",
        ),
    ]
    spec = parse_speculative_config(ms.speculative_config)
    refusals.append((spec is not None and spec.proposed_by_worker, "a draft model"))
    for refused, what in refusals:
        if refused:
            raise ValueError(
                f"--tensor-parallel-size {tp} does not work with {what} yet (its weights "
                "would have to be split over the ranks too); use --tensor-parallel-size 1 "
                "for it"
            )
