"""A NATS cluster as `kvflow serve --nats-cluster 3` starts it (shared/infra.py), real
nats-servers joined by routes with the per-role users: a service's connection moves to another
node when its own is SIGKILLed, and what the lost node dropped is published again
(shared/replay.py), so a stream of step results reaches its reader whole; the killed node
restarts and rejoins."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

from kvflow.shared import subjects as S
from kvflow.shared.access.connect import nats_auth
from kvflow.shared.access.credentials import Credentials, generate
from kvflow.shared.bus import Bus
from kvflow.shared.config import BusSettings
from kvflow.shared.infra import NatsCluster, Server, start_nats_cluster
from kvflow.shared.messages import Abort, StepResult

pytestmark = pytest.mark.integration


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[Credentials, NatsCluster]]:
    creds = generate(tmp_path / "auth")
    password = creds.nats_route_password.read_text().strip()
    c = start_nats_cluster(creds.nats_conf.parent, 3, password)
    try:
        yield creds, c
    finally:
        c.stop()


async def _bus(creds: Credentials, url: str, role: str) -> Bus:
    bus = Bus(role)
    settings = BusSettings(nats_url=url, nats_password_file=str(creds.nats_password_file(role)))
    await bus.connect(url, auth=nats_auth(settings, role))
    return bus


def _node(bus: Bus, c: NatsCluster) -> int:
    """The index of the node ``bus`` is connected to."""
    port = bus.client.connected_url.port
    return next(i for i, n in enumerate(c.nodes) if n.port == port)


async def _routed(c: NatsCluster, creds: Credentials, a: int, b: int) -> None:
    """Until a message published on node ``a`` reaches a subscriber on node ``b``."""
    sub = await _bus(creds, c.nodes[b].url, "detokenizer")
    pub = await _bus(creds, c.nodes[a].url, "gateway")
    got = asyncio.Event()

    async def on(msg, raw) -> None:
        got.set()

    await sub.subscribe(S.ABORT, on)
    try:
        for _ in range(100):
            await pub.publish(S.ABORT, Abort("probe"))
            try:
                await asyncio.wait_for(got.wait(), 0.1)
                return
            except TimeoutError:
                continue
        raise AssertionError(f"node {a} never routed to node {b}")
    finally:
        await sub.close()
        await pub.close()


async def _publish_killing(writer: Bus, n: int, kill_at: int, node: Server, every_s: float) -> None:
    """Step results 1..n on RESULTS, ``node`` SIGKILLed right after result ``kill_at``."""
    for step in range(1, n + 1):
        await writer.publish(S.RESULTS, StepResult("w", step, [], [], []))
        if step == kill_at:
            os.kill(node.proc.pid, signal.SIGKILL)
        await asyncio.sleep(every_s)


async def _until_all(got, n: int) -> None:
    """Until every step 1..n has reached the reader (``got``: the steps received)."""
    deadline = asyncio.get_running_loop().time() + 20
    while set(got) != set(range(1, n + 1)):
        missing = sorted(set(range(1, n + 1)) - set(got))[:20]
        assert asyncio.get_running_loop().time() < deadline, f"missing: {missing}"
        await asyncio.sleep(0.1)


async def test_a_stream_survives_the_loss_of_its_readers_node(cluster) -> None:
    creds, c = cluster
    for b in (1, 2):
        await _routed(c, creds, 0, b)
    reader = await _bus(creds, c.url, "detokenizer")
    writer = await _bus(creds, c.url, "worker")
    got: list[int] = []

    async def on_result(msg, raw) -> None:
        got.append(msg.step_id)

    await reader.subscribe(S.RESULTS, on_result)
    victim = _node(reader, c)
    n = 300
    await _publish_killing(writer, n, 100, c.nodes[victim], 0.005)
    await _until_all(got, n)
    assert reader.reconnects >= 1 and _node(reader, c) != victim
    # what the lost node may have dropped came again: repeats, which readers drop
    assert writer.replay_log.replays >= 1 and len(got) > n
    print(
        f"\nnode {victim} killed: reader moved to node {_node(reader, c)}, {len(got) - n} "
        f"repeats of {n} results published again"
    )
    # the killed node restarts and rejoins: a connection to it alone reaches the others
    c.restart(victim)
    others = [i for i in range(3) if i != victim]
    await _routed(c, creds, victim, others[0])
    await _routed(c, creds, others[1], victim)
    await reader.close()
    await writer.close()


async def test_the_writers_node_lost_its_last_messages_and_they_come_again(cluster) -> None:
    creds, c = cluster
    for b in (1, 2):
        await _routed(c, creds, 0, b)
    writer = await _bus(creds, c.url, "worker")
    victim = _node(writer, c)
    # the reader on another node, so only the writer's connection is lost
    reader_node = next(i for i in range(3) if i != victim)
    reader = await _bus(creds, c.nodes[reader_node].url, "detokenizer")
    got: set[int] = set()

    async def on_result(msg, raw) -> None:
        got.add(msg.step_id)

    await reader.subscribe(S.RESULTS, on_result)
    await _routed(c, creds, victim, reader_node)
    n = 200
    await _publish_killing(writer, n, 120, c.nodes[victim], 0.002)
    await _until_all(got, n)
    assert writer.reconnects >= 1 and writer.replay_log.replays >= 1
    await reader.close()
    await writer.close()


def _route_tls(tmp_path: Path, name: str, ca) -> tuple[str, str, str]:
    """A node certificate for 127.0.0.1 signed by ``ca``, its key, and ``ca``'s certificate."""
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    d = tmp_path / name
    d.mkdir()
    leaf.cert_chain_pems[0].write_to_path(d / "tls.crt")
    leaf.private_key_pem.write_to_path(d / "tls.key")
    ca.cert_pem.write_to_path(d / "ca.crt")
    return str(d / "tls.crt"), str(d / "tls.key"), str(d / "ca.crt")


async def test_tls_routes_join_nodes_whose_certificates_the_ca_signed(tmp_path: Path) -> None:
    """cluster-tls.conf's block (k8s components/nats-tls): the nodes route to one another in
    TLS, each verifying the other's certificate; nodes that trust another CA never join."""
    creds = generate(tmp_path / "auth")
    password = creds.nats_route_password.read_text().strip()
    ca = trustme.CA()
    tls = _route_tls(tmp_path, "good", ca)
    c = start_nats_cluster(creds.nats_conf.parent, 3, password, route_tls=tls)
    try:
        for b in (1, 2):
            await _routed(c, creds, 0, b)
    finally:
        c.stop()
    stranger = (*tls[:2], _route_tls(tmp_path, "other", trustme.CA())[2])
    c = start_nats_cluster(creds.nats_conf.parent, 2, password, route_tls=stranger)
    try:
        with pytest.raises(AssertionError, match="never routed"):
            await _routed(c, creds, 0, 1)
    finally:
        c.stop()
    assert "tls {" in creds.nats_cluster_tls_conf.read_text()
