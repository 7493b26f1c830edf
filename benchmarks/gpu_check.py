"""The Python steps of ``scripts/gpu-check.sh`` (the GPU path checked in one prepared run):
``python -m kvflow.benchmarks.gpu_check STEP --out DIR``, each writing ``DIR/STEP.json``.

- ``env``: versions, the device, ``nvidia-smi`` and the device-to-device copy bandwidth (the
  roofline of a decode step: it reads every weight and the KV cache once).
- ``greedy``: a random-weight Llama 3 (llama3 RoPE scaling on, prompts longer than its original
  context, weights scaled so that every layer matters) made with transformers on the device in
  fp32; kvflow's ModelRunner (Triton kernels and CUDA graphs on a GPU) driven by the real
  scheduler core under chunked prefill against transformers' greedy ``generate``, token for
  token.
- ``stack``: the whole stack (``kvflow serve --device ...``: NATS, Redis and every service) on
  a random-weight model saved as a Hugging Face directory (1B-class Llama shape on a GPU) under
  streamed ``/v1/completions`` at several concurrencies (random-token prompts, ``ignore_eos``,
  as vLLM's ``benchmark_serving.py --dataset-name random``), then transformers on the same
  device and weights: static-batch ``generate`` and, where it has it, continuous-batching
  ``generate_batch``. Output tokens/s, TTFT and TPOT for each.
- ``summary``: gathers every step's JSON, the step log (``steps.tsv``: name, exit status,
  seconds) and the two benchmarks' JSON into ``summary.json`` and ``summary.md``, with the
  targets of the GPU issue checked where their figures exist.

``--tiny`` (the script's ``--cpu`` dry run) shrinks every model and workload so the same code
runs on a CPU in seconds."""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

TOKENIZER_DIR = Path(".gpu/tokenizer")  # scripts/gpu-wheels.sh puts SmolLM2's tokenizer there


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _write(out: Path, name: str, data: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=1, default=str))


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# -- env ------------------------------------------------------------------------------------------


def step_env(args: argparse.Namespace) -> int:
    import transformers
    import triton

    from kvflow.benchmarks.model_impl import cpu_name

    dev = _device()
    info: dict = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_name(),
        "cpu_count": os.cpu_count(),
    }
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        info |= {"sm_count": p.multi_processor_count, "memory_gib": p.total_memory / 2**30}
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(dev)))
        from kvflow.benchmarks.kernel_cases import copy_bandwidth

        info["copy_bw_gbps"] = copy_bandwidth(dev) / 1e9
    else:  # the same figure for the dry run: a host memory copy of 64 MiB
        src = torch.ones(1 << 24, dtype=torch.float32)
        dst = torch.empty_like(src)
        t0 = time.perf_counter()
        for _ in range(5):
            dst.copy_(src)
        info["copy_bw_gbps"] = 5 * 2 * src.numel() * 4 / (time.perf_counter() - t0) / 1e9
    try:
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
        info["nvidia_smi"] = smi.stdout or smi.stderr
    except (OSError, subprocess.TimeoutExpired) as e:
        info["nvidia_smi"] = f"not available: {e}"
    for k, v in info.items():
        if k != "nvidia_smi":
            print(f"{k}: {v}")
    print(info["nvidia_smi"])
    _write(args.out, "env", info)
    return 0


# -- greedy ---------------------------------------------------------------------------------------


def _random_llama3(vocab: int, tiny: bool, seed: int = 0):  # -> transformers LlamaForCausalLM
    """A Llama 3 with llama3 RoPE scaling (original context 64), 2-D weights x4 so attention and
    the MLP shape every logit, in fp32."""
    import transformers as tf

    hidden, layers, heads, kv, inter = (64, 2, 4, 2, 128) if tiny else (512, 4, 8, 2, 1536)
    cfg = tf.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0) if p.dim() == 2 else p.add_(torch.randn_like(p) * 0.1)
    return model


def _hf_greedy(model, prompt: list[int], n: int, dev: torch.device) -> list[int]:
    """transformers' greedy ``generate`` of ``n`` tokens, EOS neither ending nor suppressed."""
    import copy

    gen = copy.deepcopy(model.generation_config)
    gen.eos_token_id = []
    gen.update(max_new_tokens=n, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=dev), generation_config=gen)
    return out[0, len(prompt) :].tolist()


