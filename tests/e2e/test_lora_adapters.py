"""LoRA adapters on the whole stack (two workers, real NATS and Redis) through the openai SDK:
PEFT adapters made here for SmolLM2 (random non-zero B, so they change the output); greedy text
with an adapter equals Hugging Face transformers + peft's ``generate``; a mixed batch (base and
two adapters) gives each request its text alone; loading and unloading over vLLM's run-time API
is checked by both workers; bad adapters are refused with nothing changed; prefix caching is
never shared across adapters."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.helpers.lora_stack import NEW_TOKENS, PROMPTS, greedy_text, make_adapter
from tests.helpers.stack import openai_client, running_stack, wait_all_blocks_free

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def adapters(hf_model, tokenizer, tmp_path_factory) -> dict:
    """{name: (path, {prompt: peft's greedy text})}, and the base model's texts under None."""
    root = tmp_path_factory.mktemp("lora")
    specs = {
        "sql": (
            1,
            8,
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
        "chat": (2, 16, ["q_proj", "v_proj", "down_proj"]),
    }
    out: dict = {None: (None, {p: greedy_text(hf_model, tokenizer, p) for p in PROMPTS})}
    for name, (seed, r, targets) in specs.items():
        model = make_adapter(hf_model, root / name, seed, r, targets)
        out[name] = (str(root / name), {p: greedy_text(model, tokenizer, p) for p in PROMPTS})
        del model
    # over --max-lora-rank (16) and corrupt copies of "sql", for the refusals
    big = root / "big"
    make_adapter(hf_model, big, 3, 32, ["q_proj"])
    bad = root / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((root / "sql" / "adapter_config.json").read_text())
    (bad / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    out["big"], out["bad"] = (str(big), {}), (str(bad), {})
    return out


@pytest.fixture(scope="module")
def lora_stack(adapters):
    args = ["--max-model-len", "2048", "--workers", "2", "--max-num-seqs", "4"]
    args += ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16"]
    args += ["--lora-modules", f"sql={adapters['sql'][0]}"]
    with running_stack("lora", *args) as base:
        deadline = time.monotonic() + 120
        while httpx.get(f"{base}/stats", timeout=5).json()["num_workers"] < 2:
            assert time.monotonic() < deadline, "the second worker never joined"
            time.sleep(0.5)
        yield base


def _complete(client, model: str, prompt: str) -> str:
    r = client.completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
    return r.choices[0].text


def _load(base: str, name: str, path: str) -> httpx.Response:
    return httpx.post(
        f"{base}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, timeout=120
    )


def _models(client) -> dict[str, object]:
    return {m.id: m for m in client.models.list().data}


def test_static_adapter_equals_hf_peft(lora_stack, adapters) -> None:
    client = openai_client(lora_stack)
    models = _models(client)
    assert set(models) == {MODEL, "sql"}
    assert models["sql"].parent == MODEL and models["sql"].root == adapters["sql"][0]
    for p in PROMPTS:
        assert _complete(client, "sql", p) == adapters["sql"][1][p], p
        assert _complete(client, MODEL, p) == adapters[None][1][p]
    for name in ("sql", "chat"):  # each adapter changes the text
        assert any(adapters[name][1][p] != adapters[None][1][p] for p in PROMPTS), name


def test_load_mixed_batch_and_unload_across_two_workers(lora_stack, adapters) -> None:
    client = openai_client(lora_stack)
    r = _load(lora_stack, "chat", adapters["chat"][0])
    assert r.status_code == 200, r.text
    assert "added successfully" in r.text
    assert _load(lora_stack, "chat", adapters["chat"][0]).status_code == 200  # idempotent
    assert set(_models(client)) == {MODEL, "sql", "chat"}
    # base, sql and chat on both prompts, three times each, at once: 18 requests on two
    # workers of 4 sequences each (so both serve adapters), at most 2 adapters per worker
    jobs = [(m, p) for m in (MODEL, "sql", "chat") for p in PROMPTS] * 3
    before = {w["worker_id"]: w["num_prefills"] for w in _stats(lora_stack)["workers"]}
    with ThreadPoolExecutor(len(jobs)) as ex:
        got = list(ex.map(lambda j: _complete(client, *j), jobs))
    for (m, p), text in zip(jobs, got, strict=True):
        assert text == adapters[None if m == MODEL else m][1][p], (m, p)
    after = {w["worker_id"]: w["num_prefills"] for w in _stats(lora_stack)["workers"]}
    assert all(after[w] > before.get(w, 0) for w in after), (before, after)
    # unloaded: a 404 naming `model` for requests, gone from the list, its blocks freed
    r = httpx.post(f"{lora_stack}/v1/unload_lora_adapter", json={"lora_name": "chat"}, timeout=30)
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError) as e:
        _complete(client, "chat", PROMPTS[0])
    assert e.value.body["param"] == "model"
    assert set(_models(client)) == {MODEL, "sql"}
    r = httpx.post(f"{lora_stack}/v1/unload_lora_adapter", json={"lora_name": "chat"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    stats = wait_all_blocks_free(lora_stack)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_bad_adapters_are_refused_and_nothing_changes(lora_stack, adapters, tmp_path) -> None:
    client = openai_client(lora_stack)
    cases = {
        "big": "over --max-lora-rank 16",
        "bad": "cannot be read",
    }
    for name, words in cases.items():
        r = _load(lora_stack, name, adapters[name][0])
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert words in err["message"] and err["param"] == "lora_path"
    r = _load(lora_stack, "nowhere", str(tmp_path / "missing"))
    assert r.status_code == 400 and "not a directory" in r.json()["error"]["message"]
    r = _load(lora_stack, "sql", adapters["chat"][0])  # the name is taken (another path)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    r = httpx.post(f"{lora_stack}/v1/load_lora_adapter", json={"lora_name": "x"}, timeout=30)
    assert r.status_code == 400 and "lora_path" in json.dumps(r.json())
    assert set(_models(client)) == {MODEL, "sql"}
    with pytest.raises(openai.NotFoundError) as e:
        _complete(client, "big", PROMPTS[0])
    assert e.value.body["param"] == "model"
    assert _complete(client, "sql", PROMPTS[0]) == adapters["sql"][1][PROMPTS[0]]


def test_prefix_cache_is_not_shared_across_adapters(lora_stack, adapters) -> None:
    """A 200-token prompt run by the base model, then by an adapter: the adapter's run finds
    none of the base's blocks (its K/V differs), and its own second run finds its own."""
    client = openai_client(lora_stack)
    prompt = "Tell me about the sea. " * 40

    def hits() -> int:
        return _stats(lora_stack)["prefix_cache_hits"]

    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    h0 = hits()
    client.completions.create(model="sql", prompt=prompt, max_tokens=1, temperature=0)
    h1 = hits()
    client.completions.create(model="sql", prompt=prompt, max_tokens=1, temperature=0)
    assert h1 == h0 and hits() > h1


def _stats(base: str) -> dict:
    return httpx.get(f"{base}/stats", timeout=10).json()


def test_llm_generate_with_lora_request(lora_stack, adapters) -> None:
    """vLLM's ``LLM.generate(..., lora_request=LoRARequest(name, id, path))`` on the running
    stack: the adapter is loaded by name, the text equals peft's, a list gives one per prompt."""
    from kvflow import LLM, LoRARequest, SamplingParams
    from tests.helpers.faults import stack_credentials, stack_urls

    nats_url, _ = stack_urls("lora")
    login = str(stack_credentials("lora").nats_password_file("gateway"))
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    chat = LoRARequest("py-chat", 7, adapters["chat"][0])
    with LLM(
        nats_url=nats_url, nats_password_file=login, max_model_len=2048, enable_lora=True
    ) as llm:
        out = llm.generate(PROMPTS, greedy, use_tqdm=False, lora_request=chat)
        assert [o.outputs[0].text for o in out] == [adapters["chat"][1][p] for p in PROMPTS]
        mixed = llm.generate(PROMPTS, greedy, use_tqdm=False, lora_request=[None, chat])
        assert mixed[0].outputs[0].text == adapters[None][1][PROMPTS[0]]
        assert mixed[1].outputs[0].text == adapters["chat"][1][PROMPTS[1]]
        with pytest.raises(ValueError, match="cannot be read"):
            llm.generate(PROMPTS[0], greedy, lora_request=LoRARequest("x", 8, adapters["bad"][0]))
    r = httpx.post(
        f"{lora_stack}/v1/unload_lora_adapter", json={"lora_name": "py-chat"}, timeout=30
    )
    assert r.status_code == 200
