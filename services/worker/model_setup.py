"""Setting up a ModelRunner: which weight scheme to load (``check_quantization``), the model on
its device with the CPU path's kernels chosen (``load_model``), the KV cache's size, and the
decode graphs of the device path. The runner's constructor takes the three specs below instead
of loose keywords; ``specs_from_keywords`` builds them from the flat names tests use."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvflow.kernels import batch_invariance, cpu_gemm, cpu_native, cpu_quant
from kvflow.kernels.batch_invariance import GemmRows
from kvflow.kernels.fp8_linear import fp8_supported
from kvflow.kernels.ops import KernelBackend, get_backend
from kvflow.services.worker import machine
from kvflow.services.worker.cuda_graphs import DecodeGraphs, capture_sizes
from kvflow.services.worker.device import kernel_backend as default_backend
from kvflow.services.worker.layer_weights import Weights
from kvflow.services.worker.model_interface import LoadSpec, Model
from kvflow.services.worker.model_kinds import model_kind
from kvflow.services.worker.step_inputs import DeviceBatch, HostStep, Staging, pack
from kvflow.shared.config import KV_CACHE_DTYPES, CacheSettings, ModelSettings, WorkerSettings
from kvflow.shared.model_config import load_config
from kvflow.shared.model_source import ModelSource
from kvflow.shared.models.config import ModelConfig
from kvflow.shared.quantized_checkpoints import METHODS, checkpoint_method

log = logging.getLogger("kvflow.worker")

QUANTIZATIONS = ("", "gguf", "gguf-a8", "int8", "w8a8", "gptq", "awq", "fp8")


@dataclass(frozen=True)
class KvSpec:
    """The paged KV cache: ``num_blocks`` of ``block_size`` tokens (None: as many as
    ``kv_cache_gib`` holds) and the longest sequence (None: the model's and the cache's limit)."""

    block_size: int
    num_blocks: int | None = None
    kv_cache_gib: float = 1.0
    max_model_len: int | None = None


@dataclass(frozen=True)
class DeviceSpec:
    """Where and how the model runs. ``backend``: ``"reference"`` (the CPU path) or
    ``"triton"`` (the device path; on a CPU only under TRITON_INTERPRET=1, for tests); None:
    from the device (services/worker/device.py). ``cuda_graphs``: decode steps of up to
    ``max_num_seqs`` sequences through padded static buffers, captured as CUDA graphs on CUDA
    (None: on for CUDA; True elsewhere runs the same padded path eagerly, for tests).
    ``quantization``: see ``check_quantization``."""

    device: torch.device | str = "cpu"
    dtype: torch.dtype = torch.float32
    quantization: str = ""
    backend: str | None = None
    cuda_graphs: bool | None = None
    max_num_seqs: int = 64
    model_impl: str = "auto"  # --model-impl: auto | kvflow | transformers
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype: auto | bfloat16 | float32 (kv_cache_dtype())


@dataclass(frozen=True)
class CpuPathSpec:
    """The CPU path's kernels. ``batch_invariant``: run GEMMs in a row layout that keeps each
    sequence's logits independent of the batch (``gemm_rows``, or calibrated when None).
    ``native_kernels``: the C decode-attention kernel; ``packed_gemm``: pre-packed linear
    weights (None for either: when available and the model is fp32)."""

    batch_invariant: bool = True
    gemm_rows: GemmRows | None = None
    native_kernels: bool | None = None
    packed_gemm: bool | None = None


def specs_from_keywords(
    block_size: int, num_blocks: int | None = None, **kw: Any
) -> tuple[KvSpec, DeviceSpec, CpuPathSpec]:
    """The three specs from flat keyword names (``dtype=``, ``gemm_rows=``, ...), each name a
    field of one spec; a TypeError names an unknown one."""
    out = []
    first = {"block_size": block_size, "num_blocks": num_blocks}
    for spec in (KvSpec, DeviceSpec, CpuPathSpec):
        names = spec.__dataclass_fields__
        out.append(spec(**{k: v for k, v in (first | kw).items() if k in names}))
    known = {n for spec in (KvSpec, DeviceSpec, CpuPathSpec) for n in spec.__dataclass_fields__}
    unknown = sorted(set(kw) - known)
    if unknown:
        raise TypeError(f"unknown runner options: {unknown}")
    return out[0], out[1], out[2]


def check_quantization(
    quantization: str,
    src: ModelSource | None,
    device: torch.device,
    dtype: torch.dtype,
    backend: str | None = None,
) -> str:
    """The weight scheme to load with, or a ValueError that says what to change.

    ``gguf`` keeps a GGUF's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K linear weights
    quantized; ``int8`` quantizes any
    checkpoint's linear weights to int8 blocks at load (services/worker/model_loader.py);
    ``w8a8`` is int8 with the activations rounded to int8 too, and ``gguf-a8`` gguf with them
    so, as llama.cpp computes (the CPU path only);
    ``gptq`` / ``awq`` serve such a 4-bit checkpoint's groups in place
    (services/worker/gptq_awq.py). On the CPU path (fp32 activations) they run
    kernels/cpu_quant.py, on the device path (``backend`` "triton": CUDA, or Triton's
    interpreter in tests) kernels/triton_quant.py. ``fp8`` (e4m3 weights per channel, dynamic
    per-token activations: kernels/fp8_linear.py) is the device path's only, on GPUs with fp8
    GEMMs. As in vLLM, a GPTQ or AWQ checkpoint needs no flag: ``""`` becomes its method where
    a kernel reads it, and elsewhere its weights are dequantized to ``dtype`` at load."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"--quantization must be one of {QUANTIZATIONS[1:]} or empty")
    device_path = (backend or default_backend(device)) != "reference"
    method = checkpoint_method(src.path) if src is not None and src.kind == "hf" else ""
    if quantization in METHODS and quantization != method:
        what = f"a {method} checkpoint" if method else f"not quantized with {quantization}"
        raise ValueError(
            f"--quantization {quantization}: {src.path if src else 'the model'} is {what}"
        )
    cpu_fp32 = not device_path and device.type == "cpu" and dtype == torch.float32
    integer_kernels = device_path or (cpu_fp32 and cpu_quant.available())
    if not quantization and method:
        if not integer_kernels:
            log.warning("%s checkpoint: weights dequantized to %s on %s", method, dtype, device)
            return ""
        quantization = method
    if not quantization:
        return ""
    if quantization in ("gguf", "gguf-a8") and src is not None and src.kind != "gguf":
        raise ValueError(
            f"--quantization {quantization} needs a .gguf model; {src.path} is not one"
        )
    if quantization == "fp8":
        if not device_path:
            raise ValueError(
                "--quantization fp8 runs on CUDA GPUs with fp8 GEMMs (compute capability 8.9+: "
                "Ada, Hopper); torch's CPU fp8 matmul is a slow fallback: on the CPU use int8 or "
                "gguf"
            )
        if device.type == "cuda" and not fp8_supported(device):
            raise ValueError(
                f"--quantization fp8 needs a GPU with fp8 GEMMs (compute capability 8.9+); "
                f"{device} has not: use int8 or gguf (weight-only, any GPU)"
            )
        return quantization
    if device_path:
        if quantization in ("w8a8", "gguf-a8"):
            instead = "gguf" if quantization == "gguf-a8" else "int8 (weights only) or fp8"
            raise ValueError(
                f"--quantization {quantization} rounds activations for the CPU's integer dot "
                f"products; on a GPU use {instead}"
            )
        return quantization
    if not cpu_fp32:
        raise ValueError(
            f"--quantization {quantization} runs on the CPU in float32 or on CUDA (--device cuda)"
        )
    if not cpu_quant.available():
        raise ValueError(f"--quantization {quantization} needs a C compiler (install gcc)")
    return quantization


