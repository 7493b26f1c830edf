"""The observability deployment: the Grafana dashboard is a well-formed dashboard whose panels
cover throughput, latency, KV usage, queue depth per stage and errors with series the services
export; Kubernetes ships the same dashboard; scrapers take the gateway's own series only (its
default /metrics gathers every service's); KEDA reads the engine series where they live."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.helpers.deploy import ROOT, exported_metric_names, metric_names_in, render_k8s

DASHBOARD = ROOT / "compose" / "grafana" / "dashboards" / "kvflow.json"


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(dashboard: dict) -> list[dict]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def test_dashboard_is_well_formed(dashboard) -> None:
    assert dashboard["uid"] == "kvflow" and dashboard["title"]
    assert isinstance(dashboard["schemaVersion"], int)
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    cells: set[tuple[int, int]] = set()
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] >= 1 and g["x"] + g["w"] <= 24, p["title"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
    datasources = yaml.safe_load(
        (
            ROOT / "compose" / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
        ).read_text()
    )
    prometheus = {d["uid"] for d in datasources["datasources"] if d["type"] == "prometheus"}
    for p in _panels(dashboard):
        assert p["datasource"]["uid"] in prometheus, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            expr = t["expr"]
            assert expr.count("(") == expr.count(")") and expr.count("[") == expr.count("]"), expr
            assert expr.count("{") == expr.count("}"), expr


def test_dashboard_covers_each_concern_with_exported_series(dashboard) -> None:
    exported = exported_metric_names()
    reads = {
        p["title"]: set().union(*(metric_names_in(t["expr"]) for t in p["targets"]))
        for p in _panels(dashboard)
    }
    for title, names in reads.items():
        assert names and names <= exported, f"{title}: {names - exported}"
    every = set().union(*reads.values())
    concerns = {
        "throughput": {"vllm:generation_tokens_total", "vllm:prompt_tokens_total"},
        "latency": {
            "vllm:time_to_first_token_seconds_bucket",
            "vllm:inter_token_latency_seconds_bucket",
            "vllm:e2e_request_latency_seconds_bucket",
        },
        "KV usage": {"vllm:kv_cache_usage_perc", "kvflow:worker_kv_cache_usage_perc"},
        "queue depth per stage": {
            "kvflow:gateway_open_requests",
            "vllm:num_requests_waiting",
            "kvflow:worker_plans_queued",
            "kvflow:worker_busy_fraction",
            "kvflow:bus_pending_messages",
        },
        "errors": {
            "vllm:request_success_total",
            "kvflow_bus_dropped_messages_total",
            "kvflow_bus_permission_denied_total",
            "kvflow_bus_large_messages_total",
        },
        "request phases": {
            "vllm:request_queue_time_seconds_bucket",
            "vllm:request_prefill_time_seconds_bucket",
            "vllm:request_decode_time_seconds_bucket",
        },
    }
    for concern, names in concerns.items():
        assert names <= every, f"{concern}: {names - every} not graphed"
    # latency panels show percentiles
    ttft = next(p for p in _panels(dashboard) if p["title"] == "Time to first token")
    assert [t["legendFormat"] for t in ttft["targets"]] == ["p50", "p95", "p99"]


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_kubernetes_ships_the_dashboard_and_scrapes_without_double_counting(overlay) -> None:
    docs = render_k8s(overlay)
    by_kind: dict[str, dict[str, dict]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
    cm = by_kind["ConfigMap"]["kvflow-grafana-dashboard"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["kvflow.json"]) == json.loads(DASHBOARD.read_text())
    monitor = by_kind["ServiceMonitor"]["kvflow"]
    http = next(e for e in monitor["spec"]["endpoints"] if e["port"] == "http")
    assert http["params"] == {"scope": ["local"]}
    queries = [
        t["metadata"]["query"]
        for so in by_kind["ScaledObject"].values()
        for t in so["spec"]["triggers"]
    ]
    assert queries and all('job="scheduler"' in q for q in queries)  # engine series live there


def test_compose_prometheus_takes_the_gateways_own_series() -> None:
    prom = yaml.safe_load((ROOT / "compose" / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    assert jobs["gateway"]["params"] == {"scope": ["local"]}
    assert all("params" not in j for name, j in jobs.items() if name != "gateway")
