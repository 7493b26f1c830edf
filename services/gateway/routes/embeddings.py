"""POST /v1/embeddings (OpenAI's, with vLLM's extras): one pipeline request per input, each
computed as a prefill whose pooled final hidden state comes back instead of tokens (see
docs/architecture.md, "Embeddings").

``input`` is a string, a list of strings, a list of token ids or a list of token-id lists;
``encoding_format`` "float" (a list of numbers) or "base64" (little-endian float32, as OpenAI
and vLLM encode it: the bytes the worker sent, untouched). ``dimensions`` is refused: the model
has no matryoshka representation, so a shorter vector would be a different, worse one (vLLM
refuses it for such models too). vLLM's ``truncate_prompt_tokens`` keeps an input's last N
tokens; vLLM's ``normalize`` turns the L2 normalization off. The pooling itself is the server's
``--pooling-type``."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from array import array
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from services.gateway.cancel import run_or_disconnect
from services.gateway.convert import parse_request, prompt_items, tenant_salt
from services.gateway.errors import APIError
from services.gateway.generation import CLIENT_CLOSED
from services.gateway.metrics import RequestTimer
from services.gateway.routes.common import Gateway, authorized_body, json_response, tenant
from services.gateway.routes.completions import usage_recorder
from services.gateway.schemas import EmbeddingResponse, error_responses
from services.gateway.state import GatewayState
from services.gateway.streams import RequestHandle
from services.gateway.tracing import RequestTrace
from shared.config import Settings
from shared.messages import Delta, GenerateRequest, PoolingParams, SamplingParams
from shared.sampling import MAX_TOKEN_ID

router = APIRouter()
ROUTE = "/v1/embeddings"


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings body, then vLLM's extras."""

    model_config = ConfigDict(extra="ignore")

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: keep each input's last N tokens
    normalize: bool | None = None  # vLLM's: false gives the pooled vector unnormalized


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", "BadRequestError", param)


def embedding_inputs(req: EmbeddingRequest) -> list[tuple[str | None, list[int] | None]]:
    """``(text, token ids)`` per input, as completions read ``prompt`` (400s naming
    ``input``)."""
    return prompt_items(req.input, "input")


def embedding_requests(
    req: EmbeddingRequest, request_id: str, reply_to: str, settings: Settings, salt: str | None
) -> list[GenerateRequest]:
    """The pipeline requests of a body (ids ``<request_id>-<i>``), after the checks the gateway
    makes (the tokenizer checks lengths and the vocabulary)."""
    if req.dimensions is not None:
        raise _bad(
            "dimensions",
            "this model does not support matryoshka representations; leave dimensions unset",
        )
    keep = req.truncate_prompt_tokens
    if keep is not None and (keep == 0 or not -1 <= keep <= MAX_TOKEN_ID):
        raise _bad("truncate_prompt_tokens", "must be -1 (the model length) or >= 1")
    inputs = embedding_inputs(req)
    limit = settings.gateway.max_request_sequences
    if len(inputs) > limit:
        raise _bad("input", f"at most {limit} inputs per request (--max-request-sequences)")
    normalize = True if req.normalize is None else req.normalize
    pooling = PoolingParams(settings.model.pooling_type, normalize)
    now = time.time()
    return [
        GenerateRequest(
            request_id=f"{request_id}-{i}",
            reply_to=reply_to,
            params=SamplingParams(max_tokens=1),
            prompt=text,
            prompt_token_ids=ids,
            arrival_time=now,
            truncate_prompt_tokens=keep,
            cache_salt=salt,
            pooling=pooling,
        )
        for i, (text, ids) in enumerate(inputs)
    ]


def embedding_item(delta: Delta, index: int, encoding: str) -> dict[str, Any]:
    """One ``data`` entry from an input's final delta (its vector as float32 bytes)."""
    if encoding == "base64":
        vector: Any = base64.b64encode(delta.embedding).decode("ascii")
    else:
        vector = array("f", delta.embedding).tolist()  # hosts are little-endian
    return {"object": "embedding", "embedding": vector, "index": index}


def embedding_response(
    request_id: str, model: str, deltas: list[Delta], encoding: str
) -> dict[str, Any]:
    prompt_tokens = sum(d.prompt_tokens for d in deltas)
    return {
        "id": request_id,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [embedding_item(d, i, encoding) for i, d in enumerate(deltas)],
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


async def _vectors(
    handles: list[RequestHandle], timers: list[RequestTimer], tokens: list[int]
) -> list[Delta]:
    """Each input's one final delta (an error of any input fails the request); ``tokens``
    gets each input's prompt tokens as its vector arrives."""

    async def one(i: int) -> Delta:
        delta = await handles[i].next()
        if delta.finish_reason == "error" or not delta.embedding:
            raise APIError(500, "the embedding failed in the pipeline", "InternalServerError")
        tokens[i] = delta.prompt_tokens
        timers[i].finished("stop", delta.prompt_tokens, 0)
        return delta

    tasks = [asyncio.ensure_future(one(i)) for i in range(len(handles))]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()


@router.post(
    ROUTE,
    response_model=EmbeddingResponse,
    responses=error_responses(400, 401, 404, 413, 429, 500, 503, 504),
)
async def embeddings(request: Request, state: Gateway) -> Response:
    trace = RequestTrace(ROUTE, request.headers, state.model_name)
    status, error, prompt_tokens = 200, None, 0
    try:
        key, body = await authorized_body(request, state)
        if body is None:
            status, error = CLIENT_CLOSED, "client closed"
            return Response(status_code=CLIENT_CLOSED)
        req = parse_request(EmbeddingRequest, body)
        model, lora = await state.resolve_model(req.model)
        rid = f"embd-{uuid.uuid4().hex}"
        salt = tenant_salt(tenant(state, key), None)
        gens = embedding_requests(req, rid, state.inbox, state.settings, salt)
        for gen in gens:
            gen.lora = lora
        trace.started(rid, False, len(gens))
        deltas = await _serve(request, state, gens, trace, key)
        if deltas is None:
            status, error = CLIENT_CLOSED, "aborted before the end"
            return Response(status_code=CLIENT_CLOSED)
        prompt_tokens = sum(d.prompt_tokens for d in deltas)
        return json_response(embedding_response(rid, model, deltas, req.encoding_format or "float"))
    except BaseException as e:
        status, error = getattr(e, "status", 500), getattr(e, "message", type(e).__name__)
        raise
    finally:
        trace.end(status, error, prompt_tokens)


async def _serve(
    request: Request,
    state: GatewayState,
    gens: list[GenerateRequest],
    trace: RequestTrace,
    key: str | None,
) -> list[Delta] | None:
    """Submit every input and wait for their vectors (None: the client left); every handle is
    closed at the end, which aborts what did not finish."""
    handles: list[RequestHandle] = []
    timers = [state.metrics.request_timer() for _ in gens]
    tokens = [0] * len(gens)
    headers = trace.headers()
    failed_status = 0
    try:
        for gen in gens:
            handles.append(await state.submit(gen, headers))
        work = _vectors(handles, timers, tokens)
        disconnected, deltas = await run_or_disconnect(request, work)
        return None if disconnected else deltas
    except APIError as e:
        failed_status = e.status
        raise
    finally:
        for h, timer in zip(handles, timers, strict=False):
            if not h.finished and not 400 <= failed_status < 500:
                timer.finished("abort", 0, 0)  # counted as the generation routes count aborts
            h.close()  # aborts an input whose vector did not come
        record = usage_recorder(state, key)
        if record is not None:
            record(sum(tokens), 0)
