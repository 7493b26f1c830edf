"""Block manager: exact block ids, prefix hits, lazy LRU eviction, and invariants under any
interleaving of operations (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.services.scheduler.block_manager import BlockManager, NoFreeBlocksError


def test_allocate_takes_lowest_free_blocks_in_order() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    assert bm.allocate(2) == [0, 1]
    assert bm.allocate(1) == [2]
    assert bm.num_free_blocks == 1
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(2)


def test_free_goes_to_tail_in_reverse_and_keeps_hash_until_reused() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    tokens = [1, 2, 3, 4, 5]
    blocks = bm.allocate(3)  # [0, 1, 2]
    hashes: list = []
    bm.extend_hashes(hashes, tokens, upto=5)
    assert len(hashes) == 2  # only full blocks
    bm.cache_blocks(blocks, hashes)
    bm.free_blocks(blocks)
    # free list: 3 (never used), then 2, 1, 0 (reverse of the sequence's order)
    assert list(bm.free) == [3, 2, 1, 0]
    # the prefix is still found, capped so that one token is computed
    assert bm.find_cached_prefix([1, 2, 3, 4, 9]) == [0, 1]
    assert bm.find_cached_prefix([1, 2, 3, 4]) == [0]
    assert bm.find_cached_prefix([1, 9, 3, 4, 9]) == []
    # fresh allocations take 3 then 2; block 1's hash survives until it is taken
    assert bm.allocate(2) == [3, 2]
    assert bm.find_cached_prefix([1, 2, 3, 4, 9]) == [0, 1]
    assert bm.allocate(1) == [1]
    assert bm.find_cached_prefix([1, 2, 3, 4, 9]) == [0]


def test_take_cached_revives_free_block_and_counts_references() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    a = bm.allocate(1)
    hashes: list = []
    bm.extend_hashes(hashes, [7, 8], 2)
    bm.cache_blocks(a, hashes)
    hit = bm.find_cached_prefix([7, 8, 1])
    assert hit == a
    assert bm.can_allocate(2, hit)
    bm.take_cached(hit)
    assert bm.ref_counts[a[0]] == 2
    bm.free_blocks(a)
    bm.free_blocks(a)
    assert bm.num_free_blocks == 3
    with pytest.raises(RuntimeError):
        bm.free_blocks(a)


def test_salt_separates_configurations() -> None:
    a = BlockManager(4, 2, salt=b"model-a|2").block_hashes([1, 2])
    b = BlockManager(4, 2, salt=b"model-b|2").block_hashes([1, 2])
    assert a != b


ops = st.lists(
    st.tuples(
        st.sampled_from(["new", "append", "fork", "free"]),
        st.integers(0, 7),
        st.lists(st.integers(0, 3), min_size=1, max_size=9),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_invariants_under_any_interleaving(operations) -> None:
    bm = BlockManager(num_blocks=12, block_size=2)
    seqs: dict[int, tuple[list[int], list[int], list]] = {}  # id -> (tokens, blocks, hashes)
    next_id = 0
    for op, pick, toks in operations:
        ids = sorted(seqs)
        if op == "new":
            cached = bm.find_cached_prefix(toks)
            need = bm.blocks_needed(len(toks)) - len(cached)
            if not bm.can_allocate(need, cached):
                continue
            bm.take_cached(cached)
            blocks = cached + bm.allocate(need)
            hashes: list = []
            bm.extend_hashes(hashes, toks, len(toks))
            bm.cache_blocks(blocks, hashes)
            seqs[next_id] = (list(toks), blocks, hashes)
            next_id += 1
        elif op == "append" and ids:
            tokens, blocks, hashes = seqs[ids[pick % len(ids)]]
            tokens.append(toks[0])
            need = bm.blocks_needed(len(tokens)) - len(blocks)
            if need > bm.num_free_blocks:
                tokens.pop()
                continue
            blocks += bm.allocate(need)
            bm.extend_hashes(hashes, tokens, len(tokens))
            bm.cache_blocks(blocks, hashes)
        elif op == "fork" and ids:
            tokens, blocks, hashes = seqs[ids[pick % len(ids)]]
            full = len(tokens) // 2
            seqs[next_id] = (tokens[: full * 2], bm.fork(blocks[:full]), hashes[:full])
            next_id += 1
        elif op == "free" and ids:
            sid = ids[pick % len(ids)]
            bm.free_blocks(seqs.pop(sid)[1])
        # invariants: counts equal the tables' references; free <=> unreferenced
        refs = [0] * bm.num_blocks
        for _, blocks, _ in seqs.values():
            for b in blocks:
                refs[b] += 1
        assert refs == bm.ref_counts
        assert set(bm.free) == {b for b in range(bm.num_blocks) if refs[b] == 0}
        for h, b in bm.cached.items():
            assert bm.block_hash[b] == h
    for sid in list(seqs):
        bm.free_blocks(seqs.pop(sid)[1])
    assert bm.num_free_blocks == bm.num_blocks
