"""Every wire message of kvflow, and nothing else.

Messages are msgspec Structs encoded as msgpack arrays (``array_like=True``): field order is the
wire contract, so new fields are appended last with a default. Each message carries a tag, so a
subject may carry several kinds and one typed decoder (``decode``) reads them all.

Subjects (see ``shared/subjects.py``) and the flow:

    gateway --GenerateRequest--> tokenizer --TokenizedRequest--> scheduler (+ detokenizer)
    scheduler --StepPlan--> worker --StepResult--> scheduler + detokenizer
    detokenizer --DeltaBatch--> gateway inbox;  tokenizer --RequestError--> gateway inbox
    gateway/detokenizer --Abort--> scheduler + detokenizer
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec


class FinishReason(enum.IntEnum):
    """Why a sequence stopped. NONE means it goes on."""

    NONE = 0
    STOP = 1  # EOS, a stop token id or a stop string
    LENGTH = 2  # max_tokens or max_model_len reached
    ABORT = 3  # cancelled by the client or the system
    ERROR = 4

    def openai(self) -> str | None:
        return {1: "stop", 2: "length", 3: "abort", 4: "error"}.get(int(self))


class _Msg(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag_field="k"):
    pass


# ---------------------------------------------------------------------------------------------
# Request parameters (embedded, not sent alone)


class StructuredOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A constraint on the output, enforced while sampling (the worker masks the logits with a
    grammar matcher). ``kind``: "json" (``spec`` is a JSON schema as text), "regex" (a regular
    expression), "choice" (a JSON list of strings) or "grammar" (EBNF, xgrammar's dialect)."""

    kind: str
    spec: str
    param: str = "response_format"  # the request field it came from, for error messages


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Per-request sampling and stopping parameters (vLLM names)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # top logprobs per sampled token (0 = only the sampled one)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    # top logprobs per prompt token (echo); such requests compute their whole prompt, skipping
    # prefix-cache hits, because cached tokens have no logits (vLLM does the same)
    prompt_logprobs: int | None = None
    structured_output: StructuredOutput | None = None  # response_format / guided decoding
    allowed_token_ids: list[int] | None = None  # vLLM's: sample only among these
    # vLLM's bad_words: never generate these words; the tokenizer fills in their token ids
    # (each word with and without a leading space), which the worker bans as sequences
    bad_words: list[str] = []
    bad_words_token_ids: list[list[int]] = []

    def has_penalties(self) -> bool:
        """Whether a presence, frequency or repetition penalty applies."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    def needs_token_history(self) -> bool:
        """Whether sampling looks at the tokens so far (penalties, bad words): the worker is
        then given the request's prompt and outputs (``NewRequest.token_history``)."""
        return self.has_penalties() or bool(self.bad_words_token_ids)


