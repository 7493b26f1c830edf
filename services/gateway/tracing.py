"""The gateway's span of one HTTP request: the root of the request's trace (or the child of the
client's ``traceparent``). Its context goes to the tokenizer in the NATS headers of every
GenerateRequest of the request; it ends when the response does (for a stream, when the last
event is sent or the client leaves), so the whole pipeline's work lies inside it.

A child span ``respond`` covers the time from the first delta to the end (streaming the
tokens); the time before it is the pipeline's time to first token."""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from kvflow.shared.logs import request_id_var
from kvflow.shared.telemetry import extract, inject, tracer

_tracer = tracer("gateway")


class RequestTrace:
    """The server span of one request (idempotent ``end``, never raises)."""

    def __init__(self, route: str, headers: Mapping[str, str], model: str) -> None:
        self.span = _tracer.start_span(
            f"POST {route}",
            context=extract(headers),
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": "POST",
                "http.route": route,
                "gen_ai.request.model": model,
            },
        )
        self.respond: Span | None = None
        self.ended = False

    def headers(self) -> dict[str, str]:
        """NATS headers that make the tokenizer's span a child of this one."""
        return inject(self.span)

    def started(self, request_id: str, stream: bool, sequences: int) -> None:
        """The request has its id: name it on the span, and make this task's log records
        carry it and the span's trace id (the task serves this request alone, streaming
        included, so nothing is reset)."""
        request_id_var.set(request_id)
        otel_context.attach(trace.set_span_in_context(self.span))
        self.span.set_attribute("kvflow.request_id", request_id)
        self.span.set_attribute("kvflow.stream", stream)
        self.span.set_attribute("kvflow.sequences", sequences)

    def first_delta(self) -> None:
        if self.respond is None and not self.ended:
            self.span.add_event("first_token")
            ctx = trace.set_span_in_context(self.span)
            self.respond = _tracer.start_span("respond", context=ctx)

    def end(
        self,
        status: int = 200,
        error: str | None = None,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
    ) -> None:
        if self.ended:
            return
        self.ended = True
        span = self.span
        span.set_attribute("http.response.status_code", status)
        if prompt_tokens or completion_tokens:
            span.set_attribute("gen_ai.usage.input_tokens", prompt_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", completion_tokens)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        if self.respond is not None:
            self.respond.end()
        span.end()
