"""What a worker process knows of the machine it runs on, from its settings: the machine cache
(``--cache-dir``: compiled CPU kernels, GEMM calibrations, the model's converted tokenizer) and
whether the native CPU kernels run (``--native-kernels``).

Native libraries stay loaded for a process's life, so this is set once per process, at its
entry point and before any kernel loads (``configure``): the worker's ``service.run``, each
tensor-parallel rank (from its ``RankSpec``), and the test session and the benchmarks that run
the model in process. Worker code that needs the cache asks ``cache_dir()``; the one setup is
the kernels' (kernels/cpu_native.py ``NativeSetup``)."""

from __future__ import annotations

from pathlib import Path

from kvflow.kernels import cpu_native
from kvflow.kernels.cpu_native import NativeSetup
from kvflow.shared.config import Settings


def native_setup(settings: Settings) -> NativeSetup:
    return NativeSetup(settings.ops.cache_root(), settings.worker.native_kernels)


def configure(settings: Settings) -> NativeSetup:
    """This process's setup from ``settings`` (returned: a tensor-parallel rank is given it)."""
    setup = native_setup(settings)
    cpu_native.configure(setup)
    return setup


def cache_dir() -> Path:
    """The machine cache of this (configured) process."""
    return cpu_native.setup().cache_dir
