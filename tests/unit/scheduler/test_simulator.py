"""`kvflow simulate`: the real scheduler on a cost model (offline, virtual clock)."""

from __future__ import annotations

from kvflow.services.scheduler.simulator import SimConfig, Workload, find_max_rate, simulate


def test_deterministic_for_a_seed_and_every_block_returns() -> None:
    wl = Workload(num_requests=60, rate=2.0, seed=5)
    a, b = simulate(wl, SimConfig()), simulate(wl, SimConfig())
    assert a == b
    assert a.requests == 60 and a.free_blocks_at_end == a.total_blocks
    assert simulate(Workload(num_requests=60, rate=2.0, seed=6), SimConfig()) != a


def test_tiny_kv_cache_preempts_and_every_request_still_gets_its_tokens() -> None:
    wl = Workload(num_requests=40, rate=float("inf"), prompt_len=(100, 200), output_len=(50, 100))
    roomy = simulate(wl, SimConfig())
    tight = simulate(wl, SimConfig(num_blocks=60))
    assert roomy.preemptions == 0 and tight.preemptions > 0
    assert tight.output_tokens == roomy.output_tokens  # same count for every request
    assert tight.free_blocks_at_end == 60


def test_more_workers_sustain_a_higher_rate() -> None:
    wl = Workload(num_requests=80, prompt_len=(20, 80), output_len=(16, 48))
    one, _ = find_max_rate(wl, SimConfig(workers=1), ttft_target_s=1.5, iters=6)
    two, _ = find_max_rate(wl, SimConfig(workers=2), ttft_target_s=1.5, iters=6)
    assert two > 1.5 * one > 0


def test_chunked_prefill_keeps_decodes_flowing_past_long_prompts() -> None:
    # decoding streams plus long prompts arriving: a small token budget chunks each prompt,
    # so running decodes are not stalled behind a whole 1,500-token prefill
    wl = Workload(num_requests=30, rate=1.0, prompt_len=(1000, 1500), output_len=(64, 64))
    whole = simulate(wl, SimConfig(max_num_batched_tokens=4096))
    chunked = simulate(wl, SimConfig(max_num_batched_tokens=256))
    assert chunked.tpot_p99_s < whole.tpot_p99_s
