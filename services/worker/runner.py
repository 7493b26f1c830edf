"""Executes StepPlans: keeps per-request sampling state and the paged KV cache, runs the model on
the step's tokens and samples the sequences whose chunk reaches their last known token.

Rows of single-token sequences (decode) go first and run in GEMMs padded to a row count that
calibration showed to be batch invariant on this machine, each longer chunk runs as its own GEMM
(see kernels/reference.py and kernels/batch_invariance.py), and decode attention runs in the
native CPU kernel (kernels/cpu_native.py) where a C compiler is available: a sequence's logits
are bit-identical whatever else is in the step, so batching never changes greedy output.

On a GPU (``device="cuda"``) the same StepPlans run through the Triton kernels
(``LlamaModel.forward_device``): the step's metadata is built here on the host and copied to the
device once (services/worker/step_inputs.py), decode-only steps replay CUDA graphs
(services/worker/cuda_graphs.py) and prefill / mixed steps run eagerly. Greedy rows are sampled
on the device; anything else (temperature, penalties, bias, grammars, logprobs) moves the
step's logits rows to the host and samples them exactly as on the CPU path. There is no batch
invariance on the GPU (cuBLAS picks kernels by row count).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kernels import batch_invariance, cpu_gemm, cpu_native, cpu_quant
from kernels import reference as K
from kernels.batch_invariance import GemmRows
from kernels.cpu_quant import QuantWeight
from kernels.fp8_linear import Fp8Weight, fp8_supported
from kernels.ops import KernelBackend, get_backend
from services.worker import sampler, structured
from services.worker.cuda_graphs import DecodeGraphs, capture_sizes
from services.worker.device import kernel_backend as default_backend
from services.worker.model import ForwardBatch, LlamaModel
from services.worker.prompt_logprobs import PromptRows
from services.worker.step_inputs import DeviceBatch, HostStep, pack
from shared.messages import (
    FinishReason,
    NewRequest,
    PromptLogprobs,
    SampleLogprobs,
    SamplingParams,
    ScheduledSeq,
    StepPlan,
    StepResult,
)
from shared.model_loader import ModelConfig, load_config, load_weights
from shared.model_source import ModelSource
from shared.quantized_checkpoints import METHODS, checkpoint_method
from shared.sampling import apply_processors, needs_host_sampling

log = logging.getLogger("kvflow.worker")


QUANTIZATIONS = ("", "gguf", "int8", "gptq", "awq", "fp8")


def check_quantization(
    quantization: str,
    src: ModelSource | None,
    device: torch.device,
    dtype: torch.dtype,
    backend: str | None = None,
) -> str:
    """The weight scheme to load with, or a ValueError that says what to change.

    ``gguf`` keeps a GGUF's Q8_0/Q4_0/Q4_1 linear weights quantized; ``int8`` quantizes any
    checkpoint's linear weights to int8 blocks at load (shared/model_loader.quantize_int8);
    ``gptq`` / ``awq`` serve such a 4-bit checkpoint's groups in place
    (shared/quantized_checkpoints.py). On the CPU path (fp32 activations) they run
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
    if quantization == "gguf" and src is not None and src.kind != "gguf":
        raise ValueError(f"--quantization gguf needs a .gguf model; {src.path} is not one")
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
        return quantization
    if not cpu_fp32:
        raise ValueError(
            f"--quantization {quantization} runs on the CPU in float32 or on CUDA (--device cuda)"
        )
    if not cpu_quant.available():
        raise ValueError(f"--quantization {quantization} needs a C compiler (install gcc)")
    return quantization


def to_device_weight(w: torch.Tensor | QuantWeight | Fp8Weight, device: torch.device) -> Any:
    """A loaded weight as the device path computes with it on ``device``: dense tensors moved,
    integer blocks split into the Triton kernel's planes, fp8 weights moved."""
    if isinstance(w, QuantWeight):
        from kernels.triton_quant import DeviceQuantWeight

        return DeviceQuantWeight.from_blocks(w, device)
    return w.to(device)


@dataclass
class RequestState:
    """What the worker keeps for a live request (see NewRequest)."""

    params: SamplingParams
    prompt_len: int
    num_output_tokens: int
    eos_token_ids: frozenset[int]
    stop_token_ids: frozenset[int]
    generator: torch.Generator | None
    keeps_history: bool  # sampling depends on the tokens so far (penalties, bad words)
    # the request's prompt and output tokens, kept only when ``keeps_history``:
    # NewRequest.token_history, then every token sampled here
    prompt_tokens: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    guide: structured.Guide | None = None  # grammar matcher (structured output)
    guide_failed: bool = False  # the constraint did not compile: the request ends in ERROR
    # prompt logprobs: top-k wanted (None: not asked, or sent before a preemption), and the
    # log-softmax of a chunk's last row, which predicts the next chunk's first token
    prompt_logprobs_k: int | None = None
    pending_prompt_row: tuple[int, torch.Tensor] | None = None


