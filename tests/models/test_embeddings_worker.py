"""Embeddings in the worker: the pooling math (LAST, MEAN summed across chunks, CLS, L2
normalization, the wire's little-endian float32) and ModelRunner pooling the final hidden
states of a tiny random Llama, compared with Hugging Face's LlamaModel ``last_hidden_state``
(after the final norm), whole or in chunks, alone or in a step with a generating sequence."""

from __future__ import annotations

import struct

import pytest
import torch
from transformers import LlamaForCausalLM

from kvflow.services.worker.pooling import PoolState, pooled_output
from kvflow.shared.messages import (
    NewRequest,
    PoolingParams,
    SamplingParams,
    ScheduledSeq,
    StepPlan,
    StepResult,
    decode,
    encode,
)
from tests.helpers.tiny_llama import make_runner

PROMPT = [5, 17, 99, 3, 42, 8, 64, 21, 77, 1, 33]  # 11 tokens, not a multiple of the block


def seq(rid: str, tokens: list[int], start: int, end: int, sample: bool) -> ScheduledSeq:
    """A chunk of ``rid``: blocks 0-15 for the embedding request "e", 16-31 for others."""
    table = list(range(16)) if rid == "e" else list(range(16, 32))
    return ScheduledSeq(rid, tokens[start:end], start, table, sample)


def hf_pooled(hf: LlamaForCausalLM, tokens: list[int], kind: str) -> torch.Tensor:
    with torch.no_grad():
        h = hf.model(torch.tensor([tokens])).last_hidden_state[0]  # after the final norm
    v = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[kind]
    return torch.nn.functional.normalize(v, dim=0)


def vector(data: bytes) -> torch.Tensor:
    return torch.tensor(struct.unpack(f"<{len(data) // 4}f", data))


# -- pooling math ------------------------------------------------------------------------------


def test_mean_accumulates_across_chunks_as_one_mean() -> None:
    rows = torch.randn(10, 8)
    st = PoolState(PoolingParams("MEAN", normalize=False), prompt_len=10)
    chunks = [(0, 3), (3, 4), (4, 10)]
    for a, b in chunks:
        s = ScheduledSeq("r", list(range(a, b)), a, [0], b == 10)
        assert list(st.rows_of(s)) == list(range(b - a))  # MEAN reads every row
        st.add(rows[a:b])
    torch.testing.assert_close(st.finish(), rows.mean(0))
    assert st.count == 10


@pytest.mark.parametrize(
    "kind, chunk, want_rows",
    [
        ("LAST", (0, 4), []),  # not the prompt's end: nothing
        ("LAST", (4, 10), [5]),  # the prompt's last row
        ("CLS", (0, 4), [0]),  # the prompt's first row
        ("CLS", (4, 10), []),
    ],
)
def test_rows_each_pooling_reads(kind: str, chunk: tuple[int, int], want_rows: list[int]) -> None:
    st = PoolState(PoolingParams(kind), prompt_len=10)
    a, b = chunk
    assert list(st.rows_of(ScheduledSeq("r", list(range(a, b)), a, [0], b == 10))) == want_rows


def test_normalized_and_little_endian_float32_on_the_wire() -> None:
    st = PoolState(PoolingParams("LAST"), prompt_len=1)
    st.add(torch.tensor([[3.0, 4.0]]))
    out = pooled_output("r", st.finish())
    assert out.dim == 2 and out.data == struct.pack("<2f", 0.6, 0.8)
    msg = StepResult("w", 1, [], [], [], embeddings=[out])
    assert decode(encode(msg)).embeddings == [out]


def test_no_rows_pooled_is_an_error_not_a_zero_vector() -> None:
    with pytest.raises(RuntimeError):
        PoolState(PoolingParams("MEAN"), prompt_len=3).finish()


# -- the runner --------------------------------------------------------------------------------


