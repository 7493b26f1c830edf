"""The worker's device path (ModelRunner with the Triton backend) against its CPU path, through
the real ``ModelRunner.execute`` on real StepPlans: prefill, chunked prefill, a prefix-cache hit,
decode, one-token prefill chunks that do not sample inside decode steps, and decode batches
padded to a captured size as the CUDA-graph path pads them.

Without a GPU the Triton kernels run on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1,
set by tests/conftest.py) and ``cuda_graphs=True`` runs the padded static-buffer decode step
eagerly (everything but the capture). With a GPU, the last test captures real CUDA graphs.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # as tests/conftest.py does

from kvflow.services.worker.runner import ModelRunner  # noqa: E402
from kvflow.shared.messages import NewRequest, SamplingParams, ScheduledSeq, StepPlan  # noqa: E402
from kvflow.shared.models.config import ModelConfig  # noqa: E402

BLOCK = 4
NUM_BLOCKS = 48
VOCAB = 128
GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)

requires_interpreter = pytest.mark.skipif(
    HAS_CUDA, reason="with a GPU the Triton kernels are compiled for CUDA in this process"
)


def tiny_llama(seed: int = 0) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A 2-layer random Llama under HF weight names (GQA 2, head_dim 16), weights large
    enough that logits are far from ties."""
    cfg = ModelConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=96,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_ids=(VOCAB - 1,),
    )
    g = torch.Generator().manual_seed(seed)

    def mat(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2

    def norm(n: int) -> torch.Tensor:
        return 1 + 0.1 * torch.randn(n, generator=g)

    d, kv, i = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    w = {
        "model.embed_tokens.weight": mat(VOCAB, d),
        "model.norm.weight": norm(d),
        "lm_head.weight": mat(VOCAB, d),
    }
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        w |= {
            p + "input_layernorm.weight": norm(d),
            p + "post_attention_layernorm.weight": norm(d),
            p + "self_attn.q_proj.weight": mat(d, d),
            p + "self_attn.k_proj.weight": mat(kv, d),
            p + "self_attn.v_proj.weight": mat(kv, d),
            p + "self_attn.o_proj.weight": mat(d, d),
            p + "mlp.gate_proj.weight": mat(i, d),
            p + "mlp.up_proj.weight": mat(i, d),
            p + "mlp.down_proj.weight": mat(d, i),
        }
    return cfg, w


def make(model, **kw) -> ModelRunner:
    cfg, weights = model
    weights = {k: v.clone() for k, v in weights.items()}
    return ModelRunner.from_weights(cfg, weights, BLOCK, NUM_BLOCKS, **kw)


def spy_logits(runner: ModelRunner) -> list[torch.Tensor]:
    """Every step's sampled logits rows, as ``_sample`` gets them (moved to the CPU)."""
    rows: list[torch.Tensor] = []
    sample = runner._sample

    def spy(logits, sampled):
        rows.append(logits.detach().float().cpu().clone())
        return sample(logits, sampled)

    runner._sample = spy
    return rows


# prompts; D's first 8 tokens are A's (a prefix-cache hit on A's first two blocks)
A = [5, 17, 99, 3, 42, 8, 64, 21, 77, 1, 33]
B = [11, 22, 33, 44, 55, 66, 77, 88, 99, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109]
C = [7]
D = A[:8] + [50, 60, 70]
E = [3, 4, 5]  # prefilled one token per step inside decode steps
TABLES = {
    "a": [20, 3, 31, 8, 14, 40],
    "b": [1, 29, 17, 44, 9, 36, 22, 11],
    "c": [38, 6, 26],
    "d": [20, 3, 12, 47, 5],  # A's first two blocks, then its own
    "e": [30, 2, 41],
}
PROMPTS = {"a": A, "b": B, "c": C, "d": D, "e": E}


def scenario() -> list[list[tuple[str, int, int, bool]]]:
    """Steps as (request, chunk start, chunk length, samples); decode rows have length 1 and
    start at the sequence's current length (filled in while running)."""
    return [
        [("a", 0, 11, True), ("b", 0, 10, False), ("c", 0, 1, True)],  # mixed: prefills
        [("b", 10, 9, True), ("a", -1, 1, True), ("c", -1, 1, True)],  # chunk 2 + decodes
        [("d", 8, 3, True), ("a", -1, 1, True), ("b", -1, 1, True), ("c", -1, 1, True)],
        # decode only, 5 sequences: above a 4-sequence ladder, so eager decode
        [(r, -1, 1, True) for r in "ab"] + [("e", 0, 1, False)] + [(r, -1, 1, True) for r in "cd"],
        # decode only, 4 rows of which one (e's prompt chunk, not the last row) does not sample
        [("a", -1, 1, True), ("e", 1, 1, False), ("b", -1, 1, True), ("c", -1, 1, True)],
        # 3 rows padded to 4; e's last prompt token samples
        [("a", -1, 1, True), ("b", -1, 1, True), ("e", 2, 1, True)],
        [("a", -1, 1, True), ("e", -1, 1, True)],  # 2 rows
        [("e", -1, 1, True)],  # 1 row
    ]


def drive(runner: ModelRunner) -> tuple[dict[str, list[int]], list[list[int]]]:
    """Run the scenario; returns every request's tokens and each step's written cache slots."""
    tokens = {r: list(p) for r, p in PROMPTS.items()}
    computed = dict.fromkeys(PROMPTS, 0)
    computed["d"] = 8  # the prefix-cache hit
    new = [NewRequest(r, GREEDY, len(p)) for r, p in PROMPTS.items()]
    written = []
    for step_id, step in enumerate(scenario()):
        seqs, slots = [], []
        for r, start, n, sample in step:
            start = computed[r] if start < 0 else start
            assert start == computed[r], (r, start, computed[r])
            chunk = tokens[r][start : start + n]
            seqs.append(ScheduledSeq(r, chunk, start, TABLES[r], sample))
            slots += [TABLES[r][p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + n)]
            computed[r] = start + n
        res = runner.execute(StepPlan(step_id, seqs, new))
        assert res.error is None, res.error
        new = []
        for r, tok in zip(res.request_ids, res.token_ids, strict=True):
            tokens[r].append(tok)
        written.append(slots)
    return tokens, written


@pytest.fixture(scope="module")
def model() -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    return tiny_llama()


@pytest.fixture(scope="module")
def reference(model) -> tuple[dict[str, list[int]], list[torch.Tensor]]:
    runner = make(model)
    assert runner.ops is None and runner.gemm_rows is not None  # the CPU path
    logits = spy_logits(runner)
    tokens, _ = drive(runner)
    return tokens, logits


@requires_interpreter
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "padded-static-buffers"])
def test_triton_worker_path_matches_the_cpu_path(model, reference, graphs: bool) -> None:
    runner = make(model, backend="triton", cuda_graphs=graphs, max_num_seqs=4)
    assert runner.ops is not None and runner.ops.name == "triton"
    assert runner.gemm_rows is None and runner.decode_fn is None  # CPU-path features off
    assert (runner.graphs is not None) == graphs
    logits = spy_logits(runner)
    caches: dict[str, list[torch.Tensor]] = {}

    # the padded 3-row step (index 5): the padding row must write no KV anywhere
    execute = runner.execute

    def snapshot(plan: StepPlan):
        if plan.step_id == 5:
            caches["before"] = [torch.stack([k, v]).clone() for k, v in runner.kv_caches]
        res = execute(plan)
        if plan.step_id == 5:
            caches["after"] = [torch.stack([k, v]).clone() for k, v in runner.kv_caches]
        return res

    runner.execute = snapshot
    tokens, written = drive(runner)
    want_tokens, want_logits = reference
    assert tokens == want_tokens
    assert len(logits) == len(want_logits) == len(scenario())
    for got, want in zip(logits, want_logits, strict=True):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    if graphs:
        assert runner.graphs.sizes == [1, 2, 4]
        assert runner.graphs.replays == 4  # steps 4-7; step 3 (5 rows) ran eagerly
    for before, now in zip(caches["before"], caches["after"], strict=True):
        changed = (before != now).flatten(3).any(-1).any(0).flatten()  # per cache slot
        assert changed.nonzero().flatten().tolist() == sorted(written[5])


