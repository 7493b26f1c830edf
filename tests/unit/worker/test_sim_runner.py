"""The simulated worker backend (services/worker/sim_runner.py): plans are checked and honoured,
tokens are deterministic and depend on the KV cache's contents, stopping follows the request's
parameters, blocks come back to the scheduler, and the step takes the model time asked for."""

from __future__ import annotations

import time

from kvflow.services.scheduler.core import SchedulerCore
from kvflow.services.scheduler.limits import SchedulerLimits
from kvflow.services.worker.kv_blocks import KvBlockIO
from kvflow.services.worker.sim_runner import SimRunner, step_time_fn
from kvflow.shared.messages import (
    FinishReason,
    NewRequest,
    SamplingParams,
    ScheduledSeq,
    StepPlan,
    StepResult,
    TokenizedRequest,
)
from kvflow.shared.step_cost import StepCostModel

BS = 4
VOCAB = range(100, 1100)
EOS = [2]


def runner(num_blocks: int = 64, step_ms: float = 0.0) -> SimRunner:
    return SimRunner(VOCAB, EOS, BS, num_blocks, 512, step_time=step_time_fn(step_ms, ""))


def prefill(rid: str, prompt: list[int], table: list[int], **params) -> StepPlan:
    p = SamplingParams(temperature=0.0, **params)
    return StepPlan(
        step_id=1,
        seqs=[ScheduledSeq(rid, prompt, 0, table)],
        new_requests=[NewRequest(rid, p, len(prompt))],
    )


def decode(rid: str, token: int, pos: int, table: list[int], step: int = 2) -> StepPlan:
    return StepPlan(step_id=step, seqs=[ScheduledSeq(rid, [token], pos, table)])


def generate(r: SimRunner, rid: str, prompt: list[int], table: list[int], n: int) -> list[int]:
    out = [r.execute(prefill(rid, prompt, table, max_tokens=n)).token_ids[0]]
    while len(out) < n:
        res = r.execute(decode(rid, out[-1], len(prompt) + len(out) - 1, table, len(out) + 1))
        assert res.error is None
        out += res.token_ids
    return out


def test_tokens_are_deterministic_and_a_function_of_the_context() -> None:
    prompt = [5, 6, 7, 8, 9, 10]
    a = generate(runner(), "a", prompt, [0, 1, 2, 3], 8)
    # the same prompt, another request id, other blocks, another runner: the same greedy text
    b = generate(runner(), "b", prompt, [7, 3, 12, 9], 8)
    assert a == b
    assert all(t in VOCAB for t in a)  # ordinary tokens only, never EOS
    other = generate(runner(), "c", [5, 6, 7, 8, 9, 11], [0, 1, 2, 3], 8)
    assert other != a


def test_drafts_are_verified_as_the_model_runner_verifies_them() -> None:
    """A chunk with drafts (speculative decoding) yields the drafts that equal what the step
    samples after each of them, then the next sampled token: the same text as without drafts;
    a chunk without drafts in the same step yields its one token."""
    prompt = [5, 6, 7, 8, 9, 10]
    want = generate(runner(), "a", prompt, [0, 1, 2, 3], 7)
    other = generate(runner(), "b", [9, 9, 9], [4, 5], 3)
    r = runner()
    first = r.execute(
        StepPlan(
            1,
            [ScheduledSeq("a", prompt, 0, [0, 1, 2, 3]), ScheduledSeq("b", [9, 9, 9], 0, [4, 5])],
            new_requests=[
                NewRequest("a", SamplingParams(temperature=0.0, max_tokens=7), len(prompt)),
                NewRequest("b", SamplingParams(temperature=0.0, max_tokens=3), 3),
            ],
        )
    )
    assert first.token_ids == [want[0], other[0]]
    # "a": its last token and three drafts, the first two right and the third wrong
    drafts = [want[1], want[2], want[3] + 1]
    a = ScheduledSeq("a", [want[0], *drafts], len(prompt), [0, 1, 2, 3], num_draft=3)
    b = ScheduledSeq("b", [other[0]], 3, [4, 5])
    res = r.execute(StepPlan(2, [a, b]))
    assert res.error is None
    assert res.request_ids == ["a", "a", "a", "b"]
    assert res.token_ids == [want[1], want[2], want[3], other[1]]
    assert res.num_output_tokens == [2, 3, 4, 2]


