"""`docker compose up` for real: the image is built from the Dockerfile, compose/docker-compose.yml
starts the stack (two workers, two detokenizers), and a user's checks run through the published
port: the openai SDK streams greedy text equal to Hugging Face transformers', /metrics answers,
both workers serve, a worker container killed mid-stream loses no request, nor do the
gateway's NATS node and the Redis primary killed together (the 3-node NATS cluster and Redis
with Sentinel are the default stack; the sentinels promote the replica, the killed ones
rejoin), the gateway's traces reach the collector, `docker compose stop` drains cleanly and `down -v` leaves nothing behind.
The stack is closed: the `auth` init service writes every role's credentials (kept by a second
run), clients without credentials are refused by NATS and Redis inside the compose network, a
role may not touch another's Redis keys, and `keys` manages API keys as Redis's admin.

Where Docker Hub cannot be reached (this workplace), ../shared/scripts/docker-offline.sh installs
the engine and makes local stand-ins for the python, nats and redis images; on a machine with
Docker Hub the images are pulled and the script is not needed. The observability images (the
OTel collector, Jaeger, Prometheus, Grafana) cannot be made here, so the collector is stood in for
by `kvflow traces` (kvflow's own OTLP/HTTP receiver) from the same image, under the collector's
service name; Jaeger, Prometheus and Grafana are not started by this test.

The first run on a fresh machine builds the image (several minutes); later runs reuse Docker's
layer cache, so only changed sources are copied and installed again."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import yaml

from kvflow.shared.infra import free_port
from tests.helpers.faults import MODEL, Stream
from tests.helpers.hf_reference import generate as hf_generate
from tests.helpers.stack import ROOT, openai_client

# The stack's setup (on a fresh machine: Docker's install, the stand-in images, the image build,
# 17 containers to healthy) is bounded by each step's own deadline below; the suite's 600 s
# bounds each test's own work.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600, func_only=True)]

COMPOSE_FILE = ROOT / "compose" / "docker-compose.yml"
OFFLINE_SCRIPT = ROOT.parent / "shared" / "scripts" / "docker-offline.sh"
PROJECT = "kvflow-e2e"
IMAGE = "kvflow:cpu"
STAND_IN_BASE = "local/python:3.11-bookworm"  # what docker-offline.sh makes python:* from
LOG = ROOT / ".pytest_cache" / "compose-e2e.log"
NEW_TOKENS = 24

# `kvflow traces` in the collector's place (see the module docstring), and no host ports for it
OVERRIDE = """
services:
  otel-collector:
    image: kvflow:cpu
    build: !reset null
    command: ["traces", "--host", "0.0.0.0", "--port", "4318", "--out", "/tmp/spans.jsonl"]
    depends_on: !reset {}
    ports: !reset []
    volumes: !reset []
    healthcheck:
      test: ["CMD", "python", "-c", "import socket; socket.create_connection(('127.0.0.1', 4318))"]
      interval: 2s
