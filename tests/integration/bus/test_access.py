"""Access control against a real nats-server and redis-server started with the configuration
`kvflow auth init` / `kvflow serve` generate (shared/access): strangers and wrong passwords are
refused; each role reaches exactly the subjects and keys of the pipeline's flows and is refused
everything else; TLS works with a test CA; a service whose credentials are refused exits 78
naming what was refused.

The expected flows below are written out by hand from what the services do (not derived from
shared/access/grants.py), so a grant that is too wide or too narrow fails here; the e2e suite,
which runs every stack with auth on, shows the grants are enough for the whole pipeline."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.exceptions import AuthenticationError, NoPermissionError

from kvflow.services.gateway.keys import KeyStore
from kvflow.services.scheduler.lease import Lease
from kvflow.shared import subjects as S
from kvflow.shared.access.connect import (
    EXIT_REFUSED,
    AccessError,
    NatsAuth,
    nats_auth,
    redis_options,
)
from kvflow.shared.access.credentials import Credentials, generate
from kvflow.shared.access.grants import NATS_ROLES, REDIS_ROLES
from kvflow.shared.bus import Bus
from kvflow.shared.config import BusSettings
from kvflow.shared.infra import Server, start_nats, start_redis
from kvflow.shared.messages import Ping, Pong

pytestmark = pytest.mark.integration

# concrete subjects of every kind the pipeline uses (instances: g1, w1)
GW, STEP, KV = S.gateway_inbox("g1"), S.worker_step("w1"), S.worker_kv("w1")
EVERY_SUBJECT = [
    S.TOKENIZE,
    S.TOKENIZER_RPC,
    S.REQUESTS,
    S.ABORT,
    S.RESULTS,
    S.HEARTBEAT,
    S.KV_DONE,
    S.DETOKENIZER_CLAIMS,
    S.SCHEDULER_LIVE,
    S.SCHEDULER_STATS,
    S.METRICS,
    S.ping("tokenizer"),
    S.ping("worker"),
    GW,
    STEP,
    KV,
    "_INBOX.gateway.x1",
    "_INBOX.worker.x1",
    S.blob("gateway", "x1"),  # where a connection serves its large messages' bytes
    S.blob("worker", "x1"),
    "kvflow.other",
    "$SYS.REQ.SERVER.PING",
]
# every role fetches large messages' bytes from any role's blob subjects (requests), and
# serves only its own (shared/large_messages.py)
BLOBS = {S.blob("gateway", "x1"), S.blob("worker", "x1")}
# what each role does on the bus (services/*/service.py, services/gateway/state.py)
PUBLISHES = {
    "gateway": {
        S.TOKENIZE,
        S.ABORT,
        S.TOKENIZER_RPC,
        S.SCHEDULER_STATS,
        S.METRICS,
        S.ping("tokenizer"),
        S.ping("worker"),
        "_INBOX.gateway.x1",
    },
    "tokenizer": {S.REQUESTS, GW},  # errors go to the asking gateway
    # deltas; stop strings; what it holds; which requests run (as it starts)
    "detokenizer": {GW, S.ABORT, S.DETOKENIZER_CLAIMS, S.SCHEDULER_LIVE},
    "scheduler": {STEP, GW, S.RESULTS},  # plans; Accepted / RequestError; StepVoid
    "worker": {S.RESULTS, S.KV_DONE, S.HEARTBEAT, KV, "_INBOX.worker.x1"},  # KV pulls
}
PUBLISHES = {role: subjects | BLOBS for role, subjects in PUBLISHES.items()}
SUBSCRIBES = {
    "gateway": {GW, S.METRICS, "_INBOX.gateway.x1", S.blob("gateway", "x1")},
    "tokenizer": {S.TOKENIZE, S.TOKENIZER_RPC, S.METRICS, S.ping("tokenizer")},
    "detokenizer": {S.REQUESTS, S.RESULTS, S.ABORT, S.DETOKENIZER_CLAIMS, S.METRICS},
    "scheduler": {
        S.REQUESTS,
        S.ABORT,
        S.RESULTS,
        S.HEARTBEAT,
        S.KV_DONE,
        S.SCHEDULER_STATS,
        S.SCHEDULER_LIVE,
        S.METRICS,
    },
    "worker": {STEP, KV, S.METRICS, S.ping("worker"), "_INBOX.worker.x1", S.blob("worker", "x1")},
}


@pytest.fixture(scope="module")
def closed() -> Iterator[tuple[Credentials, Server, Server]]:
    import tempfile

    creds = generate(Path(tempfile.mkdtemp(prefix="kvflow-test-auth-")))
    nats = start_nats(config=creds.nats_conf)
    rds = start_redis(aclfile=creds.redis_acl)
    try:
        yield creds, nats, rds
    finally:
        nats.stop()
        rds.stop()
        import shutil

        shutil.rmtree(creds.root, ignore_errors=True)


def login(creds: Credentials, role: str) -> NatsAuth:
    password = creds.nats_password_file(role).read_text().strip()
    return NatsAuth(role, role, password)


async def connected(url: str, auth: NatsAuth, name: str = "probe") -> Bus:
    bus = Bus(name)
    await bus.connect(url, connect_timeout=3, auth=auth)
    return bus


async def test_strangers_and_wrong_passwords_are_refused_at_once(closed) -> None:
    creds, nats, _ = closed
    cases = [
        NatsAuth(),  # no credentials
        NatsAuth("gateway", "gateway", "wrong"),
        NatsAuth("worker", "worker", login(creds, "gateway").password),  # another role's
        NatsAuth("admin", "admin", "x"),  # a Redis-only role has no NATS user
    ]
    for auth in cases:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(AccessError, match="refused"):
            await Bus("stranger").connect(nats.url, connect_timeout=10, auth=auth)
        assert loop.time() - t0 < 5  # not retried until the connect timeout


@pytest.mark.parametrize("role", NATS_ROLES)
async def test_each_role_publishes_only_its_flows(closed, role: str) -> None:
    creds, nats, _ = closed
    bus = await connected(nats.url, login(creds, role))
    try:
        refused = []
        for subject in EVERY_SUBJECT:
            before = bus.permission_denied
            await bus.client.publish(subject, b"x")
            await bus.confirm_subscriptions()  # a round trip: any refusal has arrived
            if bus.permission_denied > before:
                refused.append(subject)
        expected = [s for s in EVERY_SUBJECT if s not in PUBLISHES[role]]
        assert refused == expected
    finally:
        await bus.close()


@pytest.mark.parametrize("role", NATS_ROLES)
async def test_each_role_subscribes_only_to_its_flows(closed, role: str) -> None:
    creds, nats, _ = closed
    bus = await connected(nats.url, login(creds, role))

    async def ignore(_msg: object, _raw: object) -> None:
        pass

    try:
        refused = []
        for subject in [*EVERY_SUBJECT, ">", "kvflow.>", "_INBOX.>"]:
            try:
                await bus.subscribe(subject, ignore)
            except AccessError as e:
                assert subject in str(e) and role in str(e)
                refused.append(subject)
        expected = [s for s in [*EVERY_SUBJECT, ">", "kvflow.>", "_INBOX.>"]]
        expected = [s for s in expected if s not in SUBSCRIBES[role]]  # noqa: C416
        assert refused == expected
    finally:
        await bus.close()


async def test_the_issues_cases_and_replies_only_to_requests(closed) -> None:
    """A tokenizer cannot publish a StepPlan, a worker cannot read a gateway's inboxes, a
    fake worker cannot announce itself from another role; a responder answers a request it
    received (NATS allow_responses) but cannot write into the asker's inbox unasked."""
    creds, nats, _ = closed
    gateway = await connected(nats.url, login(creds, "gateway"), "gateway")
    tokenizer = await connected(nats.url, login(creds, "tokenizer"), "tokenizer")
    worker = await connected(nats.url, login(creds, "worker"), "worker")
    try:
        got: list[str] = []

        async def on_step(_msg: object, raw) -> None:  # noqa: ANN001
            got.append(raw.subject)

        await worker.subscribe(STEP, on_step)
        await tokenizer.client.publish(STEP, b"\x91\x00")  # a tokenizer posing as a scheduler
        await tokenizer.client.publish(S.HEARTBEAT, b"\x91\x00")  # ... or as a worker
        await tokenizer.confirm_subscriptions()
        assert tokenizer.permission_denied == 2
        for inbox in (GW, "_INBOX.gateway.>"):
            with pytest.raises(AccessError):
                await worker.subscribe(inbox, on_step)

        async def pong(msg: object, raw) -> None:  # noqa: ANN001
            if isinstance(msg, Ping):
                await tokenizer.reply(raw, Pong("tokenizer", "t1"))

        await tokenizer.subscribe(S.ping("tokenizer"), pong)
        reply = await gateway.request(S.ping("tokenizer"), Ping(), timeout=2)
        assert isinstance(reply, Pong)  # the answer to a request goes through
        before = tokenizer.permission_denied
        await tokenizer.client.publish(gateway.client.new_inbox(), b"unasked")
        await tokenizer.confirm_subscriptions()
        assert tokenizer.permission_denied == before + 1
        assert got == []  # no forged plan reached the worker
    finally:
        for b in (gateway, tokenizer, worker):
            await b.close()


