"""kvflow's benchmarks: scripts that print figures (recorded in docs/benchmarks.md), never tests."""