@dataclass
class LoadedModel:
    """The model on its device with the kernels picked for it."""

    device: torch.device
    ops: KernelBackend | None  # the device path's kernels; None: the CPU path
    model: Model
    gemm_rows: GemmRows | None  # batch-invariant row layout (CPU path)
    decode_fn: Callable[..., Any] | None  # the C decode-attention kernel (CPU path)
    gemm: str  # how linear layers run, for the log


def load_model(
    src: ModelSource | None,
    spec: DeviceSpec,
    cpu: CpuPathSpec,
    config: ModelConfig | None = None,
    weights: dict[str, torch.Tensor] | None = None,
    model: Model | None = None,
) -> LoadedModel:
    """Load ``src`` (or take in-memory ``config`` + ``weights``, or a built ``model``) onto
    ``spec.device`` as the model kind of its family says (services/worker/model_kinds.py:
    kvflow's decoder or encoder for a native family, transformers' own modules for
    ``--model-impl transformers`` or an architecture the registry lacks under ``auto``)."""
    device = torch.device(spec.device)
    backend = spec.backend or default_backend(device)
    quantization = check_quantization(spec.quantization, src, device, spec.dtype, backend)
    if backend == "reference" and device.type != "cpu":
        raise ValueError(f"the reference (CPU) path cannot run on {device}")
    ops = get_backend(backend) if backend != "reference" else None
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # this (model) thread's current device
    cpu_bf16 = ops is None and spec.dtype == torch.bfloat16
    if ops is None and spec.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the CPU path computes in float32 or bfloat16, not {spec.dtype}")
    if cpu_bf16 and not cpu_gemm.bf16_panel_available() and not cpu_gemm.bf16_instructions():
        log.warning(
            "--dtype bfloat16: this CPU has neither AVX-512 nor bf16 dot products, so oneDNN "
            "converts to fp32 and bf16 runs slower than float32 (the default) here"
        )
    if model is None:  # the CPU path builds in fp32; bf16 is its GEMMs' dtype (pack_weights)
        built = torch.float32 if ops is None else spec.dtype
        model = _build(src, spec, built, device, quantization, ops, config, weights)
    fp32 = model.dtype == torch.float32 and ops is None
    packed = cpu.packed_gemm
    if packed is None or cpu_bf16:
        packed = cpu_bf16 or (fp32 and (cpu_gemm.panel_available() or cpu_gemm.onednn_available()))
    gemm = model.pack_weights(spec.dtype if cpu_bf16 else torch.float32) if packed else "torch"
    model.kv_cache_dtype = kv_cache_dtype(spec.kv_cache_dtype, model.dtype, spec.dtype, ops)
    batch_invariant = cpu.batch_invariant and ops is None  # a CPU-path property
    gemm_rows = cpu.gemm_rows
    if batch_invariant and gemm_rows is None:
        gemm_rows = calibrate_gemm_rows(model)
    native = cpu.native_kernels
    if native is None:
        native = fp32 and cpu_native.available()
    if native:
        model.use_native_layer_ops()
    decode_fn = cpu_native.paged_decode_attention if native else None
    return LoadedModel(device, ops, model, gemm_rows if batch_invariant else None, decode_fn, gemm)


