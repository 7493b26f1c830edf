"""Serving one generation request, streamed or not, the same way for chat and completions.

A request is ``prompts x best_of`` pipeline sequences, expanded and ranked by shared/fan_out.py
(ids ``<id>-<i>``, seeds ``seed + k``). Choice indexes follow OpenAI/vLLM: prompt ``p``'s
choices are ``p * n .. p * n + n - 1``; with ``best_of > n`` (not streamed) the ``n`` sequences
with the highest cumulative logprob are returned, best first.

A streamed request waits until every sequence has sent its first delta before the HTTP response
starts, so errors that come back at once (a prompt too long, a bad schema, a full queue) are
real HTTP errors the SDK raises, not an event inside a 200 stream. Every path ends by closing
the request's handles, which aborts what did not finish in the pipeline."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from kvflow.services.gateway.cancel import SSEResponse, run_or_disconnect
from kvflow.services.gateway.convert import Job
from kvflow.services.gateway.errors import APIError
from kvflow.services.gateway.metrics import GatewayMetrics
from kvflow.services.gateway.responses import Echo, Format, Outcome, outcome_of, sse, usage
from kvflow.services.gateway.state import GatewayState
from kvflow.services.gateway.streams import RequestHandle
from kvflow.services.gateway.tracing import RequestTrace
from kvflow.shared.fan_out import best_per_prompt, expand
from kvflow.shared.messages import Delta

log = logging.getLogger("kvflow.gateway")

# Status for a request whose client left: nobody reads it, but access logs show it (nginx's).
CLIENT_CLOSED = 499

UsageCallback = Callable[[int, int], None]  # (prompt tokens, generated tokens) when closed


def _check_delta(delta: Delta) -> None:
    if delta.finish_reason == "error":
        raise APIError(500, "the request failed in the pipeline", "InternalServerError")


class Choices:
    """The sequences of one request, read together: deltas come out tagged with their sequence
    index in arrival order."""

    def __init__(
        self,
        handles: list[RequestHandle],
        metrics: GatewayMetrics | None = None,
        on_close: UsageCallback | None = None,
        best_of: int = 1,
        trace: RequestTrace | None = None,
    ) -> None:
        self.handles = handles
        self._pending: dict[int, asyncio.Task[Delta]] = {}
        self._timers = [metrics.request_timer() for _ in handles] if metrics else None
        self._on_close = on_close
        self._best_of = best_of
        self._trace = trace
        self.status = 200  # for the trace: what the client got
        self.error: str | None = None
        self._prompt_tokens = [0] * len(handles)
        self._completion_tokens = [0] * len(handles)

    @property
    def request_id(self) -> str:
        return self.handles[0].request_id

    async def next(self) -> tuple[int, Delta]:
        """The next delta of any unfinished sequence."""
        try:
            if len(self.handles) == 1:  # the common case: no task per delta
                i, delta = 0, await self.handles[0].next()
            else:
                i, delta = await self._next_of_many()
        except APIError as e:
            self.status, self.error = e.status, e.message
            raise
        if self._trace is not None:
            self._trace.first_delta()
        self._prompt_tokens[i] = max(self._prompt_tokens[i], delta.prompt_tokens)
        self._completion_tokens[i] = max(self._completion_tokens[i], delta.completion_tokens)
        if self._timers is not None:
            self._timers[i].delta(delta.num_new_tokens)
            if delta.finish_reason is not None:
                # a prompt's tokens count once, on its first sequence
                prompt = delta.prompt_tokens if i % self._best_of == 0 else 0
                self._timers[i].finished(delta.finish_reason, prompt, delta.completion_tokens)
        try:
            _check_delta(delta)
        except APIError as e:
            self.status, self.error = e.status, e.message
            raise
        return i, delta

    async def _next_of_many(self) -> tuple[int, Delta]:
        for i, h in enumerate(self.handles):
            if i not in self._pending and not h.finished:
                self._pending[i] = asyncio.ensure_future(h.next())
        done, _ = await asyncio.wait(self._pending.values(), return_when=asyncio.FIRST_COMPLETED)
        i = min(i for i, t in self._pending.items() if t in done)
        return i, self._pending.pop(i).result()

    async def first_of_each(self) -> list[tuple[int, Delta]]:
        """Deltas in arrival order until every sequence has sent one."""
        seen: set[int] = set()
        out = []
        while len(seen) < len(self.handles):
            i, delta = await self.next()
            seen.add(i)
            out.append((i, delta))
        return out

    @property
    def finished(self) -> bool:
        """Every sequence's final delta was read (a handle is finished as soon as its final
        delta arrives, which may still wait in a pending task)."""
        return not self._pending and all(h.finished for h in self.handles)

    def usage_so_far(self) -> tuple[int, int]:
        """(prompt tokens, each prompt once; tokens generated) from the deltas read so far."""
        return sum(self._prompt_tokens[:: self._best_of]), sum(self._completion_tokens)

    def close(self) -> None:
        for t in self._pending.values():
            t.cancel()
        self._pending.clear()
        for i, h in enumerate(self.handles):
            # aborted (client gone, deadline, pipeline error): counted as vLLM does; a request
            # refused with a 4xx never ran
            if self._timers is not None and not h.finished and not 400 <= self.status < 500:
                prompt = self._prompt_tokens[i] if i % self._best_of == 0 else 0
                self._timers[i].finished("abort", prompt, self._completion_tokens[i])
            h.close()  # aborts the ones whose final delta did not arrive
        if self._on_close is not None:
            cb, self._on_close = self._on_close, None
            cb(*self.usage_so_far())
        if self._trace is not None:
            if self.error is None and not all(h.finished for h in self.handles):
                self.status, self.error = CLIENT_CLOSED, "aborted before the end"
            self._trace.end(self.status, self.error, *self.usage_so_far())


async def collect(choices: Choices) -> list[Outcome]:
    """Every delta of every sequence up to its final one, joined per sequence."""
    deltas: list[list[Delta]] = [[] for _ in choices.handles]
    while not choices.finished:
        i, delta = await choices.next()
        deltas[i].append(delta)
    return [outcome_of(d) for d in deltas]


def _echo(
    job: Job, echo_texts: list[str] | None, prompt: int, delta_or_out: Delta | Outcome
) -> Echo | None:
    if not job.echo or echo_texts is None:
        return None
    lps = delta_or_out.prompt_logprobs if job.logprobs else None
    return Echo(echo_texts[prompt], lps or None)


async def sse_events(
    job: Job,
    choices: Choices,
    first: list[tuple[int, Delta]],
    fmt: Format,
    echo_texts: list[str] | None,
) -> AsyncIterator[bytes]:
    """The SSE body: opening chunks, one chunk per delta, the finishes, usage, ``[DONE]``. An
    error after the stream started can only be told in the stream: an ``error`` event. When
    streaming, best_of == n, so sequence i is choice i. The events ready together (the opening
    chunks and the first deltas; a final delta's chunks, the usage and ``[DONE]``) go out as one
    piece of the body: one socket write, not one per event."""
    out: list[bytes] = []  # events not yielded yet: yielded before waiting for the next delta
    try:
        for i in range(len(choices.handles)):
            out += [fmt.encode(chunk) for chunk in fmt.opening_chunks(i)]
        finals: dict[int, Delta] = {}
        started: set[int] = set()
        queue = list(first)
        while len(finals) < len(choices.handles):
            if queue:
                i, delta = queue.pop(0)
            else:
                if out:
                    yield b"".join(out)
                    out = []
                i, delta = await choices.next()
            echo, plps = None, None
            if i not in started:
                started.add(i)
                echo = _echo(job, echo_texts, i // job.best_of, delta)
                plps = delta.prompt_logprobs or None
            calls = delta.tool_calls
            if job.first_tool_call_only:
                calls = [t for t in calls if t.index == 0]
            chunks = fmt.text_chunk(
                delta.text, delta.finish_reason, i, delta.logprobs, echo, plps, calls
            )
            for chunk in chunks:
                if job.continuous_usage:
                    chunk["usage"] = usage(*choices.usage_so_far())
                out.append(fmt.encode(chunk))
            if delta.finish_reason is not None:
                finals[i] = delta
        if fmt.include_usage:
            prompt = sum(finals[i].prompt_tokens for i in range(0, len(finals), job.best_of))
            completion = sum(d.completion_tokens for d in finals.values())
            out.append(fmt.encode(fmt.usage_chunk(prompt, completion)))
    except APIError as e:
        log.info("request %s failed mid-stream: %s", choices.request_id, e.message)
        out.append(sse(e.body()))
    finally:
        choices.close()  # aborts what did not finish (also on cancellation)
    if fmt.done:
        out.append(fmt.done)
    if out:
        yield b"".join(out)


def full_response(job: Job, outs: list[Outcome], fmt: Format, echo_texts: list[str] | None) -> dict:
    """The non-streamed body: per prompt, its ``n`` best sequences (all of them unless
    best_of > n; shared/fan_out.py), in choice order."""
    chosen: list[Outcome] = []
    echoes: list[Echo | None] = []
    prompt_tokens = 0
    if job.first_tool_call_only:
        for out in outs:
            out.tool_calls = out.tool_calls[:1]
    ranked = best_per_prompt(outs, job.best_of, job.n, lambda o: o.cumulative_logprob)
    for p, group in enumerate(ranked):
        prompt_tokens += outs[p * job.best_of].prompt_tokens
        chosen += group
        echoes += [_echo(job, echo_texts, p, o) for o in group]
    return fmt.response(chosen, prompt_tokens, echoes)


async def serve(
    request: Request,
    state: GatewayState,
    job: Job,
    fmt: Format,
    echo_texts: list[str] | None = None,
    on_usage: UsageCallback | None = None,
    trace: RequestTrace | None = None,
) -> Response:
    """Submit ``job``'s sequences and answer the HTTP request from what comes back; ``trace``
    (the request's span) is ended when the answer is."""
    handles: list[RequestHandle] = []
    headers = trace.headers() if trace is not None else None
    if trace is not None:
        trace.started(job.prompts[0].request_id, job.stream, job.num_sequences)
    try:
        for child in expand(job.prompts, job.best_of):
            handles.append(await state.submit(child, headers))
    except APIError:
        for h in handles:
            h.close()
        raise
    choices = Choices(handles, state.metrics, on_usage, job.best_of, trace)
    handed_over = False
    try:
        work = choices.first_of_each() if job.stream else collect(choices)
        disconnected, result = await run_or_disconnect(request, work)
        if disconnected:
            log.info("client left before %s finished; aborted", choices.request_id)
            return Response(status_code=CLIENT_CLOSED)
        if not job.stream:
            assert isinstance(result, list)
            body = full_response(job, result, fmt, echo_texts)
            return Response(msgspec.json.encode(body), media_type="application/json")
        assert isinstance(result, list)
        handed_over = True
        events = sse_events(job, choices, result, fmt, echo_texts)
        return SSEResponse(events, on_close=choices.close)
    finally:
        if not handed_over:
            choices.close()
