"""Hugging Face reference results (greedy and beam-search tokens, pooled hidden states) kept on
disk once per machine: a test compares kvflow with transformers' answer, computed the first time
it is asked for and read back later.

A result is stored under the digest of everything that decides it: the model's tensors and
configuration (whatever made them: a GGUF through transformers' loader, a PEFT adapter on it, a
seeded random model), what was asked (the token ids and every argument), the versions of torch,
transformers and peft, this machine's CPU (its float arithmetic) and torch's thread count. Any
change is another key, so another computation; nothing is ever looked up by a prompt alone.
~/.cache/kvflow-tests/hf-reference (delete it to compute everything again)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CACHE = Path.home() / ".cache" / "kvflow-tests" / "hf-reference"
_DIGESTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its digest


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _machine() -> dict[str, object]:
    cpu = ""
    if Path("/proc/cpuinfo").exists():
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")
    return {
        "machine": platform.machine(),
        "cpu": cpu,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "versions": {p: _version(p) for p in ("torch", "transformers", "peft")},
    }


def _json(value: object) -> str:
    """Canonical JSON: sorted keys, sets sorted (a LoRA config's target modules are a set,
    whose order changes from process to process), anything else by its str."""

    def other(o: object) -> object:
        return sorted(o, key=str) if isinstance(o, (set, frozenset)) else str(o)

    return json.dumps(value, sort_keys=True, default=other)


def model_digest(model: torch.nn.Module) -> str:
    """sha256 of the model's configuration (its path left out), its generation configuration,
    a PEFT model's adapter configurations, and every tensor of its state dict: name, dtype,
    shape and bytes. Once per model object."""
    if model in _DIGESTS:
        return _DIGESTS[model]
    h = hashlib.sha256()
    config = model.config.to_dict()
    config.pop("_name_or_path", None)
    generation = getattr(model, "generation_config", None)
    peft = getattr(model, "peft_config", None) or {}
    described = {
        "class": type(model).__name__,
        "config": config,
        "generation": generation.to_dict() if generation is not None else None,
        "peft": {name: c.to_dict() for name, c in peft.items()},
    }
    h.update(_json(described).encode())
    for name, t in model.state_dict().items():
        h.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    _DIGESTS[model] = h.hexdigest()
    return _DIGESTS[model]


def cached(model: torch.nn.Module, kind: str, asked: dict[str, Any], compute: Callable[[], Any]):
    """``compute()`` (a JSON value) for ``model``, ``kind`` and ``asked``, from the disk when
    this machine computed it before."""
    key = {"kind": kind, "model": model_digest(model), "asked": asked, "machine": _machine()}
    digest = hashlib.sha256(_json(key).encode()).hexdigest()
    path = CACHE / f"{digest}.json"
    if path.exists():
        return json.loads(path.read_text())["result"]
    result = compute()
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.partial")  # test processes may write together
    tmp.write_text(_json({"key": key, "result": result}))
    tmp.replace(path)
    return result


def generate(model: torch.nn.Module, ids: list[int], **kwargs: Any) -> list[list[int]]:
    """The new tokens of every sequence ``model.generate`` returns for the prompt ``ids`` with
    ``kwargs`` (greedy: ``do_sample=False``; beams: ``num_beams``, ``num_return_sequences``)."""

    def run() -> list[list[int]]:
        with torch.no_grad():
            out = model.generate(torch.tensor([list(ids)]), **kwargs)
        return [row[len(ids) :].tolist() for row in out]

    return cached(model, "generate", {"ids": list(ids), "kwargs": kwargs}, run)


def pooled_hidden_state(model: torch.nn.Module, ids: list[int], pooling: str) -> torch.Tensor:
    """The decoder's last hidden state (after its final norm) of ``ids``, pooled (``LAST``:
    the last token's, ``MEAN``: the mean over the tokens) and L2-normalized, in float32."""

    def run() -> list[float]:
        with torch.no_grad():
            h = model.model(torch.tensor([list(ids)])).last_hidden_state[0]
        v = h[-1] if pooling == "LAST" else h.mean(0)
        return torch.nn.functional.normalize(v, dim=0).float().tolist()

    asked = {"ids": list(ids), "pooling": pooling}
    return torch.tensor(cached(model, "pooled_hidden_state", asked, run), dtype=torch.float32)
