"""Serving one generation request, streamed or not, the same way for chat and completions.

A streamed request waits for its first delta before the HTTP response starts, so errors that
come back at once (prompt too long, queue full) are real HTTP errors the SDK raises, not an
event inside a 200 stream. Every path ends by closing the request's handle, which aborts the
request in the pipeline unless its final delta arrived."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from services.gateway.cancel import SSEResponse, run_or_disconnect
from services.gateway.errors import APIError
from services.gateway.metrics import GatewayMetrics
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


class Choices:
    """The ``n`` sequences of one request (each its own pipeline request, ``<id>-<i>`` when
    n > 1), read together: deltas come out tagged with their choice index in arrival order."""

    def __init__(self, handles: list[RequestHandle], metrics: GatewayMetrics | None = None) -> None:
        self.handles = handles
        self._pending: dict[int, asyncio.Task[Delta]] = {}
        self._timers = [metrics.request_timer() for _ in handles] if metrics else None

    @property
    def request_id(self) -> str:
        return self.handles[0].request_id

    async def next(self) -> tuple[int, Delta]:
        """The next delta of any unfinished choice."""
        for i, h in enumerate(self.handles):
            if i not in self._pending and not h.finished:
                self._pending[i] = asyncio.ensure_future(h.next())
        done, _ = await asyncio.wait(self._pending.values(), return_when=asyncio.FIRST_COMPLETED)
        i = min(i for i, t in self._pending.items() if t in done)
        delta = self._pending.pop(i).result()
        _check_delta(delta)
        if self._timers is not None:
            self._timers[i].delta(delta.num_new_tokens)
            if delta.finish_reason is not None:
                self._timers[i].finished(
                    delta.finish_reason, delta.prompt_tokens, delta.completion_tokens
                )
        return i, delta

    @property
    def finished(self) -> bool:
        """Every choice's final delta was read (a handle is finished as soon as its final delta
        arrives, which may still wait in a pending task)."""
        return not self._pending and all(h.finished for h in self.handles)

    def close(self) -> None:
        for t in self._pending.values():
            t.cancel()
        self._pending.clear()
        for h in self.handles:
            h.close()  # aborts the ones whose final delta did not arrive


async def collect(choices: Choices) -> list[Outcome]:
    """Every delta of every choice up to its final one, joined per choice."""
    deltas: list[list[Delta]] = [[] for _ in choices.handles]
    while not choices.finished:
        i, delta = await choices.next()
        deltas[i].append(delta)
    return [outcome_of(d) for d in deltas]


async def sse_events(
    choices: Choices, first: tuple[int, Delta], fmt: Format
) -> AsyncIterator[bytes]:
    """The SSE body: opening chunks, one chunk per delta, the finishes, usage, ``[DONE]``. An
    error after the stream started can only be told in the stream: an ``error`` event."""
    try:
        for i in range(len(choices.handles)):
            for chunk in fmt.opening_chunks(i):
                yield sse(chunk)
        finals: dict[int, Delta] = {}
        i, delta = first
        while True:
            for chunk in fmt.text_chunk(delta.text, delta.finish_reason, i, delta.logprobs):
                yield sse(chunk)
            if delta.finish_reason is not None:
                finals[i] = delta
                if len(finals) == len(choices.handles):
                    break
            i, delta = await choices.next()
        if fmt.include_usage:
            prompt = finals[0].prompt_tokens
            completion = sum(d.completion_tokens for d in finals.values())
            yield sse(fmt.usage_chunk(prompt, completion))
    except APIError as e:
        log.info("request %s failed mid-stream: %s", choices.request_id, e.message)
        yield sse(e.body())
    finally:
        choices.close()  # aborts what did not finish (also on cancellation)
    yield DONE


def fan_out(gen: GenerateRequest, n: int) -> list[GenerateRequest]:
    """One pipeline request per choice. Their identical prompts share KV blocks through prefix
    caching (the scheduler registers blocks when it schedules them, so siblings admitted in the
    same step share them too); a seeded request gives choice i the seed ``seed + i``."""
    if n == 1:
        return [gen]
    out = []
    for i in range(n):
        params = gen.params
        if params.seed is not None:
            params = msgspec.structs.replace(params, seed=params.seed + i)
        out.append(msgspec.structs.replace(gen, request_id=f"{gen.request_id}-{i}", params=params))
    return out


async def serve(
    request: Request,
    state: GatewayState,
    gen: GenerateRequest,
    fmt: Format,
    stream: bool,
    n: int = 1,
) -> Response:
    """Submit ``gen`` (as ``n`` choices) and answer the HTTP request from what comes back."""
    handles: list[RequestHandle] = []
    try:
        for child in fan_out(gen, n):
            handles.append(await state.submit(child))
    except APIError:
        for h in handles:
            h.close()
        raise
    choices = Choices(handles, state.metrics)
    handed_over = False
    try:
        work = choices.next() if stream else collect(choices)
        disconnected, result = await run_or_disconnect(request, work)
        if disconnected:
            log.info("client left before %s finished; aborted", gen.request_id)
            return Response(status_code=CLIENT_CLOSED)
        if not stream:
            assert isinstance(result, list)
            return Response(
                msgspec.json.encode(fmt.response(result)), media_type="application/json"
            )
        assert isinstance(result, tuple)
        handed_over = True
        return SSEResponse(sse_events(choices, result, fmt), on_close=choices.close)
    finally:
        if not handed_over:
            choices.close()
