"""The operations endpoint of the services that do not serve HTTP themselves (tokenizer,
scheduler, worker, detokenizer): ``GET /health`` (200 when the service is connected to NATS and
ready, 503 otherwise), ``GET /live`` (200 while the process runs; for liveness probes, so that a
NATS outage, which a service rides out by reconnecting, does not get every pod restarted) and
``GET /metrics`` (Prometheus text: the default registry, i.e. process metrics, the bus's
dropped-message counter, its traffic and backlog, and the series the service registers in
``registry``). Given the service's bus, it also answers the gateway's whole-stack metrics
requests on ``kvflow.metrics`` with the same text (shared/metrics.py), and while it is ready
the gateway's Ping on ``kvflow.ping.<service>`` (its /health asks whether a tokenizer and a
detokenizer are there).

It runs uvicorn + starlette in a daemon thread with its own event loop, so it answers while the
service loads its model or its loop is busy. ``--ops-port 0`` (the default) turns it off.
Containers probe it with ``python -m kvflow.shared.ops_http URL`` (exit 0 on a 200), since the image
has no curl."""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

import uvicorn
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvflow.shared import subjects
from kvflow.shared.bus import Bus
from kvflow.shared.messages import Ping, Pong
from kvflow.shared.metrics import BusCollector, answer_metrics, instance_id

log = logging.getLogger("kvflow.ops")

START_TIMEOUT_S = 10.0


class _OpsCollector(Collector):
    """Series read at scrape time from the service's state."""

    def __init__(self, ops: OpsServer) -> None:
        self.ops = ops

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        labels = ["service"]
        ready = GaugeMetricFamily(
            "kvflow_service_ready", "1 when /health answers 200", labels=labels
        )
        ready.add_metric([self.ops.service], 1.0 if self.ops.is_ready() else 0.0)
        yield ready
        dropped = CounterMetricFamily(
            "kvflow_bus_dropped_messages",
            "Bus messages dropped: undecodable, or their handler failed",
            labels=labels,
        )
        bus = self.ops.bus
        dropped.add_metric([self.ops.service], float(bus.dropped_messages if bus else 0))
        yield dropped
        denied = CounterMetricFamily(
            "kvflow_bus_permission_denied",
            "Publishes and subscriptions NATS refused this service's role (shared/access)",
            labels=labels,
        )
        denied.add_metric([self.ops.service], float(getattr(bus, "permission_denied", 0)))
        yield denied
        large = CounterMetricFamily(
            "kvflow_bus_large_messages",
            "Messages over NATS's max_payload (shared/large_messages.py): sent as envelopes, "
            "fetched whole, or lost (their fetch failed)",
            labels=[*labels, "outcome"],
        )
        big = bus.large if bus is not None else None
        for outcome in ("sent", "fetched", "failed"):
            large.add_metric([self.ops.service, outcome], float(getattr(big, outcome, 0)))
        yield large


class OpsServer:
    """``/health``, ``/live`` and ``/metrics`` of one service. Not ready until
    :meth:`set_ready` is given a readiness callable (and that callable says so)."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.port = 0
        self.bus: Bus | None = None
        self._ready: Callable[[], bool] | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_OpsCollector(self))

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def set_ready(self, ready: Callable[[], bool], bus: Bus | None = None) -> None:
        """From now on /health answers 200 while ``ready()`` is true; ``bus`` (the service's
        NATS connection) also feeds the bus series, and, when this is called on the service's
        event loop, answers the gateway's MetricsRequests with :meth:`render`."""
        self._ready = ready
        if bus is not None and self.bus is None:
            self.registry.register(BusCollector(self.service, bus))
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                pass
            else:
                bus.spawn(answer_metrics(bus, self.service, instance_id(bus.name), self.render))
                bus.spawn(self._answer_pings(bus))
        self.bus = bus

    async def _answer_pings(self, bus: Bus) -> None:
        """Every ready instance answers Ping (no queue group: a draining instance stays silent
        while a ready one answers, and the asker takes the first Pong)."""
        instance = instance_id(bus.name)

        async def on_ping(msg: object, raw) -> None:  # noqa: ANN001 - a nats Msg
            if isinstance(msg, Ping) and self.is_ready():
                await bus.reply(raw, Pong(self.service, instance))

        await bus.subscribe(subjects.ping(self.service), on_ping)

    def render(self) -> bytes:
        """This service's /metrics text."""
        return generate_latest(REGISTRY) + generate_latest(self.registry)

    def is_ready(self) -> bool:
        if self._ready is None:
            return False
        try:
            return bool(self._ready())
        except Exception:  # noqa: BLE001 - a failing check means not ready, never a 500
            log.exception("%s: readiness check failed", self.service)
            return False

    def app(self) -> Starlette:
        async def health(request: Request) -> Response:
            ok = self.is_ready()
            body = {"status": "ok" if ok else "unavailable", "service": self.service}
            return JSONResponse(body, status_code=200 if ok else 503)

        async def live(request: Request) -> Response:
            return JSONResponse({"status": "ok", "service": self.service})

        async def metrics(request: Request) -> Response:
            return Response(self.render(), media_type=CONTENT_TYPE_LATEST)

        return Starlette(
            routes=[
                Route("/health", health),
                Route("/live", live),
                Route("/metrics", metrics),
            ]
        )

    def start(self, port: int, host: str = "0.0.0.0") -> None:
        """Bind ``host:port`` now (so a taken port fails here, loudly) and serve in a thread."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            sock.close()
            raise
        sock.listen(128)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app(),
            log_config=None,
            log_level="warning",
            access_log=False,
            lifespan="off",
        )
        self._server = uvicorn.Server(config)
        server = self._server
        self._thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name=f"ops-http-{port}", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{self.service}: ops endpoint on port {port} did not start")
            time.sleep(0.01)
        log.info("%s: /health and /metrics on %s:%d", self.service, host, self.port)

    def stop(self, timeout: float = 5.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)


def start_ops_server(port: int, service: str, host: str = "0.0.0.0") -> OpsServer:
    """The ops endpoint of ``service`` on ``port``; with ``port == 0`` it is off (the returned
    object still accepts :meth:`OpsServer.set_ready`, so services need no branch)."""
    ops = OpsServer(service)
    if port:
        ops.start(port, host)
    return ops


def probe(url: str, timeout: float = 3.0) -> bool:
    """True when GET ``url`` answers 200 (what container health checks run)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(
            "usage: python -m kvflow.shared.ops_http URL  (exit 0 when it answers 200)",
            file=sys.stderr,
        )
        sys.exit(2)
    sys.exit(0 if probe(sys.argv[1]) else 1)
