"""OpenAI request -> kvflow ``GenerateRequest``s: pure functions, no I/O, so every mapping rule
(defaults, validation, stop lists, content parts, prompt forms, batches, structured output) is
unit tested without a server."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgspec
from pydantic import BaseModel, ValidationError

from kvflow.services.gateway.errors import APIError, validation_error
from kvflow.services.gateway.guided import structured_output
from kvflow.services.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingBody,
    TokenizeChatRequest,
)
from kvflow.services.gateway.tools import chat_messages, tool_setup
from kvflow.shared.config import Settings
from kvflow.shared.fan_out import ranks, sequences_per_prompt
from kvflow.shared.messages import GenerateRequest, SamplingParams
from kvflow.shared.model_source import (
    DEFAULT_NAME,
    ModelNotFoundError,
    gguf_model_name,
    resolve_model,
)
from kvflow.shared.sampling import (
    FIELDS,
    INT64_MAX,
    INT64_MIN,
    MAX_TOKEN_ID,
    SamplingParamError,
    validate_sampling,
    wire_fields,
)

# vLLM's defaults: completions stop after 16 tokens; chat runs until the context is full,
# which the tokenizer service computes when it receives max_tokens=0 (it knows the prompt).
COMPLETION_DEFAULT_MAX_TOKENS = 16
CHAT_DEFAULT_MAX_TOKENS = 0

B = TypeVar("B", bound=BaseModel)


def parse_json(body: bytes) -> dict[str, Any]:
    """A JSON object body, or a 400 in the OpenAI shape. msgspec's decoder is strict RFC 8259
    JSON: no NaN/Infinity, no lone UTF-16 surrogates (which no message could carry on)."""
    try:
        data = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError) as e:
        raise APIError(400, f"invalid JSON body: {e}", "BadRequestError") from e
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", "BadRequestError")
    return data


def validate_body(cls: type[B], data: dict[str, Any]) -> B:
    try:
        return cls.model_validate(data)
    except (ValidationError, RecursionError) as e:
        if isinstance(e, RecursionError):
            raise APIError(400, "the request body is nested too deeply", "BadRequestError") from e
        raise validation_error(e) from e


def parse_request(cls: type[B], body: bytes) -> B:
    """Decode and validate a JSON body; any problem becomes a 400 in the OpenAI shape."""
    return validate_body(cls, parse_json(body))


def served_model_name(settings: Settings) -> str:
    """The model id the API shows and accepts. The gateway may run where the model file is
    absent (its own container), so when the file cannot be found the name is derived from the
    setting the same way ``resolve_model`` would."""
    if settings.model.served_model_name:
        return settings.model.served_model_name
    try:
        return resolve_model(settings.model.path).name
    except ModelNotFoundError:
        if not settings.model.path:
            return DEFAULT_NAME
        path = Path(settings.model.path)
        return gguf_model_name(path) if path.suffix == ".gguf" else path.name


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", "BadRequestError", param)


@dataclass
class Job:
    """One HTTP generation request, ready to submit: a GenerateRequest per prompt (each to be run
    ``best_of`` times) and what the answer must contain."""

    prompts: list[GenerateRequest]
    n: int = 1
    best_of: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: usage on every chunk
    logprobs: bool = False  # the client asked for sampled tokens' logprobs
    echo: bool = False  # completions: prompt text (and, with logprobs, its logprobs) first;
    # chat: the final message's content first (it has the answer's role)
    role: str = "assistant"  # chat: the answer's role (vLLM: the final message's without
    # add_generation_prompt)
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids
    prompt_logprobs: bool = False  # vLLM's extra: choices carry ``prompt_logprobs``
    # parallel_tool_calls false under "auto": only a choice's first call is answered (as
    # vLLM's maybe_filter_parallel_tool_calls; a forced call's grammar allows only one)
    first_tool_call_only: bool = False

    @property
    def num_sequences(self) -> int:
        return len(self.prompts) * self.best_of


def check_cache_salt(value: object) -> str | None:
    """vLLM's rule: ``cache_salt``, when given, is a non-empty string (400 otherwise)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise bad("cache_salt", "must be a non-empty string if provided")
    return value


def tenant_salt(tenant: str | None, cache_salt: str | None) -> str | None:
    """A request's salt under ``--cache-salt-per-key``: its tenant's id, with the request's own
    ``cache_salt`` after it (combined, never replaced). Tenant ids hold no ``:``, so no salt a
    client chooses can equal another tenant's."""
    if tenant is None:
        return cache_salt
    return tenant if cache_salt is None else f"{tenant}:{cache_salt}"