def kvflow_greedy(runner, prompts: list[list[int]], n: int, chunk: int) -> list[list[int]]:
    """Every prompt through the real scheduler core (chunked prefill of ``chunk`` tokens a step,
    submitted together) and ``runner`` (made with ``worker_id="w"``): the ``n`` greedy tokens
    each got."""
    from kvflow.services.scheduler.core import SchedulerCore
    from kvflow.services.scheduler.limits import SchedulerLimits
    from kvflow.shared.messages import SamplingParams, TokenizedRequest

    core = SchedulerCore(SchedulerLimits(max_num_batched_tokens=chunk, max_model_len=2048))
    core.add_worker("w", runner.num_blocks, runner.block_size)
    ws = core.workers["w"]
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    ids = [f"g{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        core.add_request(TokenizedRequest(rid, "", p, params))
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    while True:
        plan, _ = core.schedule(ws)
        if plan is None:
            break
        res = runner.execute(plan)
        if res.error:
            raise RuntimeError(res.error)
        for rid, tok in zip(res.request_ids, res.token_ids, strict=True):
            out[rid].append(tok)
        core.on_result(res)
    return [out[rid] for rid in ids]


def step_greedy(args: argparse.Namespace) -> int:
    import tempfile

    from kvflow.services.worker.runner import ModelRunner
    from kvflow.shared.model_source import ModelSource

    dev = _device()
    vocab = 512 if args.tiny else 8192
    new = 6 if args.tiny else 24
    # past the original 64 positions (the interpreter's dry run: one short, one long)
    lengths = [7, 90] if args.tiny else [7, 60, 150, 300]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    model = _random_llama3(vocab, args.tiny)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        model = model.to(dev)
        t0 = time.perf_counter()
        want = [_hf_greedy(model, p, new, dev) for p in prompts]
        hf_s = time.perf_counter() - t0
        # the device path: on a CPU (the dry run) the same Triton kernels in Triton's
        # interpreter and the graphs' padded static buffers run eagerly
        kw: dict = {"device": dev, "dtype": torch.float32, "worker_id": "w", "backend": "triton"}
        kw |= {"cuda_graphs": True, "max_num_seqs": 8}
        runner = ModelRunner.create(ModelSource("hf", Path(tmp), "llama3"), 16, 256, **kw)
        t0 = time.perf_counter()
        got = kvflow_greedy(runner, prompts, new, chunk=64)
        kv_s = time.perf_counter() - t0
    equal = got == want
    first_diff = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), None)
        for x, y in zip(got, want, strict=True)
    ]
    graphs = getattr(runner, "graphs", None)
    result = {
        "equal": equal,
        "dtype": "float32",
        "device": str(dev),
        "path": "triton" if getattr(runner, "ops", None) is not None else "cpu",
        "cuda_graphs": None if graphs is None else list(graphs.sizes),
        "prompt_lengths": lengths,
        "new_tokens": new,
        "first_difference": first_diff,
        "kvflow_s": kv_s,
        "transformers_s": hf_s,
    }
    print(json.dumps(result, indent=1))
    _write(args.out, "greedy", result)
    return 0 if equal else 1


# -- stack ----------------------------------------------------------------------------------------


def _tokenizer():  # -> transformers tokenizer
    """SmolLM2's tokenizer: the copy scripts/gpu-wheels.sh made, else from the installed wheel."""
    from transformers import AutoTokenizer

    if (TOKENIZER_DIR / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    from kvflow.services.worker import machine
    from kvflow.shared.model_source import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(), machine.cache_dir())


def _save_random_model(path: Path, tok, tiny: bool, dev: torch.device, dtype: torch.dtype):
    """A random-weight Llama (1B-class, benchmarks.random_model.LlamaShape; tiny for the dry
    run) with the tokenizer's vocabulary, made on ``dev`` and saved at ``path``; returns it."""
    import transformers as tf

    from kvflow.benchmarks.random_model import LlamaShape

    s = (
        LlamaShape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128)
        if tiny
        else (LlamaShape())
    )
    cfg = tf.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        max_position_embeddings=s.max_position,
        rms_norm_eps=s.eps,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": s.rope_theta},
    )
    torch.manual_seed(0)
    with torch.device(dev):
        model = tf.LlamaForCausalLM(cfg).to(dtype).eval()
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return model


