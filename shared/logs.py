"""Logging set-up shared by every service: one line per record, service name first; with
``--log-format json``, one JSON object per line instead, carrying the request id and the trace
and span ids of the record's context (so a log line leads to its trace and back)."""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kvflow.shared.telemetry import current_ids

# the request a task is working on; services set it around per-request work (request_scope)
request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")


@contextmanager
def request_scope(request_id: str) -> Iterator[None]:
    """Log records inside carry ``request_id``."""
    token = request_id_var.set(request_id)
    try:
        yield
    finally:
        request_id_var.reset(token)


class ContextFilter(logging.Filter):
    """Adds ``request_id``, ``trace_id`` and ``span_id`` to every record (an explicit
    ``extra={"request_id": ...}`` wins)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "request_id", ""):
            record.request_id = request_id_var.get()
        if not getattr(record, "trace_id", ""):
            record.trace_id, record.span_id = current_ids()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (RFC 3339, UTC), level, service, logger, message,
    request_id / trace_id / span_id when known, and the exception text if any."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in ("request_id", "trace_id", "span_id"):
            value = getattr(record, key, "")
            if value:
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def setup_logging(service: str, level: str = "info", fmt: str = "text") -> None:
    """``fmt``: ``text`` (the default) or ``json``."""
    if fmt not in ("text", "json"):
        raise ValueError(f"--log-format must be text or json, not {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(ContextFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s")
        )
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO), handlers=[handler], force=True
    )
    for noisy in ("httpx", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