def _build(
    src: ModelSource | None,
    spec: DeviceSpec,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str,
    ops: KernelBackend | None,
    config: ModelConfig | None,
    weights: dict[str, Any] | None,
) -> Model:
    """The model of ``src`` (or of in-memory ``config`` + ``weights``) on ``device``, its
    weights in ``dtype``."""
    how = LoadSpec(dtype, device, quantization, device_path=ops is not None)
    if config is None or weights is None:
        if src is None:
            raise ValueError("ModelRunner needs a ModelSource, config + weights, or a model")
        log.info("loading model %s from %s", src.name, src.path)
        config = load_config(src, model_impl=spec.model_impl)
        kind = model_kind(config)
        log.info("%s: %s, run by %s", src.name, config.family, kind.__name__)
        return kind.load(src, config, how)
    return model_kind(config).from_weights(config, weights, how)


def calibrate_gemm_rows(model: Model) -> GemmRows:
    """Test this machine's GEMM on the model's own weights, one of each shape (15-20 s on
    2 cores), or reuse this machine's earlier answer for the same shapes."""
    t0 = time.perf_counter()
    rows, cached = batch_invariance.calibrate_cached(model.linear_weights(), machine.cache_dir())
    how = "from the calibration cache" if cached else "calibrated"
    log.info("GEMM row layout %s (%s in %.1fs)", rows, how, time.perf_counter() - t0)
    return rows


