"""How many CPUs this process may really use: the cores it is allowed to run on (its affinity
mask, what ``taskset`` and Kubernetes' static CPU manager set) capped by its cgroup's CPU quota
(``docker run --cpus``, a Kubernetes CPU limit), which ``os.cpu_count()`` ignores. A worker that
sizes its thread pool to the machine's cores inside a 2-CPU container is throttled for most of
every period; one thread per usable CPU is what the quota pays for."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

_CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class CpuBudget:
    affinity: int  # cores this process may run on
    quota: float | None  # the cgroup's CPU quota in CPUs (None: no limit)

    @property
    def usable(self) -> int:
        """Whole CPUs to size a thread pool to (at least 1)."""
        if self.quota is None:
            return max(1, self.affinity)
        return max(1, min(self.affinity, math.ceil(self.quota - 1e-9)))

    def describe(self) -> str:
        quota = "no cgroup CPU quota" if self.quota is None else f"cgroup quota {self.quota:g} CPUs"
        return f"{self.affinity} cores in this process's affinity, {quota}"


def _quota_v2(root: Path) -> float | None:
    """cgroup v2: ``cpu.max`` of this process's cgroup ("max 100000" or "200000 100000")."""
    rel = _own_cgroup("0::")
    for d in ([root / rel.lstrip("/")] if rel else []) + [root]:
        f = d / "cpu.max"
        if f.is_file():
            quota, _, period = f.read_text().strip().partition(" ")
            if quota == "max" or not period:
                return None
            return int(quota) / int(period)
    return None


def _quota_v1(root: Path) -> float | None:
    for d in (root / "cpu,cpuacct", root / "cpu"):
        q, p = d / "cpu.cfs_quota_us", d / "cpu.cfs_period_us"
        if q.is_file() and p.is_file():
            quota, period = int(q.read_text()), int(p.read_text())
            return None if quota <= 0 or period <= 0 else quota / period
    return None


def _own_cgroup(prefix: str) -> str | None:
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith(prefix):
                return line[len(prefix) :]
    except OSError:
        pass
    return None


def cpu_budget(cgroup_root: Path = _CGROUP_ROOT) -> CpuBudget:
    """This process's CPU budget, read now (affinity, then the cgroup v2 or v1 quota)."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        affinity = os.cpu_count() or 1
    try:
        v2 = (cgroup_root / "cgroup.controllers").exists()
        quota = _quota_v2(cgroup_root) if v2 else _quota_v1(cgroup_root)
    except (OSError, ValueError):  # an unreadable or odd cgroup file: no limit known
        quota = None
    return CpuBudget(affinity, quota)


def usable_cpus() -> int:
    """Whole CPUs this process may use (affinity capped by the cgroup quota)."""
    return cpu_budget().usable
