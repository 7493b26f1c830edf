"""Scheduler <-> worker: step plans and results, heartbeats, release, and the scheduler's stats."""

from __future__ import annotations

import msgspec

from kvflow.shared.messages.base import _Msg
from kvflow.shared.messages.params import LoRARef, PoolingParams, SamplingParams

# scheduler <-> worker

# Async scheduling: a plan is built while the step before it still runs, so the token that step
# samples is not known yet. In ``ScheduledSeq.token_ids`` it is this value, and the worker fills
# in the token it sampled for the request in the step before (services/worker/placeholders.py).
PLACEHOLDER = -1


class NewRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Sent once, in the first plan that schedules a request on a worker (or again after a
    preemption): what the worker keeps while the request lives there."""

    request_id: str
    params: SamplingParams
    prompt_len: int
    num_output_tokens: int = 0  # >0 when resumed after a preemption
    eos_token_ids: list[int] = []
    # W3C traceparent of the request's scheduler span: the worker's spans for this request
    # (prefill, decode) are its children ("" when the request is not traced)
    traceparent: str = ""
    # every token known so far (prompt, then outputs) when sampling needs it (shared/sampling
    # ``needs_token_history``): a worker computes only part of them (prefix-cache hits, KV
    # moved in from a prefill worker or a tier), but penalties and bad words depend on all
    token_history: list[int] = []
    # an embedding request: pool the prompt's hidden states instead of sampling (its chunk
    # with ``sample`` set is the one that completes the prompt)
    pooling: PoolingParams | None = None
    # the LoRA adapter every chunk of this request runs with (None: the base model alone)
    lora: LoRARef | None = None


class ScheduledSeq(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One sequence's share of a step: compute ``token_ids`` at positions
    ``start_pos..start_pos+len-1``, writing their K/V into the slots given by ``block_table``.
    ``sample`` is true when this chunk reaches the end of the sequence's known tokens.
    Trailing ``PLACEHOLDER`` entries are tokens the worker sampled in the step before.

    Plans carry differences: with ``block_table_from`` >= 0, ``block_table`` holds only the
    request's blocks from that index on, and the worker keeps the ones before from the plans it
    ran (services/worker/block_tables.py); -1 (a request new to the worker) sends it whole."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool = True
    # speculative decoding: the last ``num_draft`` of ``token_ids`` are proposed tokens, not
    # known ones; the worker samples after every token of the chunk and returns the drafts its
    # model agrees with plus its own next token (several StepResult entries for the request)
    num_draft: int = 0
    # speculative decoding with a draft model: the worker's draft model proposes this many
    # tokens after ``token_ids`` (the block table has room for them), then verifies them
    num_propose: int = 0
    block_table_from: int = -1


class SampleLogprobs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Log-probabilities (of the model's raw distribution, as vLLM) for one sampled token."""

    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class StepPlan(_Msg, tag=4):
    step_id: int
    seqs: list[ScheduledSeq]
    new_requests: list[NewRequest] = []
    finished_request_ids: list[str] = []  # the worker drops what it kept for these
    # the scheduler leader's term: a worker drops what it kept when a new term starts and
    # ignores plans of older terms (a deposed leader that does not know it yet)
    epoch: int = 0
    # KV tiers: blocks the block manager evicts with this plan (copy them to the host tier
    # before the step overwrites them), and full blocks this step computes (store them in Redis)
    offload: list[BlockRef] = []
    store: list[BlockRef] = []


