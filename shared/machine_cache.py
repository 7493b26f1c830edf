"""Where kvflow keeps what a machine computes once: compiled CPU kernels, GEMM calibrations,
converted tokenizers, benchmark exports. ``$KVFLOW_CACHE_DIR`` (the image sets it, a k8s volume
mounts it) or ``~/.cache/kvflow``; this is its one reader. A cache for the machine, not a
setting of one service: every process on the machine shares it, tests and benchmarks too."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$KVFLOW_CACHE_DIR``, or ``~/.cache/kvflow`` when it is unset or empty."""
    return Path(os.environ.get("KVFLOW_CACHE_DIR") or Path.home() / ".cache" / "kvflow")
