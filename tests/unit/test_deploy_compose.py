"""compose/docker-compose.yml: valid against the Compose Specification's JSON schema (vendored
from compose-spec/compose-spec, schema/compose-spec.json), every kvflow container runs a
command `kvflow` accepts with settings that exist, everything is health-checked and restarted,
and the observability config scrapes every service and graphs metrics that exist."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest
import yaml

from kvflow.cli.main import SERVICES
from tests.unit.deploy_support import (
    ROOT,
    environ_of_compose,
    exported_metric_names,
    load_schema,
    metric_names_in,
    parse_kvflow_command,
)

COMPOSE = ROOT / "compose"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())


def _kvflow_services(compose: dict) -> dict[str, dict]:
    return {n: s for n, s in compose["services"].items() if s["image"].startswith("kvflow:")}


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
    assert {"nats", "redis", *SERVICES} <= default
    for name, svc in services.items():
        assert svc.get("restart") in ("always", "unless-stopped", "on-failure"), name
        assert svc.get("healthcheck", {}).get("test"), f"{name} has no health check"
        # Docker Engine < 25 (Debian's docker.io 20.10) refuses the whole file over this key
        assert "start_interval" not in svc["healthcheck"], name
    assert "--jetstream" in services["nats"]["command"]
    assert "${KVFLOW_PUBLISHED_PORT:-8000}:8000" in services["gateway"]["ports"]
    kvflow = _kvflow_services(compose)
    for name, svc in kvflow.items():
        needs = svc["depends_on"]
        assert needs["nats"]["condition"] == "service_healthy", name
        assert needs["redis"]["condition"] == "service_healthy", name


def test_kvflow_containers_run_commands_kvflow_accepts(compose) -> None:
    kvflow = _kvflow_services(compose)
    ran = set()
    for name, svc in kvflow.items():
        cmd = parse_kvflow_command(svc["command"], environ_of_compose(svc))
        assert name == cmd.service or name.startswith(f"{cmd.service}-"), name
        ran.add(cmd.service)
        s = cmd.settings
        assert s.bus.nats_url == "nats://nats:4222" and s.bus.redis_url.startswith("redis://redis:")
        health_url = svc["healthcheck"]["test"][-1]
        if cmd.service == "gateway":
            assert (
                s.gateway.host == "0.0.0.0"
                and health_url == f"http://127.0.0.1:{s.gateway.port}/health"
            )
        else:
            assert s.ops.ops_port and health_url == f"http://127.0.0.1:{s.ops.ops_port}/health"
        assert svc["healthcheck"]["test"][:4] == ["CMD", "python", "-m", "shared.ops_http"]
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
