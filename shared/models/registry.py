"""The one place that knows which model families kvflow serves: every family file's
``FAMILIES`` (shared/models/families/) and the transformers fallback
(shared/models/generic.py), looked up by name, by config.json's ``architectures`` (or
``model_type``) and by a GGUF's ``general.architecture``; ``hf_config`` turns a config.json into
its family's config, naming any field that nothing read.

Adding a family: a module in shared/models/families/ with its ``FAMILIES`` (config fields,
norm names, GGUF names and quirks, refusals), its name in ``_MODULES`` below, and its tests;
the worker runs what its config's features say with the model kind it names."""

from __future__ import annotations

import importlib
import logging
from functools import cache
from typing import Any

from kvflow.shared.models.config import (
    NORM_LAYOUTS,
    ConfigReader,
    ModelConfig,
    ModelConfigError,
    common_fields,
)
from kvflow.shared.models.family import Family
from kvflow.shared.models.generic import FALLBACK

log = logging.getLogger("kvflow.model")

_MODULES = (
    "llama",
    "qwen",
    "gemma",
    "phi3",
    "granite",
    "olmo2",
    "olmo3",
    "starcoder2",
    "moe",
    "bert",
)


@cache
def families() -> dict[str, Family]:
    """Every family by name: the native ones, then the transformers fallback."""
    out: dict[str, Family] = {}
    for module in _MODULES:
        for fam in importlib.import_module(f"kvflow.shared.models.families.{module}").FAMILIES:
            out[fam.name] = fam
    out[FALLBACK.name] = FALLBACK
    return out


def family(name: str) -> Family:
    return families()[name]


def supported_architectures() -> list[str]:
    return sorted(a for f in families().values() for a in f.architectures)


class UnsupportedArchitecture(ModelConfigError):
    """An architecture no family file serves (``--model-impl auto`` then tries transformers)."""


def unsupported(what: str, where: str) -> ModelConfigError:
    """The refusal of an architecture kvflow has no family for."""
    return UnsupportedArchitecture(
        f"{where}: {what} is not supported natively; supported architectures: "
        f"{', '.join(supported_architectures())}"
    )


def family_for_config(raw: dict[str, Any], where: str = "config.json") -> Family:
    """The family of a config.json: by ``architectures``, else by ``model_type``."""
    archs = raw.get("architectures") or []
    for f in families().values():
        if any(a in f.architectures for a in archs):
            return f
    model_type = raw.get("model_type", "")
    if not archs:
        for f in families().values():
            if model_type in f.model_types:
                return f
    what = f"architecture {archs[0]!r}" if archs else f"model_type {model_type!r}"
    raise unsupported(what, where)


def family_for_gguf(arch: str, where: str, experts: int = 0) -> Family:
    """The family of a GGUF's ``general.architecture``; ``experts``: its expert count (the
    families whose files hold experts are told apart from those with the same architecture
    whose files do not: llama.cpp writes Mixtral as a ``llama`` with experts)."""
    for f in families().values():
        if f.gguf is not None and arch in f.gguf.archs and f.gguf.experts == bool(experts):
            return f
    archs = sorted({a for f in families().values() if f.gguf is not None for a in f.gguf.archs})
    raise ModelConfigError(
        f"{where}: GGUF architecture {arch!r} is not supported; supported: {', '.join(archs)}"
    )


def hf_config(
    raw: dict[str, Any],
    where: str = "config.json",
    eos_extra: list[int] | None = None,
    strict: bool = False,
) -> ModelConfig:
    """A config.json's ``ModelConfig`` (ModelConfigError for what cannot be served). Fields
    that nothing read are logged by name (``strict``: refused)."""
    fam = family_for_config(raw, where)
    r = ConfigReader(raw, where)
    values = common_fields(r, eos_extra or []) | fam.read(r)
    values["family"] = fam.name
    cfg = fam.config(**values)
    check(cfg, where)
    left = r.unread(fam.ignored)
    if left:
        msg = f"{where}: fields not read by kvflow's {fam.name} implementation: {left}"
        if strict:
            raise ModelConfigError(msg)
        log.warning("%s (they change nothing kvflow computes, or it would refuse them)", msg)
    return cfg


def check(cfg: ModelConfig, where: str) -> None:
    """What any config must satisfy whatever its family."""
    if cfg.norm_layout not in NORM_LAYOUTS:
        raise ModelConfigError(f"{where}: norm layout {cfg.norm_layout!r}")
    if cfg.num_heads % cfg.num_kv_heads:
        raise ModelConfigError(
            f"{where}: {cfg.num_heads} attention heads are not a multiple of "
            f"{cfg.num_kv_heads} KV heads"
        )
    if cfg.layer_windows and len(cfg.layer_windows) != cfg.num_layers:
        raise ModelConfigError(
            f"{where}: {len(cfg.layer_windows)} windows for {cfg.num_layers} layers"
        )