class ModelRunner:
    """One worker's model, KV cache and request state; ``execute`` runs one StepPlan."""

    def __init__(
        self,
        src: ModelSource | None,
        block_size: int,
        num_blocks: int | None = None,
        kv_cache_gib: float = 1.0,
        dtype: torch.dtype = torch.float32,
        worker_id: str = "w0",
        max_model_len: int | None = None,
        *,
        config: ModelConfig | None = None,
        weights: dict[str, torch.Tensor] | None = None,
        batch_invariant: bool = True,
        gemm_rows: GemmRows | None = None,
        native_kernels: bool | None = None,
        packed_gemm: bool | None = None,
        device: torch.device | str = "cpu",
        backend: str | None = None,
        cuda_graphs: bool | None = None,
        max_num_seqs: int = 64,
        quantization: str = "",
    ) -> None:
        """``batch_invariant``: run GEMMs in a row layout that keeps each sequence's logits
        independent of the batch (``gemm_rows``, or calibrated here when None). ``native_kernels``:
        the C decode-attention kernel; ``packed_gemm``: pre-packed linear weights (None for
        either: when available and the model is fp32). These three are the CPU path's.

        ``device``: where weights and KV cache live. ``backend``: ``"reference"`` (the CPU
        path) or ``"triton"`` (the device path; on a CPU only under TRITON_INTERPRET=1, for
        tests); None: from the device (services/worker/device.py). ``cuda_graphs``: decode
        steps of up to ``max_num_seqs`` sequences through padded static buffers, captured as
        CUDA graphs on CUDA (None: on for CUDA; True elsewhere runs the same padded path
        eagerly, for tests). ``quantization``: see ``check_quantization``."""
        t0 = time.perf_counter()
        self.device = torch.device(device)
        backend = backend or default_backend(self.device)
        quantization = check_quantization(quantization, src, self.device, dtype, backend)
        if backend == "reference" and self.device.type != "cpu":
            raise ValueError(f"the reference (CPU) path cannot run on {self.device}")
        self.ops: KernelBackend | None = get_backend(backend) if backend != "reference" else None
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # this (model) thread's current device
        if config is None or weights is None:
            if src is None:
                raise ValueError("ModelRunner needs a ModelSource or config + weights")
            log.info("loading model %s from %s", src.name, src.path)
            config = load_config(src)
            weights = load_weights(src, config, dtype, quantization)
        if self.ops is not None:
            weights = {n: to_device_weight(w, self.device) for n, w in weights.items()}
        self.model = LlamaModel(config, weights)
        fp32 = self.model.dtype == torch.float32 and self.ops is None
        if packed_gemm is None:
            packed_gemm = fp32 and (cpu_gemm.panel_available() or cpu_gemm.onednn_available())
        gemm = self.model.pack_weights() if packed_gemm else "torch"
        self.worker_id = worker_id
        batch_invariant = batch_invariant and self.ops is None  # a CPU-path property
        if batch_invariant and gemm_rows is None:
            gemm_rows = self._calibrate_gemm_rows()
        self.gemm_rows = gemm_rows if batch_invariant else None
        if native_kernels is None:
            native_kernels = fp32 and cpu_native.available()
        self.decode_fn = cpu_native.paged_decode_attention if native_kernels else None
        if native_kernels:
            self.model.use_native_layer_ops()
        self._block_size = block_size
        cfg = config
        per_block = 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim
        per_block *= torch.finfo(self.model.dtype).bits // 8
        self._num_blocks = num_blocks or max(1, int(kv_cache_gib * 2**30) // per_block)
        log.info("allocating KV cache: %.2f GiB", self._num_blocks * per_block / 2**30)
        self.kv_caches = self.model.make_kv_caches(self._num_blocks, block_size)
        limit = min(cfg.max_position_embeddings, self._num_blocks * block_size)
        self._max_model_len = min(max_model_len, limit) if max_model_len else limit
        self.requests: dict[str, RequestState] = {}
        self.total_computed_tokens = 0
        self.graphs: DecodeGraphs | None = None
        if self.ops is not None and (cuda_graphs or cuda_graphs is None and self.on_cuda):
            self.graphs = self._make_decode_graphs(max_num_seqs)
        if self.ops is None:
            log.info(
                "model ready in %.1fs: %d layers, %d KV blocks x %d tokens, max_model_len %d, "
                "decode attention %s, layer ops %s, GEMMs %s in rows %s",
                time.perf_counter() - t0,
                cfg.num_layers,
                self._num_blocks,
                block_size,
                self._max_model_len,
                "native" if self.decode_fn else "torch",
                "native" if self.model.native_layer_ops else "torch",
                gemm,
                self.gemm_rows,
            )
        else:
            log.info(
                "model ready in %.1fs on %s (%s, %s kernels): %d layers, %d KV blocks x %d "
                "tokens, max_model_len %d, decode %s",
                time.perf_counter() - t0,
                self.device,
                str(self.model.dtype).removeprefix("torch."),
                self.ops.name,
                cfg.num_layers,
                self._num_blocks,
                block_size,
                self._max_model_len,
                "eager"
                if self.graphs is None
                else f"through static buffers for batch sizes {self.graphs.sizes}"
                + (" (CUDA graphs)" if self.graphs.capture_enabled else " (run eagerly)"),
            )

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def _make_decode_graphs(self, max_num_seqs: int) -> DecodeGraphs:
        """Decode graphs for a ladder of batch sizes up to ``max_num_seqs``, captured now on
        CUDA (before any step: the warm-up runs write no KV)."""
        assert self.ops is not None
        ops, cfg = self.ops, self.config
        max_blocks = -(-self._max_model_len // self._block_size)

        def forward(batch: DeviceBatch) -> torch.Tensor:
            return self.model.forward_device(ops, batch, self.kv_caches)

        def splits(size: int) -> int | None:
            if ops.name != "triton":
                return None
            from kernels.triton_decode_attention import default_num_splits

            group = cfg.num_heads // cfg.num_kv_heads
            ctx = max_blocks * self._block_size
            return default_num_splits(size, cfg.num_kv_heads, group, ctx, self.device)

        graphs = DecodeGraphs(
            forward,
            capture_sizes(max_num_seqs),
            max_blocks,
            cfg.vocab_size,
            self.device,
            splits,
            capture=self.on_cuda,
        )
        graphs.capture()
        return graphs

    def _calibrate_gemm_rows(self) -> GemmRows:
        """Test this machine's GEMM on the model's own weights, one of each shape (15-20 s on
        2 cores), or reuse this machine's earlier answer for the same shapes."""
        t0 = time.perf_counter()
        rows, cached = batch_invariance.calibrate_cached(self.model.linear_weights())
        how = "from the calibration cache" if cached else "calibrated"
        log.info("GEMM row layout %s (%s in %.1fs)", rows, how, time.perf_counter() - t0)
        return rows

    @classmethod
    def from_weights(
        cls,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        block_size: int,
        num_blocks: int,
        **kw,
    ) -> ModelRunner:
        """A runner over in-memory weights (tests with tiny random models)."""
        return cls(None, block_size, num_blocks, config=config, weights=weights, **kw)

    @property
    def config(self) -> ModelConfig:
        return self.model.cfg

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    # ----------------------------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step; never raises (errors come back in ``StepResult.error``)."""
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                ids, tokens, reasons, n, lps, plps = self._execute(plan)
            err = None
        except Exception as e:  # noqa: BLE001 - the worker loop must survive a bad step
            log.exception("step %d failed", plan.step_id)
            ids, tokens, reasons, n, lps, plps = [], [], [], 0, [], []
            err = f"{type(e).__name__}: {e}"
        counts = [self.requests[r].num_output_tokens if r in self.requests else 0 for r in ids]
        return StepResult(
            worker_id=self.worker_id,
            step_id=plan.step_id,
            request_ids=ids,
            token_ids=tokens,
            finish_reasons=reasons,
            num_computed_tokens=n,
            step_time_s=time.perf_counter() - t0,
            error=err,
            logprobs=lps,
            prompt_logprobs=plps,
            num_output_tokens=counts,
            epoch=plan.epoch,
        )

    def reset(self) -> None:
        """Forget every request (a new scheduler leader starts over; the KV cache's contents
        are just stale data to it)."""
        self.requests.clear()

    def _add_request(self, r: NewRequest) -> None:
        p = r.params
        gen = None
        if p.seed is not None:
            gen = torch.Generator().manual_seed(int(p.seed))
        eos = r.eos_token_ids or list(self.config.eos_token_ids)
        st = self.requests[r.request_id] = RequestState(
            params=p,
            prompt_len=r.prompt_len,
            num_output_tokens=r.num_output_tokens,
            eos_token_ids=frozenset(eos),
            stop_token_ids=frozenset(p.stop_token_ids),
            generator=gen,
            keeps_history=p.needs_token_history(),
            # sent with the first token already when resumed after a preemption
            prompt_logprobs_k=p.prompt_logprobs if r.num_output_tokens == 0 else None,
            prompt_tokens=list(r.token_history[: r.prompt_len]),
            output_tokens=list(r.token_history[r.prompt_len :]),
        )
        if p.structured_output is not None:
            stops = set(eos) | set(p.stop_token_ids)
            compiler = structured.compiler_for(self)
            st.guide = structured.make_guide(
                compiler, p.structured_output, stops, r.num_output_tokens
            )
            st.guide_failed = st.guide is None

    def _execute(
        self, plan: StepPlan
    ) -> tuple[
        list[str], list[int], list[int], int, list[SampleLogprobs | None], list[PromptLogprobs]
    ]:
        for rid in plan.finished_request_ids:
            self.requests.pop(rid, None)
        for r in plan.new_requests:
            self._add_request(r)
        if not plan.seqs:
            return [], [], [], 0, [], []
        bs = self._block_size
        # single-token sequences first (padded GEMM rows), then one segment per longer chunk
        order = sorted(range(len(plan.seqs)), key=lambda i: len(plan.seqs[i].token_ids) > 1)
        seqs = [plan.seqs[i] for i in order]
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        segments: list[tuple[int, int]] = []
        prompt_rows = PromptRows()  # extra logits rows for requests asking prompt logprobs
        for s in seqs:
            n = len(s.token_ids)
            if n == 0:
                raise ValueError(f"{s.request_id}: empty chunk")
            end = s.start_pos + n
            used = s.block_table[: -(-end // bs)]
            if len(used) * bs < end or min(used) < 0 or max(used) >= self._num_blocks:
                raise ValueError(f"{s.request_id}: bad block table for {end} tokens: {used}")
            if end > self.config.max_position_embeddings:
                raise ValueError(f"{s.request_id}: {end} tokens exceed the model's positions")
            if s.sample and s.request_id not in self.requests:
                raise KeyError(f"{s.request_id}: unknown request (no NewRequest)")
            start_row = len(ids)
            ids += s.token_ids
            for p in range(s.start_pos, end):
                slots.append(s.block_table[p // bs] * bs + p % bs)
            pos += range(s.start_pos, end)
            if n > 1:
                segments.append((start_row, len(ids)))
            if s.sample:
                sample_rows.append(len(ids) - 1)
            st = self.requests.get(s.request_id)
            if st is not None:
                if st.guide is not None:  # tokens generated before a preemption
                    st.guide.replay(s, st.prompt_len)
                prompt_rows.add(s, st, start_row)
        n_tokens = len(ids)
        if self.ops is not None:
            logits = self._forward_device(seqs, ids, pos, slots, sample_rows + prompt_rows.rows)
            states = [self.requests[s.request_id] for s in seqs if s.sample]
            if logits.device.type != "cpu" and (prompt_rows.rows or needs_host_sampling(states)):
                logits = logits.cpu()
        else:
            max_blocks = max(len(s.block_table) for s in seqs)
            tables = torch.tensor(
                [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in seqs]
            )
            qlens = torch.tensor([len(s.token_ids) for s in seqs])
            seq_lens = torch.tensor([s.start_pos + len(s.token_ids) for s in seqs])
            num_single = len(seqs) - len(segments)
            batch = ForwardBatch(
                slot_mapping=torch.tensor(slots),
                attn=K.plan_attention(tables, seq_lens, qlens, bs, decode_fn=self.decode_fn),
                rows=K.RowLayout(
                    num_single, tuple(segments), self.gemm_rows.tile, self.gemm_rows.pad
                )
                if self.gemm_rows
                else None,
                sample_rows=torch.tensor(sample_rows + prompt_rows.rows, dtype=torch.long),
            )
            logits = self.model(torch.tensor(ids), torch.tensor(pos), batch, self.kv_caches)
        self.total_computed_tokens += n_tokens
        prompt_lps = prompt_rows.collect(logits[len(sample_rows) :]) if prompt_rows.rows else []
        logits = logits[: len(sample_rows)]
        sampled = [s for s in seqs if s.sample]
        want_lp = [self.requests[s.request_id].params.logprobs is not None for s in sampled]
        raw = logits[torch.tensor(want_lp)].clone() if any(want_lp) else None
        tokens = self._sample(logits, sampled).tolist() if sampled else []
        by_id = dict(zip([s.request_id for s in sampled], tokens, strict=True))
        lp_by_id: dict[str, SampleLogprobs] = {}
        if raw is not None:
            asking = [(s, t) for s, t, w in zip(sampled, tokens, want_lp, strict=True) if w]
            for (s, _tok), lp in zip(asking, _logprobs(raw, asking, self.requests), strict=True):
                lp_by_id[s.request_id] = lp
        out_ids, out_tokens, reasons = [], [], []
        out_lps: list[SampleLogprobs | None] = []
        for s in plan.seqs:  # results in the plan's order
            if s.sample:
                tok = by_id[s.request_id]
                out_ids.append(s.request_id)
                out_tokens.append(tok)
                reasons.append(int(self._finish(self.requests[s.request_id], tok)))
                out_lps.append(lp_by_id.get(s.request_id))
        return out_ids, out_tokens, reasons, n_tokens, out_lps if lp_by_id else [], prompt_lps

    def _forward_device(
        self,
        seqs: list[ScheduledSeq],
        ids: list[int],
        pos: list[int],
        slots: list[int],
        rows: list[int],
    ) -> torch.Tensor:
        """The step through the device path: logits [len(rows), vocab] (on the device) of the
        flat token rows ``rows``. Decode-only steps that fit go through the decode graphs."""
        assert self.ops is not None
        bs = self._block_size
        ends = [s.start_pos + len(s.token_ids) for s in seqs]
        tables = [s.block_table[: -(-e // bs)] for s, e in zip(seqs, ends, strict=True)]
        g = self.graphs
        if (
            g is not None
            and len(ids) == len(seqs)
            and g.fits(len(seqs), max(len(t) for t in tables))
        ):
            logits = g.run(ids, pos, slots, ends, tables)
            if rows == list(range(len(seqs))):
                return logits
            return logits.index_select(0, torch.tensor(rows, device=self.device))
        qlens = [len(s.token_ids) for s in seqs]
        batch = pack(HostStep(ids, pos, slots, tables, ends, qlens, rows), self.device)
        return self.model.forward_device(self.ops, batch, self.kv_caches)

    def _sample(self, logits: torch.Tensor, sampled: list[ScheduledSeq]) -> torch.Tensor:
        """Every feature's logits processor over the rows, then one batched draw."""
        states = [self.requests[s.request_id] for s in sampled]
        apply_processors(logits, states)
        batch = sampler.make_batch([st.params for st in states], [st.generator for st in states])
        return sampler.sample(logits, batch)

    def _finish(self, st: RequestState, token: int) -> FinishReason:
        """Count the new token and say whether the request ends with it."""
        st.num_output_tokens += 1
        n, p = st.num_output_tokens, st.params
        if st.keeps_history:
            st.output_tokens.append(token)
        if st.guide_failed or (st.guide is not None and not st.guide.accept(token)):
            return FinishReason.ERROR
        if st.guide is not None and st.guide.terminated:  # the grammar ended with a stop token
            return FinishReason.STOP
        return finish_rule(
            p, token, n, st.prompt_len, st.stop_token_ids, st.eos_token_ids, self._max_model_len
        )


def finish_rule(
    p: SamplingParams,
    token: int,
    num_output_tokens: int,
    prompt_len: int,
    stop_token_ids: frozenset[int],
    eos_token_ids: frozenset[int],
    max_model_len: int,
) -> FinishReason:
    """Whether a request ends with ``token``, its ``num_output_tokens``-th: a stop token or EOS
    (once min_tokens are out), max_tokens or the model length."""
    is_stop = token in stop_token_ids or (not p.ignore_eos and token in eos_token_ids)
    if is_stop and num_output_tokens >= p.min_tokens:
        return FinishReason.STOP
    if num_output_tokens >= p.max_tokens or prompt_len + num_output_tokens >= max_model_len:
        return FinishReason.LENGTH
    return FinishReason.NONE


def _logprobs(
    raw: torch.Tensor, asking: list[tuple[ScheduledSeq, int]], requests: dict[str, RequestState]
) -> list[SampleLogprobs]:
    """Log-probabilities of the model's raw distribution (before penalties, bias or
    temperature, as vLLM reports them) for each sampled token, plus the top ``logprobs``."""
    lp = torch.log_softmax(raw.float(), dim=-1)
    out = []
    for row, (s, tok) in enumerate(asking):
        k = min(int(requests[s.request_id].params.logprobs or 0), 20)
        top_v, top_i = lp[row].topk(k) if k else (lp[row][:0], lp[row][:0].long())
        out.append(SampleLogprobs(float(lp[row, tok]), top_i.tolist(), top_v.tolist()))
    return out
