"""Prometheus pieces every service shares: the bus's traffic and backlog as series, and the
whole-stack view the gateway serves on ``/metrics``.

Whole stack: the gateway publishes a MetricsRequest on ``kvflow.metrics`` with a reply inbox;
every service instance (any number of each) answers with its own exposition text
(MetricsReport) within a short window; the gateway parses them, adds ``service`` and
``service_instance`` labels to every sample, and merges them with its own series into one
exposition (one HELP/TYPE block per metric name). vLLM users scrape one endpoint; Kubernetes
and compose scrape each service (``/metrics?scope=local`` on the gateway), so nothing is
counted twice.

Collectors here run in the ops endpoint's thread as well as on the service's event loop, so
they only read plain ints and take snapshots with ``list(...)`` (atomic under the GIL)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Iterable, Iterator

import msgspec
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from kvflow.shared import subjects
from kvflow.shared.bus import Bus
from kvflow.shared.messages import MetricsReport, MetricsRequest, decode

log = logging.getLogger("kvflow.metrics")

GATHER_WINDOW_S = 0.3  # how long the gateway collects MetricsReports for one scrape


def instance_id(name: str) -> str:
    """A process's instance label: its bus name, host and pid (unique in a cluster)."""
    return f"{name}@{socket.gethostname()}:{os.getpid()}"


class BusCollector(Collector):
    """``kvflow:bus_messages_total`` / ``kvflow:bus_bytes_total`` by subject and direction,
    and ``kvflow:bus_pending_messages`` (messages delivered to this process but not handled
    yet: the service's queue depth) by subject."""

    def __init__(self, service: str, bus: Bus) -> None:
        self.service = service
        self.bus = bus

    def collect(self) -> Iterator[Metric]:
        labels = ["service", "subject", "direction"]
        msgs = CounterMetricFamily(
            "kvflow:bus_messages", "NATS messages by subject and direction", labels=labels
        )
        size = CounterMetricFamily(
            "kvflow:bus_bytes", "NATS payload bytes by subject and direction", labels=labels
        )
        traffic = getattr(self.bus, "traffic", {})
        for (subject, direction), (n, b) in sorted(list(traffic.items())):
            msgs.add_metric([self.service, subject, direction], float(n))
            size.add_metric([self.service, subject, direction], float(b))
        yield msgs
        yield size
        pending = GaugeMetricFamily(
            "kvflow:bus_pending_messages",
            "Messages received but not handled yet, by subscription subject",
            labels=["service", "subject"],
        )
        depth: dict[str, int] = {}
        for subject, sub in list(getattr(self.bus, "subscriptions", [])):
            depth[subject] = depth.get(subject, 0) + sub.pending_msgs
        for subject, n in sorted(depth.items()):
            pending.add_metric([self.service, subject], float(n))
        yield pending
        reconnects = CounterMetricFamily(
            "kvflow:bus_reconnects",
            "Times this connection came back to NATS (to another node of a cluster, or the same)",
            labels=["service"],
        )
        reconnects.add_metric([self.service], float(getattr(self.bus, "reconnects", 0)))
        yield reconnects
        replayed = CounterMetricFamily(
            "kvflow:bus_replayed_messages",
            "Messages published again after a NATS node's loss (shared/replay.py)",
            labels=["service"],
        )
        log_ = getattr(self.bus, "replay_log", None)
        replayed.add_metric([self.service], float(log_.replayed_messages if log_ else 0))
        yield replayed


# -- merging expositions ------------------------------------------------------------------------


def parse_families(text: bytes | str, labels: dict[str, str] | None = None) -> list[Metric]:
    """The metric families of a Prometheus text exposition, with ``labels`` added to every
    sample that does not have them already."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    out = []
    for family in text_string_to_metric_families(text):
        if labels:
            family.samples = [
                Sample(s.name, {**labels, **s.labels}, s.value, s.timestamp, s.exemplar)
                for s in family.samples
            ]
        out.append(family)
    return out


class _Families:
    """A ``collect()`` over merged families, for ``generate_latest``."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def merge(groups: Iterable[list[Metric]]) -> bytes:
    """One exposition of every family of every group: families of the same name are joined
    (their samples together; a family whose type disagrees with the first one seen is left out
    and logged), and a sample seen twice with the same labels is kept once."""
    merged: dict[str, Metric] = {}
    seen: dict[str, set[tuple]] = {}
    for families in groups:
        for fam in families:
            into = merged.get(fam.name)
            if into is None:
                into = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                seen[fam.name] = set()
            elif into.type != fam.type:
                log.warning(
                    "metric %s is a %s and a %s; one left out", fam.name, into.type, fam.type
                )
                continue
            for s in fam.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                if key not in seen[fam.name]:
                    seen[fam.name].add(key)
                    into.samples.append(s)
    return generate_latest(_Families(list(merged.values())))  # type: ignore[arg-type]


# -- scatter-gather over NATS -------------------------------------------------------------------


async def gather(bus: Bus, window_s: float = GATHER_WINDOW_S) -> list[MetricsReport]:
    """Every MetricsReport that comes back within ``window_s`` of one MetricsRequest."""
    reports: list[MetricsReport] = []

    async def on_reply(raw) -> None:  # noqa: ANN001 - a nats Msg
        bus.count("_INBOX.", "in", len(raw.data))
        try:
            msg = decode(raw.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            bus.dropped_messages += 1
            return
        if isinstance(msg, MetricsReport):
            reports.append(msg)

    inbox = bus.client.new_inbox()
    sub = await bus.client.subscribe(inbox, cb=on_reply)
    try:
        await bus.publish(subjects.METRICS, MetricsRequest(), reply=inbox)
        await asyncio.sleep(window_s)
    finally:
        await sub.unsubscribe()
    return reports


async def answer_metrics(
    bus: Bus, service: str, instance: str, render: Callable[[], bytes]
) -> None:
    """Answer every MetricsRequest on ``kvflow.metrics`` with ``render()`` (no queue group:
    every instance answers)."""

    async def on_request(msg: object, raw) -> None:  # noqa: ANN001 - a nats Msg
        if isinstance(msg, MetricsRequest):
            await bus.reply(raw, MetricsReport(service, instance, render()))

    await bus.subscribe(subjects.METRICS, on_request)


def whole_stack(
    own: bytes, own_service: str, own_instance: str, reports: list[MetricsReport]
) -> bytes:
    """``own`` exposition and every other instance's report, labelled and merged."""
    groups = [parse_families(own, {"service": own_service, "service_instance": own_instance})]
    for r in sorted(reports, key=lambda r: (r.service, r.instance)):
        if r.instance == own_instance:
            continue
        try:
            groups.append(
                parse_families(r.text, {"service": r.service, "service_instance": r.instance})
            )
        except ValueError as e:
            log.warning("unparseable metrics from %s: %s", r.instance, e)
    return merge(groups)