def salt_job(job: Job, tenant: str | None) -> Job:
    """``job`` with every request salted for ``tenant`` (None: an open API, or the setting
    off: unchanged)."""
    if tenant is not None:
        for gen in job.prompts:
            gen.cache_salt = tenant_salt(tenant, gen.cache_salt)
    return job


def sampling_params(
    req: SamplingBody,
    max_tokens: int,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    n: int = 1,
    best_of: int | None = None,
    settings: Settings | None = None,
    names: dict[str, str] | None = None,
) -> SamplingParams:
    """Validate the body's sampling fields (the feature table of ``shared.sampling``; unset
    means the default) and map them onto SamplingParams. The job decides ``max_tokens`` (0: up
    to the context), ``logprobs``, ``prompt_logprobs``, ``n`` and ``best_of``. ``names``
    renames fields in errors (chat's ``max_completion_tokens``, ``top_logprobs``)."""
    values: dict[str, Any] = {f.name: f.from_body(getattr(req, f.name)) for f in FIELDS if f.body}
    values |= {
        "n": n,
        "best_of": best_of,
        "max_tokens": max_tokens or None,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
    }
    unsupported = req.unsupported()
    if unsupported is not None:
        raise bad(unsupported, "is not supported by kvflow")
    constraint = structured_output(req)
    if constraint is not None and req.allowed_token_ids:
        # the grammar and the list may leave no token at all
        raise bad("allowed_token_ids", f"cannot be combined with {constraint.param}")
    try:
        validate_sampling(**values, max_n=settings.gateway.max_n if settings else None)
    except SamplingParamError as e:
        param = (names or {}).get(e.param, e.param)
        raise bad(param, e.reason) from None
    if req.priority is not None and not INT64_MIN <= req.priority <= INT64_MAX:
        raise bad("priority", "out of range")
    check_cache_salt(req.cache_salt)
    return SamplingParams(**wire_fields(values), structured_output=constraint)


def chat_max_tokens(req: ChatCompletionRequest) -> int:
    """``max_completion_tokens`` (the newer name) wins over ``max_tokens``."""
    if req.max_completion_tokens is not None:
        return req.max_completion_tokens
    if req.max_tokens is not None:
        return req.max_tokens
    return CHAT_DEFAULT_MAX_TOKENS


def _check_max_tokens(value: int | None, param: str) -> None:
    if value is not None and value < 1:
        raise bad(param, f"must be >= 1, got {value}")


def chat_job(
    req: ChatCompletionRequest,
    request_id: str,
    reply_to: str,
    arrival_time: float,
    settings: Settings | None = None,
) -> Job:
    _check_max_tokens(req.max_tokens, "max_tokens")
    _check_max_tokens(req.max_completion_tokens, "max_completion_tokens")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad("top_logprobs", "needs logprobs to be true")
    tools = tool_setup(req.tools, req.tool_choice, req.parallel_tool_calls, settings)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    names = {"logprobs": "top_logprobs"}
    if req.max_completion_tokens is not None:
        names["max_tokens"] = "max_completion_tokens"
    n = 1 if req.n is None else req.n
    params = sampling_params(
        req, chat_max_tokens(req), logprobs, req.prompt_logprobs, n, None, settings, names
    )
    if tools.constraint is not None:
        if params.structured_output is not None:
            p = params.structured_output.param
            raise bad(p, f"cannot be combined with tool_choice {_choice_name(req)}")
        if params.allowed_token_ids:
            raise bad("allowed_token_ids", "cannot be combined with a forced tool call")
        params = msgspec.structs.replace(params, structured_output=tools.constraint)
    add_generation_prompt, continue_final = chat_template_flags(req)
    messages = chat_messages(req.messages)
    # vLLM's rule: the answer's role is the assistant's when a generation prompt opens one,
    # otherwise the final message's (which the answer continues)
    role = "assistant" if add_generation_prompt else messages[-1].role
    gen = GenerateRequest(
        request_id=request_id,
        reply_to=reply_to,
        params=params,
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        arrival_time=arrival_time,
        priority=req.priority or 0,
        truncate_prompt_tokens=req.truncate_prompt_tokens,
        continue_final_message=continue_final,
        cache_salt=req.cache_salt,
        tools=tools.specs,
        tool_parsing=tools.parsing,
        final_only=not req.stream,
    )
    return Job(
        [gen],
        n=n,
        best_of=n,
        stream=bool(req.stream),
        include_usage=req.include_usage(),
        continuous_usage=req.continuous_usage(),
        logprobs=logprobs is not None,
        echo=bool(req.echo) and messages[-1].role == role,
        role=role,
        prompt_logprobs=req.prompt_logprobs is not None,
        tokens_as_ids=bool(req.return_tokens_as_token_ids),
        first_tool_call_only=req.parallel_tool_calls is False,
    )


