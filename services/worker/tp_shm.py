"""The collectives of a tensor-parallel group whose ranks share one machine's memory (the CPU
path): all-reduce and all-gather through a shared-memory file instead of gloo's loopback TCP.
On the 2-core machine of docs/benchmarks.md a gloo all-reduce of one [1, 576] row took ~0.6 ms,
60 of them per SmolLM2 step; here a collective is a copy in, a wait for the other ranks' flags
and a copy (or sum) out.

Layout of the file: one flag (int64, 64 bytes apart) per rank, then two buffer sets (even and
odd collectives) of one slot per rank. A collective: write this rank's tensor into its slot of
the set, publish the collective's number in its flag, wait until every rank's flag has it, read
every slot. Two sets are enough: a rank can be at most one collective ahead of the slowest
(it cannot finish collective n+1 before every rank has published n+1, which each does only
after reading collective n), so it never overwrites a slot another rank still reads. Every rank
sums the slots in rank order with the same code, so all ranks get the same bits.

Stores become visible in program order only on x86 (TSO): elsewhere (ARM) a flag could be seen
before its data, so ``available`` is false there and the group uses torch.distributed."""

from __future__ import annotations

import mmap
import os
import platform
import time

import numpy as np
import torch

FLAG_STRIDE = 8  # int64s between two ranks' flags (64 bytes: one cache line each)
SPIN_CHECKS = 2000  # flag checks before each yield of the CPU to other threads


def available() -> bool:
    """Shared-memory collectives are correct on this CPU (x86's ordered stores)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def file_size(world: int, slot_bytes: int) -> int:
    return world * FLAG_STRIDE * 8 + 2 * world * slot_bytes


def create(path: str, world: int, slot_bytes: int) -> None:
    """Make the zeroed file (rank 0, before the other ranks start); OSError when /dev/shm
    has no room for it."""
    size = file_size(world, slot_bytes)
    st = os.statvfs(os.path.dirname(path))
    if st.f_bavail * st.f_frsize < 2 * size:
        raise OSError(f"{os.path.dirname(path)} has less than {2 * size >> 20} MiB free")
    with open(path, "wb") as f:
        f.truncate(size)


class ShmComm:
    """One rank's view of the file: ``all_reduce`` and ``all_gather`` of CPU tensors up to
    ``slot_bytes`` (larger ones are the caller's to send another way: ``fits``)."""

    def __init__(
        self, path: str, rank: int, world: int, slot_bytes: int, timeout_s: float = 120.0
    ) -> None:
        self.rank, self.world, self.slot_bytes, self.timeout_s = rank, world, slot_bytes, timeout_s
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), file_size(world, slot_bytes))
        head = world * FLAG_STRIDE
        self.flags = np.frombuffer(self._map, dtype=np.int64, count=head)
        data = np.frombuffer(self._map, dtype=np.uint8, offset=head * 8)
        self.slots = [
            [
                data[(s * world + r) * slot_bytes : (s * world + r + 1) * slot_bytes]
                for r in range(world)
            ]
            for s in range(2)
        ]
        self.seq = 0

    def fits(self, t: torch.Tensor) -> bool:
        return t.numel() * t.element_size() <= self.slot_bytes

    def _view(self, s: int, r: int, t: torch.Tensor) -> torch.Tensor:
        raw = self.slots[s][r][: t.numel() * t.element_size()]
        return torch.from_numpy(raw).view(t.dtype).view(t.shape)

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Publish ``t``; every rank's tensor of this collective once all have published."""
        self.seq += 1
        s = self.seq & 1
        self._view(s, self.rank, t).copy_(t)
        self.flags[self.rank * FLAG_STRIDE] = self.seq
        for r in range(self.world):
            if r != self.rank:
                self._wait(r)
        return [self._view(s, r, t) for r in range(self.world)]

    def _wait(self, r: int) -> None:
        flag, seq = r * FLAG_STRIDE, self.seq
        if self.flags[flag] >= seq:
            return
        deadline = time.monotonic() + self.timeout_s
        while True:
            for _ in range(SPIN_CHECKS):
                if self.flags[flag] >= seq:
                    return
            os.sched_yield()  # the other ranks may need this core
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel rank {r} did not reach collective {seq}")

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks (rank order), in place."""
        parts = self._exchange(t)
        t.copy_(parts[0])  # every rank's part is in the file, this rank's own included
        for p in parts[1:]:
            t += p
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (equal shapes): views into the file, valid until this rank's
        next collective but one (copy what must live longer)."""
        return self._exchange(t)
