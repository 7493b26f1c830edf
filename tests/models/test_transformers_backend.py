"""``--model-impl transformers`` (services/worker/transformers_model.py) against transformers
itself on tiny random checkpoints made here (no hub): GPT-NeoX (partial RoPE, parallel
residual), StableLM (partial RoPE, per-head q/k LayerNorm, GQA, q/k/v biases) and Qwen2 (a
sliding-window layer; it also has a native implementation to compare with). Greedy output
equals transformers' ``generate`` token for token through the real scheduler core and runner:
alone, batched with chunked prefill and mixed prompt lengths, under preemption and after a
prefix-cache hit. Also: bitwise batch invariance of the CPU path's logits, the device path
under Triton's interpreter, and the refusals."""

from __future__ import annotations

import itertools

import pytest
import torch
import transformers as tf

from kvflow.kernels import reference as K
from kvflow.kernels.batch_invariance import GemmRows
from kvflow.services.worker.model_interface import ForwardBatch
from kvflow.services.worker.runner import ModelRunner
from kvflow.services.worker.transformers_model import TransformersModel
from kvflow.shared.messages import SamplingParams, ScheduledSeq
from kvflow.shared.model_source import ModelSource
from kvflow.shared.models.generic import transformers_config
from tests.helpers import engine as engine_support
from tests.helpers.engine import (
    check_alone,
    check_batched_chunked,
    check_preempted_and_prefix_hit,
    new_core,
    run,
)
from tests.helpers.families import CONFIGS, hf_generate, make_model

PROMPTS = [
    [5, 17, 99, 3, 42, 8, 64, 21, 77, 1, 33],
    [120, 6, 6, 90, 12, 7, 7, 31],
    [11, 22, 33, 44, 55, 66, 77, 88, 99, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109],
    [9, 8],
]
NEW = 12
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
BLOCK = 4
ROWS = GemmRows(4, 4, True)  # a fixed row layout: no calibration in tests
MODELS = ["gpt_neox", "stablelm", "qwen2"]  # qwen2: native too, so the two can be compared


def transformers_runner(model: TransformersModel, num_blocks: int = 64, **kw) -> ModelRunner:
    """A ModelRunner around ``model``, set up by the real ``load_model`` (packing, kernels,
    row layout, KV cache)."""
    kw = {"gemm_rows": ROWS, "worker_id": "w"} | kw
    return ModelRunner.create(None, BLOCK, num_blocks, model=model, **kw)


@pytest.fixture(scope="module", params=MODELS)
def case(request, tmp_path_factory):
    """(name, transformers model, runner over TransformersModel, HF greedy outputs); Qwen2
    goes through ``from_pretrained`` on a saved directory, the others ``from_model``."""
    name = request.param
    hf = make_model(name)
    if name == "qwen2":
        path = tmp_path_factory.mktemp(name)
        hf.save_pretrained(path)
        model = TransformersModel.from_pretrained(path)
    else:
        model = TransformersModel.from_model(hf)
    with torch.no_grad():
        want = [hf_generate(hf, p, NEW) for p in PROMPTS]
    return name, hf, transformers_runner(model), want


def test_the_tiny_models_use_their_features(case) -> None:
    name, hf, runner, _ = case
    assert runner.config.family == "transformers"
    if name == "gpt_neox":
        assert hf.gpt_neox.layers[0].attention.rotary_ndims == 4
    if name == "stablelm":
        assert hf.model.layers[0].self_attn.rotary_ndims == 4 and runner.config.num_kv_heads == 2


def test_greedy_alone_equals_transformers(case) -> None:
    _, _, runner, want = case
    check_alone(runner, PROMPTS, want, GREEDY)


def test_batched_chunked_equals_transformers(case) -> None:
    _, _, runner, want = case
    check_batched_chunked(runner, PROMPTS, want, GREEDY)


def test_preempted_and_prefix_hit_equal_transformers(case) -> None:
    _, _, runner, want = case
    check_preempted_and_prefix_hit(
        runner, PROMPTS, want, GREEDY, blocks=16
    )  # 64 token slots for 4 sequences of up to 31 tokens