def run_embedding(runner, kind: str, chunks: list[int], with_generation: bool = False):  # noqa: ANN001, ANN201
    """Run PROMPT as an embedding request in chunks ending at ``chunks``; with a generating
    sequence in every step. Returns (the vector, every StepResult)."""
    new = [NewRequest("e", SamplingParams(max_tokens=1), len(PROMPT), pooling=PoolingParams(kind))]
    gen_prompt = [9, 8, 7, 6, 5]
    gen = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    if with_generation:
        new.append(NewRequest("g", gen, len(gen_prompt)))
    results, start, gen_tokens = [], 0, list(gen_prompt)
    for step, end in enumerate(chunks):
        seqs = [seq("e", PROMPT, start, end, end == len(PROMPT))]
        if with_generation:
            g_start = 0 if step == 0 else len(gen_tokens) - 1
            seqs.insert(0, seq("g", gen_tokens, g_start, len(gen_tokens), True))
        res = runner.execute(StepPlan(step, seqs, new if step == 0 else []))
        assert res.error is None, res.error
        results.append(res)
        if with_generation:
            assert res.request_ids == ["g"]  # the embedding request never samples a token
            gen_tokens.append(res.token_ids[0])
        else:
            assert res.request_ids == []
        start = end
    assert [len(r.embeddings) for r in results] == [0] * (len(chunks) - 1) + [1]
    out = results[-1].embeddings[0]
    assert out.request_id == "e" and out.dim == 64
    return vector(out.data), results


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
@pytest.mark.parametrize("chunks", [[11], [4, 5, 11]])
def test_runner_pools_hf_last_hidden_state(tiny_llama, kind: str, chunks: list[int]) -> None:
    got, _ = run_embedding(make_runner(tiny_llama), kind, chunks)
    want = hf_pooled(tiny_llama, PROMPT, kind)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert abs(float(got.norm()) - 1.0) < 1e-5


@pytest.mark.parametrize("kind", ["LAST", "MEAN"])
def test_runner_pools_the_same_beside_a_generating_sequence(tiny_llama, kind: str) -> None:
    alone, _ = run_embedding(make_runner(tiny_llama), kind, [4, 11])
    mixed, _ = run_embedding(make_runner(tiny_llama), kind, [4, 11], with_generation=True)
    torch.testing.assert_close(mixed, alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mixed, hf_pooled(tiny_llama, PROMPT, kind), rtol=1e-5, atol=1e-5)


def test_a_request_sent_again_starts_its_mean_over(tiny_llama) -> None:
    """After a preemption the scheduler forgets the request on the worker and sends its
    NewRequest again: the recomputed prompt gives the vector once, unchanged."""
    runner = make_runner(tiny_llama)
    new = NewRequest("e", SamplingParams(max_tokens=1), len(PROMPT), pooling=PoolingParams("MEAN"))
    res = runner.execute(StepPlan(0, [seq("e", PROMPT, 0, 6, False)], [new]))
    assert res.embeddings == []
    plan = StepPlan(1, [seq("e", PROMPT, 0, 11, True)], [new], finished_request_ids=["e"])
    res = runner.execute(plan)
    assert len(res.embeddings) == 1
    got = vector(res.embeddings[0].data)
    torch.testing.assert_close(got, hf_pooled(tiny_llama, PROMPT, "MEAN"), rtol=1e-5, atol=1e-5)


def test_unnormalized_when_asked(tiny_llama) -> None:
    runner = make_runner(tiny_llama)
    pooling = PoolingParams("LAST", normalize=False)
    new = NewRequest("e", SamplingParams(max_tokens=1), len(PROMPT), pooling=pooling)
    res = runner.execute(StepPlan(0, [seq("e", PROMPT, 0, 11, True)], [new]))
    with torch.no_grad():
        want = tiny_llama.model(torch.tensor([PROMPT])).last_hidden_state[0, -1]
    torch.testing.assert_close(vector(res.embeddings[0].data), want, rtol=1e-5, atol=1e-5)
