"""compose/docker-compose.yml: valid against the Compose Specification's JSON schema (vendored
from compose-spec/compose-spec, schema/compose-spec.json), every kvflow container runs a
command `kvflow` accepts with settings that exist, everything is health-checked and restarted,
the stack is closed by default (an init service writes each role's credentials into a volume
of its own, each service mounts only its role's, NATS and Redis load the users and
permissions), and the observability config scrapes every service and graphs metrics that
exist. The access checks read the file as `docker compose config` resolves it where the
compose plugin is installed (anchors, merges, interpolation as Docker does them), else as
YAML."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from pathlib import Path, PurePosixPath

import jsonschema
import pytest
import yaml

from kvflow.cli.keys import redis_settings
from kvflow.cli.main import SERVICES, build_parser
from kvflow.shared.access.connect import parse_sentinel_url
from kvflow.shared.access.credentials import (
    NATS_CLUSTER_CONF,
    NATS_PASSWORD,
    NATS_ROUTES,
    REDIS_ACL,
    REDIS_PASSWORD,
    REDIS_REPLICATION_CONF,
    SENTINEL_CONF,
    generate,
)
from kvflow.shared.access.grants import NATS_ROLES, REDIS_ROLES, ROLES, SENTINEL_MASTER
from kvflow.shared.access.render import redis_acl, sentinel_monitor
from kvflow.shared.bus import server_urls
from tests.helpers.deploy import (
    ROOT,
    environ_of_compose,
    exported_metric_names,
    load_schema,
    metric_names_in,
    parse_kvflow_command,
)

COMPOSE = ROOT / "compose"
COMPOSE_FILE = COMPOSE / "docker-compose.yml"
SECRETS = PurePosixPath("/run/secrets/kvflow")  # where a service finds its role's files
INIT = "auth"  # the one-shot service that writes every role's credentials
TOOLS = {"keys"}  # one-shot `docker compose run` tools
ONE_SHOT = {INIT, *TOOLS}
NATS_NODES = ["nats-0", "nats-1", "nats-2"]
REDIS_SERVERS = ["redis-0", "redis-1"]  # the primary at the first start, its replica
SENTINELS = ["sentinel-0", "sentinel-1", "sentinel-2"]
SERVERS = [*NATS_NODES, *REDIS_SERVERS, *SENTINELS]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


@pytest.fixture(scope="module")
def resolved(compose) -> dict:
    """The file as `docker compose config` resolves it, every profile on; the YAML where the
    compose plugin is missing. The caller's KVFLOW_*/OTEL_*/COMPOSE_* variables are left out,
    so the defaults are checked."""
    if shutil.which("docker"):
        skip = ("KVFLOW_", "OTEL_", "COMPOSE_")
        env = {k: v for k, v in os.environ.items() if not k.startswith(skip)}
        cmd = ["docker", "compose", "-f", str(COMPOSE_FILE), "--profile", "*", "config"]
        out = subprocess.run(
            [*cmd, "--format", "json"], capture_output=True, text=True, env=env, timeout=60
        )
        if out.returncode == 0:
            return json.loads(out.stdout)
    return _defaults(compose)


def _defaults(node: object) -> object:
    """``${NAME:-default}`` / ``${NAME-default}`` / ``${NAME}`` resolved to their defaults (""
    without one), as `docker compose config` resolves them with the variables unset."""
    if isinstance(node, dict):
        return {k: _defaults(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_defaults(v) for v in node]
    if isinstance(node, str):
        return re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*(?::?-([^}]*))?\}", lambda m: m[1] or "", node)
    return node


def _mounts(svc: dict) -> list[tuple[str, str, bool]]:
    """(source, target, read-only) of each volume, in compose's short or long syntax."""
    out = []
    for v in svc.get("volumes", []):
        if isinstance(v, str):
            source, target, *mode = v.split(":")
            out.append((source, target, "ro" in "".join(mode).split(",")))
        else:
            out.append((v.get("source", ""), v["target"], bool(v.get("read_only"))))
    return out


def _needs(svc: dict) -> dict[str, str]:
    """depends_on as service -> condition."""
    deps = svc.get("depends_on") or {}
    if isinstance(deps, list):
        return dict.fromkeys(deps, "service_started")
    return {name: d.get("condition", "service_started") for name, d in deps.items()}


def _kvflow_services(compose: dict) -> dict[str, dict]:
    """The containers that run a kvflow service (`kvflow run SERVICE`)."""
    return {
        n: s
        for n, s in compose["services"].items()
        if s["image"].startswith("kvflow:") and n not in ONE_SHOT
    }


def _role(svc: dict) -> str:
    return parse_kvflow_command(svc["command"], environ_of_compose(svc)).service