def test_a_step_s_tokens_read_together_equal_each_chunk_s_own() -> None:
    """A step reads every chunk's last two cache slots at once; each token equals what the
    chunk alone gives, a one-token prompt (no token before it: -1) and random sampling's salt
    included."""
    r = runner()
    chunks = [
        ScheduledSeq("a", [5, 6, 7, 8, 9], 0, [0, 1]),
        ScheduledSeq("b", [42], 0, [2]),
        ScheduledSeq("c", [7, 7, 7, 7], 0, [3, 4]),
    ]
    params = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(seed=3)]
    new = [
        NewRequest(s.request_id, p, len(s.token_ids)) for s, p in zip(chunks, params, strict=True)
    ]
    res = r.execute(StepPlan(1, chunks, new_requests=new))
    assert res.error is None
    salts = [r.requests[s.request_id].salt for s in chunks]
    assert salts[0] == 0 and len(set(salts)) == 3
    alone = [r._next_tokens([s], [salt])[0] for s, salt in zip(chunks, salts, strict=True)]
    assert res.token_ids == alone == r._next_tokens(chunks, salts)
    vocab = sorted(VOCAB)
    assert res.token_ids[1] == vocab[hash((42, -1, 1, salts[1])) % len(vocab)]


def test_random_sampling_depends_on_the_seed() -> None:
    prompt = [5, 6, 7, 8]

    def first(seed: int) -> int:
        p = SamplingParams(temperature=1.0, seed=seed, max_tokens=4)
        plan = StepPlan(1, [ScheduledSeq("r", prompt, 0, [0, 1])], [NewRequest("r", p, 4)])
        return runner().execute(plan).token_ids[0]

    assert first(1) == first(1)
    assert len({first(s) for s in range(8)}) > 1


def test_chunk_tokens_land_in_the_block_tables_slots() -> None:
    r = runner()
    prompt = [11, 12, 13, 14, 15, 16]
    res = r.execute(prefill("a", prompt, [5, 9]))
    assert res.error is None and res.num_computed_tokens == 6
    k, v = r.kv_caches[0]
    assert k[5].flatten().tolist() == [11, 12, 13, 14]
    assert k[9].flatten().tolist()[:2] == [15, 16]
    assert v[9].flatten().tolist()[:2] == [4, 5]  # positions


def test_moved_kv_blocks_carry_the_context_and_damage_changes_the_output() -> None:
    prompt = [21, 22, 23, 24, 25, 26, 27]  # positions 0-3 in block 3, 4-6 in block 4
    src = runner()
    first = src.execute(prefill("a", prompt, [3, 4])).token_ids[0]
    expected = src.execute(decode("a", first, 7, [3, 4])).token_ids[0]
    io_src = KvBlockIO(src.kv_caches)

    def decode_elsewhere(flip_byte: int | None) -> int:
        """Copy the blocks into blocks 10 and 11 of another runner (flipping one byte of the
        second), then decode position 7 there."""
        dst = runner()
        io_dst = KvBlockIO(dst.kv_caches)
        io_dst.write(10, io_src.read(3))
        raw = bytearray(io_src.read(4))
        if flip_byte is not None:
            raw[flip_byte] ^= 0xFF
        io_dst.write(11, bytes(raw))
        new = NewRequest("a", SamplingParams(temperature=0.0), 7, num_output_tokens=1)
        dst.execute(StepPlan(4, [], [new]))
        return dst.execute(decode("a", first, 7, [10, 11], step=5)).token_ids[0]

    assert decode_elsewhere(None) == expected
    # position 6 (token 27) is slot 2 of block 4: K bytes 16-23 (one int64 per slot)
    assert decode_elsewhere(16) != expected
    # a byte of V (positions) is not read for tokens: the output stays
    assert decode_elsewhere(32 + 16) == expected


