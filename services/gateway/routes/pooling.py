"""What the pooling routes share (/v1/embeddings, /score, /rerank, /classify): a body becomes
N pipeline requests (``<id>-<i>``, at most ``--max-request-sequences``), each a prefill whose
pooled output comes back as its one final delta (``Delta.embedding``: little-endian float32,
the vector, the class probabilities or the one score); the route waits for all of them and
makes its answer from those deltas.

``pooling_route`` is the whole path of such a route around its ``Planner`` (what makes the
body into requests and the deltas into the answer): auth, body, ids, tenant salt, tracing,
submission, the client's disconnect (every unfinished request aborted), metrics per pipeline
request and usage per API key, as the generation routes count them."""

from __future__ import annotations

import asyncio
import time
from array import array
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from kvflow.services.gateway.cancel import run_or_disconnect
from kvflow.services.gateway.convert import bad, new_request_id, tenant_salt
from kvflow.services.gateway.errors import APIError
from kvflow.services.gateway.generation import CLIENT_CLOSED
from kvflow.services.gateway.metrics import RequestTimer
from kvflow.services.gateway.routes.common import Gateway, authorized_body, json_response, tenant
from kvflow.services.gateway.routes.completions import usage_recorder
from kvflow.services.gateway.schemas import error_responses
from kvflow.services.gateway.state import GatewayState
from kvflow.services.gateway.streams import RequestHandle
from kvflow.services.gateway.tracing import RequestTrace
from kvflow.shared.config import Settings
from kvflow.shared.messages import Delta, GenerateRequest, LoRARef, PoolingParams, SamplingParams
from kvflow.shared.sampling import MAX_TOKEN_ID

POOLING_ERRORS = error_responses(400, 401, 404, 413, 429, 500, 503, 504)


class PoolingInput(NamedTuple):
    """One pipeline request's input: a text or token ids, and a cross-encoder's second text."""

    text: str | None
    ids: list[int] | None = None
    pair: str | None = None


@dataclass
class PoolingJob:
    """A body made into pipeline requests, and how their final deltas (in request order)
    become the route's JSON answer; ``lora``: the adapter the body's ``model`` names."""

    requests: list[GenerateRequest]
    answer: Callable[[list[Delta]], dict[str, Any]]
    lora: LoRARef | None = None


# (state, body, request id, tenant salt, route path) -> the job; its 400s, 404s and 503s
# (model_info) end the request before anything is submitted
Planner = Callable[[GatewayState, bytes, str, str | None, str], Awaitable[PoolingJob]]


def check_truncate(keep: int | None) -> int | None:
    """vLLM's ``truncate_prompt_tokens``: -1 (the model's length) or N >= 1 (keep N tokens)."""
    if keep is not None and (keep == 0 or not -1 <= keep <= MAX_TOKEN_ID):
        raise bad("truncate_prompt_tokens", "must be -1 (the model length) or >= 1")
    return keep


def pooling_requests(
    inputs: list[PoolingInput],
    pooling: PoolingParams,
    request_id: str,
    reply_to: str,
    settings: Settings,
    salt: str | None,
    keep: int | None,
    param: str,
) -> list[GenerateRequest]:
    """One pipeline request per input (ids ``<request_id>-<i>``); more than
    ``--max-request-sequences`` is a 400 naming ``param``."""
    limit = settings.gateway.max_request_sequences
    if len(inputs) > limit:
        raise bad(
            param,
            f"{len(inputs)} inputs to compute; at most {limit} per request "
            "(--max-request-sequences)",
        )
    now = time.time()
    return [
        GenerateRequest(
            request_id=f"{request_id}-{i}",
            reply_to=reply_to,
            params=SamplingParams(max_tokens=1),
            prompt=x.text,
            prompt_token_ids=x.ids,
            arrival_time=now,
            truncate_prompt_tokens=keep,
            cache_salt=salt,
            pooling=pooling,
            prompt_pair=x.pair,
        )
        for i, x in enumerate(inputs)
    ]


