"""What every route module uses: the gateway's state as a dependency, bodies read within the
size limit, JSON answers, the version, the OpenAPI response specs of generation routes, and the
400 for a route the served model's task does not do.

Bodies are read and validated by hand (``convert.parse_request``) rather than by FastAPI's body
injection, so invalid JSON and bad fields get OpenAI-shaped 400s naming the field, bodies over
``--max-body-bytes`` a 413 before they are read whole, and the route keeps the raw ASGI
``receive`` to race work against the client's disconnect. The OpenAPI document still carries the
body models (openapi.py) and the response models (schemas.py)."""

from __future__ import annotations

from importlib import metadata
from typing import Annotated, Any

import msgspec
from fastapi import Depends, Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from kvflow.services.gateway.errors import APIError
from kvflow.services.gateway.schemas import error_responses
from kvflow.services.gateway.state import GatewayState
from kvflow.shared.models.tasks import task_error


async def gateway_state(request: Request) -> GatewayState:
    """The GatewayState that create_app put on the app (one per app, so tests can run several).
    A coroutine: FastAPI runs a plain function dependency in its thread pool, a thread hop per
    request."""
    return request.app.state.gateway


Gateway = Annotated[GatewayState, Depends(gateway_state)]

# the OpenAPI ``responses`` of a generation route: its errors, and its 200 as an SSE stream
# whose events carry a chunk as JSON text, an error object, or ``[DONE]``
GENERATION_ERRORS = error_responses(400, 401, 404, 413, 429, 500, 503, 504)
SSE_EVENT = {
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}
STREAM_CONTENT = {"text/event-stream": {"schema": SSE_EVENT}}


def json_response(payload: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(payload), status_code=status, media_type="application/json")


def version() -> str:
    """kvflow's installed version (what /version and the OpenAPI document say)."""
    try:
        return metadata.version("kvflow")
    except metadata.PackageNotFoundError:
        return "0+unknown"


async def read_body(request: Request, limit: int) -> bytes | None:
    """The whole body, or None if the client left; 413 as soon as it is known to be over
    ``limit`` bytes (from Content-Length, or while it streams in)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is over this server's limit of {limit} bytes")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(
                    413, f"the request body is over this server's limit of {limit} bytes"
                )
            chunks.append(chunk)
    except ClientDisconnect:
        return None
    return b"".join(chunks)


def tenant(state: GatewayState, key_hash: str | None) -> str | None:
    """The API key a request came with, as its prefix-cache tenant (``--cache-salt-per-key``):
    a key store key's hash (never the key), "static" for ``--api-key``; None when the setting
    is off or the API is open (no tenants)."""
    if not state.settings.gateway.cache_salt_per_key or not state.auth.enabled:
        return None
    return key_hash or "static"  # Auth.check admitted it: no hash means the static key


async def authorized_body(request: Request, state: GatewayState) -> tuple[str | None, bytes | None]:
    """Auth first (a 401/429 before the body is read), then the body: (key hash, body or None
    when the client left)."""
    key = await state.auth.check(request)
    return key, await read_body(request, state.settings.gateway.max_body_bytes)


def check_task(served: str, api: str, route: str) -> None:
    """A 400 naming the served task when ``route``, an API of kind ``api`` (generate, embed,
    classify or score: shared/models/tasks.py ``API_TASKS``), is not what the model is served
    for (a chat request to an embedding model, /classify to a decoder)."""
    message = task_error(served, api, route)
    if message is not None:
        raise APIError(400, message, "BadRequestError")


async def require_task(state: GatewayState, api: str, route: str) -> None:
    """``check_task`` against the served task where the gateway knows it
    (``GatewayState.served_task``); where it does not yet, the tokenizer's own check refuses
    the request instead."""
    served = await state.served_task()
    if served is not None:
        check_task(served, api, route)