def _choice_name(req: ChatCompletionRequest) -> str:
    c = req.tool_choice
    return repr(c) if isinstance(c, str) else f"naming {c.function.name!r}" if c else "'auto'"


def chat_template_flags(req: ChatCompletionRequest | TokenizeChatRequest) -> tuple[bool, bool]:
    """``(add_generation_prompt, continue_final_message)``, refusing both at once as vLLM does
    (a new assistant turn cannot also continue the final message)."""
    add, cont = req.add_generation_prompt is not False, bool(req.continue_final_message)
    if add and cont:
        raise bad(
            "continue_final_message",
            "cannot be true together with add_generation_prompt: set add_generation_prompt to "
            "false to continue the final message",
        )
    return add, cont


def prompt_items(value: Any, param: str) -> list[tuple[str | None, list[int] | None]]:
    """``(text, token ids)`` per prompt of a completions ``prompt`` or an embeddings ``input``
    (a string, strings, token ids or token-id lists; one of each pair set); an empty one, an
    empty item and ids outside [0, 2^31) are 400s naming ``param`` (the tokenizer checks the
    vocabulary)."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif value and isinstance(value[0], int):
        items = [value]  # one prompt of token ids
    else:
        items = list(value)  # a batch of strings or of token-id lists
    if not items:
        raise bad(param, "must not be empty")
    out: list[tuple[str | None, list[int] | None]] = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise bad(param, "must not be empty")
            out.append((item, None))
            continue
        ids = list(item)
        if not ids:
            raise bad(param, "must not be empty")
        if any(not 0 <= t <= MAX_TOKEN_ID for t in ids):
            raise bad(param, "token ids must be in [0, 2^31)")
        out.append((None, ids))
    return out


def completion_job(
    req: CompletionRequest,
    request_id: str,
    reply_to: str,
    arrival_time: float,
    settings: Settings | None = None,
) -> Job:
    if req.suffix:
        raise bad("suffix", "is not supported: the served model has no fill-in-the-middle mode")
    _check_max_tokens(req.max_tokens, "max_tokens")
    n = 1 if req.n is None else req.n
    best_of = sequences_per_prompt(n, req.best_of)
    if req.stream and best_of != n:
        raise bad("best_of", "must equal n when streaming (the best choices are known at the end)")
    echo = bool(req.echo)
    # echo with logprobs gives the prompt tokens' logprobs too (the first one null)
    plp = req.prompt_logprobs
    if echo and req.logprobs is not None:
        plp = max(plp or 0, req.logprobs)
    # best_of ranks choices by their cumulative logprob: every sequence needs its logprobs
    logprobs = req.logprobs if req.logprobs is not None or not ranks(n, best_of) else 0
    max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    params = sampling_params(req, max_tokens, logprobs, plp, n, best_of, settings)
    prompts = prompt_items(req.prompt, "prompt")
    limit = settings.gateway.max_request_sequences if settings else None
    if limit and len(prompts) * best_of > limit:
        raise bad(
            "prompt",
            f"{len(prompts)} prompts x {best_of} sequences each is more than this server's "
            f"limit of {limit} sequences per request",
        )
    gens = [
        GenerateRequest(
            request_id=request_id,
            reply_to=reply_to,
            params=params,
            prompt=text,
            prompt_token_ids=ids,
            arrival_time=arrival_time,
            priority=req.priority or 0,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
            cache_salt=req.cache_salt,
            final_only=not req.stream,
        )
        for text, ids in prompts
    ]
    return Job(
        gens,
        n=n,
        best_of=best_of,
        stream=bool(req.stream),
        include_usage=req.include_usage(),
        continuous_usage=req.continuous_usage(),
        logprobs=req.logprobs is not None,
        echo=echo,
        prompt_logprobs=req.prompt_logprobs is not None,
        tokens_as_ids=bool(req.return_tokens_as_token_ids),
    )
