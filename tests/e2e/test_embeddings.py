"""/v1/embeddings through the official openai SDK against the session stack (LAST pooling, the
default): vectors equal Hugging Face's final hidden state of the same weights (L2-normalized),
in both encodings, for text and token-id inputs, 256 inputs in one call, alongside a streaming
generation, through the prefix cache, up to the whole context; OpenAI-shaped 400s naming the
field; every KV block free afterwards and the requests counted in the metrics.

``LLM.embed`` connects to the running stacks (no pipeline of its own): the pooling type travels
with each request (the client's ``pooling_type`` setting), so an ``LLM(pooling_type="MEAN")``
on the small stack (256-token step budget) tests MEAN pooling over chunked prefill without
another stack. Disaggregated serving is tested in
test_disaggregated.py."""

from __future__ import annotations

import base64
import struct
import threading

import httpx
import openai
import pytest
import torch

from kvflow import LLM
from tests.helpers import hf_reference
from tests.helpers.faults import stack_credentials, stack_urls
from tests.helpers.stack import wait_all_blocks_free

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"
TEXTS = [
    "The capital of France is Paris.",
    "Embeddings map text to vectors of numbers.",
    "A cat sat on the mat and looked at the bird outside.",
]


def hf_vector(hf_model, ids: list[int], pooling: str = "LAST") -> torch.Tensor:
    """HF's LlamaModel last_hidden_state (after the final norm), pooled, L2-normalized."""
    return hf_reference.pooled_hidden_state(hf_model, ids, pooling)


def cosine(a, b) -> float:  # noqa: ANN001 - lists or tensors
    a, b = torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32)
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def vectors(client, inputs, **kw) -> list[list[float]]:  # noqa: ANN001
    out = client.embeddings.create(model=MODEL, input=inputs, encoding_format="float", **kw)
    assert [d.index for d in out.data] == list(range(len(out.data)))
    return [d.embedding for d in out.data]


def test_vectors_equal_hugging_face_in_both_encodings(client, stack, hf_model, tokenizer) -> None:
    out = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert out.object == "list" and out.model == MODEL and len(out.data) == 3
    ids = [tokenizer(t)["input_ids"] for t in TEXTS]
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, ids))
    for d, i in zip(out.data, ids, strict=True):
        assert d.object == "embedding" and len(d.embedding) == 576
        assert cosine(d.embedding, hf_vector(hf_model, i)) >= 0.9999
        assert abs(float(torch.tensor(d.embedding).norm()) - 1.0) < 1e-4
    decoded = client.embeddings.create(model=MODEL, input=TEXTS)  # the SDK asks for base64
    raw = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="base64")
    for f, dec, r in zip(out.data, decoded.data, raw.data, strict=True):
        assert isinstance(r.embedding, str)
        floats = list(struct.unpack("<576f", base64.b64decode(r.embedding)))
        assert floats == f.embedding == [float(x) for x in dec.embedding]
    wait_all_blocks_free(stack)


def test_token_id_inputs_equal_text_inputs(client, tokenizer) -> None:
    ids = [tokenizer(t)["input_ids"] for t in TEXTS]
    by_text = vectors(client, TEXTS)
    assert vectors(client, ids) == by_text  # a list of token-id lists
    assert vectors(client, ids[1]) == [by_text[1]]  # one list of token ids
    assert vectors(client, TEXTS[2]) == [by_text[2]]  # one string
    last8 = vectors(client, TEXTS[2], extra_body={"truncate_prompt_tokens": 8})
    assert last8 == vectors(client, [ids[2][-8:]])  # vLLM's extra: the last 8 tokens


def test_256_inputs_in_one_call(client, stack) -> None:
    inputs = [f"Sentence {i}: the number {i * 3} is {'even' if i % 2 == 0 else 'odd'}." for i in range(256)]  # fmt: skip
    got = vectors(client, inputs)
    assert len(got) == 256 and all(len(v) == 576 for v in got)
    for i in (0, 101, 255):  # the same as alone
        assert cosine(got[i], vectors(client, inputs[i])[0]) >= 0.99999
    assert cosine(got[0], got[1]) < 0.9999  # different inputs, different vectors
    stats = wait_all_blocks_free(stack)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_same_vector_while_a_generation_streams(client, stack) -> None:
    text = "Paris is the capital and largest city of France, on the Seine."
    alone = vectors(client, text)[0]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Write a long story about a lighthouse."}],
        max_tokens=96,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    first = next(chunks)
    assert first.choices
    rest: list = []
    reader = threading.Thread(target=lambda: rest.extend(chunks))
    reader.start()
    try:
        during = [vectors(client, text)[0] for _ in range(3)]
        still_streaming = reader.is_alive()
    finally:
        reader.join(120)
    assert still_streaming, "the embeddings ran while the chat was generating"
    assert [c.choices[0].finish_reason for c in rest if c.choices and c.choices[0].finish_reason]
    for v in during:
        assert cosine(v, alone) >= 0.99999
    wait_all_blocks_free(stack)


