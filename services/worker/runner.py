"""Executes StepPlans: keeps per-request sampling state and the paged KV cache, runs the model on
the step's tokens and samples the sequences whose chunk reaches their last known token.

Rows of single-token sequences (decode) go first and run in GEMMs padded to a row count that
calibration showed to be batch invariant on this machine, each longer chunk runs as its own GEMM
(see kernels/reference.py and kernels/batch_invariance.py), and decode attention runs in the
native CPU kernel (kernels/cpu_native.py) where a C compiler is available: a sequence's logits
are bit-identical whatever else is in the step, so batching never changes greedy output.

On a GPU (``device="cuda"``) the same StepPlans run through the Triton kernels
(``DecoderModel.forward_device``): the step's metadata is built here on the host and copied to the
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

from kvflow.services.worker import sampler, speculation, structured
from kvflow.services.worker.block_tables import BlockTables
from kvflow.services.worker.cuda_graphs import DecodeGraphs
from kvflow.services.worker.draft import DraftProposer
from kvflow.services.worker.lora import LoRACache, LoRASpec, LoRAStep, lora_rows
from kvflow.services.worker.model_interface import Model
from kvflow.services.worker.model_setup import (
    CpuPathSpec,
    DeviceSpec,
    KvSpec,
    LoadedModel,
    kv_cache_blocks,
    load_model,
    log_ready,
    make_decode_graphs,
    max_model_len,
    specs_from_keywords,
    warm_up_prefill,
    weight_bytes,
)
from kvflow.services.worker.pooling import PoolState, pooled_output
from kvflow.services.worker.step_inputs import HostStep, Staging, pack
from kvflow.services.worker.step_output import StepOut, step_result
from kvflow.services.worker.step_rows import StepRows, host_batch, lay_out
from kvflow.services.worker.tensor_parallel import TPGroup
from kvflow.shared.messages import (
    FinishReason,
    LoRARef,
    NewRequest,
    PooledOutput,
    SampleLogprobs,
    SamplingParams,
    ScheduledSeq,
    StepPlan,
    StepResult,
)
from kvflow.shared.model_source import ModelSource
from kvflow.shared.models.config import ModelConfig
from kvflow.shared.sampling import (
    LogitsProcessor,
    active_processors,
    needs_token_history,
)

log = logging.getLogger("kvflow.worker")


@dataclass
class RequestState:
    """What the worker keeps for a live request (see NewRequest)."""

    params: SamplingParams
    prompt_len: int
    num_output_tokens: int
    eos_token_ids: frozenset[int]
    stop_token_ids: frozenset[int]
    keeps_history: bool  # sampling depends on the tokens so far (penalties, bad words)
    # the request's prompt and output tokens, kept only when ``keeps_history``:
    # NewRequest.token_history, then every token sampled here
    prompt_tokens: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    guide: structured.Guide | None = None  # grammar matcher (structured output)
    guide_failed: bool = False  # the constraint did not compile: the request ends in ERROR
    lora_failed: bool = False  # its adapter could not be loaded here: it ends in ERROR
    # prompt logprobs: top-k wanted (None: not asked, or sent before a preemption), and the
    # log-softmax of a chunk's last row, which predicts the next chunk's first token
    prompt_logprobs_k: int | None = None
    pending_prompt_row: tuple[int, torch.Tensor] | None = None
    pool: PoolState | None = None  # an embedding request: pooled, never sampled (pooling.py)
    lora: LoRARef | None = None  # its LoRA adapter (None: the base model)
    # what the parameters decide for sampling, once (shared/sampling/derived.py)
    processors: tuple[LogitsProcessor, ...] = field(init=False, default=())
    draw: sampler.DrawRow = field(init=False)  # what they decide for the draw (sampler.py)
    history_memo: Any = field(init=False, default=None)  # processors.TokenHistory

    def __post_init__(self) -> None:
        self.processors = active_processors(self.params)
        self.draw = sampler.draw_row(self.params)


class ModelRunner:
    """One worker's model, KV cache and request state; ``execute`` runs one StepPlan."""

    def __init__(
        self,
        src: ModelSource | None,
        kv: KvSpec,
        device: DeviceSpec | None = None,
        cpu: CpuPathSpec | None = None,
        *,
        config: ModelConfig | None = None,
        weights: dict[str, torch.Tensor] | None = None,
        worker_id: str = "w0",
        draft: LoadedModel | None = None,
        lora: LoRASpec | None = None,
        tp: TPGroup | None = None,
        model: Model | None = None,
    ) -> None:
        """Load ``src`` (or in-memory ``config`` + ``weights``) as ``device`` says and
        allocate the KV cache ``kv`` describes (services/worker/model_setup.py); ``draft``: a
        loaded draft model for speculative decoding (services/worker/draft.py); ``lora``:
        serve LoRA adapters (services/worker/lora.py); ``tp``: this rank's collectives when
        the model is a tensor-parallel shard (services/worker/tp_group.py); ``model``: a
        model built already (a ``TransformersModel`` in tests) instead of ``src``. What the
        model's family refuses (tensor parallelism, LoRA) is refused here (ValueError)."""
        t0 = time.perf_counter()
        device = device or DeviceSpec()
        loaded = load_model(src, device, cpu or CpuPathSpec(), config, weights, model)
        self.device, self.ops = loaded.device, loaded.ops
        self.model: Model = loaded.model
        self.staging = Staging(self.device)  # the device path's step inputs, reused
        self.model.tp = tp  # before graph capture: the captured steps run the collectives
        self.gemm_rows, self.decode_fn = loaded.gemm_rows, loaded.decode_fn
        self.model_path = str(src.path) if src is not None else ""  # for grammar compilers
        self.worker_id = worker_id
        self._block_size = kv.block_size
        self._num_blocks = kv_cache_blocks(self.model, kv)
        self.kv_caches = self.model.make_kv_caches(self._num_blocks, kv.block_size)
        self._max_model_len = max_model_len(self.config, self._num_blocks, kv)
        self.tables = BlockTables(self._num_blocks)  # each request's (plans send differences)
        self.draft = (
            DraftProposer(draft, self._num_blocks, kv.block_size, self.tables) if draft else None
        )
        refused = self.model.family.refusal(lora=lora is not None)
        if refused:
            raise ValueError(refused)
        self.loras = (
            LoRACache(
                self.config,
                lora.max_loras,
                lora.max_rank,
                self.model.dtype,
                self.device,
                self.ops,
                lora.shard,
            )
            if lora is not None
            else None
        )
        self.requests: dict[str, RequestState] = {}
        self.total_computed_tokens = 0
        self.graphs: DecodeGraphs | None = None
        graphs = device.cuda_graphs
        if (
            self.ops is not None
            and self.model.decode_graphs
            and (graphs or graphs is None and self.on_cuda)
        ):
            self.graphs = make_decode_graphs(
                loaded, self.kv_caches, self._max_model_len, kv.block_size, device.max_num_seqs
            )
        if self.ops is not None and self.on_cuda and self.model.generates:  # it samples one row
            warm_up_prefill(
                self.ops,
                self.model,
                self.kv_caches,
                self.staging,
                self._max_model_len,
                kv.block_size,
            )
        log_ready(loaded, self._num_blocks, kv.block_size, self._max_model_len, self.graphs, t0)

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    @classmethod
    def create(
        cls,
        src: ModelSource | None,
        block_size: int,
        num_blocks: int | None = None,
        *,
        config: ModelConfig | None = None,
        weights: dict[str, torch.Tensor] | None = None,
        worker_id: str = "w0",
        draft: LoadedModel | None = None,
        lora: LoRASpec | None = None,
        model: Model | None = None,
        **options: Any,
    ) -> ModelRunner:
        """A runner from flat option names (``dtype=``, ``max_model_len=``, ``gemm_rows=``:
        the fields of KvSpec, DeviceSpec and CpuPathSpec), for tests and benchmarks."""
        kv, device, cpu = specs_from_keywords(block_size, num_blocks, **options)
        return cls(
            src,
            kv,
            device,
            cpu,
            config=config,
            weights=weights,
            worker_id=worker_id,
            draft=draft,
            lora=lora,
            model=model,
        )

    @classmethod
    def from_weights(
        cls,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        block_size: int,
        num_blocks: int,
        **kw: Any,
    ) -> ModelRunner:
        """A runner over in-memory weights (tests with tiny random models)."""
        return cls.create(None, block_size, num_blocks, config=config, weights=weights, **kw)

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
                out = self._execute(plan)
        except Exception as e:  # noqa: BLE001 - the worker loop must survive a bad step
            log.exception("step %d failed", plan.step_id)
            err = f"{type(e).__name__}: {e}"
            return step_result(self.worker_id, plan, None, time.perf_counter() - t0, err)
        return step_result(self.worker_id, plan, out, time.perf_counter() - t0)

    def reset(self) -> None:
        """Forget every request (a new scheduler leader starts over; the KV cache's contents
        are just stale data to it)."""
        self.requests.clear()
        self.tables.clear()

    def forget_lora(self, name: str) -> None:
        """An unloaded adapter leaves the cache (it loads again if a plan names it)."""
        if self.loras is not None:
            self.loras.forget(name)

    def kv_shards(self) -> list[Any] | None:
        return None  # one process holds every KV head

    def weight_bytes(self) -> int:
        """Bytes the weights hold as loaded."""
        return weight_bytes(self.model)

    def take_expert_load(self) -> list[int] | None:
        """The last step's tokens per expert (None: no mixture of experts ran)."""
        return self.model.take_expert_load()

    def keepalive(self) -> None:
        pass  # no other ranks to keep

    def close(self) -> None:
        pass

    def _add_request(self, r: NewRequest) -> None:
        p = r.params
        eos = r.eos_token_ids or list(self.config.eos_token_ids)
        st = self.requests[r.request_id] = RequestState(
            params=p,
            prompt_len=r.prompt_len,
            num_output_tokens=r.num_output_tokens,
            eos_token_ids=frozenset(eos),
            stop_token_ids=frozenset(p.stop_token_ids),
            keeps_history=needs_token_history(p),
            # sent with the first token already when resumed after a preemption
            prompt_logprobs_k=p.prompt_logprobs if r.num_output_tokens == 0 else None,
            prompt_tokens=list(r.token_history[: r.prompt_len]),
            output_tokens=list(r.token_history[r.prompt_len :]),
            pool=PoolState(r.pooling, r.prompt_len) if r.pooling is not None else None,
            lora=r.lora,
        )
        if r.lora is not None and self.loras is None:
            raise ValueError(f"{r.request_id}: a LoRA adapter, but this worker has LoRA off")
        if p.structured_output is not None:
            stops = set(eos) | set(p.stop_token_ids)
            compiler = structured.compiler_for(self)
            st.guide = structured.make_guide(
                compiler, p.structured_output, stops, r.num_output_tokens
            )
            st.guide_failed = st.guide is None

    def _execute(self, plan: StepPlan) -> StepOut:
        self.tables.apply(plan)
        for rid in plan.finished_request_ids:
            self.requests.pop(rid, None)
            if self.draft is not None:
                self.draft.forget(rid)
        for r in plan.new_requests:
            self._add_request(r)
        out = StepOut()
        if not plan.seqs:
            return out
        self._check_served(plan.seqs)
        # a draft model runs the step's tokens and appends its drafts (services/worker/draft.py)
        plan_seqs = self.draft.step(plan.seqs) if self.draft is not None else plan.seqs
        rows_of_plan = speculation.expand(plan_seqs)  # plan_seqs itself when nothing has drafts
        step = lay_out(
            rows_of_plan,
            self.requests,
            self._block_size,
            self.config.max_position_embeddings,
        )
        seqs, prompt_rows, sample_rows = step.seqs, step.prompt_rows, step.sample_rows
        n_tokens = len(step.ids)
        lora = lora_rows(self.loras, seqs, self.requests)
        if self.ops is not None:
            # sampled (and prompt-logprob rows) where they are: only ids and logprobs leave
            logits, hidden = self._forward_device(step, lora)
        else:
            batch = host_batch(step, self.tables, self._block_size, self.decode_fn, self.gemm_rows)
            batch.lora = lora
            ids, pos = torch.tensor(step.ids), torch.tensor(step.pos)
            if step.pool_rows:
                logits, hidden = self.model.forward_pooled(ids, pos, batch, self.kv_caches)
            else:
                logits, hidden = self.model(ids, pos, batch, self.kv_caches), None
        self.total_computed_tokens += n_tokens
        out.num_computed = n_tokens
        if step.pool_pieces:
            out.embeddings = self._pool(plan.seqs, step, hidden)
        if prompt_rows.rows:
            out.prompt_logprobs = prompt_rows.collect(logits[len(sample_rows) :])
        logits = logits[: len(sample_rows)]
        sampled = [s for s in seqs if s.sample and self.requests[s.request_id].pool is None]
        tokens, row_lps = self._sample(logits, sampled) if sampled else ([], [])
        if (
            self.draft is None
            and rows_of_plan is plan_seqs
            and len(sampled) == len(plan_seqs)
            and not step.segments
        ):  # every chunk one token and sampled, in the plan's order (most steps): no drafts
            requests, finish, add = self.requests, self._finish, out.add
            for s, tok, lp in zip(sampled, tokens, row_lps, strict=True):
                st = requests[s.request_id]
                add(s.request_id, tok, int(finish(st, tok)), st.num_output_tokens, lp)
            return out
        # each request's sampled rows in position order (several when it verifies drafts)
        rows: dict[str, list[tuple[int, SampleLogprobs | None]]] = {}
        for s, tok, lp in zip(sampled, tokens, row_lps, strict=True):
            rows.setdefault(s.request_id, []).append((tok, lp))
        for s in plan_seqs:  # results in the plan's order
            got = rows.get(s.request_id)
            if got is None or not s.sample:
                continue
            picked = speculation.kept(s, [t for t, _ in got])
            if self.draft is not None:
                self.draft.verified(s, picked)
            st = self.requests[s.request_id]
            for tok, (_, lp) in zip(picked, got, strict=False):
                reason = self._finish(st, tok)
                out.add(s.request_id, tok, int(reason), st.num_output_tokens, lp)
                if reason != FinishReason.NONE:
                    break
        return out

    def _check_served(self, seqs: list[ScheduledSeq]) -> None:
        """ValueError for what the model cannot compute: a request to sample from one that
        pools only, a chunk that is not a whole input for one that computes inputs whole."""
        model = self.model
        if model.generates and not model.whole_inputs:
            return
        for s in seqs:
            st = self.requests[s.request_id]
            if not model.generates and st.pool is None:
                raise ValueError(
                    f"{self.config.family} serves pooling requests only (embed, classify, score)"
                )
            n = len(s.token_ids)
            if model.whole_inputs and (s.start_pos != 0 or n != st.prompt_len or s.num_draft):
                raise ValueError(
                    f"{s.request_id}: {self.config.family} computes a whole input in one step "
                    f"(got tokens {s.start_pos}..{s.start_pos + n} of {st.prompt_len})"
                )

    def _forward_device(
        self, step: StepRows, lora: LoRAStep | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step through the device path: logits [len(rows), vocab] (on the device) of the
        step's logits rows, and the final hidden states of its pooled rows (None without).
        Decode-only steps that fit, with nothing to pool and no LoRA adapter, go through the
        decode graphs."""
        assert self.ops is not None
        seqs, ids, pos, slots, rows = step.seqs, step.ids, step.pos, step.slots, step.logits_rows
        bs = self._block_size
        ends = [s.start_pos + len(s.token_ids) for s in seqs]
        tables = self.tables.used(seqs, ends, bs)
        g = self.graphs
        if (
            g is not None
            and not step.pool_rows
            and lora is None
            and len(ids) == len(seqs)
            and g.fits(len(seqs), tables.shape[1])
        ):
            logits = g.run(ids, pos, slots, ends, tables)
            if rows == list(range(len(seqs))):
                return logits, None
            return logits.index_select(0, torch.tensor(rows, device=self.device)), None
        qlens = [len(s.token_ids) for s in seqs]
        batch = pack(HostStep(ids, pos, slots, tables, ends, qlens, rows), self.staging)
        if self.model.length_dependent_rope:
            batch.prompt_lens = torch.tensor(step.prompt_lens, device=self.device)
        if step.token_types:
            batch.token_types = torch.tensor(step.token_types, device=self.device)
        pool = torch.tensor(step.pool_rows, device=self.device) if step.pool_rows else None
        return self.model.forward_device_pooled(self.ops, batch, self.kv_caches, pool, lora)

    def _pool(
        self, plan_seqs: list[ScheduledSeq], step: StepRows, hidden: torch.Tensor | None
    ) -> list[PooledOutput]:
        """Give each embedding request its rows of ``hidden`` (``step.pool_rows``' order);
        returns the vectors of those whose prompt this step completed."""
        at = 0
        for rid, n in step.pool_pieces:
            st = self.requests[rid].pool
            assert st is not None
            if n:
                assert hidden is not None
                st.add(hidden[at : at + n])
            at += n
        done = []
        head, activation = self.model.classifier, self.model.score_activation
        for s in plan_seqs:  # the plan's order
            st = self.requests[s.request_id].pool
            if s.sample and st is not None:
                done.append(pooled_output(s.request_id, st.finish(head, activation)))
        return done

    def _sample(
        self, logits: torch.Tensor, sampled: list[ScheduledSeq]
    ) -> tuple[list[int], list[SampleLogprobs | None]]:
        """The sampled rows' tokens and logprobs (services/worker/sampler.py). A request's rows
        are in position order (several when it verifies drafts): its k-th row samples its output
        token ``num_output_tokens + k``."""
        states, positions, seen = [], [], {}
        for s in sampled:
            st = self.requests[s.request_id]
            k = seen.get(s.request_id, 0)
            seen[s.request_id] = k + 1
            states.append(st)
            positions.append(st.num_output_tokens + k)
        return sampler.sample_rows(logits, states, positions)

    def _finish(self, st: RequestState, token: int) -> FinishReason:
        """Count the new token and say whether the request ends with it."""
        st.num_output_tokens += 1
        n, p = st.num_output_tokens, st.params
        if st.keeps_history:
            st.output_tokens.append(token)
        if st.guide_failed or st.lora_failed:
            return FinishReason.ERROR
        if st.guide is not None and not st.guide.accept(token):
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
