"""The real Gemma 3 270M GGUF (Q4_K_M: Q5_0, Q4_K, Q6_K and Q8_0 tensors, dequantized at load):
the config kvflow reads from llama.cpp's metadata (every field read; GELU-tanh, every 6th layer
global, two RoPE bases, ``<end_of_turn>`` a stop token), weights equal to transformers' GGUF
loader tensor for tensor, and ModelRunner's greedy output equal to HF ``generate`` on the same
file token for token, one prompt at a time and all prompts batched in the same steps: short and
long prompts (one past the 512-token sliding window), text, code, special tokens.

The file is the pretrained model (no chat template; its ``<end_of_turn>`` embedding is as
untrained as the ``<unusedN>`` rows), so it never ends a turn itself: the stop is checked by
forcing the token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvflow.services.worker.model_loader import load_weights
from kvflow.services.worker.runner import ModelRunner
from kvflow.shared.messages import SamplingParams
from kvflow.shared.model_config import load_config
from kvflow.shared.model_source import load_tokenizer, resolve_model
from tests.helpers import hf_reference
from tests.helpers.gguf_without_vocabulary import transformers_model
from tests.helpers.runner_steps import generate_in_steps

pytestmark = pytest.mark.integration

NEW_TOKENS = 20
BLOCK = 16
EOS, END_OF_TURN = 1, 106
LONG = " ".join(f"Line {i}: the square of {i} is {i * i}." for i in range(1, 48))
PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village by the sea,",
    "Ingredients for a simple pancake recipe:\n1.",
    "Translate to French: I would like a cup of coffee.\nFrench:",
    "Q: What is 17 + 25?\nA:",
    "<start_of_turn>user\nWhat is the capital of Italy? Answer in one word.<end_of_turn>\n"
    "<start_of_turn>model\n",
    LONG + " Line 48: the square of 48 is",  # past the sliding window (512 tokens)
]


@pytest.fixture(scope="module")
def gemma3(gemma3_gguf: Path, kvflow_cache: Path) -> dict:
    """kvflow's config, weights and runner for the file, and transformers' model and greedy
    tokens for ``PROMPTS`` (loaded once: the GGUF header alone takes seconds to parse)."""
    src = resolve_model(str(gemma3_gguf))
    cfg = load_config(src)
    weights = load_weights(src, cfg)
    hf = transformers_model(src.path, torch.float32)
    tok = load_tokenizer(src, kvflow_cache)
    prompts = [list(tok(p)["input_ids"]) for p in PROMPTS]
    want = [
        hf_reference.generate(
            hf,
            p,
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            eos_token_id=[EOS, END_OF_TURN],  # Gemma's generation_config.json: both stop
            pad_token_id=0,
        )[0]
        for p in prompts
    ]
    blocks = sum(-(-(len(p) + NEW_TOKENS) // BLOCK) for p in prompts)
    runner = ModelRunner.from_weights(cfg, weights, BLOCK, num_blocks=blocks)
    return {
        "src": src,
        "cfg": cfg,
        "weights": weights,
        "hf": hf,
        "tok": tok,
        "prompts": prompts,
        "want": want,
        "runner": runner,
    }


def generate(
    runner: ModelRunner,
    prompts: list[list[int]],
    first: list[int],
    params: SamplingParams = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0),
) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Greedy generation of all ``prompts`` in the same steps until each stops (prompt ``i``'s
    blocks start at ``first[i]``, in descending order); returns the tokens and the logits each
    token was picked from."""
    return generate_in_steps(runner, prompts, first, params, BLOCK, NEW_TOKENS, (EOS, END_OF_TURN))


