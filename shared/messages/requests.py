"""A request's way in: gateway -> tokenizer -> scheduler and detokenizer, aborts, errors, acceptance,
and the tokenizer's request/reply endpoints."""

from __future__ import annotations

from kvflow.shared.messages.base import FinishReason, _Msg
from kvflow.shared.messages.params import (
    ChatMessage,
    LoRARef,
    PoolingParams,
    SamplingParams,
    ToolParsing,
    ToolSpec,
)

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
    # vLLM's: mixed into the root of the prompt's chained block hashes, so only requests with
    # the same salt share prefix-cache (and KV tier) blocks; with --cache-salt-per-key the
    # gateway puts the API key's tenant id in front ("<tenant>:<salt>")
    cache_salt: str | None = None
    tools: list[ToolSpec] = []  # offered to the model: the chat template renders them
    tool_parsing: ToolParsing | None = None  # how the detokenizer finds calls in the text
    # set: an embedding request (/v1/embeddings, LLM.embed): the prompt's pooled hidden state
    # comes back (Delta.embedding) instead of generated tokens; ``params`` is unused
    pooling: PoolingParams | None = None
    lora: LoRARef | None = None  # the adapter the request's ``model`` names (None: the base)
    # a cross-encoder's text pair (/score, /rerank): ``prompt`` and this, tokenized as one input
    # the way the model's tokenizer joins two texts (token type 1 for the second)
    prompt_pair: str | None = None
    # the client reads each delta's ``token_ids`` (the Python API does; the HTTP API has no use
    # for them): without it the detokenizer leaves them out, per-token bytes saved on every hop
    return_token_ids: bool = False
    # the client reads only the whole output (a request not streamed, the Python API): the
    # detokenizer sends its first delta (the time to the first token) and then only the final
    # one, as vLLM's RequestOutputKind.FINAL_ONLY (no message, wake-up or merge per token)
    final_only: bool = False


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
    cache_salt: str | None = None  # GenerateRequest's, carried on to the scheduler
    tool_parsing: ToolParsing | None = None  # GenerateRequest's, for the detokenizer
    pooling: PoolingParams | None = None  # GenerateRequest's: an embedding request
    lora: LoRARef | None = None  # GenerateRequest's
    return_token_ids: bool = False  # GenerateRequest's, for the detokenizer
    final_only: bool = False  # GenerateRequest's, for the detokenizer


# ---------------------------------------------------------------------------------------------
# anyone -> scheduler and detokenizer


class Abort(_Msg, tag=3):
    """Stop a request and free its blocks. Sent by the gateway (client went away) and by the
    detokenizer (a stop string ended the text)."""

    request_id: str
    reason: FinishReason = FinishReason.ABORT


class RequestError(_Msg, tag=8):
    """A request that cannot be served, in the OpenAI error shape's terms."""

    request_id: str
    message: str
    type: str = "BadRequestError"
    param: str | None = None
    code: int = 400


class Accepted(_Msg, tag=16):
    """scheduler -> gateway inbox: the request is queued (or was already). Until it comes, the
    gateway resubmits with the same id; the scheduler runs each id once."""

    request_id: str


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
    tools: list[ToolSpec] = []  # vLLM's /tokenize takes a chat request's tools too


class TokenizeResult(_Msg, tag=21):
    tokens: list[int]
    max_model_len: int
    token_strs: list[str] | None = None


class DetokenizeRequest(_Msg, tag=22):
    tokens: list[int]


class DetokenizeResult(_Msg, tag=23):
    prompt: str


class ModelInfoRequest(_Msg, tag=24):
    """What the served model is for (the gateway asks once: it may run without the model)."""


class ModelInfo(_Msg, tag=25):
    """The served model's task (shared/models/tasks.py ``ServedTask``): ``task`` generate |
    embed | classify | score; ``labels``: a classifier's class names by index; ``max_model_len``
    the longest input."""

    task: str
    max_model_len: int
    labels: list[str] = []
