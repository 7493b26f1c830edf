"""LoRA adapter settings and PEFT adapter configs, shared by the launcher and ``LLM`` (which check
``--lora-modules`` before anything starts), the scheduler (which keeps the adapter registry),
the gateway (which resolves a request's ``model`` to an adapter) and the worker (which loads
the weights: services/worker/lora.py).

An adapter is a PEFT LoRA directory: ``adapter_config.json`` (``r``, ``lora_alpha``,
``target_modules``, ...) and ``adapter_model.safetensors`` (``...layers.N.self_attn.q_proj.
lora_A.weight`` [r, in] and ``lora_B.weight`` [out, r] per adapted projection). Served: the
attention (q/k/v/o) and MLP (gate/up/down) projections of a Llama model, ``y = W x + s B A x``
with ``s = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``)."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from kvflow.shared.messages.params import LoRARef

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
# the Llama projections an adapter may target (PEFT's module names)
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRAError(ValueError):
    """An adapter or LoRA setting that cannot be served; the message says why and what to do.
    ``param`` names the request field (or setting) it concerns."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


@dataclass(frozen=True)
class AdapterConfig:
    """What kvflow reads of a PEFT ``adapter_config.json``."""

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False
    base_model: str = ""

    def scaling(self, rank: int) -> float:
        """PEFT's scale of ``B A x`` for a module of rank ``rank``."""
        return self.lora_alpha / (rank**0.5 if self.use_rslora else rank)


def parse_lora_modules(raw: str) -> list[LoRARef]:
    """``--lora-modules`` entries (shell-quoted, space-separated), each ``NAME=PATH`` or vLLM's
    JSON ``{"name": ..., "path": ...}``, as adapters with ids 1, 2, ... in order."""
    out: list[LoRARef] = []
    for entry in shlex.split(raw or ""):
        if entry.lstrip().startswith("{"):
            try:
                obj = json.loads(entry)
                name, path = str(obj["name"]), str(obj["path"])
            except (ValueError, KeyError, TypeError) as e:
                raise LoRAError(
                    f"--lora-modules entry {entry!r} is not JSON with 'name' and 'path'",
                    "lora_modules",
                ) from e
        else:
            name, sep, path = entry.partition("=")
            if not sep or not name or not path:
                raise LoRAError(f"--lora-modules entry {entry!r} is not NAME=PATH", "lora_modules")
        if any(a.name == name for a in out):
            raise LoRAError(f"--lora-modules names {name!r} twice", "lora_modules")
        out.append(LoRARef(name, len(out) + 1, path))
    return out


def check_lora_settings(
    enable_lora: bool, lora_modules: str, max_loras: int, max_lora_rank: int
) -> list[LoRARef]:
    """The ``--lora-modules`` adapters, each config read and checked; raises LoRAError for
    settings that cannot be served (before any process starts)."""
    modules = parse_lora_modules(lora_modules)
    if modules and not enable_lora:
        raise LoRAError("--lora-modules needs --enable-lora", "lora_modules")
    if enable_lora and max_loras < 1:
        raise LoRAError(f"--max-loras must be at least 1, not {max_loras}", "max_loras")
    if enable_lora and max_lora_rank < 1:
        raise LoRAError(f"--max-lora-rank must be at least 1, not {max_lora_rank}", "max_lora_rank")
    for ref in modules:
        cfg = read_adapter_config(ref.path)
        check_rank(cfg.r, max_lora_rank, ref.name)
    return modules


def check_rank(rank: int, max_lora_rank: int, name: str) -> None:
    if rank > max_lora_rank:
        raise LoRAError(
            f"LoRA adapter {name!r} has rank {rank}, over --max-lora-rank {max_lora_rank}; "
            "start the server with a higher --max-lora-rank to serve it",
            "lora_path",
        )


def read_adapter_config(path: str | Path) -> AdapterConfig:
    """Read and check a PEFT LoRA directory's ``adapter_config.json``; raises LoRAError."""
    d = Path(path)
    if not d.is_dir():
        raise LoRAError(f"LoRA adapter path {str(d)!r} is not a directory", "lora_path")
    f = d / ADAPTER_CONFIG
    try:
        raw = json.loads(f.read_text())
    except FileNotFoundError as e:
        raise LoRAError(
            f"{str(d)!r} has no {ADAPTER_CONFIG} (not a PEFT adapter)", "lora_path"
        ) from e
    except (OSError, ValueError) as e:
        raise LoRAError(f"{f} cannot be read as JSON: {e}", "lora_path") from e
    if not isinstance(raw, dict):
        raise LoRAError(f"{f} is not a JSON object", "lora_path")
    if not any((d / w).is_file() for w in ADAPTER_WEIGHTS):
        raise LoRAError(f"{str(d)!r} has no {' or '.join(ADAPTER_WEIGHTS)}", "lora_path")
    kind = str(raw.get("peft_type", "LORA")).upper()
    refused = {
        "peft_type": kind != "LORA",
        "use_dora": bool(raw.get("use_dora")),
        "fan_in_fan_out": bool(raw.get("fan_in_fan_out")),
        "bias": raw.get("bias", "none") not in ("none", None),
        "modules_to_save": bool(raw.get("modules_to_save")),
        "rank_pattern": bool(raw.get("rank_pattern")),
        "alpha_pattern": bool(raw.get("alpha_pattern")),
    }
    bad = [k for k, v in refused.items() if v]
    if bad:
        raise LoRAError(
            f"{f}: {', '.join(f'{k}={raw.get(k)!r}' for k in bad)} is not supported (kvflow "
            "serves plain LoRA of the attention and MLP projections)",
            "lora_path",
        )
    try:
        r, alpha = int(raw["r"]), float(raw.get("lora_alpha", raw["r"]))
    except (KeyError, TypeError, ValueError) as e:
        raise LoRAError(f"{f}: 'r' and 'lora_alpha' must be numbers", "lora_path") from e
    if r < 1:
        raise LoRAError(f"{f}: rank r={r} must be at least 1", "lora_path")
    targets = raw.get("target_modules") or []
    if isinstance(targets, str):  # PEFT allows a regex; the weights then say what is adapted
        targets = list(TARGET_MODULES)
    unknown = sorted(set(targets) - set(TARGET_MODULES))
    if unknown:
        raise LoRAError(
            f"{f}: target_modules {unknown} cannot be served (only {', '.join(TARGET_MODULES)})",
            "lora_path",
        )
    return AdapterConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=tuple(targets),
        use_rslora=bool(raw.get("use_rslora")),
        base_model=str(raw.get("base_model_name_or_path") or ""),
    )


def adapter_salt(cache_salt: str | None, lora: LoRARef | None) -> str | None:
    """The prefix-cache salt of a request: its ``cache_salt`` and, with an adapter, the adapter
    (name and path), so blocks computed under one adapter are never reused by another or by
    the base model (their K/V differ)."""
    if lora is None:
        return cache_salt
    return f"{cache_salt or ''}\x00lora\x00{lora.name}\x00{lora.path}"