def kv_cache_dtype(
    asked: str, model_dtype: torch.dtype, dtype: torch.dtype, ops: object | None
) -> torch.dtype | None:
    """The KV cache's dtype where it is not the model's (``--kv-cache-dtype``), or None.

    ``auto`` follows ``--dtype`` as vLLM's does (on the CPU path, whose model computes in fp32,
    ``--dtype bfloat16`` gives a bf16 cache). The CPU path's kernels read either dtype into
    fp32 arithmetic, so there ``bfloat16`` halves the bytes of K and V every step reads (the
    decode attention's time at long contexts and large batches) with any weights; the device
    path's kernels read the cache in the model's dtype, so there only that dtype is taken."""
    if asked not in KV_CACHE_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {asked!r}"
        )
    want = {"auto": dtype, "bfloat16": torch.bfloat16, "float32": torch.float32}[asked]
    if ops is not None and asked == "auto":
        return None  # the device path: auto is the model's dtype, whatever --dtype asked
    if ops is not None and want != model_dtype:
        raise ValueError(
            f"--kv-cache-dtype {asked}: the device path keeps the KV cache in the model's dtype "
            f"({str(model_dtype).removeprefix('torch.')}); pass --dtype {asked} or leave "
            "--kv-cache-dtype auto"
        )
    return None if want == model_dtype else want


