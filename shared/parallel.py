"""Which parallel settings a worker can serve (``--tensor-parallel-size``,
``--pipeline-parallel-size``): checked by ``kvflow serve``, ``LLM()`` and the worker before
anything loads. The group itself is services/worker/tp_group.py."""

from __future__ import annotations

from kvflow.shared.config import Settings


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
    if w.worker_backend != "model":
        raise ValueError(
            f"--tensor-parallel-size {tp}: the simulated worker (--worker-backend sim) has no "
            "model to split; use --tensor-parallel-size 1 with it"
        )
    if ms.quantization in ("gguf", "gguf-a8", "gptq", "awq"):
        raise ValueError(
            f"--tensor-parallel-size {tp} does not work with --quantization {ms.quantization} "
            "yet: it keeps the checkpoint's own quantized blocks, which are not split over the "
            "ranks; use --quantization int8 or fp8 (rounded per rank) or --tensor-parallel-size 1"
        )
