"""Every native family (shared/models/families/) against transformers on a tiny random
checkpoint with its features on (tests/helpers/families.py): the config read from disk with
no field left unread, first-step logits, and greedy output equal to transformers' ``generate``
token for token through the real scheduler core and runner: each prompt alone, all batched
under chunked prefill, with preemptions (a KV cache too small for all at once) and after a
prefix-cache hit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvflow.services.worker.runner import ModelRunner
from kvflow.shared.messages import SamplingParams
from kvflow.shared.model_config import load_config
from kvflow.shared.model_source import ModelSource
from tests.helpers.engine import (
    check_alone,
    check_batched_chunked,
    check_preempted_and_prefix_hit,
    new_core,
    run,
)
from tests.helpers.families import CONFIGS, NEW, PROMPTS, family_of, hf_greedy, save_model

GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
BLOCK = 4


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family_case(request, tmp_path_factory):
    """(name, transformers model, kvflow runner from the saved directory, HF greedy outputs)."""
    name = request.param
    path = tmp_path_factory.mktemp(name)
    hf = save_model(name, path)
    src = ModelSource("hf", path, name)
    runner = ModelRunner.create(src, block_size=BLOCK, num_blocks=64, worker_id="w")
    with torch.no_grad():
        want = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    return name, hf, runner, want


def test_config_reads_every_field(family_case) -> None:
    name, _, runner, _ = family_case
    src = ModelSource("hf", Path(runner.model_path), name)
    cfg = load_config(src, strict=True)  # strict: a field nothing reads is an error
    assert cfg == runner.config
    assert cfg.family == family_of(name)


def test_first_step_logits_equal_transformers(family_case) -> None:
    """Logits, not just argmax: final soft-caps and logit divisors change values only."""
    _, hf, runner, _ = family_case
    rows = []
    sample = runner._sample

    def spy(logits, sampled):
        rows.append(logits[0].clone())
        return sample(logits, sampled)

    runner._sample = spy
    try:
        run(new_core(), runner, [(PROMPTS[0], None)], SamplingParams(max_tokens=1, temperature=0))
    finally:
        runner._sample = sample
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[0]])).logits[0, -1].float()
    torch.testing.assert_close(rows[0], ref, rtol=1e-4, atol=1e-3)


def test_greedy_alone_equals_transformers(family_case) -> None:
    _, _, runner, want = family_case
    check_alone(runner, PROMPTS, want, GREEDY)


def test_batched_chunked_equals_transformers(family_case) -> None:
    _, _, runner, want = family_case
    check_batched_chunked(runner, PROMPTS, want, GREEDY)


def test_preempted_and_prefix_hit_equal_transformers(family_case) -> None:
    _, _, runner, want = family_case
    check_preempted_and_prefix_hit(
        runner, PROMPTS, want, GREEDY, blocks=20
    )  # 80 token slots for 4 sequences of up to 33 tokens


def test_seeded_sampling_survives_preemption_and_batching(family_case) -> None:
    """A seeded request's n-th token is drawn from (seed, n) alone: preempted and recomputed
    (its state on the worker dropped and made again), batched under chunked prefill, or alone,
    every prompt gets the same hot-sampled tokens."""
    _, _, runner, _ = family_case
    hot = SamplingParams(max_tokens=NEW, temperature=1.2, top_p=0.95, seed=77, ignore_eos=True)
    alone = [run(new_core(), runner, [(p, None)], hot)[0][0] for p in PROMPTS]
    assert any(len(set(a)) > 2 for a in alone)  # really sampled, not one repeated token
    check_batched_chunked(runner, PROMPTS, alone, hot)
    check_preempted_and_prefix_hit(runner, PROMPTS, alone, hot, blocks=20)