"""
NATS_NODES = ["nats-0", "nats-1", "nats-2"]
REDIS = ["redis-0", "redis-1", "sentinel-0", "sentinel-1", "sentinel-2"]  # redis-0: the primary
SERVERS = [*NATS_NODES, *REDIS]
STACK = [*SERVERS, "gateway", "tokenizer", "scheduler", "scheduler-standby"]
STACK += ["detokenizer", "worker", "otel-collector"]
INIT = "auth"  # one-shot: writes the credentials, exits 0 before anything else starts


def run(*cmd: str, timeout: float = 600, check: bool = True, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, **kw)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} -> {out.returncode}\n{out.stderr[-3000:]}")
    return out


def _has_image(tag: str) -> bool:
    return run("docker", "image", "inspect", tag, check=False).returncode == 0


def _base_images() -> list[str]:
    dockerfile = (ROOT / "Dockerfile").read_text()
    python = dockerfile.split("ARG PYTHON_IMAGE=", 1)[1].split()[0]
    services = yaml.safe_load(COMPOSE_FILE.read_text())["services"]
    return [python, services["nats-0"]["image"], services["redis-0"]["image"]]


def prepare_docker() -> bool:
    """A running engine with the base images; True where they are docker-offline.sh's stand-ins
    (then torch comes from the stand-in's local wheels instead of PyTorch's index)."""
    images = _base_images()
    engine = shutil.which("docker") and run("docker", "info", check=False).returncode == 0
    if engine:
        for tag in images:
            if not _has_image(tag):
                run("docker", "pull", tag, check=False, timeout=300)
    if not engine or not all(_has_image(t) for t in images):
        if not OFFLINE_SCRIPT.exists():
            pytest.fail(
                f"no Docker engine with {images}, and no {OFFLINE_SCRIPT} to make them: "
                "install Docker (with the compose plugin) or put ../shared beside the project"
            )
        print(f"compose e2e: {OFFLINE_SCRIPT.name} {' '.join(images)}", flush=True)
        run("bash", str(OFFLINE_SCRIPT), *images, timeout=1800)
    base = run("docker", "image", "inspect", "-f", "{{.Id}}", images[0]).stdout.strip()
    stand_in = run("docker", "image", "inspect", "-f", "{{.Id}}", STAND_IN_BASE, check=False)
    return stand_in.returncode == 0 and stand_in.stdout.strip() == base


@dataclass
class ComposeStack:
    base: str
    files: list[str]
    env: dict[str, str]

    def compose(self, *args: str, timeout: float = 600, check: bool = True):
        cmd = ["docker", "compose", "-p", PROJECT, *self.files, *args]
        return run(*cmd, timeout=timeout, check=check, env=self.env)

    def containers(self, all_: bool = False) -> list[dict]:
        out = self.compose("ps", "--format", "json", *(["-a"] if all_ else [])).stdout.strip()
        if out.startswith("["):  # older compose: one array; newer: one object per line
            return json.loads(out)
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def exec(self, container: str, *cmd: str) -> str:
        return run("docker", "exec", container, *cmd).stdout


def _wait_healthy(stack: ComposeStack, expected: int, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while True:
        cs = stack.containers(all_=True)
        init = [c for c in cs if c["Service"] == INIT]
        assert [(c["State"], c["ExitCode"]) for c in init] == [("exited", 0)], init
        cs = [c for c in cs if c["Service"] != INIT]
        states = {c["Name"]: (c["State"], c.get("Health", "")) for c in cs}
        if len(cs) >= expected and all(s == ("running", "healthy") for s in states.values()):
            return
        dead = {n: s for n, s in states.items() if s[0] in ("exited", "dead")}
        assert not dead, f"containers stopped while starting: {dead}"
        assert time.monotonic() < deadline, f"not healthy after {timeout:.0f} s: {states}"
        time.sleep(2)


@pytest.fixture(scope="module")
def compose_stack() -> Iterator[ComposeStack]:
    t0 = time.monotonic()
    stand_in = prepare_docker()
    t_docker = time.monotonic()
    build = ["docker", "build", "-t", IMAGE, str(ROOT)]
    if stand_in:  # no PyTorch index here: torch from the stand-in's local wheels
        build[2:2] = ["--build-arg", "TORCH_INDEX_URL="]
    run(*build, timeout=2400, env={**os.environ, "DOCKER_BUILDKIT": "0"})
    t_build = time.monotonic()

    LOG.parent.mkdir(exist_ok=True)
    override = LOG.parent / "compose-e2e.override.yml"
    override.write_text(OVERRIDE)
    env = {
        **os.environ,
        "KVFLOW_PUBLISHED_PORT": str(free_port()),
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel-collector:4318",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        # the collector is in this profile: without it, `ps` and `down` would not see it
        "COMPOSE_PROFILES": "observability",
    }
    files = ["-f", str(COMPOSE_FILE), "-f", str(override)]
    stack = ComposeStack(f"http://127.0.0.1:{env['KVFLOW_PUBLISHED_PORT']}", files, env)
    stack.compose("down", "-v", "--remove-orphans", timeout=120)  # what a crashed run left
    try:
        stack.compose(
            "up", "-d", "--no-build", "--scale", "worker=2", "--scale", "detokenizer=2", *STACK
        )
        _wait_healthy(stack, expected=len(STACK) + 2)
        t_up = time.monotonic()
        print(
            f"\ncompose e2e: docker ready {t_docker - t0:.0f} s, image build "
            f"{t_build - t_docker:.0f} s, up to healthy {t_up - t_build:.0f} s",
            flush=True,
        )
        yield stack
    finally:
        logs = stack.compose("logs", "--no-color", "--tail", "200", check=False)
        LOG.write_text(logs.stdout + logs.stderr)
        stack.compose("down", "-v", "--remove-orphans", timeout=300, check=False)


@pytest.fixture(scope="module")
def hf_reference(hf_model, tokenizer) -> dict[str, str]:
    """Greedy text of Hugging Face transformers for one completion and one chat."""

    def greedy(ids: list[int]) -> str:
        (new,) = hf_generate(hf_model, ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        return tokenizer.decode(new, skip_special_tokens=True)

    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three rivers in Europe."}],
        add_generation_prompt=True,
        tokenize=True,
    )
    if not isinstance(chat, list):  # transformers 5 returns a BatchEncoding
        chat = chat["input_ids"]
    return {
        "completion": greedy(tokenizer("The capital of France is")["input_ids"]),
        "chat": greedy(list(chat)),
    }


def test_the_openai_sdk_streams_greedy_text_equal_to_transformers(
    compose_stack: ComposeStack, hf_reference: dict[str, str]
) -> None:
    client = openai_client(compose_stack.base)
    t0 = time.monotonic()
    stream = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=NEW_TOKENS,
        temperature=0,
        stream=True,
    )
    pieces, first = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            first = first or time.monotonic()
            pieces.append(chunk.choices[0].text)
    print(f"\ncompose e2e: first streamed token {first - t0:.2f} s", flush=True)
    assert "".join(pieces) == hf_reference["completion"]

    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name three rivers in Europe."}],
        max_tokens=NEW_TOKENS,
        temperature=0,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == hf_reference["chat"]


def test_metrics_answer_on_the_gateway_and_in_every_service(compose_stack: ComposeStack) -> None:
    metrics = httpx.get(f"{compose_stack.base}/metrics", timeout=10)
    assert metrics.status_code == 200 and "vllm:e2e_request_latency_seconds" in metrics.text
    for c in compose_stack.containers():
        if c["Service"] in (*SERVERS, "gateway", "otel-collector"):
            continue
        code = "import urllib.request as u; print(u.urlopen('http://127.0.0.1:9100/metrics').read().decode())"
        assert "kvflow:bus_messages_total" in compose_stack.exec(c["Name"], "python", "-c", code)


def _prompts(n: int) -> list[str]:
    topics = ["rivers", "bridges", "winter", "markets", "lamps", "gardens", "letters", "clouds"]
    return [f"Tell a short story about {topics[i % 8]} number {i}." for i in range(n)]


def _workers(base: str) -> list[dict]:
    return httpx.get(f"{base}/stats", timeout=5).json()["workers"]


def test_both_workers_serve(compose_stack: ComposeStack) -> None:
    assert len(_workers(compose_stack.base)) == 2
    streams = [Stream(compose_stack.base, p, 8).start() for p in _prompts(8)]
    assert [s.join().error for s in streams] == [None] * 8
    assert all(w["num_prefills"] > 0 for w in _workers(compose_stack.base))


@pytest.fixture(scope="module")
def undisturbed(compose_stack: ComposeStack) -> list[str]:
    """The texts of 8 greedy streams nothing was done to."""
    reference = [s.join() for s in [Stream(compose_stack.base, p, 32).start() for p in _prompts(8)]]
    assert [(r.error, r.finish_reason) for r in reference] == [(None, "length")] * 8
    return [r.text for r in reference]


def _streams_under_way(base: str) -> list[Stream]:
    streams = [Stream(base, p, 32).start() for p in _prompts(8)]
    deadline = time.monotonic() + 120
    while min(len(s.pieces) for s in streams) < 3:  # every stream is under way
        assert time.monotonic() < deadline, "streams did not start"
        time.sleep(0.05)
    return streams


def test_a_worker_container_killed_mid_stream_loses_no_request(
    compose_stack: ComposeStack, undisturbed: list[str]
) -> None:
    base = compose_stack.base
    streams = _streams_under_way(base)
    busiest = max(_workers(base), key=lambda w: w["num_running"])
    assert busiest["num_running"] > 0
    workers = [c["Name"] for c in compose_stack.containers() if c["Service"] == "worker"]
    (victim,) = [
        n
        for n in workers
        if f"worker {busiest['worker_id']} ready" in run("docker", "logs", n).stderr
    ]
    run("docker", "kill", victim)
    for s in streams:
        s.join()
    assert [s.error for s in streams] == [None] * 8
    assert [s.text for s in streams] == undisturbed


def _container(stack: ComposeStack, service: str) -> str:
    (name,) = [c["Name"] for c in stack.containers(all_=True) if c["Service"] == service]
    return name


def _gateway_node(stack: ComposeStack) -> str:
    """The NATS node the gateway is connected to (each node's monitoring port lists its
    clients and the users they logged in as)."""
    for node in NATS_NODES:
        url = "http://127.0.0.1:8222/connz?auth=true&limit=1024"
        connz = json.loads(stack.exec(_container(stack, node), "wget", "-q", "-O", "-", url))
        if any(c.get("authorized_user") == "gateway" for c in connz.get("connections") or []):
            return node
    raise AssertionError("the gateway is connected to no NATS node")


def test_a_nats_node_and_the_redis_primary_killed_mid_stream_lose_nothing(
    compose_stack: ComposeStack, undisturbed: list[str]
) -> None:
    """`docker kill` of the gateway's NATS node and of the Redis primary while 8 streams run:
    every text equals the undisturbed one, a sentinel promotes the replica and `kvflow keys`
    writes to it; the killed containers start again, the node rejoins, the old primary comes
    back as a replica, and the stack serves."""
    base = compose_stack.base
    streams = _streams_under_way(base)
    node = _gateway_node(compose_stack)
    killed = [_container(compose_stack, node), _container(compose_stack, "redis-0")]
    t_kill = time.monotonic()
    run("docker", "kill", *killed)
    try:
        for s in streams:
            s.join()
        took = time.monotonic() - t_kill
        assert [s.error for s in streams] == [None] * 8
        assert [s.text for s in streams] == undisturbed
        (gateway,) = [c["Name"] for c in compose_stack.containers() if c["Service"] == "gateway"]
        deadline = time.monotonic() + 60  # the sentinels' votes may split: a second round
        while compose_stack.exec(gateway, "python", "-c", _PRIMARY).split() != ["redis-1", "6379"]:
            assert time.monotonic() < deadline, "the sentinels did not promote redis-1"
            time.sleep(0.5)
        t_promoted = time.monotonic() - t_kill
        # --no-deps: `run` would start the services `keys` depends on again, redis-0 among them
        keys = ["run", "--rm", "--no-deps", "-T", "keys"]
        assert compose_stack.compose(*keys, "add", "e2e-failover").stdout.strip()
        compose_stack.compose(*keys, "remove", "e2e-failover")
        print(
            f"\ncompose e2e: killed {node} and redis-0; 8 streams ended {took:.1f} s after, "
            f"the sentinels named redis-1 the primary {t_promoted:.1f} s after",
            flush=True,
        )
    finally:  # started again whatever happened: the later tests need every server
        run("docker", "start", *killed)

    deadline = time.monotonic() + 120
    inspect = ["docker", "inspect", "-f", "{{.State.Health.Status}}", *killed]
    while run(*inspect).stdout.split() != ["healthy", "healthy"]:
        assert time.monotonic() < deadline, run(*inspect).stdout
        time.sleep(1)
    routez = "http://127.0.0.1:8222/routez"
    while (
        len(json.loads(compose_stack.exec(killed[0], "wget", "-q", "-O", "-", routez))["routes"])
        < 2
    ):
        assert time.monotonic() < deadline, f"{node} did not rejoin the cluster"
        time.sleep(1)
    again = [Stream(base, p, 32).start() for p in _prompts(2)]
    assert [s.join().text for s in again] == undisturbed[:2]


# run in the gateway container: where the sentinels say the primary is (as the gateway's user)
_PRIMARY = """
from redis.sentinel import Sentinel
password = open("/run/secrets/kvflow/redis-password").read().strip()
login = {"username": "gateway", "password": password}
sentinels = [(f"sentinel-{i}", 26379) for i in range(3)]
try:
    print(*Sentinel(sentinels, sentinel_kwargs=login).discover_master("kvflow"))