def test_compose_file_is_valid_against_the_compose_spec_schema(compose) -> None:
    validator = jsonschema.Draft7Validator(load_schema("compose-spec.json"))
    errors = [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(compose)]
    assert errors == []

    broken = copy.deepcopy(compose)  # the schema is strict enough to catch a typo
    broken["services"]["gateway"]["helthcheck"] = broken["services"]["gateway"].pop("healthcheck")
    assert list(validator.iter_errors(broken))


def test_every_service_has_its_own_container_health_check_and_restart_policy(compose) -> None:
    services = compose["services"]
    default = {n for n, s in services.items() if "profiles" not in s}
    assert {*SERVERS, *SERVICES} <= default
    assert {INIT} <= default and all("tools" in services[n]["profiles"] for n in TOOLS)
    for name, svc in services.items():
        if name in ONE_SHOT:  # runs once and exits 0: a restart policy would run it forever
            assert svc.get("restart", "no") == "no", name
            continue
        assert svc.get("restart") in ("always", "unless-stopped", "on-failure"), name
        assert svc.get("healthcheck", {}).get("test"), f"{name} has no health check"
        # Docker Engine < 25 (Debian's docker.io 20.10) refuses the whole file over this key
        assert "start_interval" not in svc["healthcheck"], name
    assert "${KVFLOW_PUBLISHED_PORT:-8000}:8000" in services["gateway"]["ports"]
    kvflow = _kvflow_services(compose)
    for name, svc in kvflow.items():  # every NATS node, and the sentinels (Redis through them)
        needs = _needs(svc)
        for server in [*NATS_NODES, *SENTINELS]:
            assert needs[server] == "service_healthy", (name, server)


def test_kvflow_containers_run_commands_kvflow_accepts(compose) -> None:
    kvflow = _kvflow_services(compose)
    ran = set()
    for name, svc in kvflow.items():
        cmd = parse_kvflow_command(svc["command"], environ_of_compose(svc))
        assert name == cmd.service or name.startswith(f"{cmd.service}-"), name
        ran.add(cmd.service)
        s = cmd.settings
        assert server_urls(s.bus.nats_url) == [f"nats://{n}:4222" for n in NATS_NODES]
        if cmd.service in REDIS_ROLES:  # the primary, wherever it is, from the sentinels
            sentinels, master, _, tls = parse_sentinel_url(s.bus.redis_url)
            assert sentinels == [(n, 26379) for n in SENTINELS] and master == SENTINEL_MASTER
            assert not tls, name
        else:  # no Redis credentials: nothing to do there
            assert s.bus.redis_url == "", name
        health_url = svc["healthcheck"]["test"][-1]
        if cmd.service == "gateway":
            assert (
                s.gateway.host == "0.0.0.0"
                and health_url == f"http://127.0.0.1:{s.gateway.port}/health"
            )
        else:
            assert s.ops.ops_port and health_url == f"http://127.0.0.1:{s.ops.ops_port}/health"
        assert svc["healthcheck"]["test"][:4] == ["CMD", "python", "-m", "kvflow.shared.ops_http"]
        if name == "worker":  # one rank unless KVFLOW_TENSOR_PARALLEL_SIZE is set higher
            assert s.worker.tensor_parallel_size == 1
            assert svc["environment"]["KVFLOW_TENSOR_PARALLEL_SIZE"] == "1"
    assert ran == set(SERVICES)


def test_gpu_profile_runs_disaggregated_workers_on_nvidia_devices(compose) -> None:
    gpu = {n: s for n, s in compose["services"].items() if "gpu" in s.get("profiles", [])}
    roles = set()
    for name, svc in gpu.items():
        cmd = parse_kvflow_command(svc["command"], environ_of_compose(svc))
        assert cmd.service == "worker", name
        roles.add(cmd.settings.worker.role)
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
        assert svc["build"]["args"]["TORCH_VARIANT"] != "cpu"
    assert roles == {"prefill", "decode"}