def kv_cache_blocks(model: Model, kv: KvSpec) -> int:
    """``kv.num_blocks``, or as many blocks as ``kv.kv_cache_gib`` holds for this model."""
    cache = model.kv_cache_spec()
    per_block = cache.block_bytes(kv.block_size)
    num_blocks = kv.num_blocks or max(1, int(kv.kv_cache_gib * 2**30) // per_block)
    if cache.kept:
        log.info(
            "allocating KV cache: %.2f GiB (%s)",
            num_blocks * per_block / 2**30,
            str(cache.dtype).removeprefix("torch."),
        )
    else:
        log.info(
            "no KV cache (nothing kept between steps): %d blocks count the tokens in flight",
            num_blocks,
        )
    return num_blocks


def max_model_len(cfg: ModelConfig, num_blocks: int, kv: KvSpec) -> int:
    """The longest sequence: the asked length, capped by the model's positions and the cache."""
    limit = min(cfg.max_position_embeddings, num_blocks * kv.block_size)
    return min(kv.max_model_len, limit) if kv.max_model_len else limit


PREFILL_WARM_UP_LENS = (16, 32, 64, 128)
"""Query lengths of the start-up prefill forwards: one per row tile of the extend attention
kernel (``block_m`` is the next power of two of the longest query, 16 to 128)."""


@torch.inference_mode()
def warm_up_prefill(
    ops: KernelBackend,
    model: Model,
    kv_caches: Any,
    staging: Staging,
    max_len: int,
    block_size: int,
) -> float:
    """Prefill forwards through the device path, one per query length of
    ``PREFILL_WARM_UP_LENS`` (up to ``max_len``), run at start-up on CUDA so that Triton
    compiles the eager path's kernel variants there and not in a step while requests wait: on
    an H200 the first 32-stream run compiled 8 kernels in its steps (TTFT p50 417 ms, 77 % of
    the worker's samples in Triton's compiler). Every row is padding for the KV cache (slot -1:
    nothing written) and reads block 0 only; the logits are dropped. Returns the seconds."""
    t0 = time.perf_counter()
    lens = [n for n in PREFILL_WARM_UP_LENS if n <= max_len]
    for n in lens:
        step = HostStep(
            token_ids=[0] * n,
            positions=list(range(n)),
            slots=[-1] * n,
            block_tables=np.zeros((1, -(-n // block_size)), dtype=np.int32),
            seq_lens=[n],
            query_lens=[n],
            sample_rows=[n - 1],
        )
        batch = pack(step, staging)
        if model.length_dependent_rope:
            batch.prompt_lens = torch.tensor([n], device=staging.device)
        model.forward_device_pooled(ops, batch, kv_caches)
    if staging.device.type == "cuda":
        torch.cuda.synchronize(staging.device)
    seconds = time.perf_counter() - t0
    log.info("prefill warm-up (query lengths %s) in %.1fs", lens, seconds)
    return seconds


def make_decode_graphs(
    loaded: LoadedModel,
    kv_caches: Any,
    max_len: int,
    block_size: int,
    max_num_seqs: int,
) -> DecodeGraphs | None:
    """Decode graphs for a ladder of batch sizes up to ``max_num_seqs``, captured now on
    CUDA (before any step: the warm-up runs write no KV)."""
    ops, model, device = loaded.ops, loaded.model, loaded.device
    assert ops is not None
    cfg = model.cfg
    max_blocks = -(-max_len // block_size)

    def forward(batch: DeviceBatch) -> torch.Tensor:
        return model.forward_device(ops, batch, kv_caches)

    def splits(size: int) -> int | None:
        if ops.name != "triton":
            return None
        from kvflow.kernels.triton_decode_attention import default_num_splits

        group = cfg.num_heads // cfg.num_kv_heads
        ctx = max_blocks * block_size
        return default_num_splits(size, cfg.num_kv_heads, group, ctx, device)

    if model.length_dependent_rope:
        log.info("decode graphs off: this model's RoPE depends on each sequence's prompt length")
        return None
    graphs = DecodeGraphs(
        forward,
        capture_sizes(max_num_seqs),
        max_blocks,
        cfg.vocab_size,
        device,
        splits,
        capture=device.type == "cuda",
    )
    graphs.capture()
    return graphs


def weight_bytes(model: Model) -> int:
    """Bytes the model's weights hold as loaded: dense tensors by their size, packed and
    quantized weights by their own ``nbytes`` (blocks, panels), each object once (a tied head
    is its embedding). Walks the model's attributes (its layers' typed weights, lists and
    dicts included) and its parameters."""
    seen: set[int] = set()

    def size(x: Any) -> int:
        if id(x) in seen:
            return 0
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        if isinstance(x, Weights):
            return sum(size(v) for v in x.weights())
        if isinstance(x, dict):
            return sum(size(v) for v in x.values())
        if isinstance(x, list | tuple):
            return sum(size(v) for v in x)
        nbytes = getattr(x, "nbytes", None)
        return int(nbytes) if isinstance(nbytes, int) else 0

    own = {k: v for k, v in vars(model).items() if not k.startswith("_")}
    return size(own) + sum(size(p) for p in model.parameters())


def log_ready(
    loaded: LoadedModel,
    num_blocks: int,
    block_size: int,
    max_len: int,
    graphs: DecodeGraphs | None,
    t0: float,
) -> None:
    """One line saying what was set up and how long it took."""
    cfg, model = loaded.model.cfg, loaded.model
    if loaded.ops is None:
        log.info(
            "model ready in %.1fs: weights %.0f MiB, %d layers, %d KV blocks x %d tokens, "
            "max_model_len %d, decode attention %s, layer ops %s, GEMMs %s in rows %s",
            time.perf_counter() - t0,
            weight_bytes(model) / 2**20,
            cfg.num_layers,
            num_blocks,
            block_size,
            max_len,
            "native" if loaded.decode_fn else "torch",
            "native" if model.native_layer_ops else "torch",
            loaded.gemm,
            loaded.gemm_rows,
        )
        return
    decode = "eager"
    if graphs is not None:
        decode = f"through static buffers for batch sizes {graphs.sizes}" + (
            " (CUDA graphs)" if graphs.capture_enabled else " (run eagerly)"
        )
    log.info(
        "model ready in %.1fs on %s (%s, %s kernels): %d layers, %d KV blocks x %d "
        "tokens, max_model_len %d, decode %s",
        time.perf_counter() - t0,
        loaded.device,
        str(model.dtype).removeprefix("torch."),
        loaded.ops.name,
        cfg.num_layers,
        num_blocks,
        block_size,
        max_len,
        decode,
    )


def runner_specs(
    model: ModelSettings, cache: CacheSettings, worker: WorkerSettings, max_num_seqs: int
) -> tuple[KvSpec, DeviceSpec]:
    """The runner's specs from the worker's settings sections (``--device auto`` and
    ``--dtype auto`` resolved here)."""
    from kvflow.services.worker.device import resolve_device, resolve_dtype

    device = resolve_device(worker.device)
    kv = KvSpec(
        cache.block_size, cache.num_kv_blocks or None, cache.kv_cache_memory, model.max_model_len
    )
    return kv, DeviceSpec(
        device,
        resolve_dtype(model.dtype, device),
        model.quantization,
        cuda_graphs=False if worker.enforce_eager else None,
        max_num_seqs=max_num_seqs,
        model_impl=model.model_impl,
        kv_cache_dtype=cache.kv_cache_dtype,
    )