except Exception as e:
    print("none:", type(e).__name__)
"""


def test_the_gateways_traces_reach_the_collector(compose_stack: ComposeStack) -> None:
    (collector,) = [
        c["Name"] for c in compose_stack.containers() if c["Service"] == "otel-collector"
    ]
    deadline = time.monotonic() + 60  # the exporters send in batches every few seconds
    while True:
        out = run("docker", "exec", collector, "cat", "/tmp/spans.jsonl", check=False).stdout
        services = {json.loads(line)["service"] for line in out.splitlines() if line.strip()}
        if "kvflow-gateway" in services:
            break
        assert time.monotonic() < deadline, f"no gateway spans; services seen: {services}"
        time.sleep(2)
    assert {"kvflow-scheduler", "kvflow-worker"} <= services


# run in the gateway container, on the compose network: no credentials, then the gateway's own
_REFUSED = """
import asyncio, nats, redis
async def connect():
    try:
        await nats.connect("nats://nats-0:4222", allow_reconnect=False, connect_timeout=5)
    except Exception as e:
        print("nats:", e)
    else:
        print("nats: connected")
asyncio.run(connect())
def get(client):
    try:
        client.get("kvflow:kv:0")
    except redis.exceptions.NoPermissionError as e:
        return "refused"
    return "allowed"
