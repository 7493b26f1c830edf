"""k8s/: each overlay rendered by a real kustomize (kubectl kustomize), from a copy of k8s/
whose base/secrets holds what `kvflow auth init` writes (the Secrets are generated from those
files; the real tree has none, and the build refuses to run without them), is valid against
the Kubernetes schemas (kubernetes-validate, strict) and, for KEDA's ScaledObject and the
prometheus-operator's ServiceMonitor, against their CRDs' schemas (vendored); cert-manager's
Issuer and Certificate (components/nats-tls), whose CRDs are not vendored, against a small
closed schema of the fields used here. Every kvflow container runs a command `kvflow` accepts
with settings that exist, and has probes on the ports its settings open, resources, and the
scaling and disruption objects the design asks for. Access control (Secrets, NetworkPolicies,
security contexts, TLS): test_deploy_k8s_access.py."""

from __future__ import annotations

import copy

import jsonschema
import kubernetes_validate
import pytest

from kvflow.cli.main import SERVICES
from kvflow.shared.access.connect import parse_sentinel_url
from kvflow.shared.access.grants import SENTINEL_MASTER
from kvflow.shared.bus import server_urls
from tests.helpers.deploy import (
    COMPONENTS,
    OVERLAYS,
    closed_crd_schema,
    environ_of_container,
    exported_metric_names,
    load_schema,
    metric_names_in,
    parse_kvflow_command,
    render_k8s,
)

K8S_VERSION = "1.33"
CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "keda-scaledobject-v1alpha1.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring-servicemonitor-v1.json",
}


def rendered(overlay: str) -> tuple[dict, ...]:
    return render_k8s(overlay)


# cert-manager's CRDs are not vendored: the fields these manifests use, closed (a misspelled
# field fails), with the ones cert-manager requires
_REF = {
    "type": "object",
    "required": ["name", "kind"],
    "properties": {"name": {"type": "string"}, "kind": {"enum": ["Issuer", "ClusterIssuer"]},
                   "group": {"const": "cert-manager.io"}},
    "additionalProperties": False,
}  # fmt: skip
_META = {"type": "object", "required": ["name", "namespace"]}
CERT_MANAGER_SCHEMAS = {
    "Issuer": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "cert-manager.io/v1"},
            "kind": {"const": "Issuer"},
            "metadata": _META,
            "spec": {
                "type": "object",
                "minProperties": 1,
                "maxProperties": 1,
                "properties": {
                    "selfSigned": {"type": "object", "additionalProperties": False},
                    "ca": {
                        "type": "object",
                        "required": ["secretName"],
                        "properties": {"secretName": {"type": "string"}},
                        "additionalProperties": False,
                    },
                },
                "additionalProperties": False,
            },
        },
        "additionalProperties": False,
    },
    "Certificate": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "cert-manager.io/v1"},
            "kind": {"const": "Certificate"},
            "metadata": _META,
            "spec": {
                "type": "object",
                "required": ["secretName", "issuerRef"],
                "anyOf": [{"required": ["commonName"]}, {"required": ["dnsNames"]}],
                "properties": {
                    "secretName": {"type": "string"},
                    "issuerRef": _REF,
                    "isCA": {"type": "boolean"},
                    "commonName": {"type": "string"},
                    "dnsNames": {"type": "array", "items": {"type": "string"}, "minItems": 1},
                    "duration": {"type": "string", "pattern": "^[0-9]+h$"},
                    "renewBefore": {"type": "string", "pattern": "^[0-9]+h$"},
                    "usages": {"type": "array", "items": {"enum": [
                        "server auth", "client auth", "digital signature", "key encipherment",
                        "cert sign"]}},
                    "privateKey": {
                        "type": "object",
                        "properties": {
                            "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
                            "size": {"type": "integer"},
                            "rotationPolicy": {"enum": ["Never", "Always"]},
                        },
                        "additionalProperties": False,
                    },
                },
                "additionalProperties": False,
            },
        },
        "additionalProperties": False,
    },
}  # fmt: skip


