"""k8s/ is closed by default (issue 22): rendered as test_deploy_k8s.py renders it (a copy of
k8s/ after `kvflow auth init k8s/base/secrets`), every kvflow service mounts only its own
role's Secret, whose passwords are the ones NATS's config and Redis's ACL file (their own
Secrets) accept for that role's user, and reads them through KVFLOW_*_PASSWORD_FILE; NATS runs
with -c and Redis with --aclfile; the NetworkPolicies deny ingress but for the gateway's API,
NATS and Redis from kvflow's pods, and the ops ports from kvflow's pods and the monitoring
namespace (checked by evaluating them as a CNI would for sources inside and outside); every
container runs as a fixed non-root user without privileges, with a read-only root filesystem
and emptyDirs where kvflow (and the libraries it uses) write; components/nats-tls wires
cert-manager's certificate into NATS and its CA into every service; components/keys-admin runs
`kvflow keys` as Redis's admin. Without base/secrets the build fails."""

from __future__ import annotations

import base64
import hashlib
import re
import subprocess
from pathlib import PurePosixPath

import bcrypt
import pytest

from kvflow.cli.keys import redis_settings
from kvflow.cli.main import build_parser
from kvflow.shared.access.credentials import NATS_PASSWORD, REDIS_PASSWORD
from kvflow.shared.access.grants import NATS_ROLES, REDIS_ROLES, ROLES
from kvflow.shared.bus import server_urls
from tests.helpers.deploy import (
    COMPONENTS,
    OVERLAYS,
    ROOT,
    _copy_k8s,
    environ_of_container,
    kustomize_command,
    parse_kvflow_command,
    render_k8s,
)

SECRETS = PurePosixPath("/run/secrets/kvflow")  # where a service finds its role's files
MONITORING = {"kubernetes.io/metadata.name": "monitoring"}  # the monitoring stack's namespace
NAMESPACE = {"kubernetes.io/metadata.name": "kvflow"}
DOCKERFILE = (ROOT / "Dockerfile").read_text()
IMAGE_UID = int(re.search(r"--uid (\d+)", DOCKERFILE).group(1))
IMAGE_CACHE_DIR = PurePosixPath(re.search(r"KVFLOW_CACHE_DIR=(\S+)", DOCKERFILE).group(1))
CACHE_VARIABLES = (
    "XDG_CACHE_HOME",
    "HF_HOME",
    "TRITON_HOME",
    "CUDA_CACHE_PATH",
    "TORCHINDUCTOR_CACHE_DIR",
)
VARIANTS = [(o, ()) for o in OVERLAYS] + [(o, COMPONENTS) for o in OVERLAYS]


def _by_kind(docs) -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = {}
    for d in docs:
        out.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
    return out