print("redis ping:", redis.Redis(host="redis-1").ping())
print("redis get:", get(redis.Redis(host="redis-1")))
password = open("/run/secrets/kvflow/redis-password").read().strip()
gateway = redis.Redis(host="redis-1", username="gateway", password=password)
print("gateway ping:", gateway.ping(), "get:", get(gateway))
"""


def test_the_stack_is_closed_to_clients_without_credentials(compose_stack: ComposeStack) -> None:
    (gateway,) = [c["Name"] for c in compose_stack.containers() if c["Service"] == "gateway"]
    out = compose_stack.exec(gateway, "python", "-c", _REFUSED).splitlines()
    assert out[0].startswith("nats:") and "Authorization Violation" in out[0], out
    assert out[1:] == [
        "redis ping: True",  # the health check's
        "redis get: refused",
        "gateway ping: True get: refused",  # the KV tier is the workers', not the gateway's
    ]

    # a second run of the init service keeps the credentials the services have
    password = compose_stack.exec(gateway, "cat", "/run/secrets/kvflow/nats-password")
    again = compose_stack.compose("run", "--rm", "-T", INIT)
    assert "kept" in again.stdout + again.stderr
    assert compose_stack.exec(gateway, "cat", "/run/secrets/kvflow/nats-password") == password


def test_keys_manages_api_keys_as_the_redis_admin(compose_stack: ComposeStack) -> None:
    key = compose_stack.compose("run", "--rm", "-T", "keys", "add", "e2e-alice", "--rpm", "5")
    assert key.stdout.strip()
    listed = compose_stack.compose("run", "--rm", "-T", "keys", "list").stdout
    assert any(line.split()[:2] == ["e2e-alice", "5"] for line in listed.splitlines()), listed
    compose_stack.compose("run", "--rm", "-T", "keys", "remove", "e2e-alice")


def test_stop_drains_cleanly_and_down_leaves_nothing(compose_stack: ComposeStack) -> None:
    compose_stack.compose("stop", timeout=300)
    exits = {
        c["Name"]: c["ExitCode"]
        for c in compose_stack.containers(all_=True)
        if c["Service"] not in SERVERS
    }
    killed = {n for n, code in exits.items() if code == 137}  # the worker killed above
    assert len(killed) <= 1, exits
    failed = {n: code for n, code in exits.items() if n not in killed and code != 0}
    if failed:  # name them with the end of their logs (pytest cuts a long dict short)
        tails = {n: run("docker", "logs", "--tail", "40", n, check=False) for n in failed}
        logs = "\n".join(f"--- {n}\n{t.stdout[-3000:]}{t.stderr[-3000:]}" for n, t in tails.items())
        raise AssertionError(f"not stopped cleanly: {failed}\n{logs}")
    compose_stack.compose("down", "-v", "--remove-orphans", timeout=300)
    label = f"label=com.docker.compose.project={PROJECT}"
    for kind in ("container", "volume", "network"):
        flags = ["-a"] if kind == "container" else []
        left = run("docker", kind, "ls", *flags, "-q", "--filter", label).stdout.split()
        assert left == [], f"{kind}s left behind: {left}"