def first_blocks(prompts: list[list[int]]) -> list[int]:
    """Each prompt's first block id: disjoint ranges, one after the other."""
    out, b = [], 0
    for p in prompts:
        out.append(b)
        b += -(-(len(p) + NEW_TOKENS) // BLOCK)
    return out


def test_config_reads_every_field_llama_cpp_hardcodes_the_rest(gemma3) -> None:
    """strict: every field the GGUF metadata gives is read by the Gemma 3 reader."""
    cfg = load_config(gemma3["src"], strict=True)
    assert cfg == gemma3["cfg"] and cfg.family == "gemma3"
    shape = (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size)
    assert shape == (18, 4, 1, 256, 640) and cfg.vocab_size == 262144
    assert cfg.hidden_act == "gelu_tanh" and cfg.tie_word_embeddings
    assert cfg.bos_token_id == 2 and cfg.eos_token_ids == (EOS, END_OF_TURN)
    assert cfg.layer_windows == (512,) * 5 + (0,) + (512,) * 5 + (0,) + (512,) * 5 + (0,)
    assert (cfg.rope.theta, cfg.rope_local.theta) == (1_000_000.0, 10_000.0)
    assert cfg.rope.rope_type == cfg.rope_local.rope_type == "default"
    assert cfg.scale == 256**-0.5 and cfg.final_softcap == cfg.attn_softcap == 0.0
    hf = gemma3["hf"].config
    assert (hf.sliding_window, hf.query_pre_attn_scalar, hf.hidden_activation) == (
        512,
        256,
        "gelu_pytorch_tanh",
    )
    assert gemma3["tok"].convert_tokens_to_ids("<end_of_turn>") == END_OF_TURN


def test_weights_equal_transformers_gguf_loader(gemma3) -> None:
    ours, theirs = gemma3["weights"], gemma3["hf"].state_dict()
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied to the embedding
    for name, w in ours.items():
        assert w.dtype == torch.float32 and torch.equal(w, theirs[name]), name


def test_greedy_matches_hf_alone_and_batched(gemma3) -> None:
    runner, prompts, want = gemma3["runner"], gemma3["prompts"], gemma3["want"]
    assert len(prompts[-1]) > 512  # the long prompt's sliding layers drop its first tokens
    assert prompts[6][:3] == [2, 105, 2364]  # <bos> <start_of_turn> user: special tokens parsed
    assert [len(w) for w in want] == [NEW_TOKENS] * len(PROMPTS)  # none stops early
    assert gemma3["tok"].decode(want[0]).startswith(" the capital of the country of France.")
    first = first_blocks(prompts)
    alone_logits = []
    for i, p in enumerate(prompts):
        tokens, logits = generate(runner, [p], [first[i]])
        assert tokens == [want[i]], i
        alone_logits += logits
    tokens, batched_logits = generate(runner, prompts, first)
    assert tokens == want
    # batching changes no bit of any sequence's logits, not only its argmax
    for alone, batched in zip(alone_logits, batched_logits, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(alone, batched, strict=True))


def test_end_of_turn_and_eos_stop_a_request(gemma3) -> None:
    """``<end_of_turn>`` (which the GGUF does not name: found by its text, as llama.cpp does)
    ends a request like ``<eos>``; the token is forced by a logit bias."""
    prompt = gemma3["prompts"][6]
    for stop in (END_OF_TURN, EOS):
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logit_bias={stop: 100.0})
        tokens, _ = generate(gemma3["runner"], [prompt], [0], params)
        assert tokens == [[stop]]  # generate asserts FinishReason.STOP


