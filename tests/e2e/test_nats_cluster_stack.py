"""`kvflow serve --nats-cluster 3`: every service is given the three nats-servers. The node the
gateway is connected to is SIGKILLed while 16 streams run: every stream finishes with the text
of an undisturbed run (what the lost node dropped is published again; repeats are dropped,
late pieces put in order). The killed node is started again and rejoins; then the node the
gateway moved to is killed: the same."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import psutil
import pytest

from tests.helpers.faults import Stream, service_pids, stack_urls
from tests.helpers.stack import running_stack, wait_all_blocks_free

pytestmark = pytest.mark.e2e
NAME = "nats-cluster"
TOPICS = ["rivers", "bridges", "winter", "markets", "lamps", "gardens", "letters", "clouds"]
PROMPTS = [f"Tell a short story about {TOPICS[i % 8]} number {i}." for i in range(16)]
MAX_TOKENS = 40


def _nats_pid(port: int) -> int:
    for p in psutil.process_iter(["name", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if "nats-server" in " ".join(cmd[:1]) and str(port) in cmd:
            return p.pid
    raise AssertionError(f"no nats-server on port {port}")


def _gateway_node(nats_url: str) -> int:
    """The client port of the node the stack's gateway is connected to."""
    ports = {int(u.rsplit(":", 1)[1]) for u in nats_url.split(",")}
    gateway = psutil.Process(service_pids(nats_url)["gateway"])
    for conn in gateway.net_connections(kind="tcp"):
        if conn.raddr and conn.raddr.port in ports and conn.status == psutil.CONN_ESTABLISHED:
            return conn.raddr.port
    raise AssertionError("the gateway has no NATS connection")


def _run(base: str) -> list[Stream]:
    streams = [Stream(base, p, MAX_TOKENS).start() for p in PROMPTS]
    return streams


def test_killed_nats_nodes_lose_no_stream_and_rejoin() -> None:
    restarted: list[subprocess.Popen] = []
    with running_stack(NAME, "--nats-cluster", "3", "--max-model-len", "1024") as base:
        nats_url, _ = stack_urls(NAME)
        assert len(nats_url.split(",")) == 3
        reference = [s.join().text for s in _run(base)]
        assert all(reference)
        try:
            for round_ in (1, 2):
                port = _gateway_node(nats_url)
                pid = _nats_pid(port)
                cmdline = psutil.Process(pid).cmdline()
                streams = _run(base)
                while min(len(s.pieces) for s in streams) < 3:
                    time.sleep(0.05)
                os.kill(pid, signal.SIGKILL)
                t_kill = time.monotonic()
                for s in streams:
                    s.join()
                took = time.monotonic() - t_kill
                assert [s.error for s in streams] == [None] * len(PROMPTS)
                assert [s.text for s in streams] == reference, f"round {round_}"
                moved = _gateway_node(nats_url)
                assert moved != port
                print(
                    f"\nround {round_}: killed the gateway's node :{port}; 16 streams finished "
                    f"{took:.1f} s later with their text; the gateway moved to :{moved}"
                )
                # the killed node starts again on its ports and rejoins the cluster
                restarted.append(
                    subprocess.Popen(
                        cmdline,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )
                deadline = time.monotonic() + 20
                while not any(
                    c.laddr.port == port and c.status == psutil.CONN_LISTEN
                    for c in psutil.Process(restarted[-1].pid).net_connections(kind="tcp")
                ):
                    assert time.monotonic() < deadline, "the restarted node did not listen"
                    time.sleep(0.1)
            metrics = httpx.get(f"{base}/metrics", timeout=10).text
            assert "kvflow:bus_reconnects_total" in metrics
            wait_all_blocks_free(base, timeout=30)
        finally:
            for p in restarted:
                p.kill()
                p.wait()