@requires_interpreter
def test_the_prefill_warm_up_writes_no_kv_and_changes_no_output(model, reference) -> None:
    """The start-up prefill forwards (run on CUDA so that Triton compiles there, not in a step
    while requests wait) go through the device path as padding: the KV cache is unchanged and
    the runner's tokens are the CPU path's afterwards."""
    from kvflow.services.worker.model_setup import warm_up_prefill

    runner = make(model, backend="triton", cuda_graphs=False)
    for k, v in runner.kv_caches:  # something to read in block 0, and to see overwritten
        k.normal_()
        v.normal_()
    before = [torch.stack([k, v]).clone() for k, v in runner.kv_caches]
    seconds = warm_up_prefill(runner.ops, runner.model, runner.kv_caches, runner.staging, 32, BLOCK)
    assert seconds > 0
    for was, (k, v) in zip(before, runner.kv_caches, strict=True):
        assert torch.equal(was, torch.stack([k, v]))
    tokens, _ = drive(runner)
    assert tokens == reference[0]


@requires_interpreter
def test_triton_worker_prompt_logprobs_and_sampling_params(model) -> None:
    """Rows sampled on the device with logprobs, temperature with a seed, penalties, and prompt
    logprobs give what the CPU path gives."""
    params = [
        SamplingParams(max_tokens=3, temperature=0.0, logprobs=2, prompt_logprobs=1),
        SamplingParams(max_tokens=3, temperature=0.9, seed=5, repetition_penalty=1.3),
    ]
    results = []
    for kw in ({}, {"backend": "triton", "cuda_graphs": True, "max_num_seqs": 2}):
        runner = make(model, **kw)
        new = [NewRequest("p", params[0], len(A)), NewRequest("q", params[1], len(B))]
        seqs = [ScheduledSeq("p", A, 0, TABLES["a"]), ScheduledSeq("q", B, 0, TABLES["b"])]
        out = [runner.execute(StepPlan(0, seqs, new))]
        for step in (1, 2):
            toks = dict(zip(out[-1].request_ids, out[-1].token_ids, strict=True))
            n = len(A) + step - 1, len(B) + step - 1
            seqs = [
                ScheduledSeq("p", [toks["p"]], n[0], TABLES["a"]),
                ScheduledSeq("q", [toks["q"]], n[1], TABLES["b"]),
            ]
            out.append(runner.execute(StepPlan(step, seqs)))
        results.append(out)
    for ref, tri in zip(*results, strict=True):
        assert ref.error is None and tri.error is None
        assert tri.token_ids == ref.token_ids
        assert [lp is None for lp in tri.logprobs] == [lp is None for lp in ref.logprobs]
        for a, b in zip(ref.logprobs, tri.logprobs, strict=True):
            if a is None:
                continue
            assert b.top_ids == a.top_ids
            assert b.logprob == pytest.approx(a.logprob, abs=1e-4)
        for a, b in zip(ref.prompt_logprobs, tri.prompt_logprobs, strict=True):
            assert (b.start, b.token_ids, b.ranks) == (a.start, a.token_ids, a.ranks)
            assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)
    assert results[0][0].prompt_logprobs  # the prompt logprobs really were asked for