class BlockRef(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A worker's KV block and the prefix hash that identifies its content."""

    block: int
    hash: bytes


class StepResult(_Msg, tag=5):
    """One message per worker step for the whole batch, columnar: entry i of each list belongs to
    ``request_ids[i]`` (only sequences that sampled a token appear). A request that verified
    draft tokens (speculative decoding) has one entry per token it got, consecutive and in
    order; only its last entry may carry a finish reason."""

    worker_id: str
    step_id: int
    request_ids: list[str]
    token_ids: list[int]
    finish_reasons: list[int]
    num_computed_tokens: int = 0  # tokens run through the model in this step
    step_time_s: float = 0.0
    error: str | None = None
    logprobs: list[SampleLogprobs | None] = []  # per entry, only when some request asked
    prompt_logprobs: list[PromptLogprobs] = []  # prompt positions computed in this step, if asked
    # per entry: the request's output tokens counting this one, so a token that a re-run step
    # produces again (after a failure) is recognised and dropped downstream
    num_output_tokens: list[int] = []
    epoch: int = 0  # the plan's
    host_tier_evicted: list[bytes] = []  # block hashes the host tier dropped (LRU) this step
    # embedding requests whose prompt this step completed: their pooled vectors (such
    # requests have no entry in ``request_ids``; a vector ends its request)
    embeddings: list[PooledOutput] = []


class StepVoid(_Msg, tag=44):
    """scheduler -> detokenizers and standby schedulers (on ``kvflow.results``): steps of a
    worker given up (silent past ``--worker-timeout``, or a step lost), whose sequences are
    recomputed elsewhere. A result of one of them that arrives later (the worker was frozen,
    not dead) is dropped: nothing it computed for sequences that moved is streamed."""

    worker_id: str
    epoch: int
    step_ids: list[int]


# StepResult.error of a plan from an older scheduler term (the deposed leader stops on it)
STALE_EPOCH_ERROR = "stale scheduler term"


class PromptLogprobs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Log-probabilities of prompt tokens ``start..start+len-1`` (each given the tokens before
    it; position 0 has none), with their ranks and the top ``prompt_logprobs`` alternatives. A
    prompt computed in chunks comes in several pieces; one recomputed after a preemption may
    come again (same values, same positions)."""

    request_id: str
    start: int
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]  # 1 = the most likely token
    top_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []


class PooledOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """An embedding request's vector: ``data`` is little-endian float32 (``dim`` values), the
    layout of OpenAI's base64 encoding, so it passes to the client without conversion."""

    request_id: str
    data: bytes
    dim: int = 0


class WorkerHeartbeat(_Msg, tag=6):
    worker_id: str
    role: str  # "both" | "prefill" | "decode"
    num_blocks: int
    block_size: int
    model: str
    step_subject: str
    max_model_len: int = 0
    kv_address: str = ""  # where this worker serves its blocks (opaque; the KV connector's)
    kv_layout: str = ""  # dtype and shape of one block; KV moves only between equal layouts
    draining: bool = False  # leaving: finish what runs here, take nothing new
    instance: str = ""  # random per process: the same worker id from a new process is a restart
    redis_tier: str = ""  # "on", "off" (Redis unreachable: blocks are recomputed) or "" (none)
    redis_tier_errors: int = 0  # Redis operations that failed (each may switch the tier off)
    redis_stored_blocks: int = 0  # blocks written to Redis so far
    host_tier_blocks: int = 0  # blocks the host tier holds now
    host_tier_bytes: int = 0  # the host tier's capacity (0: none)
    tensor_parallel_size: int = 1  # ranks the worker's model is split over
    # progress, so a slow step is not taken for a lost one: the step being computed now (0:
    # none) and its scheduler term, and since when (seconds, the worker's own clock)
    step_id: int = 0
    step_epoch: int = 0
    step_seconds: float = 0.0
    # plans received and not started yet, and the last step finished here: an idle worker with
    # nothing queued did not get a plan sent well before, or its result was lost on the way
    # (a NATS node failed): the scheduler recomputes it without waiting for --step-timeout
    queued_plans: int = 0
    last_step_id: int = 0
    last_step_epoch: int = 0


class WorkerRelease(_Msg, tag=15):
    """scheduler -> a draining worker: nothing of yours is running or needed any more; exit."""

    worker_id: str


class WorkerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    worker_id: str
    role: str
    num_blocks: int
    num_free_blocks: int
    num_running: int
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_prefills: int = 0  # requests routed here for their prefill
    num_decodes: int = 0  # requests routed here for their decode
    draining: bool = False
    redis_tier: str = ""
    redis_tier_errors: int = 0
    redis_stored_blocks: int = 0
    host_tier_blocks: int = 0
    tensor_parallel_size: int = 1


# ---------------------------------------------------------------------------------------------
# scheduler stats (request/reply)


class StatsRequest(_Msg, tag=9):
    pass


class SchedulerStats(_Msg, tag=10):
    num_workers: int
    num_total_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    num_finished: int = 0
    num_preemptions: int = 0
    model: str = ""
    max_model_len: int = 0
    num_computed_tokens: int = 0  # tokens run through the model, all workers (prefix hits skip)
    prefix_cache_queries: int = 0  # full blocks looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which found
    workers: list[WorkerStats] = []
    kv_transfers: int = 0  # finished KV block transfers between workers
    kv_transfer_failures: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: float = 0.0  # summed over transfers (each from order to done)
    scheduler_id: str = ""  # the leader that answered
    epoch: int = 0  # its term
    tier_loads: int = 0  # KvLoad orders completed
    tier_host_hits: int = 0  # blocks loaded from a worker's host tier instead of recomputed
    tier_redis_hits: int = 0  # blocks loaded from Redis instead of recomputed
    tier_misses: int = 0  # blocks ordered but found in no tier (then recomputed)
    tier_bytes: int = 0
    tier_load_seconds: float = 0.0
    tier_offloaded_blocks: int = 0  # evicted blocks sent to host tiers
