"""Reading and writing whole KV blocks of a worker's paged cache as bytes, for moving them to
another worker (disaggregated decode) or a storage tier.

A block's bytes for layers ``[l0, l1)`` are, layer by layer, its K then its V, each
``[block_size, Hkv, D]`` in the cache's dtype. Both ends must have the same ``layout()`` (dtype,
layers, block size, KV heads, head size); the scheduler pairs only equal layouts.

On the CPU the copies go through numpy views of the cache tensors: a plain memcpy that takes no
torch thread team, so the event loop can serve and receive blocks while the model thread runs a
step (on other blocks: a block in transfer is never scheduled).
"""

from __future__ import annotations

import numpy as np
import torch

KvCaches = list[tuple[torch.Tensor, torch.Tensor]]


class _Shard:
    """One cache's byte views (a tensor-parallel rank's KV heads, or all of them)."""

    def __init__(self, kv_caches: KvCaches) -> None:
        k0 = kv_caches[0][0]
        self.caches = kv_caches
        self.num_kv_heads = k0.shape[2]
        self.on_cpu = k0.device.type == "cpu"
        # byte views: numpy has no bfloat16, and bytes are all a copy needs
        self.bytes = [(k.view(torch.uint8), v.view(torch.uint8)) for k, v in kv_caches]
        self.np = [(k.numpy(), v.numpy()) for k, v in self.bytes] if self.on_cpu else []
        self.layer_bytes = 2 * k0[0].numel() * k0.element_size()  # K and V of one block

    def read(self, block: int, l0: int, l1: int) -> bytes:
        if self.on_cpu:
            return b"".join(self.np[i][kv][block].tobytes() for i in range(l0, l1) for kv in (0, 1))
        parts = [self.bytes[i][kv][block] for i in range(l0, l1) for kv in (0, 1)]
        return torch.stack(parts).cpu().numpy().tobytes()

    def write(self, block: int, data: bytes | memoryview, l0: int, l1: int) -> None:
        shape = (l1 - l0, 2, *self.bytes[0][0].shape[1:])
        arr = np.frombuffer(data, dtype=np.uint8).reshape(shape)
        if self.on_cpu:
            for j, i in enumerate(range(l0, l1)):
                self.np[i][0][block] = arr[j, 0]
                self.np[i][1][block] = arr[j, 1]
            return
        dev = self.caches[0][0].device
        src = torch.from_numpy(arr.copy()).to(dev)
        for j, i in enumerate(range(l0, l1)):
            self.bytes[i][0][block].copy_(src[j, 0])
            self.bytes[i][1][block].copy_(src[j, 1])


class KvBlockIO:
    """Blocks of ``kv_caches`` as bytes. A tensor-parallel worker passes every rank's caches
    (``shards``, rank order; the followers' mapped from their processes: tp_group.py): a block
    is then each rank's bytes for the layers, rank after rank, and the layout names each
    rank's KV heads, so only a worker split the same way exchanges blocks with it."""

    def __init__(self, kv_caches: KvCaches, shards: list[KvCaches] | None = None) -> None:
        if not kv_caches:  # an encoder's worker: no KV at all (layout "none", no bytes)
            self.caches, self._shards = kv_caches, []
            self.num_layers = self.num_blocks = self.block_size = self.head_dim = 0
            self.num_kv_heads, self.layer_bytes, self.dtype = 0, 0, torch.float32
            return
        k0 = kv_caches[0][0]
        self.caches = kv_caches
        self._shards = [_Shard(c) for c in (shards or [kv_caches])]
        self.num_layers = len(kv_caches)
        self.num_blocks, self.block_size, _, self.head_dim = k0.shape
        self.num_kv_heads = sum(sh.num_kv_heads for sh in self._shards)
        self.dtype = k0.dtype
        self.layer_bytes = sum(sh.layer_bytes for sh in self._shards)  # K and V of one block

    def layout(self) -> str:
        if not self._shards:
            return "none"
        dtype = str(self.dtype).removeprefix("torch.")
        heads = "+".join(str(sh.num_kv_heads) for sh in self._shards)
        return f"{dtype}:{self.num_layers}x{self.block_size}x{heads}x{self.head_dim}"

    @property
    def block_bytes(self) -> int:
        return self.layer_bytes * self.num_layers

    def layer_chunks(self, max_bytes: int) -> list[tuple[int, int]]:
        """Layer ranges whose bytes for one block stay within ``max_bytes`` (at least one
        layer each)."""
        if not self.num_layers:
            return []
        per = max(1, max_bytes // self.layer_bytes)
        return [(a, min(a + per, self.num_layers)) for a in range(0, self.num_layers, per)]

    def _check(self, block: int, l0: int, l1: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block {block} is outside [0, {self.num_blocks})")
        if not 0 <= l0 < l1 <= self.num_layers:
            raise ValueError(f"layers [{l0}, {l1}) are outside [0, {self.num_layers})")

    def read(self, block: int, l0: int = 0, l1: int | None = None) -> bytes:
        if not self._shards:
            return b""  # nothing is kept
        l1 = self.num_layers if l1 is None else l1
        self._check(block, l0, l1)
        if len(self._shards) == 1:
            return self._shards[0].read(block, l0, l1)
        return b"".join(sh.read(block, l0, l1) for sh in self._shards)

    def write(self, block: int, data: bytes, l0: int = 0, l1: int | None = None) -> None:
        if not self._shards and not data:
            return
        l1 = self.num_layers if l1 is None else l1
        self._check(block, l0, l1)
        if len(data) != self.layer_bytes * (l1 - l0):
            raise ValueError(
                f"{len(data)} bytes for layers [{l0}, {l1}) of a block; expected "
                f"{self.layer_bytes * (l1 - l0)}"
            )
        view, at = memoryview(data), 0
        for sh in self._shards:
            n = sh.layer_bytes * (l1 - l0)
            sh.write(block, view[at : at + n], l0, l1)
            at += n
