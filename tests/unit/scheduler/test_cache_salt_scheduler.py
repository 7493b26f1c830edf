"""vLLM's ``cache_salt`` in the scheduler, offline: the salt is part of the root of every chained
block hash, so requests with different salts (or one salted, one not) never share prefix-cache
blocks, KV-tier keys or decode-worker blocks, equal salts share as before, and the outputs never
change (the stand-in worker's output depends on every K/V slot it reads)."""

from __future__ import annotations

import msgspec

from kvflow.services.scheduler.block_manager import BlockManager
from kvflow.services.scheduler.core import SchedulerCore
from kvflow.services.scheduler.limits import SchedulerLimits
from kvflow.shared.kv_tier import tier_key
from kvflow.shared.messages import GenerateRequest, SamplingParams, TokenizedRequest, decode, encode
from tests.helpers.scheduler import Cluster, FakeWorker, make_core, run_all

BS = 4
PREFIX = list(range(32))  # 8 full blocks
PROMPT = PREFIX + [1, 2]


def salted(rid: str, prompt: list[int], salt: str | None, max_tokens: int = 3) -> TokenizedRequest:
    params = SamplingParams(max_tokens=max_tokens)
    return TokenizedRequest(rid, "inbox", prompt, params, cache_salt=salt)


# -- the block manager ----------------------------------------------------------------------


def test_every_chained_hash_differs_between_salts_and_equal_salts_agree() -> None:
    bm = BlockManager(16, BS, salt=b"m|4")
    toks = list(range(12))
    plain, a, b = bm.block_hashes(toks), bm.block_hashes(toks, "a"), bm.block_hashes(toks, "b")
    assert bm.block_hashes(toks, "a") == a
    assert len(plain) == len(a) == len(b) == 3
    # the salt enters the first block; the chain carries it to every later one
    assert set(plain).isdisjoint(a) and set(plain).isdisjoint(b) and set(a).isdisjoint(b)
    # salts are compared whole: a tenant prefix cannot be mimicked by a shorter salt
    assert set(bm.block_hashes(toks, "t:a")).isdisjoint(bm.block_hashes(toks, "t"))
    # nor by moving the boundary between salt and tokens ("x1" then 2... against "x" then 12...)
    assert bm.block_hashes([2, *toks[1:4]], "x1") != bm.block_hashes([12, *toks[1:4]], "x")
    assert bm.block_hashes([2, 0, 0, 0], "x\x02") != bm.block_hashes([2, 0, 0, 0], "x")
    assert bm.block_hashes(toks, "") == plain  # no salt (the gateway refuses an empty one)
    # extend_hashes (a running sequence, block by block) agrees with block_hashes
    hashes: list = []
    bm.extend_hashes(hashes, toks, 5, "a")
    bm.extend_hashes(hashes, toks, 12, "a")
    assert hashes == a
    # another manager (another worker of the same model and block size) computes the same
    assert BlockManager(8, BS, salt=b"m|4").block_hashes(toks, "a") == a


def test_cached_blocks_are_found_only_with_their_salt() -> None:
    bm = BlockManager(16, BS, salt=b"m|4")
    toks = list(range(9))  # 2 full blocks and one token
    blocks = bm.allocate(3)
    hashes: list = []
    bm.extend_hashes(hashes, toks, 9, "a")
    assert bm.cache_blocks(blocks, hashes) == blocks[:2]
    assert bm.find_cached_prefix(toks, "b") == []
    assert bm.find_cached_prefix(toks) == []
    assert bm.find_cached_prefix(toks, "a") == blocks[:2]
    assert (bm.prefix_queries, bm.prefix_hits) == (6, 2)
    assert bm.lookup_prefix(toks, cache_salt="a") == blocks[:2]
    assert bm.lookup_prefix(toks, 1, "a") == blocks[:1]
    assert bm.lookup_prefix(toks, cache_salt="b") == []


# -- through the scheduler core -------------------------------------------------------------


def run_one(
    core: SchedulerCore, worker: FakeWorker, rid: str, salt: str | None
) -> tuple[int, list[int]]:
    """Run one request of PROMPT to the end: (prefix-cache block hits it scored, output)."""
    before = core.stats().prefix_cache_hits
    core.add_request(salted(rid, PROMPT, salt))
    out = run_all(core, worker)[rid]
    assert core.stats().num_free_blocks == core.stats().num_total_blocks
    return core.stats().prefix_cache_hits - before, out


