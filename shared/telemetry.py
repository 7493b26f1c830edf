"""Tracing for every service (OpenTelemetry): set-up, and the W3C trace context that travels
with a request in NATS headers (``traceparent``) or, where one message carries many requests,
in a field of the message (``NewRequest.traceparent``).

Export is configured the standard way, by environment: ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) turns OTLP export on, ``OTEL_EXPORTER_OTLP_PROTOCOL``
picks ``grpc`` (the default) or ``http/protobuf``, ``OTEL_TRACES_SAMPLER`` /
``OTEL_TRACES_SAMPLER_ARG`` sample (default: every trace), ``OTEL_BSP_*`` tune the batching.
Without an endpoint nothing is exported and nothing is recorded: spans are non-recording (their
ids still exist, so logs carry a trace id and an incoming ``traceparent`` is passed on), which
costs a few microseconds per span. ``OTEL_SDK_DISABLED=true`` leaves OpenTelemetry's no-op
provider in place."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger("kvflow.telemetry")

_propagator = TraceContextTextMapPropagator()
_configured: str | None = None


def otlp_endpoint(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    return env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT", ""
    )


def setup_tracing(service: str, instance: str = "") -> None:
    """Install this process's tracer provider (once; later calls do nothing). Spans carry
    ``service.name = kvflow-<service>``."""
    global _configured
    if _configured is not None:
        return
    _configured = service
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased

    resource = Resource.create(
        {
            "service.name": f"kvflow-{service}",
            "service.namespace": "kvflow",
            "service.instance.id": instance or f"{socket.gethostname()}:{os.getpid()}",
        }
    )
    endpoint = otlp_endpoint()
    if not endpoint:
        # nothing to export to: record nothing unless a caller's sampled context asks for it
        trace.set_tracer_provider(TracerProvider(ParentBased(ALWAYS_OFF), resource))
        return
    provider = TracerProvider(resource=resource)  # sampler from OTEL_TRACES_SAMPLER
    provider.add_span_processor(BatchSpanProcessor(_exporter()))
    trace.set_tracer_provider(provider)
    log.info("%s: exporting traces to %s", service, endpoint)


def _exporter():  # noqa: ANN202 - the exporter class depends on the protocol
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"
    )
    if protocol.startswith("http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[assignment]
            OTLPSpanExporter,
        )
    return OTLPSpanExporter()


def tracer(component: str) -> Tracer:
    """The tracer of a kvflow component (``kvflow.gateway``, ``kvflow.worker`` ...)."""
    return trace.get_tracer(f"kvflow.{component}")


def inject(span: Span | None = None) -> dict[str, str]:
    """NATS headers carrying ``span``'s context (default: the current span); empty when there
    is no valid context."""
    ctx = trace.set_span_in_context(span) if span is not None else None
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=ctx)
    return carrier


def extract(headers: Mapping[str, str] | None) -> Context:
    """The context a message's (or an HTTP request's) headers carry; an empty context (a new
    trace) when they carry none."""
    if not headers:
        return Context()
    return _propagator.extract(headers)


def traceparent(span: Span) -> str:
    """``span``'s context as one W3C ``traceparent`` string ("" if it has none)."""
    return inject(span).get("traceparent", "")


def context_of(traceparent_value: str) -> Context:
    """The context of a ``traceparent`` string ("" gives an empty context)."""
    if not traceparent_value:
        return Context()
    return _propagator.extract({"traceparent": traceparent_value})


def is_sampled(traceparent_value: str) -> bool:
    """Whether a ``traceparent`` says its trace is recorded (flags ``01``), without parsing a
    context: the hot path (a worker step) skips unsampled requests with this."""
    try:
        return len(traceparent_value) == 55 and bool(int(traceparent_value[-2:], 16) & 1)
    except ValueError:
        return False


def current_ids() -> tuple[str, str]:
    """(trace id, span id) of the current span as hex, or ("", "") outside any span."""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return "", ""
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")
