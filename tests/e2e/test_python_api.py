"""The Python API (`from kvflow import LLM, SamplingParams`) and the legacy `/generate` endpoint,
on the session stack (the LLM connects to its NATS) and once with a pipeline of its own: 500
prompts in order with bounded memory, greedy outputs equal to the HTTP API's, the seed's
examples as written, beam search equal to Hugging Face's with shared prefix blocks, and one
validation for both paths."""

from __future__ import annotations

import json
import resource
import time

import httpx
import pytest

from kvflow import LLM, BeamSearchParams, SamplingParams
from tests.helpers import hf_reference
from tests.helpers.faults import service_pids, stack_credentials, stack_urls
from tests.helpers.stack import openai_client, wait_all_blocks_free

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def llm(stack):
    nats_url, _ = stack_urls("default")
    # a running stack is closed: the client logs in as the gateway role, as a user would
    # with the credentials `kvflow serve` printed
    login = str(stack_credentials("default").nats_password_file("gateway"))
    with LLM(nats_url=nats_url, nats_password_file=login, max_model_len=2048) as llm:
        yield llm


def http_greedy(base: str, prompt, max_tokens: int) -> str:
    r = openai_client(base).completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0
    )
    return r.choices[0].text


def test_500_prompts_come_back_in_order_equal_to_http_with_bounded_memory(llm, stack) -> None:
    prompts = [f"Item {i}: the number {i * 7} written in words is" for i in range(500)]
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert len(outs) == 500
    assert [o.prompt for o in outs] == prompts
    assert all(len(o.outputs) == 1 and o.outputs[0].finish_reason for o in outs)
    for i in (0, 137, 499):
        assert outs[i].outputs[0].text == http_greedy(stack, prompts[i], 2), i
        assert outs[i].prompt_token_ids == llm.get_tokenizer()(prompts[i])["input_ids"]
    print(f"\n500 prompts: peak RSS of the caller grew by {grown_mib:.1f} MiB")
    assert grown_mib < 200
    wait_all_blocks_free(stack)