def _workloads(docs) -> dict[str, dict]:
    """Every pod template by its workload's name (Deployments and StatefulSets)."""
    return {
        d["metadata"]["name"]: d["spec"]["template"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
    }


def _services(docs):
    """(workload, pod spec, container, environment, kvflow role) of every kvflow service."""
    configmaps = _by_kind(docs)["ConfigMap"]
    for name, template in _workloads(docs).items():
        for c in template["spec"]["containers"]:
            if c["image"].startswith("kvflow:") and c.get("args", [])[:1] == ["run"]:
                env = environ_of_container(c, configmaps)
                yield name, template["spec"], c, env, parse_kvflow_command(c["args"], env)


def _secret_volumes(pod: dict) -> dict[str, dict]:
    return {v["name"]: v["secret"] for v in pod.get("volumes", []) if "secret" in v}


def _mount_of(container: dict, volume: str) -> dict:
    (mount,) = [m for m in container.get("volumeMounts", []) if m["name"] == volume]
    return mount


def _secret_file(docs, secret: str, key: str) -> str:
    return base64.b64decode(_by_kind(docs)["Secret"][secret]["data"][key]).decode()


def _file_in_secret(pod: dict, container: dict, path: str) -> tuple[str, str]:
    """(Secret, key) that the file at ``path`` in ``container`` comes from."""
    for name, secret in _secret_volumes(pod).items():
        for m in container.get("volumeMounts", []):
            if m["name"] == name and PurePosixPath(path).parent == PurePosixPath(m["mountPath"]):
                key = PurePosixPath(path).name
                items = {i["path"]: i["key"] for i in secret.get("items", [])}
                return secret["secretName"], items.get(key, key) if items else key
    raise AssertionError(f"{path} is not in a mounted Secret")


def test_the_build_refuses_to_run_without_credentials(tmp_path) -> None:
    tree = _copy_k8s(tmp_path / "k8s")
    out = subprocess.run(
        [*kustomize_command(), str(tree / "overlays" / "cpu")], capture_output=True, text=True
    )
    assert out.returncode != 0 and "secrets/" in out.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_service_mounts_only_its_roles_secret_and_reads_its_passwords(overlay) -> None:
    docs = render_k8s(overlay)
    secrets = _by_kind(docs)["Secret"]
    assert set(secrets) == {f"kvflow-{r}" for r in ROLES} | {
        "kvflow-nats-config",
        "kvflow-redis-acl",
        "kvflow-redis-sentinel",
    }
    nats_conf = _secret_file(docs, "kvflow-nats-config", "nats.conf")
    nats_hashes = dict(re.findall(r'user: "(\w+)"\s+password: "([^"]+)"', nats_conf))
    acl = _secret_file(docs, "kvflow-redis-acl", "users.acl")
    redis_hashes = dict(re.findall(r"^user (\w+) on #([0-9a-f]{64}) ", acl, re.M))
    expected = {
        "nats": {"kvflow-nats-config"},
        "redis": {"kvflow-redis-acl"},
        "redis-sentinel": {"kvflow-redis-sentinel"},
    }
    for name, pod, c, _, cmd in _services(docs):
        role = cmd.service
        expected[name] = {f"kvflow-{role}"}
        volumes = _secret_volumes(pod)
        assert [v["secretName"] for v in volumes.values()] == [f"kvflow-{role}"], name
        (volume,) = volumes
        mount = _mount_of(c, volume)
        assert PurePosixPath(mount["mountPath"]) == SECRETS and mount["readOnly"] is True
        # readable by the pod's group (fsGroup), by nobody else
        assert volumes[volume]["defaultMode"] == 0o440 and pod["securityContext"]["fsGroup"]
        bus = cmd.settings.bus
        assert bus.nats_user in ("", role) and bus.redis_user in ("", role)  # user: the role
        assert PurePosixPath(bus.nats_password_file) == SECRETS / NATS_PASSWORD
        expected_keys = {NATS_PASSWORD}
        if role in REDIS_ROLES:
            assert PurePosixPath(bus.redis_password_file) == SECRETS / REDIS_PASSWORD
            expected_keys.add(REDIS_PASSWORD)
        else:
            assert bus.redis_password_file == ""
        assert set(secrets[f"kvflow-{role}"]["data"]) == expected_keys
        # the passwords are the ones the servers accept for this role's user
        password = _secret_file(docs, f"kvflow-{role}", NATS_PASSWORD).strip()
        assert bcrypt.checkpw(password.encode(), nats_hashes[role].encode()), name
        if role in REDIS_ROLES:
            password = _secret_file(docs, f"kvflow-{role}", REDIS_PASSWORD).strip()
            assert hashlib.sha256(password.encode()).hexdigest() == redis_hashes[role]
    # each workload mounts the Secrets it needs and no other; every role has a service
    used = {
        name: {s["secretName"] for s in _secret_volumes(template["spec"]).values()}
        for name, template in _workloads(docs).items()
    }
    assert used == expected
    assert set().union(*expected.values()) >= {f"kvflow-{r}" for r in NATS_ROLES}


def _hash_of(text: str, user: str) -> str:
    """The SHA-256 password hash of ``user`` in Redis ACL lines."""
    (line,) = [ln for ln in text.splitlines() if ln.startswith(f"user {user} ")]
    return re.search(r"#([0-9a-f]{64})", line).group(1)


def _sha(password: str) -> str:
    return hashlib.sha256(password.encode()).hexdigest()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_nats_nodes_run_the_cluster_config_and_redis_its_acl_with_sentinel(overlay) -> None:
    """Each NATS node: cluster.conf (with nats.conf beside it, which it includes) under its pod's
    name, routes to every pod of the StatefulSet; Redis: the ACL file and a replica's login,
    the replica following redis-0; the sentinels: the monitor lines before sentinel.conf,
    whose logins are the ones the servers' ACL file accepts."""
    docs = render_k8s(overlay)
    workloads, sets = _workloads(docs), _by_kind(docs)["StatefulSet"]

    pod = workloads["nats"]["spec"]
    (c,) = pod["containers"]
    conf = c["args"][c["args"].index("-c") + 1]
    assert _file_in_secret(pod, c, conf) == ("kvflow-nats-config", "cluster.conf")
    assert c["args"][c["args"].index("--name") + 1] == "$(POD_NAME)"
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in c[
        "env"
    ]
    cluster = _secret_file(docs, "kvflow-nats-config", "cluster.conf")
    assert 'include "nats.conf"' in cluster
    assert "authorization" in _secret_file(docs, "kvflow-nats-config", "nats.conf")
    service = sets["nats"]["spec"]["serviceName"]
    nodes = [f"nats-{i}.{service}:6222" for i in range(sets["nats"]["spec"]["replicas"])]
    assert re.findall(r"@([^\"]+)\"", cluster) == nodes
    assert "--jetstream" not in c["args"]  # kvflow uses none; the nodes keep no state

    pod = workloads["redis"]["spec"]
    (c,) = pod["containers"]
    script = c["command"][-1]
    acl_path = re.search(r"--aclfile (\S+)", script).group(1)
    assert _file_in_secret(pod, c, acl_path) == ("kvflow-redis-acl", "users.acl")
    replication = re.search(r"redis-server (\S+)", script).group(1)
    assert _file_in_secret(pod, c, replication) == ("kvflow-redis-acl", "replication.conf")
    primary = f"redis-0.{sets['redis']['spec']['serviceName']}"
    assert f"--replicaof {primary} 6379" in script
    # the readiness probe's `redis-cli ping` logs in as the default user, which may only PING
    assert c["readinessProbe"]["exec"]["command"] == ["redis-cli", "ping"]
    acl = _secret_file(docs, "kvflow-redis-acl", "users.acl")
    assert re.search(r"^user default on nopass .*-@all \+ping$", acl, re.M)
    login = _secret_file(docs, "kvflow-redis-acl", "replication.conf")
    masterauth = re.search(r'masterauth "([^"]+)"', login).group(1)
    assert "masteruser replication" in login and _sha(masterauth) == _hash_of(acl, "replication")

    pod = workloads["redis-sentinel"]["spec"]
    (c,) = pod["containers"]
    script = c["command"][-1]
    conf = re.search(r"cat (\S+)", script).group(1)
    assert _file_in_secret(pod, c, conf) == ("kvflow-redis-sentinel", "sentinel.conf")
    assert f"sentinel monitor kvflow {primary} 6379 2" in script
    sentinel = _secret_file(docs, "kvflow-redis-sentinel", "sentinel.conf")
    auth_pass = re.search(r'sentinel auth-pass kvflow "([^"]+)"', sentinel).group(1)
    assert _sha(auth_pass) == _hash_of(acl, "sentinel")  # the servers know the sentinels
    for role in REDIS_ROLES:  # each role asks the sentinels with its own Redis password
        password = _secret_file(docs, f"kvflow-{role}", "redis-password").strip()
        assert _hash_of(sentinel, role) == _sha(password) == _hash_of(acl, role), role
    assert (
        "users.acl" not in {i for v in _secret_volumes(pod).values() for i in [v["secretName"]]}
        and _secret_volumes(pod)["config"]["secretName"] == "kvflow-redis-sentinel"
    )


# --- NetworkPolicies, evaluated as a CNI enforces them ---------------------------------------


def _selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, "only matchLabels selectors are evaluated here"
    return selector.get("matchLabels", {}).items() <= labels.items()


def _peer_admits(peer: dict, src_ns: dict, src_labels: dict) -> bool:
    if "ipBlock" in peer:
        return False  # none used; sources here are pods
    if "namespaceSelector" in peer:
        ns_ok = _selects(peer["namespaceSelector"], src_ns)
    else:
        ns_ok = src_ns == NAMESPACE  # a bare podSelector: the policy's own namespace
    return ns_ok and _selects(peer.get("podSelector", {}), src_labels)


def _port_matches(rule_ports, port: tuple[str, int]) -> bool:
    if not rule_ports:
        return True
    return any(p.get("protocol", "TCP") == "TCP" and p["port"] in port for p in rule_ports)


def allowed(policies, src_ns: dict, src_labels: dict, dst: dict, port_name: str) -> bool:
    """Whether a pod (``src_labels`` in namespace ``src_ns``) may connect to the port named
    ``port_name`` of the pod template ``dst`` in namespace kvflow."""
    labels = dst["metadata"]["labels"]
    ports = {p["name"]: p["containerPort"] for c in dst["spec"]["containers"] for p in c["ports"]}
    port = (port_name, ports[port_name])
    selecting = [
        p["spec"]
        for p in policies
        if _selects(p["spec"]["podSelector"], labels) and "Ingress" in p["spec"]["policyTypes"]
    ]
    if not selecting:
        return True
    for spec in selecting:
        for rule in spec.get("ingress", []):
            peers = rule.get("from")
            if _port_matches(rule.get("ports"), port) and (
                not peers or any(_peer_admits(p, src_ns, src_labels) for p in peers)
            ):
                return True
    return False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_deny_ingress_but_what_kvflow_needs(overlay) -> None:
    docs = render_k8s(overlay)
    policies = list(_by_kind(docs)["NetworkPolicy"].values())
    deny = [p for p in policies if p["spec"]["podSelector"] == {}]
    assert len(deny) == 1 and deny[0]["spec"]["policyTypes"] == ["Ingress"]
    assert "ingress" not in deny[0]["spec"]
    workloads = _workloads(docs)
    kvflow_pod = {"app.kubernetes.io/part-of": "kvflow", "app.kubernetes.io/name": "gateway"}
    stranger = {"app.kubernetes.io/name": "debug"}  # a pod of the namespace, not kvflow's
    outside = {"kubernetes.io/metadata.name": "elsewhere"}

    def ok(src_ns, src_labels, dst, port):
        return allowed(policies, src_ns, src_labels, workloads[dst], port)

    # the gateway's API: from anywhere
    for ns, labels in ((outside, {}), (NAMESPACE, stranger), (NAMESPACE, kvflow_pod)):
        assert ok(ns, labels, "gateway", "http")
    # NATS, Redis and the sentinels: kvflow's pods only (not other pods, not other namespaces,
    # not monitoring)
    for dst, port in (("nats", "client"), ("redis", "redis"), ("redis-sentinel", "sentinel")):
        assert ok(NAMESPACE, kvflow_pod, dst, port)
        assert ok(NAMESPACE, {**stranger, "app.kubernetes.io/part-of": "kvflow"}, dst, port)
        assert not ok(NAMESPACE, stranger, dst, port)
        assert not ok(outside, kvflow_pod, dst, port)
        assert not ok(MONITORING, {}, dst, port)
    # the NATS nodes' routes: the other nodes only
    node = {"app.kubernetes.io/part-of": "kvflow", "app.kubernetes.io/name": "nats"}
    assert ok(NAMESPACE, node, "nats", "cluster")
    assert not ok(NAMESPACE, kvflow_pod, "nats", "cluster")
    # NATS monitoring: the monitoring stack only (probes come from the node, always allowed)
    assert ok(MONITORING, {}, "nats", "monitor")
    assert not ok(NAMESPACE, kvflow_pod, "nats", "monitor")
    # every service's ops port: kvflow's pods and the monitoring stack
    services = [name for name, *_ in _services(docs) if name != "gateway"]
    assert services
    for name in services:
        assert ok(NAMESPACE, kvflow_pod, name, "ops") and ok(MONITORING, {}, name, "ops")
        assert not ok(NAMESPACE, stranger, name, "ops") and not ok(outside, {}, name, "ops")
    # egress is left open (documented): no policy restricts it
    assert all("Egress" not in p["spec"]["policyTypes"] for p in policies)
    # every named port a policy opens is a port of a pod it selects
    for p in policies:
        selected = [
            w
            for w in workloads.values()
            if _selects(p["spec"]["podSelector"], w["metadata"]["labels"])
        ]
        names = {pt["name"] for w in selected for c in w["spec"]["containers"] for pt in c["ports"]}
        for rule in p["spec"].get("ingress", []):
            for port in rule.get("ports", []):
                assert port["port"] in names, (p["metadata"]["name"], port)


# --- pods: unprivileged, read-only, writes on emptyDirs --------------------------------------


@pytest.mark.parametrize(("overlay", "components"), VARIANTS)
def test_every_container_runs_unprivileged_on_a_read_only_root(overlay, components) -> None:
    docs = render_k8s(overlay, components)
    for name, template in _workloads(docs).items():
        pod = template["spec"]
        sc = pod["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] > 0, name
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert pod["automountServiceAccountToken"] is False, name
        if _secret_volumes(pod):
            assert sc["fsGroup"], f"{name}: its Secret files (0440) need the pod's group"
        for c in pod["containers"]:
            csc = c["securityContext"]
            assert csc["allowPrivilegeEscalation"] is False, name
            assert csc["capabilities"] == {"drop": ["ALL"]}, name
            assert csc["readOnlyRootFilesystem"] is True, name
            assert not csc.get("privileged") and "runAsUser" not in csc, name
            if c["image"].startswith("kvflow:"):
                assert sc["runAsUser"] == IMAGE_UID and sc["fsGroup"] == IMAGE_UID, name
        for v in _secret_volumes(pod).values():
            assert v["defaultMode"] & 0o007 == 0, f"{name}: Secret files readable by others"


def _empty_dir_mounts(pod: dict, c: dict) -> list[PurePosixPath]:
    empty = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
    return [PurePosixPath(m["mountPath"]) for m in c["volumeMounts"] if m["name"] in empty]


def _writable(path: str | PurePosixPath, mounts: list[PurePosixPath]) -> bool:
    path = PurePosixPath(path)
    return any(path == m or m in path.parents for m in mounts)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kvflow_writes_only_where_an_empty_dir_is_mounted(overlay) -> None:
    """/tmp, the libraries' caches (pointed there by settings.yaml) and, for workers, kvflow's
    compiled kernels and GEMM calibrations (paths from kernels/, in the machine cache a worker
    of this image finds from its settings: the image's KVFLOW_CACHE_DIR unless the pod sets
    another); the image's converted tokenizer under it stays visible."""
    from kvflow.kernels import batch_invariance, cpu_native
    from kvflow.services.worker import machine
    from kvflow.shared.config import Settings

    docs = render_k8s(overlay)
    for name, pod, c, env, cmd in _services(docs):
        mounts = _empty_dir_mounts(pod, c)
        assert _writable("/tmp", mounts), name
        for var in CACHE_VARIABLES:
            assert _writable(env[var], mounts), f"{name}: {var}={env[var]} is read-only"
        every = [PurePosixPath(m["mountPath"]) for m in c["volumeMounts"]]
        tokenizers = IMAGE_CACHE_DIR / "tokenizers"
        assert not any(m == tokenizers or m in tokenizers.parents for m in every), name
        if cmd.service == "worker":
            given = {k: v for k, v in env.items() if k.startswith("KVFLOW_")}
            image = {"KVFLOW_CACHE_DIR": str(IMAGE_CACHE_DIR)}
            settings = Settings.from_args(cmd.args, environ=image | given)
            root = machine.native_setup(settings).cache_dir
            for cache in (cpu_native.library_dir(root), batch_invariance.calibration_dir(root)):
                assert _writable(cache, mounts), f"{name}: {cache} is read-only"


# --- components ------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_nats_tls_component_serves_tls_and_gives_every_service_the_ca(overlay) -> None:
    docs = render_k8s(overlay, ("nats-tls",))
    kinds = _by_kind(docs)
    issuers, certs = kinds["Issuer"], kinds["Certificate"]
    # a self-signed issuer signs the CA; the CA issuer signs NATS's certificate
    (selfsigned,) = [i for i in issuers.values() if "selfSigned" in i["spec"]]
    (ca,) = [c for c in certs.values() if c["spec"].get("isCA")]
    assert ca["spec"]["issuerRef"]["name"] == selfsigned["metadata"]["name"]
    (ca_issuer,) = [i for i in issuers.values() if "ca" in i["spec"]]
    assert ca_issuer["spec"]["ca"]["secretName"] == ca["spec"]["secretName"]
    (server,) = [c for c in certs.values() if not c["spec"].get("isCA")]
    assert server["spec"]["issuerRef"]["name"] == ca_issuer["metadata"]["name"]
    assert "server auth" in server["spec"]["usages"]
    ns = server["metadata"]["namespace"]
    assert {"nats", f"nats.{ns}.svc", f"nats.{ns}.svc.cluster.local"} <= set(
        server["spec"]["dnsNames"]
    )
    server_secret = server["spec"]["secretName"]
    # nats-server: --tls with the certificate's files
    nats_pod = _workloads(docs)["nats"]["spec"]
    (nats,) = nats_pod["containers"]
    args = nats["args"]
    assert "--tls" in args
    for flag, key in (("--tlscert", "tls.crt"), ("--tlskey", "tls.key")):
        path = args[args.index(flag) + 1]
        assert _file_in_secret(nats_pod, nats, path) == (server_secret, key)
    assert "-c" in args  # still the users and permissions
    # the routes in TLS too: cluster-tls.conf, whose files are the same Secret's
    conf = args[args.index("-c") + 1]
    assert _file_in_secret(nats_pod, nats, conf) == ("kvflow-nats-config", "cluster-tls.conf")
    cluster = _secret_file(docs, "kvflow-nats-config", "cluster-tls.conf")
    files = dict(re.findall(r"(cert_file|key_file|ca_file): \"([^\"]+)\"", cluster))
    assert {k: _file_in_secret(nats_pod, nats, v) for k, v in files.items()} == {
        "cert_file": (server_secret, "tls.crt"),
        "key_file": (server_secret, "tls.key"),
        "ca_file": (server_secret, "ca.crt"),
    }
    assert "verify: true" in cluster and "client auth" in server["spec"]["usages"]
    # every service: a tls:// URL to a name in the certificate, the CA (and only the CA)
    seen = set()
    for name, pod, c, _, cmd in _services(docs):
        seen.add(cmd.service)
        bus = cmd.settings.bus
        for url in server_urls(bus.nats_url):  # every node by a name the certificate holds
            assert url.startswith("tls://"), name
            host = url.removeprefix("tls://").split(":")[0]
            names = server["spec"]["dnsNames"]
            assert host in names or f"*.{host.split('.', 1)[1]}" in names, (name, host)
        assert _file_in_secret(pod, c, bus.nats_tls_ca) == (server_secret, "ca.crt"), name
        for v in _secret_volumes(pod).values():
            if v["secretName"] == server_secret:
                assert [i["key"] for i in v["items"]] == ["ca.crt"], f"{name} sees the key"
    assert seen == set(NATS_ROLES)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_keys_admin_component_runs_kvflow_keys_as_the_redis_admin(overlay, monkeypatch) -> None:
    docs = render_k8s(overlay, COMPONENTS)
    deployment = _by_kind(docs)["Deployment"]["kvflow-admin"]
    assert deployment["spec"]["replicas"] == 0  # scaled up only to manage keys
    template = deployment["spec"]["template"]
    pod = template["spec"]
    (c,) = pod["containers"]
    assert [v["secretName"] for v in _secret_volumes(pod).values()] == ["kvflow-admin"]
    assert set(_by_kind(docs)["Secret"]["kvflow-admin"]["data"]) == {REDIS_PASSWORD}
    env = environ_of_container(c, _by_kind(docs)["ConfigMap"])
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    # `kubectl exec deploy/kvflow-admin -- kvflow keys list`: the login comes from the env
    args = build_parser("keys").parse_args(["keys", "list"])
    bus = redis_settings(args)  # the variables, read as the services read them
    settings = _by_kind(docs)["ConfigMap"]["kvflow-settings"]["data"]
    assert bus.redis_url == settings["KVFLOW_REDIS_URL"]  # the primary, through the sentinels
    assert bus.redis_user in ("", "admin")
    assert _file_in_secret(pod, c, bus.redis_password_file) == ("kvflow-admin", REDIS_PASSWORD)
    policies = list(_by_kind(docs)["NetworkPolicy"].values())
    redis = _workloads(docs)["redis"]
    assert allowed(policies, NAMESPACE, template["metadata"]["labels"], redis, "redis")
