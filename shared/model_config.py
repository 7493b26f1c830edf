"""A model's config, read from its files alone (a GGUF's header: shared/models/gguf_config.py,
or a Hugging Face directory's config.json and generation_config.json) for any family the
registry knows (shared/models/registry.py), and checked against what the settings ask for.

Nothing here imports torch: the processes that only need the model's shape (the scheduler, the
tokenizer, the detokenizer, ``kvflow serve``'s checks) start without it. The weights are read by
the worker (services/worker/model_loader.py).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

from kvflow.shared.model_source import ModelSource, resolve_model
from kvflow.shared.models.config import ModelConfig, ModelConfigError
from kvflow.shared.models.generic import transformers_config
from kvflow.shared.models.gguf_config import gguf_config
from kvflow.shared.models.registry import UnsupportedArchitecture, family, hf_config
from kvflow.shared.models.tasks import served_task, st_max_seq_length

if TYPE_CHECKING:
    from kvflow.shared.config import Settings

__all__ = ["MODEL_IMPLS", "check_model", "check_settings_model", "load_config"]


MODEL_IMPLS = ("auto", "kvflow", "transformers")
"""vLLM's ``--model-impl``: ``kvflow`` (a native family, shared/models/registry.py), ``transformers``
(transformers' own modules around kvflow's paged attention), ``auto`` (native where the registry
has the architecture, else transformers)."""


def load_config(src: ModelSource, strict: bool = False, model_impl: str = "auto") -> ModelConfig:
    """The model's shape, features and special ids; raises ModelConfigError (a ValueError)
    naming the field and value kvflow cannot run, and what to do instead."""
    if model_impl not in MODEL_IMPLS:
        raise ModelConfigError(f"--model-impl must be one of {', '.join(MODEL_IMPLS)}")
    if src.kind == "gguf":
        if model_impl == "transformers":
            raise ModelConfigError(
                f"{src.path.name}: --model-impl transformers serves Hugging Face directories, "
                "not GGUF files"
            )
        return gguf_config(src.path, strict)
    cfg = _hf_config(src.path, strict, model_impl)
    cap = st_max_seq_length(src.path)  # sentence-transformers truncates its inputs here
    if 0 < cap < cfg.max_position_embeddings:
        cfg = dataclasses.replace(cfg, max_position_embeddings=cap)
    return cfg


def check_model(
    path: str,
    served_name: str = "",
    model_impl: str = "auto",
    tensor_parallel_size: int = 1,
    enable_lora: bool = False,
    task: str = "auto",
    pooling_type: str = "",
) -> ModelConfig:
    """What ``kvflow serve``, ``kvflow run`` and ``LLM()`` check before anything starts: the
    model is found and its config can be served as asked, ``--task``, tensor parallelism and
    LoRA adapters included (its family's refusals); ModelNotFoundError or ModelConfigError,
    both naming what to change. Only config.json (and a sentence-transformers directory's own
    configs) or the GGUF header is read."""
    src = resolve_model(path, served_name)
    cfg = load_config(src, model_impl=model_impl)
    served_task(cfg, src.path if src.kind == "hf" else None, task, pooling_type)
    refused = family(cfg.family).refusal(tensor_parallel_size > 1, enable_lora)
    if refused:
        raise ModelConfigError(f"{path}: {refused}")
    return cfg


def check_settings_model(settings: Settings) -> ModelConfig:
    """``check_model`` with what the settings ask for."""
    ms = settings.model
    return check_model(
        ms.path,
        ms.served_model_name,
        ms.model_impl,
        settings.worker.tensor_parallel_size,
        ms.enable_lora,
        ms.task,
        ms.pooling_type,
    )


def _hf_config(path: Path, strict: bool = False, model_impl: str = "auto") -> ModelConfig:
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelConfigError(f"{path}/config.json cannot be read: {e}") from e
    eos: list[int] = []
    gen = path / "generation_config.json"
    if gen.is_file():
        got = json.loads(gen.read_text()).get("eos_token_id")
        eos = [] if got is None else [int(i) for i in (got if isinstance(got, list) else [got])]
    where = f"{path}/config.json"
    if model_impl == "transformers":
        return transformers_config(raw, where, eos)
    try:
        return hf_config(raw, where, eos, strict)
    except UnsupportedArchitecture as e:
        if model_impl == "kvflow":
            raise ModelConfigError(f"{e}; or serve it with --model-impl transformers") from e
        try:
            return transformers_config(raw, where, eos)
        except ModelConfigError as fallback:
            raise ModelConfigError(f"{e}; and {fallback}") from e
    except ModelConfigError as e:
        raise ModelConfigError(f"{e} (or serve it with --model-impl transformers)") from e
