"""A parser that cannot take its request down: the first exception is logged and counted, and
from then on text passes through as content (with the text the parser was holding back, when
no call had gone out yet)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from kvflow.services.detokenizer.tool_parsers.base import Parsed, ToolParser

log = logging.getLogger("kvflow.detokenizer")


class _Errors:
    count = 0  # parser exceptions in this process


def parser_errors() -> int:
    return _Errors.count


def count_error() -> None:
    _Errors.count += 1


class ToolParserErrors(Collector):
    """``kvflow:detokenizer_tool_parser_errors_total``, for a service's registry."""

    def collect(self) -> Iterator[Metric]:
        c = CounterMetricFamily(
            "kvflow:detokenizer_tool_parser_errors",
            "Tool-call parser failures (the request's text went on as content)",
        )
        c.add_metric([], float(_Errors.count))
        yield c


class GuardedParser(ToolParser):
    def __init__(self, parser: ToolParser, request_id: str = "") -> None:
        self.parser = parser
        self.request_id = request_id
        self.failed = False
        self._called = False
        self._fed: list[str] | None = []  # all text fed, until a call goes out
        self._content: list[str] = []  # all content returned, until a call goes out

    @property
    def tools_called(self) -> bool:  # type: ignore[override]
        return self._called

    def feed(self, text: str) -> Parsed:
        if self.failed:
            return text, []
        if self._fed is not None:
            self._fed.append(text)
        try:
            return self._keep(self.parser.feed(text))
        except Exception:
            return self._fail(text)

    def finish(self) -> Parsed:
        if self.failed:
            return "", []
        try:
            return self._keep(self.parser.finish())
        except Exception:
            return self._fail("")

    def _keep(self, parsed: Parsed) -> Parsed:
        self._called = self._called or bool(parsed[1])
        if self._fed is not None:
            if parsed[1]:
                self._fed = None
                self._content = []
            else:
                self._content.append(parsed[0])
        return parsed

    def _fail(self, text: str) -> Parsed:
        log.exception(
            "tool-call parser failed on request %s: its text goes on as content", self.request_id
        )
        count_error()
        self.failed = True
        if self._fed is None:
            return text, []  # calls went out: what the parser held since then is lost
        fed, sent = "".join(self._fed), "".join(self._content)
        self._fed = None
        return (fed[len(sent) :] if fed.startswith(sent) else text), []