def redis_as(server: Server, creds: Credentials, role: str | None) -> redis.Redis:
    if role is None:
        return redis.Redis(port=server.port)
    password = creds.redis_password_file(role).read_text().strip()
    return redis.Redis(port=server.port, username=role, password=password)


def test_redis_strangers_only_ping_and_wrong_passwords_are_refused(closed) -> None:
    creds, _, rds = closed
    stranger = redis_as(rds, creds, None)
    assert stranger.ping()  # health checks need no password
    for op in (lambda: stranger.get("kvflow:kv:x"), lambda: stranger.hgetall("kvflow:keys")):
        with pytest.raises(NoPermissionError):
            op()
    with pytest.raises(AuthenticationError):
        redis.Redis(port=rds.port, username="worker", password="wrong").ping()
    with pytest.raises(AuthenticationError):  # NATS-only roles have no Redis user
        redis.Redis(port=rds.port, username="tokenizer", password="x").ping()


# (role, operation, allowed); keys: the KV tier, the key store, the scheduler's lease
REDIS_CASES = [
    ("worker", lambda r: r.set("kvflow:kv:l:ab", b"v", ex=60, nx=True), True),
    ("worker", lambda r: r.mget(["kvflow:kv:l:ab"]), True),
    ("worker", lambda r: r.hgetall("kvflow:keys"), False),
    ("worker", lambda r: r.hset("kvflow:key:h", "name", "forged"), False),
    ("worker", lambda r: r.set("kvflow:scheduler:m:lease", "me"), False),
    ("worker", lambda r: r.keys("*"), False),
    ("worker", lambda r: r.flushall(), False),
    ("gateway", lambda r: r.set("kvflow:kv:l:ab", b"forged"), False),  # a forged KV block
    ("gateway", lambda r: r.hset("kvflow:keys", "mallory", "h"), False),  # adding a key
    ("gateway", lambda r: r.hgetall("kvflow:keys"), True),
    ("gateway", lambda r: r.config_get("*"), False),
    ("scheduler", lambda r: r.exists("kvflow:kv:l:ab"), True),
    ("scheduler", lambda r: r.hset("kvflow:keys", "mallory", "h"), False),
    ("scheduler", lambda r: r.get("kvflow:key:h"), False),
    ("admin", lambda r: r.hgetall("kvflow:keys"), True),
    ("admin", lambda r: r.get("kvflow:kv:l:ab"), False),
    ("admin", lambda r: r.set("kvflow:scheduler:m:lease", "me"), False),
]


