"""kvflow's benchmarks: scripts that print figures (recorded in docs/benchmarks.md), never tests."""

import kvflow.shared.openmp_env  # noqa: F401  (before anything imports torch)