def test_scheduler_shares_prefix_blocks_only_between_equal_salts() -> None:
    core, worker = make_core(block_size=BS)
    hits, first = run_one(core, worker, "a1", "tenant-a")
    assert hits == 0
    assert run_one(core, worker, "a2", "tenant-a") == (8, first)  # same salt: every block hits
    assert run_one(core, worker, "b1", "tenant-b") == (0, first)  # another salt: none
    assert run_one(core, worker, "n1", None) == (0, first)  # no salt after salted ones: none
    assert run_one(core, worker, "n2", None) == (8, first)  # unsalted share among themselves
    assert run_one(core, worker, "b2", "tenant-b") == (8, first)
    stats = core.stats()
    assert stats.prefix_cache_hits == 24 and stats.workers[0].prefix_cache_hits == 24


def test_siblings_admitted_in_one_step_share_only_with_equal_salts() -> None:
    """Blocks are registered when the step that fills them is planned: a request admitted later
    in the same step shares them, but only if its salt is the same."""
    core, worker = make_core(block_size=BS, max_num_batched_tokens=256)
    for rid, salt in (("x1", "s"), ("x2", "s"), ("y", "t"), ("z", None)):
        core.add_request(salted(rid, PROMPT, salt))
    outs = run_all(core, worker)
    assert len({tuple(o) for o in outs.values()}) == 1
    assert core.stats().prefix_cache_hits == 8  # x2 on x1's blocks, nothing else


def test_redis_keys_follow_the_salt_and_match_what_the_worker_stores() -> None:
    core = SchedulerCore(SchedulerLimits(), model="m")
    ws = core.add_worker("w", 64, BS, redis_tier=True, kv_layout="L")
    keys = {s: core.redis_keys_for(PROMPT, s) for s in (None, "a", "b")}
    assert all(len(k) == 8 for k in keys.values())
    assert core.redis_keys_for(PROMPT, "a") == keys["a"]
    assert set(keys[None]).isdisjoint(keys["a"]) and set(keys["a"]).isdisjoint(keys["b"])
    # the blocks a salted request writes through to Redis are the ones its salt looks up
    core.add_request(salted("r", PROMPT, "a"))
    worker, stored = FakeWorker(BS), []
    while (plan := core.schedule(ws)[0]) is not None:
        stored += [tier_key("L", ref.hash) for ref in plan.store]
        core.on_result(worker.execute(plan))
    assert set(keys["a"]) <= set(stored)  # (and a block its output tokens filled)
    assert set(stored).isdisjoint(keys[None] + keys["b"])


def test_disaggregated_decode_worker_reuses_blocks_only_with_the_same_salt() -> None:
    c = Cluster({"p": "prefill", "d": "decode"})

    def add(rid: str, salt: str | None) -> int:
        """Run a request of PROMPT; returns the blocks copied to the decode worker."""
        copied = c.copied_blocks
        c.core.add_request(salted(rid, PROMPT, salt))
        c.outputs[rid] = []
        c.run()
        return c.copied_blocks - copied

    assert add("a1", "a") == 9  # 34 tokens: 8 full blocks + 1 partial
    assert add("b1", "b") == 9  # another salt: nothing shared on either worker
    assert add("n1", None) == 9
    assert add("a2", "a") == 1  # the same salt: only the partial block
    outs = {tuple(o) for o in c.outputs.values()}
    assert len(outs) == 1 and c.all_free()


def test_the_salt_travels_in_the_messages_and_old_messages_still_decode() -> None:
    gen = GenerateRequest("r", "inbox", SamplingParams(), prompt="hi", cache_salt="s")
    assert decode(encode(gen)).cache_salt == "s"
    tok = salted("r", [1, 2], "s")
    assert decode(encode(tok)).cache_salt == "s"
    assert decode(encode(salted("r", [1, 2], None))).cache_salt is None
    # messages are arrays, the salt a later field: one from a sender that predates it (the
    # array cut before the salt) decodes with no salt
    for msg in (gen, tok):
        fields = msgspec.msgpack.decode(encode(msg))
        names = [f.name for f in msgspec.structs.fields(type(msg))]
        at = 1 + names.index("cache_salt")  # after the tag
        assert fields[at] == "s"
        old = decode(msgspec.msgpack.encode(fields[:at]))
        assert type(old) is type(msg) and old.cache_salt is None