@pytest.mark.parametrize("role,op,allowed", REDIS_CASES)
def test_each_redis_role_reaches_only_its_keys(closed, role: str, op, allowed: bool) -> None:
    creds, _, rds = closed
    client = redis_as(rds, creds, role)
    if allowed:
        op(client)
    else:
        with pytest.raises(NoPermissionError):
            op(client)


async def test_the_key_store_and_the_lease_work_under_their_acls(closed) -> None:
    """The real code paths (Lua scripts included) as their roles: `kvflow keys` adds a key as
    admin, the gateway admits and counts it, the scheduler takes and renews its lease."""
    creds, _, rds = closed
    import redis.asyncio as aioredis

    def bus(role: str) -> BusSettings:
        return BusSettings(
            redis_url=rds.url, redis_password_file=str(creds.redis_password_file(role))
        )

    admin = aioredis.from_url(
        rds.url, decode_responses=True, **redis_options(bus("admin"), "admin")
    )
    gateway = aioredis.from_url(
        rds.url, decode_responses=True, **redis_options(bus("gateway"), "gateway")
    )
    try:
        key = await KeyStore(admin).add("tenant-a", rpm=5)
        admission = await KeyStore(gateway).admit(key)
        assert admission.status == "ok" and admission.name == "tenant-a"
        await KeyStore(gateway).record(admission.key_hash, 3, 4)
        with pytest.raises(NoPermissionError):
            await KeyStore(gateway).add("mallory")
        assert [k.requests for k in await KeyStore(admin).list()] == [1]
    finally:
        await admin.aclose()
        await gateway.aclose()
    lease = Lease(rds.url, "m", options=redis_options(bus("scheduler"), "scheduler"))
    try:
        assert await lease.try_acquire()
        await lease.renew()
        assert lease.valid() and lease.epoch == 1
        await lease.release()
    finally:
        await lease.close()


