"""Find, on the machine at hand, how to run GEMMs so that a row's result never depends on the
rest of the batch.

A BLAS picks micro-kernels, K-blocking and thread splits from a GEMM's shape, so the same row can
get different bits in a 5-row GEMM than in a 32-row one, or at a different position. Which row
counts are safe is a property of the BLAS build and the CPU, not something to assume: on one
Intel Xeon only fixed 16-row tiles were; on an AMD EPYC any multiple of 4 rows is. ``calibrate``
tests it with the model's own weights: for each candidate padding ``pad`` (1, 2, 4, 8, 16) it
runs GEMMs of every multiple of ``pad`` up to ``max_rows`` rows, on rows drawn in random order,
and compares each row with the same row computed in a ``max_rows``-row GEMM. The smallest
``pad`` that never differs wins; if none does, fixed 16-row tiles are returned, as before
calibration existed (and ``invariant`` says whether even those were shown to hold).

``calibrate_cached`` keeps each answer in the machine cache its caller gives (its gemm-rows/
folder), keyed by what decides it: the CPU (model name and flags), torch's version
and build configuration (its BLAS/oneDNN), the thread count, each weight's shape, dtype and kind
(dense or packed) and the calibration's own parameters. Weight values are not in the key: the
BLAS picks its kernels from shapes, layouts and threads, not from values. A restart on the same
machine then skips the ~15-20 s of calibration.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvflow.kernels.reference import Weight, matmul_fn

log = logging.getLogger("kvflow.kernels")

CANDIDATE_PADS = (1, 2, 4, 8, 16)
FALLBACK_TILE = 16


@dataclass(frozen=True)
class GemmRows:
    """Single-token rows are padded to a multiple of ``pad`` and run in GEMMs of at most
    ``tile`` rows (see ``reference.RowLayout``)."""

    pad: int
    tile: int
    invariant: bool  # shown to be batch invariant by calibration


def rows_are_invariant(
    weight: torch.Tensor | Weight, pad: int, max_rows: int, generator: torch.Generator
) -> bool:
    """True when every GEMM of ``pad, 2*pad, ..., max_rows`` rows (rows in random order) gives
    each row the same bits as a ``max_rows``-row GEMM does."""
    mm = matmul_fn(weight)
    x = torch.randn(max_rows, weight.shape[1], generator=generator)
    full = mm(x)
    for m in range(pad, max_rows + 1, pad):
        for _ in range(2):
            idx = torch.randperm(max_rows, generator=generator)[:m]
            if not torch.equal(mm(x[idx]), full[idx]):
                return False
    return True


def calibrate(
    weights: Sequence[torch.Tensor | Weight], max_rows: int = 64, seed: int = 0
) -> GemmRows:
    """The cheapest batch-invariant row layout for GEMMs with these fp32 ``weights`` ([N, K]
    each, dense or packed, one per distinct shape), with the current torch thread count."""
    if max_rows % FALLBACK_TILE:
        raise ValueError(f"max_rows must be a multiple of {FALLBACK_TILE}")
    if all(getattr(w, "batch_invariant", False) for w in weights):
        # kernels invariant by construction, up to the rows where they change method
        tile = min(getattr(w, "max_invariant_rows", max_rows) for w in weights)
        return GemmRows(1, min(max_rows, tile), True)
    gen = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        for pad in CANDIDATE_PADS:
            if all(rows_are_invariant(w, pad, max_rows, gen) for w in weights):
                return GemmRows(pad, max_rows, True)
        fallback = all(rows_are_invariant(w, FALLBACK_TILE, FALLBACK_TILE, gen) for w in weights)
    if not fallback:
        log.warning(
            "this BLAS gives rows different bits for different batches even in fixed %d-row "
            "tiles: outputs may change slightly with what else is batched",
            FALLBACK_TILE,
        )
    return GemmRows(FALLBACK_TILE, FALLBACK_TILE, fallback)


def _cpu_identity() -> str:
    """The CPU's model name and feature flags (Linux), or what platform knows elsewhere."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    keep = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(keep)))


def cache_key(weights: Sequence[torch.Tensor | Weight], max_rows: int, seed: int) -> str:
    """What decides a calibration's answer on this machine (see the module docstring)."""
    parts = {
        "cpu": _cpu_identity(),
        "torch": torch.__version__,
        "torch_config": torch.__config__.show(),
        "threads": torch.get_num_threads(),
        "weights": [
            [list(w.shape), str(getattr(w, "dtype", "")), type(w).__qualname__] for w in weights
        ],
        "max_rows": max_rows,
        "seed": seed,
        "pads": [*CANDIDATE_PADS, FALLBACK_TILE],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def calibration_dir(cache_dir: Path) -> Path:
    """Where answers are kept in the machine cache ``cache_dir``."""
    return cache_dir / "gemm-rows"


def calibrate_cached(
    weights: Sequence[torch.Tensor | Weight], cache_dir: Path, max_rows: int = 64, seed: int = 0
) -> tuple[GemmRows, bool]:
    """``calibrate``, answered from the machine cache ``cache_dir`` when this machine already
    ran the same one; (layout, whether it came from the cache). A cache that cannot be read or written is
    skipped with a log line, never an error. Weights invariant by construction are answered
    at once and never cached (their answer is each kernel's own ``max_invariant_rows``, which a
    new version of the kernel may change)."""
    if all(getattr(w, "batch_invariant", False) for w in weights):
        return calibrate(weights, max_rows, seed), False
    path = calibration_dir(cache_dir) / f"{cache_key(weights, max_rows, seed)}.json"
    try:
        return GemmRows(**json.loads(path.read_text())), True
    except FileNotFoundError:
        pass
    except (OSError, ValueError, TypeError) as e:
        log.warning("ignoring the GEMM calibration cache %s: %s", path, e)
    rows = calibrate(weights, max_rows, seed)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(rows)))
        os.replace(tmp, path)  # atomic: workers starting together never read half a file
    except OSError as e:
        log.warning("could not write the GEMM calibration cache %s: %s", path, e)
    return rows, False