def test_logits_and_hidden_states_equal_transformers(case) -> None:
    """One prefill through ``forward_pooled``: the last row's logits and every row's final
    hidden states (what embedding requests pool) against the HF model's own forward."""
    _, hf, runner, _ = case
    ids = torch.tensor(PROMPTS[2])
    n = len(ids)
    plan = K.plan_attention(torch.arange(5)[None], torch.tensor([n]), torch.tensor([n]), BLOCK)
    batch = ForwardBatch(torch.arange(n), plan, None, torch.tensor([n - 1]), torch.arange(n))
    caches = runner.model.make_kv_caches(5, BLOCK)
    logits, hidden = runner.model.forward_pooled(ids, torch.arange(n), batch, caches)
    with torch.no_grad():
        out = hf(ids[None])
        ref_hidden = hf.base_model(ids[None]).last_hidden_state[0]
    torch.testing.assert_close(logits[0], out.logits[0, -1], rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(hidden, ref_hidden, rtol=1e-4, atol=1e-4)


def test_qwen2_native_and_transformers_agree(tmp_path) -> None:
    """The same Qwen2 checkpoint through the native decoder and the transformers backend:
    the same greedy tokens, first-step logits equal to fp32 rounding."""
    hf = make_model("qwen2")
    hf.save_pretrained(tmp_path)
    src = ModelSource("hf", tmp_path, "qwen2")
    native = ModelRunner.create(src, block_size=BLOCK, num_blocks=64, worker_id="w", gemm_rows=ROWS)
    fallback = transformers_runner(TransformersModel.from_pretrained(tmp_path))
    first = {}
    for key, r in (("native", native), ("transformers", fallback)):
        rows = _spy_rows(r)
        got, _ = run(new_core(max_num_batched_tokens=8), r, [(p, None) for p in PROMPTS], GREEDY)
        first[key] = (got, rows[0])
    assert first["native"][0] == first["transformers"][0]
    torch.testing.assert_close(first["native"][1], first["transformers"][1], rtol=1e-4, atol=1e-3)


def _spy_rows(runner: ModelRunner) -> list[torch.Tensor]:
    """Every step's sampled logits, as the runner's ``_sample`` gets them."""
    rows: list[torch.Tensor] = []
    sample = runner._sample

    def spy(logits: torch.Tensor, sampled: list[ScheduledSeq]) -> torch.Tensor:
        rows.append(logits.detach().float().cpu().clone())
        return sample(logits, sampled)

    runner._sample = spy
    return rows


def test_logits_bitwise_batch_invariant(monkeypatch) -> None:
    """A sequence's logits do not change by one bit when other sequences (decoding, or
    prefilling in chunks) share its steps."""
    model = TransformersModel.from_model(make_model("gpt_neox"))
    got: list[list[torch.Tensor]] = []
    for prompts in ([PROMPTS[2]], [PROMPTS[2], *PROMPTS[:2], PROMPTS[3], [9] * 30]):
        monkeypatch.setattr(engine_support, "_ids", itertools.count())  # the target is r0
        runner = transformers_runner(model)
        rows: list[torch.Tensor] = []
        sample = runner._sample

        def spy(logits, sampled, rows=rows, sample=sample):  # noqa: ANN001, ANN202
            ids = [s.request_id for s in sampled]
            if "r0" in ids:
                rows.append(logits[ids.index("r0")].clone())
            return sample(logits, sampled)

        runner._sample = spy
        run(new_core(max_num_batched_tokens=12), runner, [(p, None) for p in prompts], GREEDY)
        got.append(rows)
    assert len(got[0]) == len(got[1]) == NEW
    for a, b in zip(*got, strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs without a GPU")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "padded-static-buffers"])
def test_device_path_under_the_triton_interpreter(graphs: bool) -> None:
    """The device path (the Triton backend's cache write and decode / extend attention, here
    in Triton's interpreter on the CPU) gives transformers' greedy tokens, batched with
    chunked prefill; with ``graphs`` decode steps go through the padded static buffers of
    the CUDA-graph path (every row's logits, run eagerly)."""
    hf = make_model("stablelm")
    model = TransformersModel.from_model(hf)
    runner = transformers_runner(model, backend="triton", cuda_graphs=graphs, max_num_seqs=4)
    assert runner.ops is not None and (runner.graphs is not None) == graphs
    prompts, params = (
        [PROMPTS[0], PROMPTS[3]],
        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
    )
    with torch.no_grad():
        want = [hf_generate(hf, p, 4) for p in prompts]
    got, _ = run(new_core(max_num_batched_tokens=8), runner, [(p, None) for p in prompts], params)
    assert got == want


# -- refusals and config reading ---------------------------------------------------------------


@pytest.fixture(scope="module")
def neox() -> TransformersModel:
    return TransformersModel.from_model(make_model("gpt_neox"))


def test_refuses_tensor_parallelism_and_lora(neox) -> None:
    with pytest.raises(ValueError, match="tensor parallelism"):
        neox.tp = object()
    plan = K.plan_attention(
        torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]), torch.tensor([1]), BLOCK
    )
    batch = ForwardBatch(torch.tensor([0]), plan, None, torch.tensor([0]), lora=object())
    with pytest.raises(ValueError, match="LoRA"):
        neox(torch.tensor([3]), torch.tensor([0]), batch, neox.make_kv_caches(1, BLOCK))
    with pytest.raises(ValueError, match="LoRA"):
        neox.forward_device_pooled(None, None, [], lora=object())