def _start_stack(model_dir: Path, dev: torch.device, args: argparse.Namespace, log: Path):
    from kvflow.shared.infra import free_port, wait_for_http

    port = free_port()
    cmd = [sys.executable, "-m", "kvflow.cli.main", "serve", "--model", str(model_dir)]
    cmd += ["--device", dev.type, "--port", str(port), "--max-num-seqs", str(max(args.streams))]
    cmd += ["--max-model-len", str(args.input_len + args.output_len + 16)]
    if dev.type == "cuda":
        cmd += ["--kv-cache-memory", str(args.kv_cache_gib)]
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.Popen(
        cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )
    base = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    wait_for_http(f"{base}/health", proc, "kvflow serve", timeout=args.ready_timeout)
    # every service up (the gateway answers /health before the worker has joined)
    while "kvflow: ready" not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.perf_counter() - t0 > args.ready_timeout:
            raise RuntimeError(f"kvflow serve not ready:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return proc, base, time.perf_counter() - t0


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _requests_for(c: int, args: argparse.Namespace) -> int:
    return max(c * args.waves, 4)


def _py_spy(pid: int | None, out: Path) -> subprocess.Popen | None:
    """With ``GPU_CHECK_PY_SPY=SECONDS`` and py-spy on the PATH (scripts/gpu-wheels.sh carries
    it): the worker's stacks, every thread, sampled for that long from the timed run's start
    into ``out`` (py-spy's raw format: one line per stack with its sample count)."""
    import shutil

    seconds = os.environ.get("GPU_CHECK_PY_SPY")
    if not seconds or pid is None or shutil.which("py-spy") is None:
        return None
    cmd = ["py-spy", "record", "--pid", str(pid), "--duration", seconds, "--rate", "200"]
    cmd += ["--threads", "--nonblocking", "--format", "raw", "--output", str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def _triton_compiled() -> int:
    """Kernels in Triton's cache folder (one folder per compiled variant): its growth over a
    run is the kernels compiled while requests waited (the stack's children share the cache)."""
    root = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return sum(1 for _ in root.glob("*/*.json")) if root.is_dir() else 0


def _kvflow_runs(
    base: str, proc: subprocess.Popen, model: str, vocab: int, args: argparse.Namespace
) -> list[dict]:
    from kvflow.benchmarks.client import percentile
    from kvflow.benchmarks.pipeline import (
        SERVICES,
        WORKER_SERIES,
        cpu_seconds,
        random_prompts,
        run_streams,
        stack_processes,
        worker_series,
    )

    procs = stack_processes(proc.pid)
    rows = []
    for c in args.streams:
        prompts = random_prompts(_requests_for(c, args), args.input_len, c, (100, vocab - 100))
        # a short round of this concurrency first: its prefill shapes compiled before timing
        asyncio.run(run_streams(base, model, prompts[:c], 4, c))
        w0, k0 = worker_series(base), _triton_compiled()
        cpu0 = {n: cpu_seconds(pid) for n, pid in procs.items()}
        spy = _py_spy(procs.get("worker"), args.out / f"py-spy-worker-{c}.txt")
        run = run_streams(base, model, prompts, args.output_len, c, warm_up=False)
        stats, dur = asyncio.run(run)
        if spy is not None:
            spy.wait(30)
        w1, k1 = worker_series(base), _triton_compiled()
        cpu1 = {n: cpu_seconds(pid) for n, pid in procs.items()}
        w = {n: w1[n] - w0[n] for n in WORKER_SERIES}
        steps = max(1.0, w["kvflow:worker_step_seconds_count"])
        tokens = sum(s.output_tokens for s in stats)
        cpu_us = {n: (cpu1[n] - cpu0[n]) * 1e6 / max(1, tokens) for n in procs}
        row = {
            "system": "kvflow",
            "streams": c,
            "requests": len(stats),
            "output_tokens": tokens,
            "seconds": dur,
            "tokens_per_s": tokens / dur,
            "ttft_p50_ms": percentile([s.ttft_s for s in stats], 50) * 1e3,
            "ttft_p99_ms": percentile([s.ttft_s for s in stats], 99) * 1e3,
            "tpot_p50_ms": percentile([s.tpot_s for s in stats], 50) * 1e3,
            "tpot_p99_ms": percentile([s.tpot_s for s in stats], 99) * 1e3,
            # the worker's time in steps over the run's wall time (the figure a GPU operator
            # watches), and each process's CPU per output token (the stack's host cost)
            "worker_busy_fraction": w["kvflow:worker_busy_seconds_total"] / dur,
            # the runner's own measure of its steps (StepResult.step_time_s), their batch and
            # tokens: TPOT far above the step time is time between steps
            "worker_steps": w["kvflow:worker_step_seconds_count"],
            "worker_step_ms": w["kvflow:worker_step_seconds_sum"] / steps * 1e3,
            "worker_batch_mean": w["kvflow:worker_batch_seqs_sum"] / steps,
            "worker_tokens_per_step": w["kvflow:worker_step_tokens_sum"] / steps,
            "triton_compiled": k1 - k0,
            "kvflow_cpu_us_per_token": sum(
                v for n, v in cpu_us.items() if n.split("-")[0] in SERVICES
            ),
            "cpu_us_per_token": cpu_us,
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _hf_static(model, vocab: int, dev: torch.device, args: argparse.Namespace) -> list[dict]:
    """transformers' ``generate`` in static batches of each concurrency (all prompts of one
    length, so no padding): each batch's whole latency is its requests' TTFT as a non-streaming
    static server answers."""
    from kvflow.benchmarks.pipeline import random_prompts

    gen = model.generation_config
    gen.eos_token_id = []
    gen.update(do_sample=False, pad_token_id=0)
    rows = []
    for c in args.streams:
        prompts = random_prompts(_requests_for(c, args), args.input_len, c, (100, vocab - 100))
        ids = torch.tensor(prompts[:c], device=dev)
        with torch.no_grad():  # warm-up: a short run of the same batch
            model.generate(ids, generation_config=gen, max_new_tokens=2)
        _sync(dev)
        t0 = time.perf_counter()
        tokens = 0
        for i in range(0, len(prompts), c):
            batch = torch.tensor(prompts[i : i + c], device=dev)
            with torch.no_grad():
                out = model.generate(batch, generation_config=gen, max_new_tokens=args.output_len)
            tokens += (out.shape[1] - batch.shape[1]) * batch.shape[0]
        _sync(dev)
        dur = time.perf_counter() - t0
        waves = -(-len(prompts) // c)
        row = {"system": "transformers generate (static batch)", "streams": c}
        row |= {"requests": len(prompts), "output_tokens": tokens, "seconds": dur}
        row |= {"tokens_per_s": tokens / dur, "batch_latency_ms": dur / waves * 1e3}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _hf_continuous(model, vocab: int, args: argparse.Namespace) -> dict:
    """transformers' continuous batching (``generate_batch``), every request of the largest
    concurrency submitted at once; or why it could not run."""
    import inspect

    from kvflow.benchmarks.pipeline import random_prompts

    c = max(args.streams)
    if not hasattr(model, "generate_batch"):
        return {"system": "transformers generate_batch", "error": "not in this transformers"}
    prompts = random_prompts(_requests_for(c, args), args.input_len, c, (100, vocab - 100))
    gen = model.generation_config
    gen.update(max_new_tokens=args.output_len, do_sample=False, eos_token_id=[], pad_token_id=0)
    takes = inspect.signature(model.generate_batch).parameters
    kw = {"progress_bar": False} if "progress_bar" in takes else {}
    # its KV cache sized for the workload: left to itself it takes a share of the free memory,
    # which on a CPU is the machine's RAM (the dry run was OOM-killed inside the test suite)
    page = 256
    blocks = len(prompts) * -(-(args.input_len + args.output_len) // page) + 8
    if "continuous_batching_config" in takes:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        # the page's name: block_size in transformers 5.17, page_size in 5.24
        named = inspect.signature(ContinuousBatchingConfig.__init__).parameters
        size = "page_size" if "page_size" in named else "block_size"
        kw["continuous_batching_config"] = ContinuousBatchingConfig(
            **{size: page}, num_blocks=blocks
        )
    else:  # older transformers read it from the generation config
        gen.update(block_size=page, num_blocks=blocks)
    try:
        with torch.no_grad():
            model.generate_batch(prompts[:2], generation_config=gen, **kw)  # warm-up
            t0 = time.perf_counter()
            res = model.generate_batch(prompts, generation_config=gen, **kw)
            dur = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - the baseline's failure is a result, not ours
        return {"system": "transformers generate_batch", "error": f"{type(e).__name__}: {e}"}
    tokens = sum(len(r.generated_tokens) for r in res.values())
    row = {"system": "transformers generate_batch (continuous)", "streams": c}
    row |= {"requests": len(prompts), "output_tokens": tokens, "seconds": dur}
    row["tokens_per_s"] = tokens / dur
    print(json.dumps(row), flush=True)
    return row


def step_stack(args: argparse.Namespace) -> int:
    import tempfile

    dev = _device()
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    result: dict = {"device": str(dev), "dtype": str(dtype).removeprefix("torch."), "runs": []}
    result |= {"input_len": args.input_len, "output_len": args.output_len}
    tok = _tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "random-llama"
        t0 = time.perf_counter()
        model = _save_random_model(model_dir, tok, args.tiny, dev, dtype)
        result["model"] = f"random Llama, {model.num_parameters() / 1e9:.2f}B parameters"
        result["model_saved_s"] = time.perf_counter() - t0
        proc, base, ready_s = _start_stack(model_dir, dev, args, args.out / "stack-serve.log")
        result["stack_ready_s"] = ready_s
        try:
            result["runs"] += _kvflow_runs(base, proc, model_dir.name, len(tok), args)
        finally:
            _stop(proc)
        _write(args.out, "stack", result)  # what is measured so far survives a later hang
        if not args.skip_transformers:
            result["runs"] += _hf_static(model, len(tok), dev, args)
            _write(args.out, "stack", result)
            result["runs"].append(_hf_continuous(model, len(tok), args))
    _write(args.out, "stack", result)
    return 0


def step_pipeline(args: argparse.Namespace) -> int:
    """``kvflow bench pipeline`` on this machine (the stack with a simulated worker at
    ``--sim-step-ms`` 5 and 0, 32 random tokens in, 256 out, ignore_eos): the pipeline's own
    cost where it does not share two cores with the client, against the async-scheduling
    issue's targets. The stack serves a tiny random Llama (only its config and tokenizer are
    read by the simulated worker)."""
    import tempfile

    from kvflow.benchmarks import pipeline

    tok = _tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "random-llama"
        _save_random_model(model_dir, tok, True, torch.device("cpu"), torch.float32)
        ns = argparse.Namespace(
            model=str(model_dir),
            serve_args=f"--model {model_dir} --device cpu",
            concurrency=",".join(str(c) for c in args.streams),
            sim_step_ms="5,0",
            input_len=32,
            output_len=8 if args.tiny else 256,
            nats_tls="off",
            requests_per_stream=1.0 if args.tiny else 2.0,
            no_stream=False,
            seed=0,
            out=str(Path(tmp) / "out"),
        )
        pipeline.main(ns)
        (written,) = (Path(tmp) / "out").glob("pipeline-*.json")
        data = json.loads(written.read_text())
    _write(args.out, "pipeline", data)
    return 0


# -- splits and profile (tuning data) ----------------------------------------------------------


def step_splits(args: argparse.Namespace) -> int:
    """Paged decode attention (the kernel table's four shapes) at each split count against
    ``default_num_splits``' choice: the data its heuristic is tuned on."""
    import triton.testing

    from kvflow.benchmarks.kernel_cases import BLOCK_SIZE, _paged
    from kvflow.benchmarks.random_model import LlamaShape
    from kvflow.kernels.ops import get_backend
    from kvflow.kernels.triton_decode_attention import default_num_splits

    dev = _device()
    if dev.type != "cuda":
        print("splits: needs a CUDA GPU (do_bench times CUDA events)")
        _write(args.out, "splits", {"error": "no CUDA GPU"})
        return 0
    ops, s = get_backend("triton"), LlamaShape()
    h, hkv, d, dtype = s.heads, s.kv_heads, s.head_dim, torch.bfloat16
    rows = []
    for batch, ctx in ((64, 512), (32, 2048), (4, 8192), (1, 32768), (256, 512), (8, 2048)):
        k_cache, v_cache, tables = _paged(batch, ctx, hkv, d, dtype, dev)
        q = torch.randn(batch, h, d, dtype=dtype, device=dev)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        nbytes = 2 * batch * ctx * hkv * d * 2
        chosen = default_num_splits(batch, hkv, h // hkv, tables.shape[1] * BLOCK_SIZE, dev)
        for n in (None, 1, 2, 4, 8, 16, 32, 64, 128):  # None: as the worker calls it
            if n is not None and n > 1 and ctx // n < 64:
                continue
            run = functools.partial(
                ops.decode_attention, q, k_cache, v_cache, tables, lens, d**-0.5, n
            )
            us = triton.testing.do_bench(run) * 1e3
            row = {"batch": batch, "context": ctx, "splits": n, "us": us}
            row |= {"gbps": nbytes / us / 1e3, "default": n in (None, chosen)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    _write(args.out, "splits", {"rows": rows})
    return 0


def step_profile(args: argparse.Namespace) -> int:
    """cProfile of the worker's decode steps (benchmarks.decode at batch 64, CUDA graphs): where
    the host's time per step goes, top functions by own time, into profile.txt."""
    import cProfile
    import io
    import pstats

    from kvflow.benchmarks import decode

    dev = _device()
    argv = ["--device", dev.type, "--random-llama", "--batch", "64", "--context", "512"]
    argv += ["--steps", "50", "--warmup", "5"]
    if args.tiny:
        argv += ["--hidden", "128", "--layers", "2", "--intermediate", "256", "--batch", "8"]
        argv += ["--context", "32", "--steps", "5", "--warmup", "1"]
    prof = cProfile.Profile()
    prof.runcall(decode.main, argv)
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text).sort_stats("tottime")
    stats.print_stats(40)
    stats.sort_stats("cumulative").print_stats("runner|step_inputs|cuda_graphs|sampl", 40)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile.txt").write_text(text.getvalue())
    print(text.getvalue()[:6000])
    return 0


# -- summary --------------------------------------------------------------------------------------


def _load(out: Path, name: str) -> dict | None:
    try:
        return json.loads((out / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None


def _targets(out: Path) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met: None where the figures are missing): the GPU issue's four, and the
    async-scheduling issue's pipeline targets where the pipeline step ran."""
    env, kernels, decode, greedy, stack, pipeline = (
        _load(out, n) for n in ("env", "kernels", "decode", "greedy", "stack", "pipeline")
    )
    rows: list[tuple[str, str, bool | None]] = []
    attn = [r for r in (kernels or {}).get("kernels", []) if r["kernel"].startswith("decode")]
    if attn:
        best = max(r["copy_bw_frac"] for r in attn)
        each = ", ".join(f"{r['shape']}: {100 * r['copy_bw_frac']:.0f}%" for r in attn)
        rows.append(("paged decode attention >= 70% of copy bandwidth", each, best >= 0.70))
    else:
        rows.append(("paged decode attention >= 70% of copy bandwidth", "not measured", None))
    loop = {r["batch"]: r["graph_ms"] for r in (kernels or {}).get("e2e", [])}
    step = {r["batch"]: r["median_ms"] for r in (decode or {}).get("rows", [])}
    if 64 in loop and 64 in step:
        ratio = step[64] / loop[64]
        what = f"{step[64]:.2f} ms vs {loop[64]:.2f} ms: {ratio:.2f}x"
        rows.append(
            ("worker decode step at batch 64 within 1.3x of the device loop", what, ratio <= 1.3)
        )
    else:
        rows.append(("worker decode step at batch 64 within 1.3x of the device loop", "not measured", None))  # fmt: skip
    runs = (stack or {}).get("runs", [])
    top = max((r["streams"] for r in runs if r.get("system") == "kvflow"), default=None)
    ours = [r for r in runs if r.get("system") == "kvflow" and r["streams"] == top]
    theirs = [r for r in runs if r.get("system", "").startswith("transformers") and "tokens_per_s" in r]  # fmt: skip
    if ours and theirs:
        best = max(theirs, key=lambda r: r["tokens_per_s"])
        ratio = ours[0]["tokens_per_s"] / best["tokens_per_s"]
        what = (
            f"kvflow {ours[0]['tokens_per_s']:.0f} tok/s at {top} streams vs {best['system']} "
            f"{best['tokens_per_s']:.0f} tok/s (batch {best['streams']}): {ratio:.2f}x"
        )
        rows.append((f"stack at {top} streams >= 2x transformers' best", what, ratio >= 2.0))
    else:
        rows.append(("stack >= 2x transformers' best", "not measured", None))
    sim = {
        r["concurrency"]: r for r in (pipeline or {}).get("results", {}).get("sim_step_ms=5", [])
    }
    for c, limit in ((1, 5.5), (32, 6.0), (256, 9.0)):
        what = f"TPOT p50 with --sim-step-ms 5 at {c} streams <= {limit} ms"
        if c in sim:
            rows.append((what, f"{sim[c]['tpot_p50_ms']:.2f} ms", sim[c]["tpot_p50_ms"] <= limit))
    if 256 in sim:
        us = sim[256]["kvflow_us_per_token"]
        rows.append(
            ("kvflow CPU per token at 256 streams (sim) <= 50 us", f"{us:.0f} us", us <= 50)
        )
    if greedy is not None:
        rows.append(("greedy equality with transformers", f"equal: {greedy['equal']}", greedy["equal"]))  # fmt: skip
    else:
        rows.append(("greedy equality with transformers", "not measured", None))
    return rows


def _num(v: float | None, digits: int) -> str:
    return "" if v is None else f"{v:.{digits}f}"


def _steps(out: Path) -> list[dict]:
    rows = []
    path = out / "steps.tsv"
    if path.is_file():
        for line in path.read_text().splitlines():
            name, rc, secs, *rest = line.split("\t")
            rows.append({"step": name, "rc": int(rc), "seconds": float(secs), "note": " ".join(rest)})  # fmt: skip
    return rows


def _junit(out: Path) -> dict | None:
    """The tests step's counts and failed tests' ids from pytest's junit XML."""
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(out / "junit.xml").getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}  # fmt: skip
    failed = [
        f"{case.get('classname')}::{case.get('name')}: "
        + (bad.get("message") or "").splitlines()[0][:200]
        if (bad.get("message") or "")
        else f"{case.get('classname')}::{case.get('name')}"
        for case in root.iter("testcase")
        for bad in case
        if bad.tag in ("failure", "error")
    ]
    return counts | {"failed": failed}


def _stack_md(stack: dict | None) -> list[str]:
    """The stack step's table for summary.md."""
    if not stack:
        return []
    md = [
        "",
        f"Stack: {stack.get('model')}, {stack.get('dtype')}, prompts of {stack['input_len']} "
        f"random tokens, {stack['output_len']} output tokens (ignore_eos); ready in "
        f"{stack.get('stack_ready_s', 0):.0f} s.",
        "",
        "| system | streams | requests | tok/s | TTFT p50 ms | TPOT p50 ms | worker busy | step ms | batch | kvflow CPU us/tok | note |",  # fmt: skip
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in stack["runs"]:
        if "error" in r:
            md.append(f"| {r['system']} | | | | | | | | | | {r['error'][:120]} |")
            continue
        ttft = r.get("ttft_p50_ms", r.get("batch_latency_ms"))
        tpot, busy = r.get("tpot_p50_ms"), r.get("worker_busy_fraction")
        cpu = r.get("kvflow_cpu_us_per_token")
        md.append(
            f"| {r['system']} | {r['streams']} | {r['requests']} | {r['tokens_per_s']:.0f} | "
            f"{'' if ttft is None else f'{ttft:.0f}'} | {'' if tpot is None else f'{tpot:.1f}'} | "  # fmt: skip
            f"{'' if busy is None else f'{busy:.0%}'} | {_num(r.get('worker_step_ms'), 2)} | "
            f"{_num(r.get('worker_batch_mean'), 1)} | {'' if cpu is None else f'{cpu:.0f}'} | "
            + (
                f"{r['triton_compiled']} kernels compiled in the run |"
                if r.get("triton_compiled")
                else "|"
            )  # fmt: skip
        )
    return md


def _pipeline_md(pipe: dict | None) -> list[str]:
    """The pipeline step's table for summary.md."""
    if not pipe or not pipe.get("results"):
        return []
    md = ["", f"Simulated worker (kvflow bench pipeline, {pipe.get('cpus')} CPUs):", ""]
    md += ["| step ms | streams | tok/s | TPOT p50 ms | kvflow CPU us/tok | client us/tok |"]
    md += ["|---|---:|---:|---:|---:|---:|"]
    for key, runs in pipe["results"].items():
        for r in runs:
            md.append(
                f"| {key.split('=')[1]} | {r['concurrency']} | {r['output_tokens_per_s']:.0f} | "
                f"{r['tpot_p50_ms']:.2f} | {r['kvflow_us_per_token']:.0f} | "
                f"{r['cpu_us_per_token'].get('client', 0):.0f} |"
            )
    return md


def step_summary(args: argparse.Namespace) -> int:
    out = args.out
    steps = _steps(out)
    targets = _targets(out)
    data = {
        "steps": steps,
        "targets": [{"target": t, "measured": m, "met": ok} for t, m, ok in targets],
    }
    tests = _junit(out)
    if tests is not None:
        data["tests"] = tests
    for name in (
        "env",
        "greedy",
        "kernels",
        "decode",
        "decode-eager",
        "sampling",
        "stack",
        "pipeline",
    ):
        part = _load(out, name)
        if part is not None:
            part.pop("nvidia_smi", None) if name == "env" else None
            data[name] = part
    (out / "summary.json").write_text(json.dumps(data, indent=1, default=str))
    env = data.get("env", {})
    md = [
        f"# kvflow GPU check: {env.get('device', '?')}",
        "",
        f"python {env.get('python')}, torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), "
        f"triton {env.get('triton')}, transformers {env.get('transformers')}; copy bandwidth "
        f"{env.get('copy_bw_gbps', 0):.0f} GB/s (read + write)",
        "",
        "| step | exit | seconds | note |",
        "|---|---:|---:|---|",
    ]
    md += [f"| {s['step']} | {s['rc']} | {s['seconds']:.0f} | {s['note']} |" for s in steps]
    if tests is not None:
        md += ["", f"Tests: {tests['tests']} run, {tests['failures']} failed, {tests['errors']} errors, {tests['skipped']} skipped."]  # fmt: skip
        md += [f"- {f}" for f in tests["failed"][:40]]
    md += ["", "| target | measured | met |", "|---|---|---|"]
    md += [f"| {t} | {m} | {'n/a' if ok is None else ('yes' if ok else 'NO')} |" for t, m, ok in targets]  # fmt: skip
    splits = _load(out, "splits")
    if splits and splits.get("rows"):
        md += ["", "Paged decode attention by split count (us; * marks default_num_splits):", ""]
        shapes = sorted({(r["batch"], r["context"]) for r in splits["rows"]})
        for b, c in shapes:
            cells = [
                f"{r['splits'] or 'auto'}: {r['us']:.1f}{'*' if r['default'] else ''}"
                for r in splits["rows"]
                if (r["batch"], r["context"]) == (b, c)
            ]
            md.append(f"- B={b} ctx={c}: " + ", ".join(cells))
        data["splits"] = splits
    sampling = data.get("sampling")
    if sampling and sampling.get("results"):
        md += ["", f"One step's sampling on {sampling['device']} (ms; host: logits copied first):"]
        md += [""] + [
            f"- {r['rows']} rows, {r['mix']}: "
            + ", ".join(f"{k[:-3]} {v:.3f}" for k, v in r.items() if k.endswith("_ms"))
            for r in sampling["results"]
        ]
    md += _stack_md(data.get("stack")) + _pipeline_md(data.get("pipeline"))
    (out / "summary.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


# -- main -----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    steps = ["env", "greedy", "stack", "pipeline", "splits", "profile", "summary"]
    ap.add_argument("step", choices=steps)
    ap.add_argument("--out", type=Path, required=True, help="folder for STEP.json")
    ap.add_argument("--tiny", action="store_true", help="tiny models and workloads (CPU dry run)")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--waves", type=int, default=2, help="requests per stream (at least 4 in all)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--kv-cache-gib", type=float, default=20.0)
    ap.add_argument("--ready-timeout", type=float, default=240.0)
    ap.add_argument("--skip-transformers", action="store_true")
    args = ap.parse_args(argv)
    from kvflow.services.worker import machine
    from kvflow.shared.config import Settings

    machine.configure(Settings.from_env())  # before any kernel loads (the greedy, profile steps)

    def _term(*_: object) -> None:  # the script's step cap: unwind so the stack is stopped
        raise SystemExit(124)

    signal.signal(signal.SIGTERM, _term)
    step = {"env": step_env, "greedy": step_greedy, "stack": step_stack, "summary": step_summary}
    step |= {"splits": step_splits, "profile": step_profile, "pipeline": step_pipeline}
    return step[args.step](args)


if __name__ == "__main__":
    sys.exit(main())
