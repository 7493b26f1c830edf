"""OpenMP settings for torch's own thread team, set on import, before torch is first imported
(libgomp reads them once, when torch loads it). ``import kvflow.shared.openmp_env`` comes first in
the entry points that run the worker: the ``kvflow`` package (its CLI runs every service, and
the ``LLM`` API) and ``benchmarks``. The test process itself keeps libgomp's default: its
tests mostly run torch reference code, back-to-back small parallel ops that a passive team
makes ~25 % slower (tests/unit: 38 s against 48 s); the services the e2e tests start get
PASSIVE through the ``kvflow`` CLI.

``OMP_WAIT_POLICY=PASSIVE``: a thread of torch's team sleeps as soon as a torch op ends instead of
spinning for the next one (libgomp's default spins ~300,000 times, milliseconds). The worker's
heavy work runs on kvflow's own thread pool (kernels/csrc/thread_pool.c) between torch ops, and
a spinning torch thread takes the very core a pool thread needs: measured on this project's
2-core AMD EPYC, a batch-16 SmolLM2 decode step took 97-104 ms with torch's team spinning and
65-69 ms with it passive (docs/benchmarks.md). A value set by the user is kept."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
