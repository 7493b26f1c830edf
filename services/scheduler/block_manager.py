"""Paged KV cache bookkeeping for one worker: which physical blocks each sequence uses.

The worker owns the memory; this owns the ids (as in vLLM). Blocks have reference counts, so a
full block identified by its prefix hash can be shared by every sequence with that prefix
(automatic prefix caching). A block whose count drops to zero keeps its hash and goes to the
tail of the free list; a fresh allocation takes the head (least recently freed) and only then
forgets the old hash, so cached prefixes survive until the memory is really needed (lazy LRU).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], salt: bytes = b"") -> BlockHash:
    """Hash of a full block chained over its whole prefix: equal hashes mean equal token
    prefixes (and equal salt: model, block size, the request's cache_salt), so the cached K/V
    can be reused. The salt enters the first block only, after its length (so no salt and
    tokens can read as another salt and other tokens); the chain carries it on. Token ids go
    in as fixed-width integers (4x cheaper than as text, and as unambiguous)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent if parent is not None else b"root:%d:" % len(salt) + salt)
    h.update(array("q", token_ids).tobytes())
    return BlockHash(h.digest())


class NoFreeBlocksError(RuntimeError):
    pass


class BlockManager:
    """Block ids, reference counts, the free list (LRU order) and the prefix-hash index."""

    def __init__(self, num_blocks: int, block_size: int, salt: bytes = b"") -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.salt = salt
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}
        # Free blocks in eviction order (head first). OrderedDict gives O(1) pop/remove/append.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.prefix_queries = 0  # blocks looked up
        self.prefix_hits = 0  # blocks found
        # (block, hash) of cached blocks reallocated since the last take_evicted(): their
        # content is about to be overwritten (the KV tiers keep a copy)
        self.evicted: list[tuple[int, BlockHash]] = []

    # -- queries ------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def root_salt(self, cache_salt: str | None = None) -> bytes:
        """The salt of a sequence's first block: this manager's (model, block size), plus the
        request's ``cache_salt`` (vLLM's) when it has one, so sequences with different salts
        (or one salted, one not) never share a block, here or in the KV tiers (same hashes)."""
        if not cache_salt:
            return self.salt
        return self.salt + b"\x00cache_salt\x00" + cache_salt.encode("utf-8", "surrogatepass")

    def block_hashes(
        self, token_ids: Sequence[int], cache_salt: str | None = None
    ) -> list[BlockHash]:
        """Chained hashes of every full block of ``token_ids`` (salted with ``cache_salt``)."""
        hashes: list[BlockHash] = []
        parent: BlockHash | None = None
        bs, salt = self.block_size, self.root_salt(cache_salt)
        for i in range(len(token_ids) // bs):
            parent = hash_block(parent, token_ids[i * bs : (i + 1) * bs], salt)
            hashes.append(parent)
        return hashes

    def find_cached_prefix(
        self, token_ids: Sequence[int], cache_salt: str | None = None
    ) -> list[int]:
        """Block ids holding the longest cached prefix of ``token_ids`` (full blocks only), at
        most ``(len-1)//block_size`` blocks so that at least one token is still computed (its
        logits are needed to sample). Counts the lookup in the hit-rate counters."""
        found = self.lookup_prefix(token_ids, cache_salt=cache_salt)
        self.count_prefix((len(token_ids) - 1) // self.block_size, len(found))
        return found

    def count_prefix(self, queries: int, hits: int) -> None:
        """Count a prefix-cache lookup of ``queries`` blocks that found ``hits`` (the only
        place the hit-rate counters change)."""
        self.prefix_queries += queries
        self.prefix_hits += hits

    def lookup_prefix(
        self, token_ids: Sequence[int], limit: int | None = None, cache_salt: str | None = None
    ) -> list[int]:
        """Like ``find_cached_prefix`` but counts nothing (routing probes every worker);
        ``limit`` caps the number of blocks (default: leave one token to compute)."""
        if limit is None:
            limit = (len(token_ids) - 1) // self.block_size
        found: list[int] = []
        parent: BlockHash | None = None
        bs, salt = self.block_size, self.root_salt(cache_salt)
        for i in range(min(limit, len(token_ids) // bs)):
            parent = hash_block(parent, token_ids[i * bs : (i + 1) * bs], salt)
            block = self.cached.get(parent)
            if block is None:
                break
            found.append(block)
        return found

    # -- changes ------------------------------------------------------------------------------

    def can_allocate(self, num_blocks: int, reused: Sequence[int] = ()) -> bool:
        """Whether ``num_blocks`` fresh blocks fit after taking ``reused`` cached blocks (those
        that are free now stop being available for fresh allocation)."""
        reused_free = sum(1 for b in reused if self.ref_counts[b] == 0)
        return len(self.free) - reused_free >= num_blocks

    def take_cached(self, blocks: Sequence[int]) -> None:
        """Add a reference to each of ``blocks`` (prefix hits), reviving free ones."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                del self.free[b]
            self.ref_counts[b] += 1

    def allocate(self, n: int, offload: bool = True) -> list[int]:
        """``n`` fresh blocks from the head of the free list, forgetting their old hashes.
        The cached ones among them are ``evicted`` (for the host tier) unless ``offload`` is
        False: blocks a KV-tier load fills are written by that load, which might get there
        before a step could copy them."""
        if n > len(self.free):
            raise NoFreeBlocksError(f"need {n} blocks, {len(self.free)} free")
        out: list[int] = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            old = self.block_hash[b]
            if old is not None:
                if self.cached.get(old) == b:
                    del self.cached[old]
                    if offload:
                        self.evicted.append((b, old))
                self.block_hash[b] = None
            self.ref_counts[b] = 1
            out.append(b)
        return out

    def take_evicted(self) -> list[tuple[int, BlockHash]]:
        out, self.evicted = self.evicted, []
        return out

    def fork(self, blocks: Sequence[int]) -> list[int]:
        """Share ``blocks`` with another sequence (n>1, beams): one more reference each."""
        self.take_cached(blocks)
        return list(blocks)

    def free_blocks(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each block; unreferenced ones join the free list's tail.
        Freed in reverse so a sequence's last blocks (least shareable) are evicted first."""
        for b in reversed(blocks):
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"block {b} freed twice")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free[b] = None

    def extend_hashes(
        self,
        hashes: list[BlockHash],
        token_ids: Sequence[int],
        upto: int,
        cache_salt: str | None = None,
    ) -> None:
        """Append to ``hashes`` the chained hashes of the full blocks of ``token_ids[:upto]``
        not hashed yet (a sequence keeps its list, so each block is hashed once; ``cache_salt``
        matters only for the first block, the rest chain from it)."""
        bs = self.block_size
        salt = self.root_salt(cache_salt) if not hashes else b""
        for i in range(len(hashes), upto // bs):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, token_ids[i * bs : (i + 1) * bs], salt))

    def cache_blocks(self, blocks: Sequence[int], hashes: Sequence[BlockHash]) -> list[int]:
        """Register the hashes of full blocks, so later sequences with the same prefix can share
        them. Returns the blocks newly registered."""
        added: list[int] = []
        for b, h in zip(blocks, hashes, strict=False):
            if self.block_hash[b] is None:
                if h in self.cached:  # same content computed twice concurrently: keep the first
                    continue
                self.block_hash[b] = h
                self.cached[h] = b
                added.append(b)
        return added

    def uncache(self, blocks: Sequence[int]) -> None:
        """Forget the hashes of ``blocks`` (their content is not to be trusted)."""
        for b in blocks:
            h = self.block_hash[b]
            if h is not None:
                if self.cached.get(h) == b:
                    del self.cached[h]
                self.block_hash[b] = None
