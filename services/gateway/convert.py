"""OpenAI request -> kvflow ``GenerateRequest``: pure functions, no I/O, so every mapping rule
(defaults, stop lists, content parts, prompt forms) is unit tested without a server."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from services.gateway.errors import APIError, validation_error
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest, SamplingBody
from shared.config import Settings
from shared.messages import ChatMessage, GenerateRequest, SamplingParams
from shared.model_source import DEFAULT_NAME, ModelNotFoundError, gguf_model_name, resolve_model

# vLLM's defaults: completions stop after 16 tokens; chat runs until the context is full,
# which the tokenizer service computes when it receives max_tokens=0 (it knows the prompt).
COMPLETION_DEFAULT_MAX_TOKENS = 16
CHAT_DEFAULT_MAX_TOKENS = 0

B = TypeVar("B", bound=BaseModel)


def parse_request(cls: type[B], body: bytes) -> B:
    """Decode and validate a JSON body; any problem becomes a 400 in the OpenAI shape."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"invalid JSON body: {e}", "BadRequestError") from e
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", "BadRequestError")
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from e


def served_model_name(settings: Settings) -> str:
    """The model id the API shows and accepts. The gateway may run where the model file is
    absent (its own container), so when the file cannot be found the name is derived from the
    setting the same way ``resolve_model`` would."""
    if settings.served_model_name:
        return settings.served_model_name
    try:
        return resolve_model(settings.model).name
    except ModelNotFoundError:
        if not settings.model:
            return DEFAULT_NAME
        path = Path(settings.model)
        return gguf_model_name(path) if path.suffix == ".gguf" else path.name


def check_model(requested: str | None, served: str) -> str:
    """The served name, if the request asked for it (or for nothing); else 404."""
    if requested and requested != served:
        raise APIError(
            404,
            f"The model `{requested}` does not exist. This server serves `{served}`.",
            "NotFoundError",
            "model",
        )
    return served


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sampling_params(
    req: SamplingBody, max_tokens: int, logprobs: int | None = None
) -> SamplingParams:
    """Map the OpenAI/vLLM fields onto SamplingParams; ``None`` means the default."""
    top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0  # -1 and 0: off
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=top_k,
        min_p=req.min_p or 0.0,
        seed=req.seed,
        stop=req.stop_list(),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=bool(req.ignore_eos),
        min_tokens=req.min_tokens or 0,
        skip_special_tokens=req.skip_special_tokens is not False,
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logprobs=logprobs,
        logit_bias=dict(req.logit_bias) if req.logit_bias else None,
    )


def chat_max_tokens(req: ChatCompletionRequest) -> int:
    """``max_completion_tokens`` (the newer name) wins over ``max_tokens``."""
    return req.max_completion_tokens or req.max_tokens or CHAT_DEFAULT_MAX_TOKENS


def chat_to_generate(
    req: ChatCompletionRequest, request_id: str, reply_to: str, arrival_time: float
) -> GenerateRequest:
    messages = [
        ChatMessage("system" if m.role == "developer" else m.role, m.text()) for m in req.messages
    ]
    return GenerateRequest(
        request_id=request_id,
        reply_to=reply_to,
        params=sampling_params(req, chat_max_tokens(req), req.logprobs_count()),
        messages=messages,
        arrival_time=arrival_time,
        priority=req.priority or 0,
    )


def completion_prompt(req: CompletionRequest) -> tuple[str | None, list[int] | None]:
    """``(prompt, prompt_token_ids)``: one of them set. Batched prompts are refused, as one
    request carries one sequence through the pipeline."""
    p = req.prompt
    empty = APIError(400, "prompt must not be empty", "BadRequestError", "prompt")
    if isinstance(p, list) and p and not isinstance(p[0], int):
        if len(p) > 1:
            raise APIError(
                400,
                f"batched prompts are not supported ({len(p)} prompts given); "
                "send one request per prompt",
                "BadRequestError",
                "prompt",
            )
        p = p[0]  # a list of one string, or of one list of token ids
    if isinstance(p, str):
        if not p:
            raise empty
        return p, None
    ids = [int(t) for t in p]  # type: ignore[arg-type]
    if not ids:
        raise empty
    if any(t < 0 for t in ids):
        raise APIError(400, "token ids must not be negative", "BadRequestError", "prompt")
    return None, ids


def completion_to_generate(
    req: CompletionRequest, request_id: str, reply_to: str, arrival_time: float
) -> GenerateRequest:
    prompt, ids = completion_prompt(req)
    max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    return GenerateRequest(
        request_id=request_id,
        reply_to=reply_to,
        params=sampling_params(req, max_tokens, req.logprobs_count()),
        prompt=prompt,
        prompt_token_ids=ids,
        arrival_time=arrival_time,
        priority=req.priority or 0,
    )
