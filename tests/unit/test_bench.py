"""Bench workload and accounting (offline; the bench itself is run by hand, not in the suite)."""

from __future__ import annotations

import pytest

from services.bench import make_workload
from services.bench_client import RequestStats, percentile, summarize


def test_workload_is_deterministic_and_within_bounds(tokenizer) -> None:
    a = make_workload(tokenizer, 20, seed=3, prompt_len=(10, 300), max_tokens=(32, 256))
    b = make_workload(tokenizer, 20, seed=3, prompt_len=(10, 300), max_tokens=(32, 256))
    c = make_workload(tokenizer, 20, seed=4, prompt_len=(10, 300), max_tokens=(32, 256))
    assert a == b and a != c
    assert all(10 <= len(p) <= 300 and 32 <= n <= 256 for p, n in a)


def test_percentile_picks_nearest_rank() -> None:
    xs = [float(i) for i in range(1, 101)]
    assert percentile(xs, 50) == 51.0  # index round(49.5) = 50 (round half to even)
    assert percentile(xs, 99) == 99.0
    assert percentile([2.0], 99) == 2.0


def test_static_batch_accounting_counts_useful_tokens_only() -> None:
    # two requests in one batch that ran 10 s to its longest request; prefill took 1 s
    stats = [RequestStats(1.0, 10.0, 50), RequestStats(1.0, 10.0, 100)]
    s = summarize("hf-static-2", 2, stats, 10.0)
    assert s.output_tokens == 150 and s.output_tokens_per_s == pytest.approx(15.0)
    assert s.ttft_p50_s == 1.0
    assert s.tpot_p50_s == pytest.approx(9.0 / 99)  # (10 - 1) s over 99 later tokens
    assert s.tpot_p99_s == pytest.approx(9.0 / 49)


def test_llamacpp_bench_sends_the_same_random_token_prompts_to_every_system() -> None:
    from services.bench_llamacpp import random_prompts

    a, b = random_prompts(49152, 8, 128, seed=1), random_prompts(49152, 8, 128, seed=1)
    assert a == b and a != random_prompts(49152, 8, 128, seed=2)
    assert all(len(p) == 128 and all(100 <= t < 49052 for t in p) for p in a)


def test_llamacpp_bench_configs_and_server_lookup(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    from services.bench_llamacpp import find_llama_server, parse_configs

    assert parse_configs("gguf=--quantization gguf; fp32=") == [
        ("kvflow-gguf", ["--quantization", "gguf"]),
        ("kvflow-fp32", []),
    ]
    given, env = tmp_path / "given", tmp_path / "env"
    given.write_text("")
    env.write_text("")
    monkeypatch.setenv("LLAMA_SERVER", str(env))
    assert find_llama_server(str(given)) == given  # the flag first
    assert find_llama_server() == env  # then the environment
    assert find_llama_server(str(tmp_path / "missing")) is None  # a wrong path is not guessed
    monkeypatch.delenv("LLAMA_SERVER")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_llama_server() is None


def test_llamacpp_bench_table_compares_at_the_same_number_in_flight(capsys) -> None:  # noqa: ANN001
    from services.bench_llamacpp import print_table

    def run(name: str, c: int, toks: int) -> object:
        return summarize(f"{name}@{c}", c, [RequestStats(0.1, 1.0, toks)] * c, 1.0)

    print_table([run("llama.cpp", 1, 80), run("llama.cpp", 16, 100), run("kvflow-int8", 16, 150)])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| kvflow")]
    assert rows and rows[0].split("|")[2].strip() == "16" and rows[0].endswith("| 1.50x |")
