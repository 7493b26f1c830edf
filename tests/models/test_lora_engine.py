"""LoRA adapters through the real scheduler core and model runner (no network), against Hugging
Face transformers + peft on a tiny random Llama: greedy output equal to peft's, a mixed batch
(base and two adapters) equal to each request alone, prefix caching never shared across
adapters, at most ``max_loras`` adapters in a step, LRU eviction, and bad adapters refused with
a clear error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from kvflow.services.worker.lora import LoRASpec
from kvflow.services.worker.lora_weights import load_adapter
from kvflow.services.worker.runner import ModelRunner
from kvflow.shared.lora import LoRAError, adapter_salt, check_lora_settings, parse_lora_modules
from kvflow.shared.messages import FinishReason, LoRARef
from tests.helpers.engine import new_core
from tests.helpers.lora import GREEDY, PROMPTS, argmax_tokens, make_adapter, run
from tests.helpers.tiny_llama import make_runner


@pytest.fixture(scope="module")
def adapters(tiny_llama: LlamaForCausalLM, tmp_path_factory: pytest.TempPathFactory):
    """Two adapters: every projection at rank 8, and q/v only at rank 4 with rsLoRA."""
    root = tmp_path_factory.mktemp("lora")
    a1 = make_adapter(tiny_llama, root / "a1", seed=1)
    a2 = make_adapter(
        tiny_llama, root / "a2", seed=2, r=4, targets=["q_proj", "v_proj"], rslora=True
    )
    return {
        "a1": (LoRARef("a1", 1, str(root / "a1")), a1),
        "a2": (LoRARef("a2", 2, str(root / "a2")), a2),
    }


def lora_runner(hf: LlamaForCausalLM, max_loras: int = 2, max_rank: int = 16) -> ModelRunner:
    return make_runner(hf, worker_id="w", lora=LoRASpec(max_loras, max_rank))


def test_greedy_equals_hf_peft(tiny_llama: LlamaForCausalLM, adapters) -> None:
    runner = lora_runner(tiny_llama)
    for ref, peft_model in adapters.values():
        for prompt in PROMPTS:
            got, _ = run(new_core(), runner, [(prompt, ref)])
            want = argmax_tokens(peft_model, prompt, GREEDY.max_tokens)
            assert got[0] == want, ref.name
            assert want != argmax_tokens(tiny_llama, prompt, GREEDY.max_tokens)  # it changes output


def test_mixed_batch_equals_each_alone(tiny_llama: LlamaForCausalLM, adapters) -> None:
    """Base, adapter 1 and adapter 2 (each on every prompt) in one batch, under chunked
    prefill: each request gets the tokens it gets alone."""
    refs = [None, adapters["a1"][0], adapters["a2"][0]]
    jobs = [(p, ref) for p in PROMPTS for ref in refs]
    alone = [run(new_core(), lora_runner(tiny_llama), [job])[0][0] for job in jobs]
    core = new_core(max_loras=2, max_num_batched_tokens=16)
    together, plans = run(core, lora_runner(tiny_llama), jobs)
    assert together == alone
    assert max(len({s.request_id for s in p.seqs}) for p in plans) >= 6  # really batched
    assert len({tuple(t) for t in alone[:3]}) == 3  # the three differ on the first prompt


def test_max_loras_bounds_every_step(tiny_llama: LlamaForCausalLM, adapters) -> None:
    """With max_loras=1 a step runs one adapter at most (the base model beside it), a request
    of another adapter waits its turn, and the worker's cache evicts the least recent."""
    a1, a2 = adapters["a1"][0], adapters["a2"][0]
    jobs = [(PROMPTS[0], a1), (PROMPTS[1], a2), (PROMPTS[2], None), (PROMPTS[1], a1)]
    core = new_core(max_loras=1)
    runner = lora_runner(tiny_llama, max_loras=1)
    got, plans = run(core, runner, jobs)
    by_id = {}
    for p in plans:
        by_id.update({r.request_id: r.lora for r in p.new_requests})
        names = {by_id[s.request_id].name for s in p.seqs if by_id[s.request_id] is not None}
        assert len(names) <= 1
    alone = [run(new_core(), lora_runner(tiny_llama), [job])[0][0] for job in jobs]
    assert got == alone
    assert runner.loras is not None and len(runner.loras.loaded) == 1
    assert runner.loras.loads == 2  # a1 (both a1 requests ran together), then a2


def test_prefix_cache_is_never_shared_across_adapters(
    tiny_llama: LlamaForCausalLM,
    adapters,
) -> None:
    a1, a2 = adapters["a1"][0], adapters["a2"][0]
    prompt = PROMPTS[2]  # 13 tokens: 3 full blocks of 4
    core = new_core()
    runner = lora_runner(tiny_llama)
    bm = core.workers["w"].bm
    first = {}
    for ref in (None, a1, a2):
        hits = bm.prefix_hits
        first[ref and ref.name], _ = run(core, runner, [(prompt, ref)])
        assert bm.prefix_hits == hits  # a new adapter: nothing cached for it
    for ref in (None, a1, a2):
        hits = bm.prefix_hits
        again, _ = run(core, runner, [(prompt, ref)])
        assert bm.prefix_hits > hits  # the same adapter again: its own blocks are reused
        assert again == first[ref and ref.name]
    assert adapter_salt(None, a1) != adapter_salt(None, a2) != adapter_salt(None, None)
    assert adapter_salt("s", a1) != adapter_salt(None, a1)


