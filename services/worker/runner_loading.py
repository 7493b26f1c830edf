"""The worker's StepRunner from its settings (on the model thread): the model
(``_load_model``), a tensor-parallel group whose rank 0 this process is (``_load_group``:
services/worker/tp_group.py) or the simulated worker (``_load_sim``). A setting that cannot be served stops the worker with a
message (SystemExit)."""

from __future__ import annotations

import logging
import os

from kvflow.services.worker.draft import load_draft
from kvflow.services.worker.lora import LoRASpec
from kvflow.services.worker.model_setup import check_quantization, runner_specs
from kvflow.services.worker.runner import ModelRunner
from kvflow.services.worker.sim_runner import SimRunner, step_time_fn, vocab_for
from kvflow.services.worker.step_runner import StepRunner
from kvflow.services.worker.tp_group import TPLeader, start_group
from kvflow.shared.config import Settings
from kvflow.shared.cpu_budget import cpu_budget
from kvflow.shared.lora import parse_lora_modules
from kvflow.shared.model_config import load_config
from kvflow.shared.model_source import ModelNotFoundError, ModelSource
from kvflow.shared.speculative import parse_speculative_config

log = logging.getLogger("kvflow.worker")

SIM_DEFAULT_BLOCKS = 65536  # the simulated worker's KV blocks without --num-kv-blocks (8 MiB)


def load_runner(settings: Settings, src: ModelSource) -> StepRunner:
    """What runs the worker's steps: the group this process leads when
    ``--tensor-parallel-size`` > 1, else the simulated or the model runner."""
    if settings.worker.tensor_parallel_size > 1:
        return _load_group(settings, src)
    if settings.worker.worker_backend == "sim":
        return _load_sim(settings, src)
    return _load_model(settings, src)


def _load_model(settings: Settings, src: ModelSource) -> ModelRunner:
    """The model runner, on the model thread: the model, cache and worker sections."""
    import torch

    _set_threads(settings.worker.threads)
    kv, device = runner_specs(
        settings.model, settings.cache, settings.worker, settings.scheduler.max_num_seqs
    )
    try:
        check_quantization(device.quantization, src, torch.device(device.device), device.dtype)
    except ValueError as e:
        raise SystemExit(f"worker: {e}") from None
    draft = None
    try:
        spec = parse_speculative_config(settings.model.speculative_config)
        if spec is not None and spec.proposed_by_worker:
            draft = load_draft(spec, device, load_config(src))
    except (ValueError, ModelNotFoundError) as e:
        raise SystemExit(f"worker: draft model: {e}") from None
    runner = ModelRunner(
        src, kv, device, worker_id=settings.worker.worker_id, draft=draft, lora=_lora_spec(settings)
    )
    _check_lora_modules(runner, settings)
    return runner


def _set_threads(threads: int) -> None:
    """The worker's CPU threads (its native kernels' pool and torch's own): ``--threads``, or
    with 0 every CPU this process may use (its affinity capped by its cgroup quota); logged."""
    import torch

    budget = cpu_budget()
    torch.set_num_threads(threads if threads > 0 else budget.usable)
    log.info(
        "CPU threads: %d (%s; %s); native kernels on kvflow's thread pool, OMP_WAIT_POLICY=%s",
        torch.get_num_threads(),
        "--threads" if threads > 0 else "all usable",
        budget.describe(),
        os.environ.get("OMP_WAIT_POLICY", "unset"),
    )


def _lora_spec(settings: Settings) -> LoRASpec | None:
    ms = settings.model
    return LoRASpec(ms.max_loras, ms.max_lora_rank) if ms.enable_lora else None


def _check_lora_modules(runner: ModelRunner, settings: Settings) -> None:
    """--lora-modules that cannot be served stop the worker here."""
    if runner.loras is not None:
        for ref in parse_lora_modules(settings.model.lora_modules):
            runner.loras.check(ref)


def _load_group(settings: Settings, src: ModelSource) -> TPLeader:
    """A tensor-parallel group (``--tensor-parallel-size`` > 1): this process is rank 0."""
    kv, device = runner_specs(
        settings.model, settings.cache, settings.worker, settings.scheduler.max_num_seqs
    )
    try:
        spec = parse_speculative_config(settings.model.speculative_config)
        draft = spec if spec is not None and spec.proposed_by_worker else None
        group = start_group(settings, src, kv, device, _lora_spec(settings), draft)
    except (ValueError, ModelNotFoundError) as e:
        raise SystemExit(f"worker: {e}") from None
    assert group.runner is not None
    _check_lora_modules(group.runner, settings)
    return group


def _load_sim(settings: Settings, src: ModelSource) -> SimRunner:
    """The simulated runner (``--worker-backend sim``): no weights."""
    vocab, eos = vocab_for(src)
    cache, worker = settings.cache, settings.worker
    bs = cache.block_size
    num_blocks = cache.num_kv_blocks or SIM_DEFAULT_BLOCKS
    return SimRunner(
        vocab,
        eos,
        bs,
        num_blocks,
        min(settings.model.max_model_len, num_blocks * bs),
        worker_id=worker.worker_id,
        step_time=step_time_fn(worker.sim_step_ms, worker.sim_cost_model),
    )