def test_stopping_follows_the_request() -> None:
    r = runner()
    res = r.execute(prefill("a", [1, 2, 3], [0], max_tokens=1))
    assert res.finish_reasons == [FinishReason.LENGTH]
    assert res.num_output_tokens == [1]
    # a stop token id that the simulator produces ends the request with STOP
    tok = runner().execute(prefill("b", [1, 2, 3], [0], max_tokens=5)).token_ids[0]
    res = runner().execute(prefill("b", [1, 2, 3], [0], max_tokens=5, stop_token_ids=[tok]))
    assert res.finish_reasons == [FinishReason.STOP]
    # ... but not before min_tokens
    res = runner().execute(
        prefill("b", [1, 2, 3], [0], max_tokens=5, stop_token_ids=[tok], min_tokens=2)
    )
    assert res.finish_reasons == [FinishReason.NONE]
    # logprobs come back in shape: the sampled token with probability 1
    res = runner().execute(prefill("c", [1, 2, 3], [0], logprobs=2))
    assert res.logprobs[0].logprob == 0.0 and res.logprobs[0].top_ids == res.token_ids


def test_bad_plans_are_step_errors() -> None:
    r = runner(num_blocks=8)
    assert "bad block table" in (r.execute(prefill("a", [1] * 9, [0, 1])).error or "")
    assert "bad block table" in (r.execute(prefill("a", [1] * 3, [8])).error or "")
    assert "outside [0, 8)" in (r.execute(prefill("a", [1], [8])).error or "")
    assert "unknown request" in (r.execute(decode("zz", 5, 3, [0])).error or "")
    # still serving afterwards
    assert r.execute(prefill("b", [1, 2], [0])).error is None


def test_structured_output_is_refused_per_request() -> None:
    from kvflow.shared.messages import StructuredOutput

    res = runner().execute(
        prefill("a", [1, 2], [0], structured_output=StructuredOutput("regex", "a+"))
    )
    assert res.finish_reasons == [FinishReason.ERROR]


def test_scheduler_gets_every_block_back() -> None:
    """The real scheduler core drives the simulator to the end of every request: all blocks
    are free again and every request produced exactly max_tokens."""
    limits = SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512)
    core = SchedulerCore(limits)
    ws = core.add_worker("w", 40, BS)
    r = SimRunner(VOCAB, EOS, BS, 40, 512, worker_id="w")
    produced: dict[str, list[int]] = {}
    for i in range(12):
        prompt = [(i * 37 + j) % 900 + 100 for j in range(5 + 3 * i)]
        req = TokenizedRequest(f"r{i}", "", prompt, SamplingParams(temperature=0, max_tokens=9))
        core.add_request(req)
    for _ in range(500):
        plan, loads = core.schedule(ws)
        assert not loads
        if plan is None:
            break
        res: StepResult = r.execute(plan)
        assert res.error is None
        for rid, tok in zip(res.request_ids, res.token_ids, strict=True):
            produced.setdefault(rid, []).append(tok)
        core.on_result(res)
    assert not core.requests
    assert {k: len(v) for k, v in produced.items()} == {f"r{i}": 9 for i in range(12)}
    assert ws.bm.num_free_blocks == 40


def test_step_time_is_the_model_time_asked_for() -> None:
    r = runner(step_ms=30)
    t0 = time.perf_counter()
    res = r.execute(prefill("a", [1, 2, 3], [0]))
    took = time.perf_counter() - t0
    assert took >= 0.030 and res.step_time_s >= 0.030
    assert took < 1.0  # a sleep, not a busy loop gone wrong
    empty = r.execute(StepPlan(2, []))  # no sequences: no model time
    assert empty.step_time_s < 0.030
    cost = StepCostModel(overhead_s=0.01, per_decode_token_s=0, per_prefill_token_s=0.001)
    fn = step_time_fn(0.0, "")
    assert fn(prefill("a", [1] * 10, [0, 1, 2])) == 0.0
    assert abs(cost.step_time(prefill("a", [1] * 10, [0, 1, 2])) - 0.02) < 1e-9