def test_bad_adapters_are_refused(
    tiny_llama: LlamaForCausalLM,
    adapters,
    tmp_path: Path,
) -> None:
    runner = lora_runner(tiny_llama)
    cfg = runner.config
    a1 = adapters["a1"][0]
    with pytest.raises(LoRAError, match="rank 8, over --max-lora-rank 4"):
        load_adapter(a1, cfg, max_rank=4)
    with pytest.raises(LoRAError, match="not a directory"):
        load_adapter(LoRARef("x", 3, str(tmp_path / "missing")), cfg, 16)

    def variant(name: str, conf_edit=None, tensors_edit=None, raw: bytes | None = None) -> LoRARef:
        d = tmp_path / name
        d.mkdir()
        conf = json.loads((Path(a1.path) / "adapter_config.json").read_text())
        if conf_edit:
            conf.update(conf_edit)
        (d / "adapter_config.json").write_text(json.dumps(conf))
        if raw is not None:
            (d / "adapter_model.safetensors").write_bytes(raw)
        else:
            t = load_file(str(Path(a1.path) / "adapter_model.safetensors"))
            save_file(tensors_edit(t) if tensors_edit else t, str(d / "adapter_model.safetensors"))
        return LoRARef(name, 9, str(d))

    def wrong_shape(t: dict) -> dict:
        k = next(k for k in t if "q_proj.lora_B" in k)
        t[k] = torch.zeros(t[k].shape[0] + 1, t[k].shape[1])
        return t

    def lm_head(t: dict) -> dict:
        t["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, 64)
        return t

    cases = {
        "corrupt": (variant("corrupt", raw=b"not a safetensors file"), "cannot be read"),
        "shape": (variant("shape", tensors_edit=wrong_shape), "another model"),
        "dora": (variant("dora", {"use_dora": True}), "use_dora"),
        "head": (variant("head", tensors_edit=lm_head), "other than the attention"),
        "target": (variant("target", {"target_modules": ["embed_tokens"]}), "cannot be served"),
    }
    assert runner.loras is not None
    for name, (ref, words) in cases.items():
        with pytest.raises(LoRAError, match=words):
            runner.loras.check(ref)
        assert name not in runner.loras.loaded
    got, _ = run(new_core(), runner, [(PROMPTS[1], None)])  # the runner still serves
    assert len(got[0]) == GREEDY.max_tokens


def test_an_adapter_gone_at_run_time_ends_its_requests_not_the_step(
    tiny_llama: LlamaForCausalLM,
    adapters,
    tmp_path: Path,
) -> None:
    """An adapter whose files are gone when a step needs it (removed after it was checked):
    its request ends in ERROR at its first token; the base and a good adapter in the same steps
    finish as they would alone."""
    gone = LoRARef("gone", 5, str(tmp_path / "deleted"))
    a1 = adapters["a1"][0]
    jobs = [(PROMPTS[0], None), (PROMPTS[1], gone), (PROMPTS[2], a1)]
    core = new_core()
    reasons: dict[str, int] = {}
    runner = lora_runner(tiny_llama)
    execute = runner.execute

    def spy(plan):  # noqa: ANN001, ANN202
        res = execute(plan)
        reasons.update(zip(res.request_ids, res.finish_reasons, strict=True))
        return res

    runner.execute = spy
    got, _ = run(core, runner, jobs)
    assert len(got[1]) == 1  # its first token ended it
    assert [FinishReason(r) for r in reasons.values()].count(FinishReason.ERROR) == 1
    alone = [run(new_core(), lora_runner(tiny_llama), [job])[0][0] for job in (jobs[0], jobs[2])]
    assert [got[0], got[2]] == alone


def test_lora_settings() -> None:
    assert parse_lora_modules("") == []
    refs = parse_lora_modules('sql=/a/b \'{"name": "chat", "path": "/c d"}\'')
    assert refs == [LoRARef("sql", 1, "/a/b"), LoRARef("chat", 2, "/c d")]
    for bad, words in [("sql", "NAME=PATH"), ("a=/x a=/y", "twice"), ("{bad", "JSON")]:
        with pytest.raises(LoRAError, match=words):
            parse_lora_modules(bad)
    with pytest.raises(LoRAError, match="needs --enable-lora"):
        check_lora_settings(False, "a=/x", 1, 16)
    with pytest.raises(LoRAError, match="max-loras"):
        check_lora_settings(True, "", 0, 16)


def test_registry_names_ids_and_refusals() -> None:
    from kvflow.services.scheduler.lora_registry import LoraRegistry

    reg = LoraRegistry(parse_lora_modules("sql=/a"), enabled=True)
    assert reg.check_new("chat", "/c", "base") and reg.check_new("new", "/n", "base")
    chat, new = reg.add("chat", "/c"), reg.add("new", "/n")  # two loads in flight at once
    assert (chat.id, new.id) == (2, 3)
    assert not reg.check_new("chat", "/c", "base")  # the same again: nothing to do
    for name, path, words in [("chat", "/other", "already been loaded"), ("base", "/x", "base")]:
        with pytest.raises(LoRAError, match=words):
            reg.check_new(name, path, "base")
    assert reg.resolve(LoRARef("chat", 0, "")) == chat  # the registry's, whatever was asked
    with pytest.raises(LoRAError) as e:
        reg.resolve(LoRARef("gone", 9, "/g"))
    assert e.value.status == 404 and e.value.param == "model"
    assert reg.remove("chat") == chat and [a.name for a in reg.list()] == ["sql", "new"]
    with pytest.raises(LoRAError, match="cannot be found"):
        reg.remove("chat")
    with pytest.raises(LoRAError, match="--enable-lora"):
        LoraRegistry([], enabled=False).check_new("x", "/x", "base")
