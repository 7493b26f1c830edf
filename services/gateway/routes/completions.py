"""The OpenAI generation routes: /v1/chat/completions, /v1/completions, and vLLM's legacy
/generate; ``generate`` is the path they (and /v1/responses) share: auth, body, job, response
format, then generation.serve. A model served for another task than generate (an embedding
model, a classifier) answers them with a 400 naming its task."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from kvflow.services.gateway.convert import (
    Job,
    chat_job,
    completion_job,
    new_request_id,
    parse_request,
    salt_job,
)
from kvflow.services.gateway.errors import APIError
from kvflow.services.gateway.generation import CLIENT_CLOSED, UsageCallback, serve
from kvflow.services.gateway.legacy import legacy_generate
from kvflow.services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from kvflow.services.gateway.responses import ChatFormat, CompletionFormat, Format
from kvflow.services.gateway.routes.common import (
    GENERATION_ERRORS,
    STREAM_CONTENT,
    Gateway,
    authorized_body,
    require_task,
    tenant,
)
from kvflow.services.gateway.schemas import STREAM_NOTE, ChatCompletionResponse, CompletionResponse
from kvflow.services.gateway.state import GatewayState
from kvflow.services.gateway.tracing import RequestTrace
from kvflow.shared.config import Settings
from kvflow.shared.messages import DetokenizeRequest, DetokenizeResult

router = APIRouter()

# a body model -> Job conversion of convert.py / responses_api.py: (body, request id, inbox,
# arrival time, settings) -> Job
JobFactory = Callable[[Any, str, str, float, Settings], Job]


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    responses={200: {"content": STREAM_CONTENT, "description": STREAM_NOTE}, **GENERATION_ERRORS},
)
async def chat_completions(request: Request, state: Gateway) -> Response:
    return await generate(
        request,
        state,
        "/v1/chat/completions",
        ChatCompletionRequest,
        "chatcmpl",
        chat_job,
        ChatFormat,
    )


@router.post(
    "/v1/completions",
    response_model=CompletionResponse,
    responses={200: {"content": STREAM_CONTENT, "description": STREAM_NOTE}, **GENERATION_ERRORS},
)
async def completions(request: Request, state: Gateway) -> Response:
    return await generate(
        request,
        state,
        "/v1/completions",
        CompletionRequest,
        "cmpl",
        completion_job,
        CompletionFormat,
    )


@router.post("/generate", responses=GENERATION_ERRORS)
async def generate_legacy(request: Request, state: Gateway) -> Response:
    """vLLM's legacy API server endpoint: ``{"prompt", "n", "use_beam_search", ...}`` ->
    ``{"text": [...]}`` (services/gateway/legacy.py)."""
    key, body = await authorized_body(request, state)
    if body is None:
        return Response(status_code=CLIENT_CLOSED)
    await require_task(state, "generate", "/generate")
    return await legacy_generate(request, state, body, tenant(state, key))


async def generate(
    request: Request,
    state: GatewayState,
    route: str,
    model_cls: type[BaseModel],
    prefix: str,
    make_job: JobFactory,
    fmt_cls: type[Format],
) -> Response:
    """One generation route: auth, body, parse (``model_cls``), job (``make_job``), response
    format (``fmt_cls``), serve; traced as ``route``, ids ``<prefix>-<hex>``."""
    trace = RequestTrace(route, request.headers, state.model_name)
    try:
        key, body = await authorized_body(request, state)
        if body is None:
            trace.end(CLIENT_CLOSED, "client closed")
            return Response(status_code=CLIENT_CLOSED)
        req = parse_request(model_cls, body)
        model, lora = await state.resolve_model(req.model)
        await require_task(state, "generate", route)
        rid = new_request_id(prefix)
        job = make_job(req, rid, state.inbox, time.time(), state.settings)
        salt_job(job, tenant(state, key))
        for gen in job.prompts:
            gen.lora = lora
        fmt = fmt_cls(rid, model, include_usage=job.include_usage)
        fmt.with_logprobs, fmt.with_prompt_logprobs = job.logprobs, job.prompt_logprobs
        fmt.role, fmt.tokens_as_ids = job.role, job.tokens_as_ids
        fmt.take_request(req)
        texts = await echo_texts(state, job)
        return await serve(request, state, job, fmt, texts, usage_recorder(state, key), trace)
    except BaseException as e:
        trace.end(getattr(e, "status", 500), getattr(e, "message", type(e).__name__))
        raise


async def echo_texts(state: GatewayState, job: Job) -> list[str] | None:
    """The text each prompt echoes: as given, decoded from its token ids, or (chat) the final
    message's content."""
    if not job.echo:
        return None
    out = []
    for gen in job.prompts:
        if gen.messages:
            out.append(gen.messages[-1].content)
        elif gen.prompt is not None:
            out.append(gen.prompt)
        else:
            msg = DetokenizeRequest(list(gen.prompt_token_ids or []))
            try:
                res = await state.tokenizer_call(msg, DetokenizeResult)
            except APIError as e:
                if e.status == 400:
                    e.param, e.message = "prompt", e.message.replace("tokens", "prompt", 1)
                raise
            out.append(res.prompt)
    return out


def usage_recorder(state: GatewayState, key: str | None) -> UsageCallback | None:
    """What records a request's tokens against its API key when it closes (none without keys)."""
    if key is None:
        return None
    return lambda prompt, completion: state.auth.record(key, prompt, completion)