def floats(delta: Delta) -> list[float]:
    """A pooled output's values (the worker's little-endian float32 bytes; hosts are too)."""
    return array("f", delta.embedding).tolist()


def prompt_tokens(deltas: list[Delta]) -> int:
    return sum(d.prompt_tokens for d in deltas)


def add_pooling_routes(
    router: APIRouter,
    paths: tuple[str, ...],
    name: str,
    prefix: str,
    plan: Planner,
    response_model: type[BaseModel],
) -> None:
    """POST ``paths`` (aliases of one API, e.g. /score and /v1/score) on ``router``, each
    traced and named in its errors as itself; request ids ``<prefix>-<hex>``."""
    for path in paths:
        router.add_api_route(
            path,
            _handler(path, prefix, plan),
            methods=["POST"],
            name=name,
            response_model=response_model,
            responses=POOLING_ERRORS,
        )


def _handler(route: str, prefix: str, plan: Planner) -> Callable[..., Awaitable[Response]]:
    async def handler(request: Request, state: Gateway) -> Response:
        return await pooling_route(request, state, route, prefix, plan)

    return handler


async def pooling_route(
    request: Request, state: GatewayState, route: str, prefix: str, plan: Planner
) -> Response:
    """One pooling request from auth to answer (499 when the client left)."""
    trace = RequestTrace(route, request.headers, state.model_name)
    status, error, tokens = 200, None, 0
    try:
        key, body = await authorized_body(request, state)
        if body is None:
            status, error = CLIENT_CLOSED, "client closed"
            return Response(status_code=CLIENT_CLOSED)
        rid = new_request_id(prefix)
        job = await plan(state, body, rid, tenant_salt(tenant(state, key), None), route)
        for gen in job.requests:
            gen.lora = job.lora
        trace.started(rid, False, len(job.requests))
        deltas = await _serve(request, state, job.requests, trace, key)
        if deltas is None:
            status, error = CLIENT_CLOSED, "aborted before the end"
            return Response(status_code=CLIENT_CLOSED)
        tokens = prompt_tokens(deltas)
        return json_response(job.answer(deltas))
    except BaseException as e:
        status, error = getattr(e, "status", 500), getattr(e, "message", type(e).__name__)
        raise
    finally:
        trace.end(status, error, tokens)


async def _outputs(
    handles: list[RequestHandle], timers: list[RequestTimer], tokens: list[int]
) -> list[Delta]:
    """Each request's one final delta (an error of any fails the whole body); ``tokens`` gets
    each request's prompt tokens as its output arrives."""

    async def one(i: int) -> Delta:
        delta = await handles[i].next()
        if delta.finish_reason == "error" or not delta.embedding:
            raise APIError(500, "the pooling request failed in the pipeline", "InternalServerError")
        tokens[i] = delta.prompt_tokens
        timers[i].finished("stop", delta.prompt_tokens, 0)
        return delta

    tasks = [asyncio.ensure_future(one(i)) for i in range(len(handles))]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()


async def _serve(
    request: Request,
    state: GatewayState,
    gens: list[GenerateRequest],
    trace: RequestTrace,
    key: str | None,
) -> list[Delta] | None:
    """Submit every request and wait for their outputs (None: the client left); every handle
    is closed at the end, which aborts what did not finish."""
    handles: list[RequestHandle] = []
    timers = [state.metrics.request_timer() for _ in gens]
    tokens = [0] * len(gens)
    headers = trace.headers()
    failed_status = 0
    try:
        for gen in gens:
            handles.append(await state.submit(gen, headers))
        work = _outputs(handles, timers, tokens)
        disconnected, deltas = await run_or_disconnect(request, work)
        return None if disconnected else deltas
    except APIError as e:
        failed_status = e.status
        raise
    finally:
        for h, timer in zip(handles, timers, strict=False):
            if not h.finished and not 400 <= failed_status < 500:
                timer.finished("abort", 0, 0)  # counted as the generation routes count aborts
            h.close()  # aborts a request whose output did not come
        record = usage_recorder(state, key)
        if record is not None:
            record(sum(tokens), 0)