def _device_runner(model) -> ModelRunner:
    """The device path: on the GPU when there is one, else the Triton interpreter."""
    return make(model, backend="triton", max_num_seqs=4, **({"device": "cuda"} if HAS_CUDA else {}))


def _sample_on_device(
    runner: ModelRunner, want: dict[str, tuple[list[int], list[int], SamplingParams]], steps: int
):
    """Prefill then decode ``steps`` times every request of ``want`` (id: prompt, block table,
    params), in the dict's order; returns each request's tokens and sampled logprobs. Checks
    that the sampler is given the logits where the model made them."""
    sample = runner._sample

    def on_device(logits, sampled):
        assert logits.device == runner.kv_caches[0][0].device
        return sample(logits, sampled)

    runner._sample = on_device
    new = [NewRequest(r, p, len(prompt)) for r, (prompt, _, p) in want.items()]
    seqs = [ScheduledSeq(r, prompt, 0, table) for r, (prompt, table, _) in want.items()]
    got: dict[str, list[int]] = {r: [] for r in want}
    lps: dict[str, list] = {r: [] for r in want}
    for step in range(steps):
        res = runner.execute(StepPlan(step, seqs, new))
        assert res.error is None, res.error
        for r, tok, lp in zip(res.request_ids, res.token_ids, res.logprobs, strict=True):
            got[r].append(tok)
            lps[r].append(None if lp is None else (lp.logprob, lp.top_ids))
        new = []
        seqs = [
            ScheduledSeq(r, [got[r][-1]], len(prompt) + step, table)
            for r, (prompt, table, _) in want.items()
        ]
    return got, lps