async def test_tls_with_a_test_ca(tmp_path: Path) -> None:
    trustme = pytest.importorskip("trustme")  # a dev dependency (pyproject [dev])
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "server.key"))
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "server.pem"))
    creds = generate(
        tmp_path / "auth",
        tls_cert=str(tmp_path / "server.pem"),
        tls_key=str(tmp_path / "server.key"),
    )
    server = start_nats(config=creds.nats_conf)
    try:
        settings = BusSettings(
            nats_url=f"tls://127.0.0.1:{server.port}",
            nats_password_file=str(creds.nats_password_file("worker")),
            nats_tls_ca=str(tmp_path / "ca.pem"),
        )
        bus = await connected(settings.nats_url, nats_auth(settings, "worker"))
        try:
            assert bus.client.connected_url.scheme == "tls"
            got = asyncio.get_running_loop().create_future()

            async def on_msg(msg: object, _raw: object) -> None:
                got.set_result(msg)

            await bus.subscribe(KV, on_msg)
            await bus.publish(KV, Ping())
            assert isinstance(await asyncio.wait_for(got, 5), Ping)
        finally:
            await bus.close()
        untrusted = BusSettings(
            nats_url=settings.nats_url, nats_password_file=settings.nats_password_file
        )  # the system's CAs do not know the test CA
        with pytest.raises(AccessError, match="certificate"):
            await Bus("w").connect(untrusted.nats_url, 5, nats_auth(untrusted, "worker"))
    finally:
        server.stop()


def test_a_service_refused_its_credentials_exits_78_naming_what(closed, tmp_path: Path) -> None:
    creds, nats, _ = closed
    wrong = tmp_path / "pw"
    wrong.write_text("not-the-password\n")
    env = {
        **os.environ,
        "KVFLOW_NATS_URL": nats.url,
        "KVFLOW_NATS_PASSWORD_FILE": str(wrong),
        "KVFLOW_OPS_PORT": "0",
    }
    out = subprocess.run(
        [sys.executable, "-m", "kvflow.cli.main", "run", "detokenizer"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == EXIT_REFUSED, out.stderr[-2000:]
    assert "refused" in out.stderr and "'detokenizer'" in out.stderr


def test_every_role_has_credentials() -> None:
    assert set(NATS_ROLES) == set(PUBLISHES) == set(SUBSCRIBES)
    assert set(REDIS_ROLES) == {"gateway", "scheduler", "worker", "admin"}