def test_prefix_cache_hit_gives_the_same_vector(client, stack, hf_model, tokenizer) -> None:
    text = " ".join(f"word{i}" for i in range(120))  # many full blocks
    before = httpx.get(f"{stack}/stats", timeout=5).json()["prefix_cache_hits"]
    first = vectors(client, text)[0]
    second = vectors(client, text)[0]
    after = httpx.get(f"{stack}/stats", timeout=5).json()["prefix_cache_hits"]
    assert after > before, "the second request reused the first one's blocks"
    assert cosine(first, second) >= 0.99999
    assert cosine(second, hf_vector(hf_model, tokenizer(text)["input_ids"])) >= 0.9999
    stats = wait_all_blocks_free(stack)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_an_input_may_fill_the_whole_context(client, tokenizer) -> None:
    ids = (tokenizer(" ".join(f"item{i}" for i in range(2000)))["input_ids"] * 2)[:2048]
    assert len(ids) == 2048  # the stack's --max-model-len: no room for an output needed
    out = client.embeddings.create(model=MODEL, input=[ids], encoding_format="float")
    assert out.usage.prompt_tokens == 2048
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MODEL, input=[ids + [42]])
    assert e.value.body["param"] == "input" and "2048" in e.value.body["message"]


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["ok", ""]}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [[1, 99999999]]}, "input"),  # out of the vocabulary (the tokenizer's check)
        ({"input": [-5]}, "input"),
        ({"input": "ok", "dimensions": 64}, "dimensions"),
        ({"input": "ok", "encoding_format": "int8"}, "encoding_format"),
    ],
)
def test_bad_requests_are_400_naming_the_field(client, stack, kw: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MODEL, **kw)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and e.value.body["type"] == "BadRequestError"


def test_wrong_model_is_404_and_requests_are_counted(client, stack) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.embeddings.create(model="no-such-model", input="x")
    assert e.value.body["param"] == "model"

    def successes() -> float:
        text = httpx.get(f"{stack}/metrics?scope=local", timeout=5).text
        lines = [ln for ln in text.splitlines() if ln.startswith("vllm:request_success_total")]
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if 'reason="stop"' in ln)

    before = successes()
    vectors(client, TEXTS)
    assert successes() - before == len(TEXTS)


def connect(name: str, **settings) -> LLM:  # noqa: ANN003
    """An LLM on the running stack ``name``, logged in as the gateway role."""
    nats_url, _ = stack_urls(name)
    login = str(stack_credentials(name).nats_password_file("gateway"))
    return LLM(nats_url=nats_url, nats_password_file=login, max_model_len=2048, **settings)


def test_llm_embed_equals_http_and_hugging_face(client, stack, hf_model, tokenizer) -> None:
    ids = [tokenizer(t)["input_ids"] for t in TEXTS]
    with connect("default") as llm:
        outs = llm.embed(TEXTS, use_tqdm=False)
        assert [o.prompt_token_ids for o in outs] == ids
        assert len({o.request_id for o in outs}) == 3 and all(o.finished for o in outs)
        by_http = vectors(client, TEXTS)
        for o, want, i in zip(outs, by_http, ids, strict=True):
            assert o.outputs.hidden_size == 576
            assert cosine(o.outputs.embedding, want) >= 0.99999
            assert cosine(o.outputs.embedding, hf_vector(hf_model, i)) >= 0.9999
        one = llm.embed(TEXTS[0])  # a single prompt, as str, token ids and dict prompts
        assert one[0].outputs.embedding == outs[0].outputs.embedding
        assert llm.embed(ids[1])[0].outputs.embedding == outs[1].outputs.embedding
        salted = llm.embed([{"prompt_token_ids": ids[2], "cache_salt": "t1"}])[0]
        assert cosine(salted.outputs.embedding, outs[2].outputs.embedding) >= 0.99999
        cut = llm.embed(TEXTS[2], truncate_prompt_tokens=5)[0]
        assert cut.prompt_token_ids == ids[2][-5:]
        with pytest.raises(ValueError, match="input"):
            llm.embed([[1, 99999999]])
    wait_all_blocks_free(stack)


def test_mean_pooling_over_chunked_prefill(small_stack, hf_model, tokenizer) -> None:
    """Inputs of ~560 tokens on a 256-token step budget (3 chunks each, MEAN summed across
    them), six at once: every vector is Hugging Face's mean over the whole prompt. (A
    recomputed embedding after a preemption or failed step: tests/unit/{gateway,scheduler}/test_embeddings_*.)"""
    texts = [" ".join(f"{w}{k}" for k in range(170)) for w in ("ab", "cd", "ef")] * 2
    texts = [f"{i} " + t for i, t in enumerate(texts)]
    with connect("small", pooling_type="MEAN") as llm:
        outs = llm.embed(texts, use_tqdm=False)
    assert len(outs) == 6
    for o, t in zip(outs, texts, strict=True):
        ids = tokenizer(t)["input_ids"]
        assert o.prompt_token_ids == ids and len(ids) > 512
        assert cosine(o.outputs.embedding, hf_vector(hf_model, ids, "MEAN")) >= 0.9999
    last = hf_vector(hf_model, outs[0].prompt_token_ids, "LAST")
    assert cosine(outs[0].outputs.embedding, last) < 0.999  # MEAN, not LAST
    stats = wait_all_blocks_free(small_stack)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
