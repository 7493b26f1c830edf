"""Serving one generation request, streamed or not, the same way for chat and completions.

A streamed request waits for its first delta before the HTTP response starts, so errors that
come back at once (prompt too long, queue full) are real HTTP errors the SDK raises, not an
event inside a 200 stream. Every path ends by closing the request's handle, which aborts the
request in the pipeline unless its final delta arrived."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from services.gateway.cancel import SSEResponse, run_or_disconnect
from services.gateway.errors import APIError
from services.gateway.responses import DONE, Format, Outcome, outcome_of, sse
from services.gateway.state import GatewayState
from services.gateway.streams import RequestHandle
from shared.messages import Delta, GenerateRequest

log = logging.getLogger("kvflow.gateway")

# Status for a request whose client left: nobody reads it, but access logs show it (nginx's).
CLIENT_CLOSED = 499


def _check_delta(delta: Delta) -> None:
    if delta.finish_reason == "error":
        raise APIError(500, "the request failed in the pipeline", "InternalServerError")


async def collect(handle: RequestHandle) -> Outcome:
    """Every delta up to the final one, joined."""
    deltas = []
    while True:
        delta = await handle.next()
        _check_delta(delta)
        deltas.append(delta)
        if delta.finish_reason is not None:
            return outcome_of(deltas)


async def first_delta(handle: RequestHandle) -> Delta:
    delta = await handle.next()
    _check_delta(delta)
    return delta


async def sse_events(handle: RequestHandle, first: Delta, fmt: Format) -> AsyncIterator[bytes]:
    """The SSE body: opening chunks, one chunk per delta, the finish, usage, ``[DONE]``. An
    error after the stream started can only be told in the stream: an ``error`` event."""
    try:
        for chunk in fmt.opening_chunks():
            yield sse(chunk)
        delta = first
        while True:
            for chunk in fmt.text_chunk(delta.text, delta.finish_reason):
                yield sse(chunk)
            if delta.finish_reason is not None:
                break
            delta = await handle.next()
            _check_delta(delta)
        if fmt.include_usage:
            yield sse(fmt.usage_chunk(delta.prompt_tokens, delta.completion_tokens))
    except APIError as e:
        log.info("request %s failed mid-stream: %s", handle.request_id, e.message)
        yield sse(e.body())
    finally:
        handle.close()  # aborts if the final delta did not arrive (also on cancellation)
    yield DONE


async def serve(
    request: Request, state: GatewayState, gen: GenerateRequest, fmt: Format, stream: bool
) -> Response:
    """Submit ``gen`` and answer the HTTP request from what comes back."""
    handle = await state.submit(gen)
    handed_over = False
    try:
        work = first_delta(handle) if stream else collect(handle)
        disconnected, result = await run_or_disconnect(request, work)
        if disconnected:
            log.info("client left before %s finished; aborted", gen.request_id)
            return Response(status_code=CLIENT_CLOSED)
        if not stream:
            assert isinstance(result, Outcome)
            return Response(
                msgspec.json.encode(fmt.response(result)), media_type="application/json"
            )
        assert isinstance(result, Delta)
        handed_over = True
        return SSEResponse(sse_events(handle, result, fmt), on_close=handle.close)
    finally:
        if not handed_over:
            handle.close()