def test_refuses_quantization(tmp_path) -> None:
    with pytest.raises(ValueError, match="unquantized"):
        TransformersModel.from_pretrained(tmp_path, quantization="int8")
    raw = CONFIGS["qwen2"]().to_dict() | {"quantization_config": {"quant_method": "gptq"}}
    with pytest.raises(ValueError, match="quantized checkpoint"):
        transformers_config(raw, "q/config.json", [])


def test_refuses_encoder_decoders_and_models_that_are_not_causal_lms() -> None:
    with pytest.raises(ValueError, match="encoder-decoder"):
        transformers_config(tf.T5Config().to_dict(), "t5/config.json", [])
    with pytest.raises(ValueError, match="not a causal LM"):
        transformers_config(tf.ViTConfig().to_dict(), "vit/config.json", [])
    with pytest.raises(ValueError, match="not one transformers knows"):
        transformers_config({"model_type": "no-such-model"}, "x/config.json", [])


def test_refuses_attention_outside_the_interface() -> None:
    """A layer whose attention never calls the registered function (here: replaced by one
    that does its own thing), and a model with no attention at all (Mamba)."""
    hf = make_model("gpt_neox")
    attention = hf.gpt_neox.layers[1].attention
    attention.forward = lambda hidden_states, *a, **kw: (attention.dense(hidden_states), None)
    with pytest.raises(ValueError, match=r"ran for layers \[0\] of 2"):
        TransformersModel.from_model(hf)
    torch.manual_seed(0)
    mamba = tf.MambaForCausalLM(tf.MambaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2))
    with pytest.raises(ValueError, match="attention"):
        TransformersModel.from_model(mamba)


def test_config_reads_any_causal_lm() -> None:
    """GPT-2's config names its fields n_embd, n_layer, n_head, n_positions: transformers'
    aliases give the shape; generation_config EOS ids are added to the config's."""
    raw = tf.GPT2Config(n_embd=64, n_layer=3, n_head=4, n_positions=96, vocab_size=100).to_dict()
    cfg = transformers_config(raw, "gpt2/config.json", [7, 50256])
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (64, 3, 4, 4)
    assert (cfg.head_dim, cfg.max_position_embeddings, cfg.vocab_size) == (16, 96, 100)
    assert cfg.eos_token_ids == (50256, 7) and cfg.family == "transformers"