def test_greedy_chat_n_seeds_and_logprobs_match_the_http_api(llm, stack) -> None:
    prompt = "Write one sentence about the sea."
    sp = SamplingParams(temperature=0, max_tokens=24, logprobs=3, ignore_eos=True)
    c = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
    }
    assert (
        c.text
        == httpx.post(f"{stack}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    )
    assert len(c.token_ids) == 24 and len(c.logprobs) == 24
    assert c.cumulative_logprob == pytest.approx(
        sum(c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids))
    )
    assert all(len(d) >= 3 for d in c.logprobs)
    convo = [{"role": "user", "content": "Name a color."}]
    chat = llm.chat(convo, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    r = openai_client(stack).chat.completions.create(
        model=MODEL, messages=convo, max_tokens=12, temperature=0
    )
    assert chat.outputs[0].text == r.choices[0].message.content
    draft = [*convo, {"role": "assistant", "content": "My favourite colour is"}]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    cont = llm.chat(draft, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False, **flags)
    r = openai_client(stack).chat.completions.create(
        model=MODEL, messages=draft, max_tokens=8, temperature=0, extra_body=flags
    )
    assert cont[0].outputs[0].text == r.choices[0].message.content
    seeded = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12)
    a = llm.generate(prompt, seeded, use_tqdm=False)[0]
    b = llm.generate(prompt, seeded, use_tqdm=False)[0]
    assert [o.index for o in a.outputs] == [0, 1, 2]
    assert [o.text for o in a.outputs] == [o.text for o in b.outputs]  # seeds make it repeatable
    best = llm.generate(
        prompt,
        SamplingParams(n=2, best_of=4, temperature=1.0, seed=3, max_tokens=8),
        use_tqdm=False,
    )[0]
    assert len(best.outputs) == 2
    assert best.outputs[0].cumulative_logprob >= best.outputs[1].cumulative_logprob


def test_invalid_parameters_name_the_field_in_python_and_over_http(llm, stack) -> None:
    with pytest.raises(ValueError) as e:
        llm.generate("x", SamplingParams(temperature=-1))
    assert e.value.param == "temperature"
    body = {"model": MODEL, "prompt": "x", "temperature": -1}
    r = httpx.post(f"{stack}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = httpx.post(f"{stack}/generate", json={"prompt": "x", "temperature": -1}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    with pytest.raises(ValueError):  # the pipeline's own check (prompt too long), as a ValueError
        llm.generate([1] * 3000, SamplingParams(max_tokens=4), use_tqdm=False)


def test_the_seeds_generate_curl_examples_work_as_written(stack) -> None:
    for prompt in (
        "The capital of France is",
        "The largest planet in our solar system is",
        "To be or not to be, that is",
    ):
        body = {
            "prompt": prompt,
            "n": 1,
            "use_beam_search": False,
            "temperature": 0.7,
            "max_tokens": 10,
        }
        r = httpx.post(f"{stack}/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        texts = r.json()["text"]
        assert len(texts) == 1 and texts[0].startswith(prompt) and len(texts[0]) > len(prompt)
    body = {"prompt": "The capital of France is", "temperature": 0, "max_tokens": 8}
    plain = httpx.post(f"{stack}/generate", json=body, timeout=60).json()["text"][0]
    assert plain == "The capital of France is" + http_greedy(stack, "The capital of France is", 8)
    with httpx.stream("POST", f"{stack}/generate", json={**body, "stream": True}, timeout=60) as r:
        lines = [json.loads(x) for x in r.iter_lines() if x.strip()]
    assert r.headers["content-type"].startswith("application/x-ndjson")
    assert len(lines) >= 2 and lines[-1]["text"] == [plain]
    assert all(
        lines[i]["text"][0].startswith(lines[i - 1]["text"][0]) for i in range(1, len(lines))
    )
    two = httpx.post(
        f"{stack}/generate", json={**body, "n": 2, "temperature": 0.9, "seed": 1}, timeout=60
    )
    assert len(two.json()["text"]) == 2


def test_beam_search_equals_hugging_face_and_shares_prefix_blocks(
    llm, stack, hf_model, tokenizer
) -> None:
    prompt = (  # 36 tokens: two full blocks that every beam's request shares
        "A good teacher once told me that patience, daily practice and honest curiosity matter "
        "more than talent when one studies anything difficult. In her view, the best way to "
        "learn a language is"
    )
    ids = tokenizer(prompt)["input_ids"]
    hf_best = hf_reference.generate(
        hf_model, ids, num_beams=4, num_return_sequences=4, do_sample=False, max_new_tokens=6
    )[0]
    before = httpx.get(f"{stack}/stats", timeout=5).json()
    out = llm.beam_search([prompt], BeamSearchParams(beam_width=4, max_tokens=6))[0]
    after = httpx.get(f"{stack}/stats", timeout=5).json()
    seqs = out.sequences
    assert len(seqs) == 4
    assert seqs[0].tokens[len(ids) :] == hf_best
    assert [s.cum_logprob for s in seqs] == sorted((s.cum_logprob for s in seqs), reverse=True)
    # every step's requests found the prompt's full blocks cached
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    computed = after["num_computed_tokens"] - before["num_computed_tokens"]
    asked = sum(len(ids) + step for step in range(6)) * 4  # tokens of every expand request
    print(f"\nbeam search: {hits} prefix-cache block hits, {computed} of {asked} tokens computed")
    assert hits > 0 and computed < asked / 2
    # the legacy endpoint: the same best beam
    body = {
        "prompt": prompt,
        "n": 2,
        "best_of": 4,
        "use_beam_search": True,
        "temperature": 0,
        "max_tokens": 6,
    }
    texts = httpx.post(f"{stack}/generate", json=body, timeout=120).json()["text"]
    assert len(texts) == 2 and texts[0] == prompt + tokenizer.decode(
        hf_best, skip_special_tokens=True
    )
    wait_all_blocks_free(stack)


def test_an_llm_starts_its_own_pipeline_and_stops_it() -> None:
    t0 = time.monotonic()
    llm = LLM(max_model_len=512, kv_cache_memory=0.25)
    nats_url = llm._stack.nats_url
    log_dir = llm._stack.log_path.parent
    assert "tokenizer ready" in llm._stack.log_path.read_text()
    try:
        assert service_pids(nats_url)  # tokenizer, scheduler, detokenizer, worker
        outs = llm.generate(
            [
                "What is machine learning?",
                "Explain quantum computing",
                "How does photosynthesis work?",
            ],
            SamplingParams(temperature=0.7, top_p=0.95),
            use_tqdm=False,
        )
        assert len(outs) == 3 and all(o.outputs[0].finish_reason for o in outs)
    finally:
        llm.close()
    print(f"\nLLM(): started, served, stopped in {time.monotonic() - t0:.1f} s")
    deadline = time.monotonic() + 15
    while service_pids(nats_url) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert service_pids(nats_url) == {}
    assert not log_dir.exists()  # the pipeline's log goes with it when nothing failed


def test_chat_with_tools_renders_them_and_equals_the_http_api(llm, stack) -> None:
    """LLM.chat(tools=...) (vLLM's): the hermes template shows the tools and an earlier call;
    the greedy text (calls are not parsed by LLM.chat) is the call the HTTP API parses."""
    from tests.helpers.tools import TOOLS, one_shot

    sp = SamplingParams(temperature=0, max_tokens=40)
    out = llm.chat(one_shot("Tokyo"), sp, use_tqdm=False, tools=TOOLS)[0]
    assert "<tools>" in out.prompt and "<tool_call>" in out.prompt
    text = out.outputs[0].text
    assert text.startswith("<tool_call>")
    r = openai_client(stack).chat.completions.create(
        model=MODEL, messages=one_shot("Tokyo"), tools=TOOLS, max_tokens=40, temperature=0
    )
    [call] = r.choices[0].message.tool_calls
    body = json.loads(text.removeprefix("<tool_call>").split("</tool_call>")[0])
    assert (call.function.name, json.loads(call.function.arguments)) == (
        body["name"],
        body["arguments"],
    )
