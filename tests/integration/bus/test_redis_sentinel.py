"""Redis with Sentinel as `kvflow serve --redis-sentinel` starts it (shared/infra.py): a primary,
a replica and three sentinels from one deployment's credentials, real servers on free ports.
Every Redis client kvflow has (the API key store, the scheduler's lease, the KV tier) is made
from the ``redis+sentinel://`` URL, keeps its ACL user on every server and on the sentinels,
and follows a failover after the primary is SIGKILLed."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.exceptions import NoPermissionError, RedisError, ResponseError

from kvflow.services.gateway.keys import KeyStore
from kvflow.services.scheduler.lease import Lease
from kvflow.shared.access.connect import parse_sentinel_url, redis_client, redis_options
from kvflow.shared.access.credentials import Credentials, generate
from kvflow.shared.access.grants import SENTINEL_MASTER
from kvflow.shared.config import BusSettings
from kvflow.shared.infra import RedisWithSentinel, start_redis_sentinel

pytestmark = pytest.mark.integration


@pytest.fixture
def sentinel(tmp_path: Path) -> Iterator[tuple[Credentials, RedisWithSentinel]]:
    creds = generate(tmp_path / "auth")
    rs = start_redis_sentinel(creds.redis_acl, creds.redis_replication_conf, creds.sentinel_conf)
    try:
        yield creds, rs
    finally:
        rs.stop()


def _bus(creds: Credentials, url: str, role: str) -> BusSettings:
    return BusSettings(redis_url=url, redis_password_file=str(creds.redis_password_file(role)))


def _direct(creds: Credentials, port: int, role: str) -> redis.Redis:
    """A plain client of one server (not through the sentinels) as ``role``."""
    password = creds.redis_password_file(role).read_text().strip()
    return redis.Redis(port=port, username=role, password=password, socket_timeout=2)


async def _until_ok(op, what: str, timeout: float = 30.0) -> float:
    """Seconds until ``op()`` succeeds (a client riding out a failover)."""
    t0 = time.monotonic()
    while True:
        try:
            await op()
            return time.monotonic() - t0
        except (RedisError, OSError) as e:
            assert time.monotonic() - t0 < timeout, f"{what}: still failing after {timeout}s: {e}"
            await asyncio.sleep(0.1)


def _wait_replicated(creds: Credentials, replica_port: int, key: str) -> None:
    replica = _direct(creds, replica_port, "worker")
    deadline = time.monotonic() + 10
    while not replica.exists(key):
        assert time.monotonic() < deadline, "the replica never copied the primary"
        time.sleep(0.05)
    replica.close()


async def test_every_client_follows_a_failover_with_its_acl(sentinel) -> None:
    creds, rs = sentinel
    primary, replica = rs.servers
    sentinels, master, db, tls = parse_sentinel_url(rs.url)
    assert [p for _h, p in sentinels] == [s.port for s in rs.sentinels]
    assert (master, db, tls) == (SENTINEL_MASTER, 0, False)

    admin = redis_client(_bus(creds, rs.url, "admin"), "admin", decode_responses=True)
    gateway = redis_client(_bus(creds, rs.url, "gateway"), "gateway", decode_responses=True)
    worker = redis_client(_bus(creds, rs.url, "worker"), "worker", socket_timeout=0.5)
    opts = redis_options(_bus(creds, rs.url, "scheduler"), "scheduler")
    lease = Lease(rs.url, "m", options=opts)
    try:
        key = await KeyStore(admin).add("tenant-a", rpm=100)
        assert (await KeyStore(gateway).admit(key)).status == "ok"
        assert await lease.try_acquire() and lease.epoch == 1
        await worker.set("kvflow:kv:block-1", b"\x01" * 64)
        _wait_replicated(creds, replica.port, "kvflow:kv:block-1")

        os.kill(primary.proc.pid, signal.SIGKILL)
        primary.proc.wait()
        took = await _until_ok(lambda: worker.set("kvflow:kv:block-2", b"\x02"), "KV tier")
        print(f"\nRedis failover: the KV tier wrote again {took:.2f} s after SIGKILL")
        # everything written before the kill was on the replica that now leads
        assert await worker.get("kvflow:kv:block-1") == b"\x01" * 64
        assert (await KeyStore(gateway).admit(key)).status == "ok"
        assert [k.name for k in await KeyStore(admin).list()] == ["tenant-a"]
        # the lease: the same holder renews it on the new primary (or takes it again)
        await _until_ok(lease.renew, "lease")
        assert lease.valid()
        assert await lease.redis.get(lease.epoch_key) == b"1"
        # the ACLs hold on the promoted server too
        with pytest.raises(NoPermissionError):
            await KeyStore(gateway).add("mallory")
        with pytest.raises(NoPermissionError):
            await worker.get("kvflow:keys")
        leader = await admin.connection_pool.get_master_address()
        assert leader == ("127.0.0.1", replica.port)
    finally:
        for c in (admin, gateway, worker):
            await c.aclose()
        await lease.close()


def test_the_sentinels_answer_roles_only_where_the_primary_is(sentinel) -> None:
    creds, rs = sentinel
    port = rs.sentinels[0].port
    gateway = _direct(creds, port, "gateway")
    try:
        host, p = gateway.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SENTINEL_MASTER)
        assert int(p) == rs.servers[0].port
        with pytest.raises(NoPermissionError):
            gateway.execute_command("SENTINEL", "FAILOVER", SENTINEL_MASTER)
        with pytest.raises(NoPermissionError):
            gateway.execute_command("SENTINEL", "SET", SENTINEL_MASTER, "quorum", "1")
    finally:
        gateway.close()
    anonymous = redis.Redis(port=port, socket_timeout=2)
    assert anonymous.ping()  # health checks
    with pytest.raises((NoPermissionError, ResponseError)):
        anonymous.execute_command("SENTINEL", "MASTERS")
    anonymous.close()
    wrong = redis.Redis(port=port, username="gateway", password="wrong", socket_timeout=2)
    with pytest.raises(redis.AuthenticationError):
        wrong.ping()
    wrong.close()