def test_seeded_sampling_on_the_device_is_the_same_whatever_the_batch(model) -> None:
    """A seeded request sampled on the device (its own generator there) draws the same tokens
    and logprobs alone and inside a batch of greedy, unseeded and other seeded rows; another
    seed draws others."""
    hot = dict(max_tokens=8, temperature=1.5, top_p=0.95, top_k=60, ignore_eos=True)
    seeded = SamplingParams(**hot, seed=11, logprobs=2, repetition_penalty=1.1)
    alone, alone_lps = _sample_on_device(_device_runner(model), {"s": (A, TABLES["a"], seeded)}, 6)
    batch = {
        "g": (B, TABLES["b"], GREEDY),
        "u": (C, TABLES["c"], SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)),
        "s": (A, TABLES["a"], seeded),
        "t": (E, TABLES["e"], SamplingParams(**hot, seed=12, min_p=0.01)),
    }
    mixed, mixed_lps = _sample_on_device(_device_runner(model), batch, 6)
    assert mixed["s"] == alone["s"]
    for (lp_a, top_a), (lp_b, top_b) in zip(alone_lps["s"], mixed_lps["s"], strict=True):
        assert top_a == top_b and lp_a == pytest.approx(lp_b, abs=1e-4)
    other = SamplingParams(**hot, seed=12, logprobs=2, repetition_penalty=1.1)
    again, _ = _sample_on_device(_device_runner(model), {"s": (A, TABLES["a"], other)}, 6)
    assert again["s"] != alone["s"]  # the seed decides the draws


@requires_interpreter
def test_gpu_decode_bench_code_path(monkeypatch) -> None:
    """What ``python -m kvflow.benchmarks.decode --device cuda --random-llama`` runs (a
    random Llama drawn on the device, decode steps through the decode graphs), on a tiny
    shape in the interpreter, so the GPU bench does not first fail on a GPU."""
    from kvflow.benchmarks import decode as bench_decode
    from kvflow.benchmarks.random_model import LlamaShape, random_llama

    shape = LlamaShape(vocab=64, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=48)
    cfg, weights = random_llama(torch.float32, torch.device("cpu"), shape=shape)
    assert cfg.head_dim == 16 and weights["lm_head.weight"].shape == (64, 32)
    runner = ModelRunner.from_weights(
        cfg, weights, 4, 16, backend="triton", cuda_graphs=True, max_num_seqs=4
    )
    wall, cpu = bench_decode.decode_steps(runner, 3, 9, steps=2, warmup=1, first_block=2)
    assert len(wall) == len(cpu) == 2 and runner.graphs.replays == 3
    assert runner.requests == {}  # the bench forgets its requests afterwards


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA-graph capture needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_graphs_on_the_gpu(model, reference, dtype) -> None:
    """On a GPU: the scenario with decode steps replayed from captured graphs equals the eager
    device path, and in fp32 the CPU path's tokens too."""
    cfg, weights = model
    cast = (cfg, {k: v.to(dtype) for k, v in weights.items()})
    eager = make(cast, device="cuda", cuda_graphs=False)
    graphs = make(cast, device="cuda", cuda_graphs=True, max_num_seqs=4)
    assert eager.graphs is None and graphs.graphs is not None
    assert sorted(graphs.graphs.graphs) == [1, 2, 4]  # every size captured
    assert eager.kv_caches[0][0].is_cuda and eager.kv_caches[0][0].dtype == dtype
    got_eager, got_graphs = spy_logits(eager), spy_logits(graphs)
    tokens_eager, _ = drive(eager)
    tokens_graphs, _ = drive(graphs)
    assert graphs.graphs.replays == 4
    if dtype == torch.float32:
        want_tokens, want_logits = reference
        assert tokens_graphs == tokens_eager == want_tokens
        for a, b in zip(got_graphs, want_logits, strict=True):
            torch.testing.assert_close(a, b, atol=2e-3, rtol=1e-3)
    else:
        # bf16: graph and eager steps differ in GEMM row counts and split counts, so compare
        # logits step by step while both have sampled the same tokens so far
        for a, b in zip(got_graphs, got_eager, strict=True):
            assert (a - b).abs().max() <= 0.03 * b.abs().max()
            if not torch.equal(a.argmax(-1), b.argmax(-1)):
                break