class ChatMessage(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    role: str
    content: str


# ---------------------------------------------------------------------------------------------
# gateway -> tokenizer


class GenerateRequest(_Msg, tag=1):
    """A validated OpenAI request, not yet tokenized."""

    request_id: str
    reply_to: str  # the gateway's inbox subject for DeltaBatch / RequestError
    params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    arrival_time: float = 0.0
    priority: int = 0  # lower runs first (vLLM's convention); FCFS within a priority
    truncate_prompt_tokens: int | None = None  # vLLM's: keep only the prompt's last N tokens
    # vLLM's: the chat template leaves the final (assistant) message open, to be continued
    continue_final_message: bool = False


# ---------------------------------------------------------------------------------------------
# tokenizer -> scheduler and detokenizer


class TokenizedRequest(_Msg, tag=2):
    request_id: str
    reply_to: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    eos_token_ids: list[int] = []
    priority: int = 0


# ---------------------------------------------------------------------------------------------
# anyone -> scheduler and detokenizer


class Abort(_Msg, tag=3):
    """Stop a request and free its blocks. Sent by the gateway (client went away) and by the
    detokenizer (a stop string ended the text)."""

    request_id: str
    reason: FinishReason = FinishReason.ABORT


# ---------------------------------------------------------------------------------------------
# scheduler <-> worker


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
    # every token known so far (prompt, then outputs) when ``params.needs_token_history()``:
    # a worker computes only part of them (prefix-cache hits, KV moved in from a prefill
    # worker or a tier), but penalties and bad words depend on all of them
    token_history: list[int] = []


class ScheduledSeq(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One sequence's share of a step: compute ``token_ids`` at positions
    ``start_pos..start_pos+len-1``, writing their K/V into the slots given by ``block_table``.
    ``sample`` is true when this chunk reaches the end of the sequence's known tokens."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool = True


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
    ``request_ids[i]`` (only sequences that sampled a token appear)."""

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


class WorkerHeartbeat(_Msg, tag=6):
    worker_id: str
    role: str  # "both" | "prefill" | "decode"
    num_blocks: int
    block_size: int
    model: str
    step_subject: str
    max_model_len: int = 0
    kv_subject: str = ""  # where this worker serves KvChunkRequest (its blocks, to other workers)
    kv_layout: str = ""  # dtype and shape of one block; KV moves only between equal layouts
    draining: bool = False  # leaving: finish what runs here, take nothing new
    instance: str = ""  # random per process: the same worker id from a new process is a restart
    redis_tier: str = ""  # "on", "off" (Redis unreachable: blocks are recomputed) or "" (none)
    redis_tier_errors: int = 0  # Redis operations that failed (each may switch the tier off)
    redis_stored_blocks: int = 0  # blocks written to Redis so far
    host_tier_blocks: int = 0  # blocks the host tier holds now
    host_tier_bytes: int = 0  # the host tier's capacity (0: none)


# ---------------------------------------------------------------------------------------------
# detokenizer / tokenizer -> gateway inbox


class TokenLogprob(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One generated token's text and log-probability, with the top alternatives."""

    token: str
    logprob: float
    top: list[tuple[str, float]] = []
    token_id: int = -1
    top_ids: list[int] = []  # the ids of ``top``, same order


class Delta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    text: str
    num_new_tokens: int = 0
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[TokenLogprob] = []  # for the tokens this delta covers, when asked
    # every prompt token (entry 0 has no logprob), on a request's first delta, when asked
    prompt_logprobs: list[PromptTokenLogprob] = []
    # the ids of the tokens generated since the previous delta (one with text held back or
    # without text of its own comes with the next delta sent)
    token_ids: list[int] = []


class PromptTokenLogprob(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One prompt token's id, text and log-probability given the tokens before it (None for
    the first token), its rank, and the top alternatives as (id, text, logprob), best first."""

    token_id: int
    token: str
    logprob: float | None = None
    rank: int = 0
    top: list[tuple[int, str, float]] = []


class DeltaBatch(_Msg, tag=7):
    deltas: list[Delta]


class RequestError(_Msg, tag=8):
    """A request that cannot be served, in the OpenAI error shape's terms."""

    request_id: str
    message: str
    type: str = "BadRequestError"
    param: str | None = None
    code: int = 400


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


# ---------------------------------------------------------------------------------------------
# KV block transfer between workers (disaggregated prefill -> decode)
#
#   scheduler --KvPull--> decode worker (its step subject)
#   decode worker --KvChunkRequest--> prefill worker's kv subject (request/reply) --KvChunk-->
#   decode worker --KvTransferDone--> scheduler


class KvPull(_Msg, tag=11):
    """Fetch the K/V of ``src_blocks`` on worker ``src_worker`` into this worker's
    ``dst_blocks`` (pairwise), then report KvTransferDone."""

    transfer_id: str
    request_id: str
    src_worker: str
    src_subject: str  # the source's kv subject
    src_blocks: list[int]
    dst_blocks: list[int]
    epoch: int = 0


class KvChunkRequest(_Msg, tag=12):
    """Layers ``[layer_start, layer_end)`` of one block (K then V of each layer)."""

    transfer_id: str
    block: int
    layer_start: int
    layer_end: int


class KvChunk(_Msg, tag=13):
    """The reply to a KvChunkRequest: raw bytes in the source's ``kv_layout``, with their
    CRC-32 so the receiver can tell a damaged chunk from a good one."""

    transfer_id: str
    block: int
    layer_start: int
    layer_end: int
    data: bytes = b""
    crc32: int = 0
    kv_layout: str = ""
    error: str | None = None


class KvTransferDone(_Msg, tag=14):
    transfer_id: str
    request_id: str
    worker_id: str  # the receiving (decode) worker
    ok: bool
    num_bytes: int = 0
    seconds: float = 0.0
    error: str | None = None


class WorkerRelease(_Msg, tag=15):
    """scheduler -> a draining worker: nothing of yours is running or needed any more; exit."""

    worker_id: str


class KvLoad(_Msg, tag=17):
    """scheduler -> worker: fill ``blocks`` (in order) from the KV tiers, from the host tier or
    Redis, by their hashes; stop at the first block found in neither; report KvLoadDone."""

    load_id: str
    request_id: str
    blocks: list[BlockRef]
    epoch: int = 0


class KvLoadDone(_Msg, tag=18):
    load_id: str
    request_id: str
    worker_id: str
    num_loaded: int  # leading blocks of the order now holding their content
    host_hits: int = 0
    redis_hits: int = 0
    num_bytes: int = 0
    seconds: float = 0.0


class Accepted(_Msg, tag=16):
    """scheduler -> gateway inbox: the request is queued (or was already). Until it comes, the
    gateway resubmits with the same id; the scheduler runs each id once."""

    request_id: str


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


# ---------------------------------------------------------------------------------------------
# gateway <-> tokenizer, request/reply (the /tokenize and /detokenize endpoints, echo of token-id
# prompts). Errors come back as RequestError with an empty request_id. Tags from 20 on.


class TokenizeRequest(_Msg, tag=20):
    """Token ids of a text prompt, or of chat messages through the chat template."""

    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    return_token_strs: bool = False
    continue_final_message: bool = False


class TokenizeResult(_Msg, tag=21):
    tokens: list[int]
    max_model_len: int
    token_strs: list[str] | None = None


class DetokenizeRequest(_Msg, tag=22):
    tokens: list[int]


class DetokenizeResult(_Msg, tag=23):
    prompt: str


# ---------------------------------------------------------------------------------------------
# metrics, scatter-gather (the gateway's /metrics serves the whole stack). Tags from 30 on.


class MetricsRequest(_Msg, tag=30):
    """Sent on ``kvflow.metrics`` with a reply subject: every service instance answers with a
    MetricsReport."""


class MetricsReport(_Msg, tag=31):
    """One service instance's Prometheus text exposition (what its /metrics serves)."""

    service: str  # gateway | tokenizer | scheduler | worker | detokenizer
    instance: str  # unique per process
    text: bytes


class Ping(_Msg, tag=32):
    """Sent on ``kvflow.ping.<service>`` (request/reply, the service's queue group): one ready
    instance of that service answers with a Pong. The gateway's /health asks the services that
    have no other request/reply (tokenizer, detokenizer) whether one of them is there."""


class Pong(_Msg, tag=33):
    service: str
    instance: str


Message = (
    GenerateRequest
    | TokenizedRequest
    | Abort
    | StepPlan
    | StepResult
    | WorkerHeartbeat
    | DeltaBatch
    | RequestError
    | StatsRequest
    | SchedulerStats
    | KvPull
    | KvChunkRequest
    | KvChunk
    | KvTransferDone
    | WorkerRelease
    | Accepted
    | KvLoad
    | KvLoadDone
    | TokenizeRequest
    | TokenizeResult
    | DetokenizeRequest
    | DetokenizeResult
    | MetricsRequest
    | MetricsReport
    | Ping
    | Pong
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Any) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """Decode any kvflow message; raises ``msgspec.DecodeError`` or ``ValidationError``."""
    return _decoder.decode(data)
