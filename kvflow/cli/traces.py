"""``kvflow traces``: a small OTLP/HTTP trace receiver that prints each request's trace as a
text timeline, for looking at traces without Jaeger (and what the tests collect spans with).

    kvflow traces --port 4318 &
    OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf \\
        kvflow serve

It accepts ``POST /v1/traces`` (protobuf, optionally gzip-compressed), keeps the spans in
memory (``--out FILE`` also appends them as JSON lines), and prints a trace once its root span
(the gateway's request) has arrived and no new span came for it for a second."""

from __future__ import annotations

import argparse
import gzip
import json
import signal
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class SpanRecord:
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root
    name: str
    service: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[str, int, dict[str, Any]]] = field(default_factory=list)
    links: list[tuple[str, str]] = field(default_factory=list)  # (trace id, span id)
    error: str = ""


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def decode_export(body: bytes) -> list[SpanRecord]:
    """The spans of one OTLP ExportTraceServiceRequest."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    out = []
    for rs in req.resource_spans:
        service = str(_attrs(rs.resource.attributes).get("service.name", ""))
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    SpanRecord(
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(),
                        name=s.name,
                        service=service,
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        attributes=_attrs(s.attributes),
                        events=[(e.name, e.time_unix_nano, _attrs(e.attributes)) for e in s.events],
                        links=[(lk.trace_id.hex(), lk.span_id.hex()) for lk in s.links],
                        error=s.status.message if s.status.code == 2 else "",
                    )
                )
    return out


class TraceStore:
    """Spans by trace id, thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.traces: dict[str, list[SpanRecord]] = defaultdict(list)
        self.last_update: dict[str, float] = {}

    def add(self, spans: list[SpanRecord]) -> None:
        with self._lock:
            for s in spans:
                self.traces[s.trace_id].append(s)
                self.last_update[s.trace_id] = time.monotonic()

    def trace(self, trace_id: str) -> list[SpanRecord]:
        with self._lock:
            return list(self.traces.get(trace_id, []))

    def all_spans(self) -> list[SpanRecord]:
        with self._lock:
            return [s for spans in self.traces.values() for s in spans]


class OtlpReceiver:
    """``POST /v1/traces`` on ``host:port`` (0: a free port) in a thread."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, out: str | None = None) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceResponse,
        )

        self.store = TraceStore()
        store, out_path = self.store, out
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path.rstrip("/") != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                spans = decode_export(body)
                store.add(spans)
                if out_path:
                    with lock, open(out_path, "a") as f:
                        for s in spans:
                            f.write(json.dumps(asdict(s)) + "\n")
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.port = self.server.server_address[1]
        self.endpoint = f"http://{host}:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# -- the timeline -------------------------------------------------------------------------------


def _fmt_attrs(attrs: dict[str, Any], keep: int = 6) -> str:
    items = [f"{k.removeprefix('kvflow.')}={v}" for k, v in attrs.items()][:keep]
    return " ".join(items)


def timeline(spans: list[SpanRecord], width: int = 40, max_events: int = 4) -> str:
    """One trace as text: each span under its parent (by start time), its service, start
    offset and duration, a bar on a common time axis, its attributes, and its first events."""
    if not spans:
        return "(no spans)"
    t0 = min(s.start_ns for s in spans)
    t1 = max(s.end_ns for s in spans)
    total = max(1, t1 - t0)
    ids = {s.span_id for s in spans}
    children: dict[str, list[SpanRecord]] = defaultdict(list)
    for s in spans:
        children[s.parent_id if s.parent_id in ids else ""].append(s)
    lines = [f"trace {spans[0].trace_id}: {len(spans)} spans, {total / 1e6:.1f} ms"]

    def walk(parent: str, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda s: (s.start_ns, s.name)):
            a = int((s.start_ns - t0) / total * width)
            b = max(a + 1, int((s.end_ns - t0) / total * width))
            bar = " " * a + "#" * (b - a) + " " * (width - b)
            label = f"{'  ' * depth}{s.name}"
            svc = s.service.removeprefix("kvflow-")
            lines.append(
                f"{label:<28} {svc:<12} +{(s.start_ns - t0) / 1e6:8.1f} ms "
                f"{(s.end_ns - s.start_ns) / 1e6:8.1f} ms |{bar}| {_fmt_attrs(s.attributes)}"
                + (f" ERROR {s.error}" if s.error else "")
            )
            for name, t, attrs in s.events[:max_events]:
                lines.append(
                    f"{'  ' * (depth + 1)}. {name} +{(t - t0) / 1e6:.1f} ms {_fmt_attrs(attrs)}"
                )
            if len(s.events) > max_events:
                lines.append(f"{'  ' * (depth + 1)}. ... {len(s.events) - max_events} more events")
            walk(s.span_id, depth + 1)

    walk("", 0)
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``kvflow traces``'s arguments."""
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=4318)
    p.add_argument("--out", default=None, help="also append every span to FILE as JSON lines")


def main(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `docker stop` ends it as Ctrl-C
    rx = OtlpReceiver(args.host, args.port, args.out).start()
    print(f"kvflow traces: OTLP/HTTP on {rx.endpoint}/v1/traces (Ctrl-C stops)", flush=True)
    printed: set[str] = set()
    try:
        while True:
            time.sleep(0.5)
            now = time.monotonic()
            for tid, updated in list(rx.store.last_update.items()):
                spans = rx.store.trace(tid)
                has_root = any(
                    s.service == "kvflow-gateway" and s.name.startswith("POST") for s in spans
                )
                if tid not in printed and has_root and now - updated > 1.0:
                    printed.add(tid)
                    print(timeline(spans) + "\n", flush=True)
    except KeyboardInterrupt:
        return 0
    finally:
        rx.stop()