def test_observability_profile_and_prometheus_scrape_every_service(compose) -> None:
    obs = {n for n, s in compose["services"].items() if "observability" in s.get("profiles", [])}
    assert {"otel-collector", "jaeger", "prometheus", "grafana"} <= obs
    for name, svc in compose["services"].items():  # mounted config files exist
        for volume in svc.get("volumes", []):
            src = volume.split(":")[0]
            if src.startswith("./"):
                assert (COMPOSE / src).exists(), f"{name} mounts missing {src}"

    prom = yaml.safe_load((COMPOSE / "prometheus" / "prometheus.yml").read_text())
    scraped: dict[str, int] = {}
    for job in prom["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            for host in sd["names"]:
                scraped[host] = sd["port"]
    for name, svc in _kvflow_services(compose).items():
        cmd = parse_kvflow_command(svc["command"], environ_of_compose(svc))
        port = cmd.settings.gateway.port if cmd.service == "gateway" else cmd.settings.ops.ops_port
        assert scraped.get(name) == port, f"Prometheus does not scrape {name} on {port}"


def test_grafana_dashboard_queries_metrics_the_services_export() -> None:
    dashboard = json.loads((COMPOSE / "grafana" / "dashboards" / "kvflow.json").read_text())
    exported = exported_metric_names()
    assert "vllm:time_to_first_token_seconds_bucket" in exported  # the helper sees vLLM names
    exprs = [t["expr"] for p in dashboard["panels"] if p["type"] != "row" for t in p["targets"]]
    assert len(exprs) >= 10
    used = set().union(*(metric_names_in(e) for e in exprs))
    assert used - exported == set()
    assert {
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
    } <= used
    assert metric_names_in("sum(rate(vllm:typo_total[1m]))") - exported == {"vllm:typo_total"}

    datasources = yaml.safe_load(
        (COMPOSE / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )
    uids = {d["uid"] for d in datasources["datasources"]}
    assert {p["datasource"]["uid"] for p in dashboard["panels"] if "datasource" in p} <= uids


# -- closed by default: credentials per role ---------------------------------------------------


def test_every_kvflow_service_mounts_only_its_own_roles_credentials(resolved) -> None:
    """One volume per role, read-only at /run/secrets/kvflow, and the password files the
    settings name there; the user is left to default to the role (the service's name)."""
    kvflow = _kvflow_services(resolved)
    assert {"worker-prefill", "worker-decode", "scheduler-standby"} <= set(kvflow)
    for name, svc in kvflow.items():
        cmd = parse_kvflow_command(svc["command"], environ_of_compose(svc))
        role, bus = cmd.service, cmd.settings.bus
        assert _mounts(svc) == [(f"kvflow-auth-{role}", str(SECRETS), True)], name
        assert role in NATS_ROLES and bus.nats_user == "", name
        assert bus.nats_password_file == str(SECRETS / NATS_PASSWORD), name
        if role in REDIS_ROLES:
            assert bus.redis_user == "" and bus.redis_password_file == str(SECRETS / REDIS_PASSWORD)
        else:
            assert bus.redis_password_file == "", name

    # a role's volume is mounted by the init service and that role's services, nobody else
    mounted_by: dict[str, set[str]] = {}
    for name, svc in resolved["services"].items():
        for source, _, _ in _mounts(svc):
            mounted_by.setdefault(source, set()).add(name)
    for role in ROLES:
        users = {n for n, s in kvflow.items() if _role(s) == role}
        if role == "admin":
            users = set(TOOLS)
        assert mounted_by[f"kvflow-auth-{role}"] == {INIT, *users}, role
    assert mounted_by["kvflow-auth-nats"] == {INIT, *NATS_NODES}
    assert mounted_by["kvflow-auth-redis"] == {INIT, *REDIS_SERVERS, *SENTINELS}


def test_the_init_service_writes_every_file_of_auth_init_into_a_volume(
    resolved, tmp_path: Path
) -> None:
    """`kvflow auth init /out --if-missing --mode 644` as root, each top-level directory it
    writes a named volume of the project's own (so `down -v` removes them), nothing left in
    the container's own layer."""
    init = resolved["services"][INIT]
    args = build_parser("auth").parse_args(init["command"])
    assert (args.command, args.auth_command) == ("auth", "init")
    assert args.if_missing and not args.force and int(args.mode, 8) == 0o644
    assert str(init["user"]).split(":")[0] in ("0", "root")
    assert not init.get("entrypoint") and init["image"] == "kvflow:cpu"
    assert init.get("network_mode") == "none"  # it only writes files

    generate(tmp_path)  # what `kvflow auth init` writes
    written = {p.name for p in tmp_path.iterdir()}
    assert all((tmp_path / d).is_dir() for d in written)  # no file at the top
    assert set(ROLES) | {NATS_CLUSTER_CONF.parent.name, REDIS_ACL.parent.name} == written
    out = PurePosixPath(str(args.dir))
    assert sorted(_mounts(init)) == sorted(
        (f"kvflow-auth-{d}", str(out / d), False) for d in written
    )
    for d in written:
        volume = resolved["volumes"][f"kvflow-auth-{d}"] or {}
        assert not volume.get("external"), d


def _aliases(svc: dict) -> list[str]:
    return (svc.get("networks") or {}).get("default", {}).get("aliases", [])


def test_nats_nodes_form_one_cluster_with_the_users_and_are_not_published(resolved) -> None:
    """Each node: cluster.conf (nats.conf's users and permissions, the routes) under its own
    name, reachable under the name cluster.conf's routes give it."""
    services = resolved["services"]
    assert [n for n in services if n.startswith("nats")] == NATS_NODES
    routes = [r.rsplit(":", 1)[0] for r in NATS_ROUTES]
    for node, route in zip(NATS_NODES, routes, strict=True):
        svc = services[node]
        cmd = svc["command"]
        conf = PurePosixPath(cmd[cmd.index("-c") + 1])
        assert conf.name == NATS_CLUSTER_CONF.name
        assert _mounts(svc) == [("kvflow-auth-nats", str(conf.parent), True)]
        assert cmd[cmd.index("--name") + 1] == node
        assert route in _aliases(svc), node
        assert "--http_port" in cmd and "8222" in svc["healthcheck"]["test"][-1]
        assert not svc.get("ports"), node  # only the compose network reaches it


def test_redis_runs_a_primary_a_replica_and_three_sentinels_with_the_users(resolved) -> None:
    services = resolved["services"]
    for name in REDIS_SERVERS:
        svc, cmd = services[name], services[name]["command"]
        acl = PurePosixPath(cmd[cmd.index("--aclfile") + 1])
        assert cmd[0] == "redis-server" and acl.name == REDIS_ACL.name
        assert PurePosixPath(cmd[1]).name == REDIS_REPLICATION_CONF.name  # a replica's login
        assert ("kvflow-auth-redis", str(acl.parent), True) in _mounts(svc)
        assert cmd[cmd.index("--replica-announce-ip") + 1] == name
        assert ("--replicaof" in cmd) == (name != REDIS_SERVERS[0]), name
        # the health check logs in as nobody: the default user may PING and nothing else
        assert svc["healthcheck"]["test"][1:] == ["redis-cli", "ping"]
    replica = services[REDIS_SERVERS[1]]["command"]
    assert replica[replica.index("--replicaof") + 1 :][:2] == [REDIS_SERVERS[0], "6379"]
    (default,) = [line for line in redis_acl({}).splitlines() if line.startswith("user default")]
    assert default.split()[-2:] == ["-@all", "+ping"]

    monitor = sentinel_monitor(REDIS_SERVERS[0], 6379).splitlines()
    for name in SENTINELS:
        svc = services[name]
        script = svc["command"][-1].replace("$$", "$")  # compose's escape of a shell's $
        written = [
            line.split("echo ", 1)[1].strip('"') for line in script.splitlines() if "echo " in line
        ]
        assert written[0] == "port 26379" and "sentinel announce-ip $SENTINEL_NAME" in written
        assert svc["environment"]["SENTINEL_NAME"] == name
        assert [w for w in written if w in monitor] == monitor  # what `kvflow serve` writes
        assert f"cat /etc/kvflow/redis/{SENTINEL_CONF.name}" in script
        assert "--sentinel" in script and (
            "kvflow-auth-redis",
            "/etc/kvflow/redis",
            True,
        ) in _mounts(svc)
        assert any(target == "/data" for _, target, _ in _mounts(svc))  # its own rewritten file
        assert svc["healthcheck"]["test"][1:] == ["redis-cli", "-p", "26379", "ping"]
    for name in [*REDIS_SERVERS, *SENTINELS]:
        assert not services[name].get("ports"), name


def test_every_service_waits_for_the_credentials(resolved) -> None:
    services = resolved["services"]
    waiting = {*SERVERS, *_kvflow_services(resolved), *TOOLS}
    for name in waiting:
        assert _needs(services[name]).get(INIT) == "service_completed_successfully", name
    assert not _needs(services[INIT])
    for name, svc in services.items():  # the third-party observability images need none
        if name not in waiting | {INIT}:
            assert "observability" in svc["profiles"], name


def test_keys_runs_kvflow_keys_as_the_redis_admin(resolved, monkeypatch) -> None:
    """`docker compose run --rm keys add NAME`: `kvflow keys` logged in as Redis's admin (the
    user a password file implies), from the admin volume, which no service mounts."""
    keys = resolved["services"]["keys"]
    assert _mounts(keys) == [("kvflow-auth-admin", str(SECRETS), True)]
    assert all(_needs(keys)[s] == "service_healthy" for s in SENTINELS)
    assert keys["entrypoint"] == ["kvflow", "keys"]
    env = environ_of_compose(keys)
    assert env.get("KVFLOW_REDIS_USER", "admin") == "admin"
    for name, value in env.items():  # `kvflow keys` takes its login from these variables
        monkeypatch.setenv(name, value)
    args = build_parser("keys").parse_args(["keys", *keys["command"]])
    bus = redis_settings(args)  # the variables, read as the services read them
    assert parse_sentinel_url(bus.redis_url)[0] == [(n, 26379) for n in SENTINELS]
    assert bus.redis_password_file == str(SECRETS / REDIS_PASSWORD)

    gateway = environ_of_compose(resolved["services"]["gateway"])
    assert gateway["KVFLOW_KEY_STORE"] == ""  # open API by default; 'redis' checks the keys