def _of_kind(docs, kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def validate_resource(doc: dict) -> None:
    """Raise if ``doc`` does not match its kind's schema."""
    if doc["apiVersion"].startswith("cert-manager.io/"):
        jsonschema.Draft7Validator(CERT_MANAGER_SCHEMAS[doc["kind"]]).validate(doc)
        return
    crd = CRD_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
    if crd is None:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        return
    schema = closed_crd_schema(load_schema(crd))
    jsonschema.Draft7Validator(schema).validate(doc)


@pytest.mark.parametrize("components", [(), COMPONENTS], ids=["plain", "components"])
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendered_manifests_are_valid_kubernetes_objects(overlay: str, components) -> None:
    docs = render_k8s(overlay, components)
    assert len(docs) > 10
    kinds = {d["kind"] for d in docs}
    assert {"Secret", "NetworkPolicy"} <= kinds
    assert ("Certificate" in kinds) == ("nats-tls" in components)
    for doc in docs:
        try:
            validate_resource(doc)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as e:
            pytest.fail(f"{overlay}: {doc['kind']}/{doc['metadata']['name']}: {e}")
        assert doc["kind"] == "Namespace" or doc["metadata"]["namespace"] == "kvflow"


def test_the_validators_reject_broken_objects() -> None:
    docs = rendered("cpu")
    deployment = copy.deepcopy(_of_kind(docs, "Deployment")["gateway"])
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_resource(deployment)
    scaled = copy.deepcopy(_of_kind(docs, "ScaledObject")["worker"])
    scaled["spec"]["maxReplicas"] = 3  # KEDA spells it maxReplicaCount
    with pytest.raises(jsonschema.ValidationError):
        validate_resource(scaled)
    monitor = copy.deepcopy(_of_kind(docs, "ServiceMonitor")["kvflow"])
    del monitor["spec"]["selector"]
    with pytest.raises(jsonschema.ValidationError):
        validate_resource(monitor)
    tls = render_k8s("cpu", ("nats-tls",))
    cert = copy.deepcopy(_of_kind(tls, "Certificate")["nats-server"])
    cert["spec"]["dnsName"] = cert["spec"].pop("dnsNames")
    with pytest.raises(jsonschema.ValidationError):
        validate_resource(cert)
    issuer = copy.deepcopy(_of_kind(tls, "Issuer")["kvflow-ca"])
    issuer["spec"]["ca"]["secret"] = issuer["spec"]["ca"].pop("secretName")
    with pytest.raises(jsonschema.ValidationError):
        validate_resource(issuer)


def _kvflow_containers(docs):
    """The kvflow services' containers (``kvflow run SERVICE``; components/keys-admin's
    container, which only waits for `kubectl exec`, sets its own command)."""
    configmaps = _of_kind(docs, "ConfigMap")
    for name, dep in _of_kind(docs, "Deployment").items():
        for c in dep["spec"]["template"]["spec"]["containers"]:
            if c["image"].startswith("kvflow:") and "command" not in c:
                yield name, dep, c, environ_of_container(c, configmaps)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_service_runs_a_command_kvflow_accepts_with_probes_on_its_ports(overlay) -> None:
    docs = rendered(overlay)
    seen: dict[str, str] = {}
    for dep in _of_kind(docs, "Deployment").values():
        for c in dep["spec"]["template"]["spec"]["containers"]:
            if c["image"].startswith("kvflow:"):
                assert "command" not in c, "the image's entrypoint is kvflow; args choose"
    for name, dep, c, env in _kvflow_containers(docs):
        cmd = parse_kvflow_command(c["args"], env)
        seen[name] = cmd.service
        s = cmd.settings
        # every NATS node, every sentinel, by the names their StatefulSets give their pods
        assert server_urls(s.bus.nats_url) == [f"nats://{h}:4222" for h in _pods(docs, "nats")]
        sentinels, master, _, _ = parse_sentinel_url(s.bus.redis_url)
        assert sentinels == [(h, 26379) for h in _pods(docs, "redis-sentinel")]
        assert master == SENTINEL_MASTER
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        if cmd.service == "gateway":
            assert s.gateway.host == "0.0.0.0" and ports["http"] == s.gateway.port
            assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        else:
            assert ports["ops"] == s.ops.ops_port
            assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "ops"}
            assert c["livenessProbe"]["httpGet"] == {"path": "/live", "port": "ops"}
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert probe in c, f"{name} has no {probe}"
        assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
        # no Service links: a Service named like a setting would inject KVFLOW_* variables
        assert dep["spec"]["template"]["spec"]["enableServiceLinks"] is False
        if overlay == "gpu" and cmd.service == "worker":
            assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
            assert c["image"] == "kvflow:cuda"
    assert set(seen.values()) == set(SERVICES)
    workers = {n: s for n, s in seen.items() if s == "worker"}
    roles = set()
    for name, _, c, env in _kvflow_containers(docs):
        if name in workers:
            roles.add(parse_kvflow_command(c["args"], env).settings.worker.role)
    assert roles == ({"both"} if overlay == "cpu" else {"prefill", "decode"})


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_scaling_disruption_budgets_services_and_monitoring(overlay: str) -> None:
    docs = rendered(overlay)
    deployments = _of_kind(docs, "Deployment")
    hpas = _of_kind(docs, "HorizontalPodAutoscaler")
    assert {h["spec"]["scaleTargetRef"]["name"] for h in hpas.values()} == {
        "gateway",
        "tokenizer",
        "detokenizer",
    }
    assert hpas["gateway"]["spec"]["minReplicas"] >= 2
    workers = {n for n, _, c, _ in _kvflow_containers(docs) if c["args"][1] == "worker"}
    scaled = _of_kind(docs, "ScaledObject")
    assert {s["spec"]["scaleTargetRef"]["name"] for s in scaled.values()} == workers
    exported = exported_metric_names()
    for so in scaled.values():  # KEDA's queries read series the gateway exports
        for trigger in so["spec"]["triggers"]:
            assert metric_names_in(trigger["metadata"]["query"]) <= exported
    pdb_targets = {
        p["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"]
        for p in _of_kind(docs, "PodDisruptionBudget").values()
    }
    assert {"gateway", "tokenizer", *workers} <= pdb_targets
    # a leader and a standby on the Redis lease, never scaled by an autoscaler
    assert deployments["scheduler"]["spec"]["replicas"] == 2
    assert "scheduler" not in {h["spec"]["scaleTargetRef"]["name"] for h in hpas.values()}
    # a rolling update replaces one at a time: the other holds or takes the lease meanwhile
    assert deployments["scheduler"]["spec"]["strategy"]["type"] == "RollingUpdate"

    services = _of_kind(docs, "Service")
    assert set(deployments) <= set(services), "every Deployment has a Service (API or metrics)"
    monitor = _of_kind(docs, "ServiceMonitor")["kvflow"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    scraped_ports = {e["port"] for e in monitor["spec"]["endpoints"]}
    for name, *_ in _kvflow_containers(docs):
        svc = services[name]
        assert selector.items() <= svc["metadata"]["labels"].items(), name
        assert {p["name"] for p in svc["spec"]["ports"]} & scraped_ports, name
    # no single point of failure: three NATS nodes, two Redis servers, three sentinels, each
    # behind a headless Service that names its pods, a drain taking one at a time
    sets = _of_kind(docs, "StatefulSet")
    assert {n: s["spec"]["replicas"] for n, s in sets.items()} == {
        "nats": 3,
        "redis": 2,
        "redis-sentinel": 3,
    }
    budgets = {
        p["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"]: p["spec"]
        for p in _of_kind(docs, "PodDisruptionBudget").values()
    }
    for name, sts in sets.items():
        headless = services[sts["spec"]["serviceName"]]["spec"]
        assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"], name
        assert budgets[name] == {
            "maxUnavailable": 1,
            "selector": {"matchLabels": {"app.kubernetes.io/name": name}},
        }
    assert "nats" in services  # the client Service (the TLS certificate's name)


def _pods(docs, name: str) -> list[str]:
    """The names a StatefulSet's pods have in DNS: POD.SERVICE."""
    spec = _of_kind(docs, "StatefulSet")[name]["spec"]
    return [f"{name}-{i}.{spec['serviceName']}" for i in range(spec["replicas"])]


def test_the_tensor_parallel_component_makes_each_worker_pod_a_group_kvflow_accepts() -> None:
    from kvflow.shared.parallel import check_parallel_settings

    docs = render_k8s("cpu", ("tensor-parallel",))
    for doc in docs:
        validate_resource(doc)
    workers = [(c, env) for n, _, c, env in _kvflow_containers(docs) if n == "worker"]
    assert len(workers) == 1
    c, env = workers[0]
    settings = parse_kvflow_command(c["args"], env).settings
    assert settings.worker.tensor_parallel_size == 2 and settings.worker.threads == 4
    check_parallel_settings(settings)  # nothing in the pod's settings refuses a group
    assert c["resources"]["requests"]["cpu"] == "8"  # two ranks of --threads 4
    assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
