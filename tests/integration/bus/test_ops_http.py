"""The ops endpoint (/health, /live, /metrics) of non-gateway services: a real uvicorn server
on a free port, readiness from a real NATS connection, and one real service started with
``--ops-port``."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from kvflow.shared import subjects
from kvflow.shared.bus import Bus
from kvflow.shared.infra import free_port, start_nats
from kvflow.shared.messages import Ping, Pong
from kvflow.shared.ops_http import OpsServer, probe, start_ops_server
from tests.helpers.paths import ROOT

pytestmark = pytest.mark.integration


async def _get(url: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=5) as c:
        return await c.get(url)


async def _wait_status(url: str, status: int, timeout: float = 15.0) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        r = await _get(url)
        if r.status_code == status or time.monotonic() > deadline:
            return r
        await asyncio.sleep(0.1)


def _sample(metrics_text: str, name: str, service: str) -> float:
    prefix = f'{name}{{service="{service}"}} '
    for line in metrics_text.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix) :])
    raise AssertionError(f"{prefix!r} not in /metrics")


async def test_health_follows_the_nats_connection_and_metrics_count_drops() -> None:
    nats = start_nats()
    ops = OpsServer("tokenizer")
    ops.start(free_port(), "127.0.0.1")
    base = f"http://127.0.0.1:{ops.port}"
    bus = Bus("tokenizer")
    try:
        # before the service says how to judge readiness: alive, not ready
        assert (await _get(f"{base}/live")).status_code == 200
        r = await _get(f"{base}/health")
        assert r.status_code == 503 and r.json()["service"] == "tokenizer"

        await bus.connect(nats.url)
        ops.set_ready(lambda: bus.client.is_connected, bus)
        assert (await _get(f"{base}/health")).status_code == 200

        async def handler(msg, raw) -> None:
            pass

        await bus.subscribe("t.ops", handler)
        await bus.client.publish("t.ops", b"\xffnot msgpack")
        await bus.client.flush()
        for _ in range(100):  # the drop is counted in the bus's callback, soon after
            if bus.dropped_messages:
                break
            await asyncio.sleep(0.05)
        metrics = await _get(f"{base}/metrics")
        assert metrics.status_code == 200
        assert metrics.headers["content-type"].startswith("text/plain")
        text = metrics.text
        assert _sample(text, "kvflow_bus_dropped_messages_total", "tokenizer") == 1.0
        assert _sample(text, "kvflow_service_ready", "tokenizer") == 1.0
        assert _sample(text, "kvflow_bus_permission_denied_total", "tokenizer") == 0.0
        assert 'kvflow_bus_large_messages_total{outcome="failed",service="tokenizer"} 0.0' in text
        assert "process_resident_memory_bytes" in text  # the default registry's process metrics

        nats.stop()  # NATS gone: not ready, but still alive (liveness must not restart it)
        r = await _wait_status(f"{base}/health", 503)
        assert r.status_code == 503
        assert (await _get(f"{base}/live")).status_code == 200
        assert (
            _sample((await _get(f"{base}/metrics")).text, "kvflow_service_ready", "tokenizer") == 0
        )
    finally:
        await bus.close()
        ops.stop()
        nats.stop()
    assert not ops.running


async def test_a_ready_service_answers_ping_and_a_draining_one_stays_silent() -> None:
    """What the gateway's /health asks of the tokenizer and the detokenizer."""
    nats = start_nats()
    ops = OpsServer("detokenizer")
    bus, asker = Bus("detokenizer"), Bus("gateway")
    ready = [True]
    try:
        await bus.connect(nats.url)
        await asker.connect(nats.url)
        with pytest.raises(NoRespondersError):
            await asker.request(subjects.ping("detokenizer"), Ping(), 1.0)
        ops.set_ready(lambda: ready[0], bus)
        pong = None
        for _ in range(50):  # the subscription is made by a task the call spawned
            try:
                pong = await asker.request(subjects.ping("detokenizer"), Ping(), 1.0)
                break
            except Exception:  # noqa: BLE001 - not subscribed yet
                await asyncio.sleep(0.05)
        assert isinstance(pong, Pong) and pong.service == "detokenizer"
        ready[0] = False  # draining: subscribed, but no answer
        with pytest.raises(NatsTimeout):
            await asker.request(subjects.ping("detokenizer"), Ping(), 0.3)
    finally:
        await asker.close()
        await bus.close()
        nats.stop()


async def test_failing_readiness_check_is_a_503_not_a_500() -> None:
    ops = OpsServer("worker")
    ops.start(free_port(), "127.0.0.1")
    try:
        ops.set_ready(lambda: 1 / 0 > 0)
        assert (await _get(f"http://127.0.0.1:{ops.port}/health")).status_code == 503
    finally:
        ops.stop()


def test_port_zero_is_off_and_a_taken_port_fails_loudly() -> None:
    off = start_ops_server(0, "scheduler")
    assert not off.running
    off.set_ready(lambda: True)  # accepted, nothing served

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        with pytest.raises(OSError):
            start_ops_server(taken.getsockname()[1], "scheduler", host="127.0.0.1")


def test_a_service_started_with_ops_port_serves_health_and_metrics() -> None:
    """`kvflow run tokenizer --ops-port P` (what containers run): /health turns 200 once it is
    connected; the probe command the compose health checks use agrees."""
    nats = start_nats()
    port = free_port()
    env = {**os.environ, "KVFLOW_NATS_URL": nats.url, "KVFLOW_OPS_PORT": str(port)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvflow.cli.main", "run", "tokenizer"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not probe(f"{url}/health", timeout=1):
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "tokenizer never became ready"
            time.sleep(0.2)
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
        assert _sample(metrics, "kvflow_service_ready", "tokenizer") == 1.0
        check = [sys.executable, "-m", "kvflow.shared.ops_http", f"{url}/health"]
        assert subprocess.run(check, cwd=ROOT).returncode == 0
        assert subprocess.run([*check[:-1], f"{url}/nope"], cwd=ROOT).returncode == 1
    finally:
        proc.terminate()
        proc.wait(30)
        nats.stop()