def test_kept_in_blocks_equals_the_dense_run(gemma3) -> None:
    """``--quantization gguf``: every linear weight stays in its own block type (Q4_K_M's Q5_0,
    Q4_K, Q6_K, Q8_0; a fused projection of two types as a StackedWeight) at a fraction of the
    dense bytes, and greedy output equals the dense run's (the same weights: the products differ
    only in the order of fp32 sums)."""
    from kvflow.kernels import cpu_quant
    from kvflow.kernels.cpu_quant import QuantWeight
    from kvflow.kernels.stacked_weight import StackedWeight

    if not cpu_quant.available():
        pytest.skip("no C compiler: the block kernels are C")
    src, cfg = gemma3["src"], gemma3["cfg"]
    blocks = load_weights(src, cfg, quantization="gguf")
    linear = {n: w for n, w in blocks.items() if n.endswith("_proj.weight")}
    assert all(isinstance(w, QuantWeight) for w in linear.values())
    assert {w.type_name for w in linear.values()} == {"Q5_0", "Q4_K", "Q6_K", "Q8_0"}
    dense_bytes = sum(gemma3["weights"][n].numel() * 4 for n in linear)
    assert sum(w.nbytes for w in linear.values()) < dense_bytes / 5
    # the embedding (Q8_0, also the tied head) is looked up from its blocks: no dense copy
    embed, ids = blocks["model.embed_tokens.weight"], torch.tensor([2, 106, 262143, 2])
    assert isinstance(embed, QuantWeight) and "lm_head.weight" not in blocks
    assert torch.equal(embed[ids], gemma3["weights"]["model.embed_tokens.weight"][ids])
    prompts, want = gemma3["prompts"], gemma3["want"]
    n_blocks = sum(-(-(len(p) + NEW_TOKENS) // BLOCK) for p in prompts)
    runner = ModelRunner.from_weights(cfg, blocks, BLOCK, num_blocks=n_blocks)
    fused = [layer.qkv for layer in runner.model.layers]
    assert all(isinstance(w, QuantWeight | StackedWeight) for w in fused)
    tokens, _ = generate(runner, prompts, first_blocks(prompts))
    assert tokens == want


def test_int8_activations_stay_close_and_batch_invariant(gemma3) -> None:
    """``--quantization gguf-a8``: the same blocks, repacked into the tiled int8 kernel's layout
    (kernels/cpu_quant_tiles.py) and multiplied with activations rounded to int8 per 32, as
    llama.cpp computes; the tied embedding and head are one tiled copy, looked up exactly.
    Greedy tokens part from transformers' fp32 ones within a generation (measured here: 11, 20,
    20, 20, 20, 20, 13 and 20 of 20 agree); each prompt's first 8 must, unless they part where
    fp32's own top logits are within 0.25 (a near tie), and batching changes no logit bit."""
    from kvflow.kernels import cpu_quant_tiles
    from kvflow.kernels.cpu_quant_tiles import TiledQuantWeight
    from kvflow.kernels.stacked_weight import StackedWeight

    if not cpu_quant_tiles.available():
        pytest.skip("the tiled kernel needs AVX-512 VNNI (elsewhere gguf-a8 runs the blocks)")
    src, cfg = gemma3["src"], gemma3["cfg"]
    weights = load_weights(src, cfg, quantization="gguf-a8")
    prompts, want = gemma3["prompts"], gemma3["want"]
    n_blocks = sum(-(-(len(p) + NEW_TOKENS) // BLOCK) for p in prompts)
    runner = ModelRunner.from_weights(cfg, weights, BLOCK, num_blocks=n_blocks)
    model = runner.model
    for layer in model.layers:
        for w in (layer.qkv, layer.o, layer.gate_up, layer.down):
            parts = w.parts if isinstance(w, StackedWeight) else [w]
            assert all(isinstance(p, TiledQuantWeight) for p in parts)
    assert model.embed is model.lm_head and isinstance(model.embed, TiledQuantWeight)
    ids = torch.tensor([2, 106, 262143, 2])
    assert torch.equal(model.embed[ids], gemma3["weights"]["model.embed_tokens.weight"][ids])
    alone = [
        generate(runner, [p], [b]) for p, b in zip(prompts, first_blocks(prompts), strict=True)
    ]
    for i, ((tokens, _), w) in enumerate(zip(alone, want, strict=True)):
        n = min(8, len(w))
        part = next((j for j in range(n) if tokens[0][j] != w[j]), n)
        if part < n:  # fp32's logits along its own tokens, where they part
            _, (fp32,) = generate(gemma3["runner"], [prompts[i]], [first_blocks(prompts)[i]])
            assert fp32[part][tokens[0][part]] >= fp32[part].max() - 0.25, (i, part)
    tokens, batched = generate(runner, prompts, first_blocks(prompts))
    assert tokens == [a[0][0] for a in alone]
    for (_, (alone_logits,)), b in zip(alone, batched, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(alone_logits, b, strict=True))