def _quantized(model, scheme: str) -> tuple[ModelConfig, dict]:
    """The tiny model's weights as ``--quantization int8`` or ``fp8`` loads them."""
    from kvflow.services.worker.model_loader import round_weights

    cfg, weights = model
    return cfg, round_weights({k: v.clone() for k, v in weights.items()}, scheme)


@requires_interpreter
@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_quantized_weights_on_the_device_path_match_the_cpu_path(model, scheme: str) -> None:
    """Integer blocks through kernels/triton_quant.py and fp8 weights through torch._scaled_mm
    on the device path give the CPU path's tokens and logits on the same quantized weights (the
    CPU path reads the blocks with its C kernel and calls the fp8 weight itself)."""
    from kvflow.kernels.fp8_linear import Fp8Weight
    from kvflow.kernels.triton_quant import DeviceQuantWeight

    cfg, weights = _quantized(model, scheme)
    cpu = ModelRunner.from_weights(cfg, dict(weights), BLOCK, NUM_BLOCKS)
    dev = ModelRunner.from_weights(
        cfg, dict(weights), BLOCK, NUM_BLOCKS, backend="triton", cuda_graphs=True, max_num_seqs=4
    )
    kind = DeviceQuantWeight if scheme == "int8" else Fp8Weight
    assert isinstance(dev.model.layers[0].qkv, kind)  # fused, still quantized
    assert isinstance(dev.model.layers[1].down, kind)
    want_logits, got_logits = spy_logits(cpu), spy_logits(dev)
    want_tokens, _ = drive(cpu)
    tokens, _ = drive(dev)
    assert tokens == want_tokens
    # fp8 rounds each step's activations: a last-bit difference upstream can move one
    # activation to the next e4m3 value, so its tolerance is that of one rounding step
    tol = dict(atol=2e-4, rtol=1e-4) if scheme == "int8" else dict(atol=5e-2, rtol=5e-2)
    for got, want in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(got, want, **tol)
    # and it still computes roughly the model's function: the first step (prefills, the same
    # inputs for both; later steps follow each model's own tokens)
    dense = make(model)
    dense_logits = spy_logits(dense)
    drive(dense)
    # (cosine of each prefill's logits: int8 0.9997-0.9999, fp8 0.971-0.997 on this model,
    # whose weights of std 0.2 make it far more sensitive than a trained one)
    cos = F.cosine_similarity(got_logits[0], dense_logits[0], dim=-1)
    assert bool((cos >= (0.999 if scheme == "int8" else 0.95)).all()), cos


@requires_interpreter
def test_an_embedding_in_blocks_feeds_the_device_path_and_its_tied_head(model) -> None:
    """``--quantization gguf`` keeps a tied embedding in its blocks on the CPU (rows decoded as
    they are looked up); the device path looks rows up in the decoded table and multiplies by
    the head's blocks as a quantized weight. Both give the same tokens."""
    import dataclasses

    from kvflow.kernels.triton_quant import DeviceQuantWeight

    cfg, weights = _quantized(model, "int8")
    cfg = dataclasses.replace(cfg, tie_word_embeddings=True)
    weights["model.embed_tokens.weight"] = weights.pop("lm_head.weight")  # Q8_0 blocks, tied
    cpu = ModelRunner.from_weights(cfg, dict(weights), BLOCK, NUM_BLOCKS)
    dev = ModelRunner.from_weights(
        cfg, dict(weights), BLOCK, NUM_BLOCKS, backend="triton", max_num_seqs=4
    )
    assert cpu.model.embed is cpu.model.lm_head  # one copy: the blocks
    assert isinstance(dev.model.embed, torch.Tensor)
    assert isinstance(dev.model.lm_head, DeviceQuantWeight)
    assert torch.equal(dev.model.embed.cpu(), weights["model.embed_tokens.weight"].dequantize())
    want_tokens, _ = drive(cpu)
    tokens, _ = drive(dev)
    assert tokens == want_tokens


def _embed_steps(runner: ModelRunner, kind: str) -> tuple[bytes, list[int]]:
    """A's prompt as an embedding request in two chunks, beside C generating (its prefill,
    then decode rows; one-row steps of the embedding itself: E's pattern); returns the vector's
    bytes and C's tokens."""
    from kvflow.shared.messages import PoolingParams

    new = [
        NewRequest("a", SamplingParams(max_tokens=1), len(A), pooling=PoolingParams(kind)),
        NewRequest("c", GREEDY, len(C)),
    ]
    c_tokens = list(C)
    steps = [(0, 6), (6, 10), (10, 11)]  # the last chunk is one row (a graph-shaped step)
    out = b""
    for i, (a, b) in enumerate(steps):
        c_start = 0 if i == 0 else len(c_tokens) - 1
        seqs = [
            ScheduledSeq("c", c_tokens[c_start:], c_start, TABLES["c"], True),
            ScheduledSeq("a", A[a:b], a, TABLES["a"], b == len(A)),
        ]
        res = runner.execute(StepPlan(i, seqs, new if i == 0 else []))
        assert res.error is None, res.error
        assert res.request_ids == ["c"]
        c_tokens.append(res.token_ids[0])
        if res.embeddings:
            out = res.embeddings[0].data
    return out, c_tokens


@requires_interpreter
@pytest.mark.parametrize("kind", ["LAST", "MEAN"])
def test_triton_worker_pools_embeddings_as_the_cpu_path(model, kind: str) -> None:
    """forward_device_pooled: the pooled final-norm states of the device path equal the CPU
    path's, with decode rows in the same steps, and the decode graphs are not used for a step
    that pools (its last step has single-token rows only)."""
    want, want_c = _embed_steps(make(model), kind)
    runner = make(model, backend="triton", cuda_graphs=True, max_num_seqs=4)
    got, got_c = _embed_steps(runner, kind)
    assert got_c == want_c and runner.graphs.replays == 0
    g = torch.frombuffer(bytearray(got), dtype=torch.float32)
    w = torch.frombuffer(bytearray(want), dtype=torch.float32)
    assert g.numel() == 64 and abs(float(w.norm()) - 1) < 1e-5
    torch.testing.assert_close(g, w, atol=2e-4, rtol=1e-4)


@requires_interpreter
@pytest.mark.parametrize(
    ("graphs", "method"),
    [(False, "ngram"), (True, "ngram"), (False, "draft_model")],
    ids=["eager", "padded-static-buffers", "draft-model"],
)
def test_speculative_decoding_on_the_device_path(model, graphs: bool, method: str) -> None:
    """n-gram drafts, or a draft model's (the tiny model itself, on the device path too),
    verified on the device path (each draft a decode row; decode-only steps through the padded
    graph buffers) give the CPU path's plain greedy tokens."""
    from kvflow.services.scheduler.core import SchedulerCore
    from kvflow.services.scheduler.limits import SchedulerLimits
    from kvflow.shared.speculative import SpeculativeConfig
    from tests.helpers.engine import run_core

    prompts = [[5, 17, 99, 5, 17, 99, 5, 17], [7, 7, 7, 7, 7]]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)

    def core(spec: SpeculativeConfig | None) -> SchedulerCore:
        c = SchedulerCore(SchedulerLimits(max_num_seqs=4, max_model_len=128), speculative=spec)
        c.add_worker("w", NUM_BLOCKS, BLOCK)
        return c

    want, _ = run_core(core(None), make(model, worker_id="w"), prompts, params)
    spec = SpeculativeConfig(method, 3, 1, 3, model="tiny" if method == "draft_model" else "")
    draft = None
    if method == "draft_model":
        from kvflow.services.worker.model_setup import CpuPathSpec, DeviceSpec, load_model

        cfg, weights = model
        clone = {k: v.clone() for k, v in weights.items()}
        draft = load_model(None, DeviceSpec(backend="triton"), CpuPathSpec(), cfg, clone)
        assert draft.ops is not None
    runner = make(
        model, worker_id="w", backend="triton", cuda_graphs=graphs, max_num_seqs=8, draft=draft
    )
    c = core(spec)
    got, plans = run_core(c, runner, prompts, params)
    assert got == want
    assert any(s.num_draft or s.num_propose for p in plans for s in p.seqs)
    if draft is not None:  # the target as its own draft: accepted
        assert c.speculator is not None and c.speculator.stats.num_accepted_tokens > 0
    if graphs:
        assert runner.graphs is not None and runner.graphs.replays > 0
