"""``kvflow serve``: nats-server and redis-server as child processes on free ports, then every
service as its own process (``kvflow run SERVICE``), the gateway on --host/--port. Waits until
the gateway's /health says the pipeline can serve, prints the URL, and on Ctrl-C or SIGTERM stops
every child it started, gateway first and infrastructure last. It never reaches into a
service's internals: services are processes that meet on the bus."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from shared.config import Settings
from shared.infra import Server, port_is_free, start_nats, start_redis
from shared.model_source import ModelNotFoundError, resolve_model
from shared.processes import spawn_service, stop_processes

STARTUP_TIMEOUT_S = 300.0
MAX_RESTARTS_PER_MINUTE = 3


class _Stop(Exception):
    pass


def _fail(msg: str) -> int:
    print(f"kvflow: error: {msg}", file=sys.stderr)
    return 2


def _stop(procs: list[tuple[str, subprocess.Popen]], graceful: bool, drain_s: float) -> None:
    """Stop children in order. Graceful (SIGTERM to `kvflow serve`): the gateway first, with
    SIGTERM, so it takes no new request and finishes the open ones while the rest of the
    pipeline still runs; then the others. Quick (Ctrl-C): everyone at once."""
    rest = list(procs)
    if graceful:
        for name, p in procs:
            if name == "gateway" and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(drain_s + 5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        rest = [(n, p) for n, p in procs if n != "gateway"]
    stop_processes([p for _name, p in rest])


def _ops_ports(specs: dict[str, tuple[str, dict[str, str]]], settings: Settings) -> str:
    """Give each child its own ops port: ``--ops-port`` for the first, then the next ones in
    start order (workers, schedulers, tokenizers, detokenizers); returns them for printing."""
    shown = []
    for i, (name, (_service, overrides)) in enumerate(specs.items()):
        overrides["ops_port"] = str(settings.ops_port + i)
        shown.append(f"{name} :{settings.ops_port + i}")
    return ", ".join(shown)


def worker_plan(both: int, prefill: int, decode: int) -> list[tuple[str, str]]:
    """(worker id, role) of every worker to start."""
    if min(both, prefill, decode) < 0:
        raise ValueError("worker counts cannot be negative")
    if (prefill > 0) != (decode > 0) and both == 0:
        raise ValueError(
            "disaggregated serving needs at least one prefill and one decode worker "
            "(or a 'both' worker with --workers)"
        )
    plan = [(f"worker-{i}", "both") for i in range(both)]
    plan += [(f"prefill-{i}", "prefill") for i in range(prefill)]
    plan += [(f"decode-{i}", "decode") for i in range(decode)]
    if not plan:
        raise ValueError("no workers: pass --workers, or --prefill-workers and --decode-workers")
    return plan


def _healthy(url: str, num_workers: int = 1) -> bool:
    """The gateway answers /health with 200 and the scheduler knows ``num_workers`` workers."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            if r.status != 200:
                return False
            return json.loads(r.read()).get("num_workers", 0) >= num_workers
    except (urllib.error.URLError, OSError, ValueError):
        return False


def serve(
    settings: Settings,
    workers: int = 1,
    prefill_workers: int = 0,
    decode_workers: int = 0,
    schedulers: int = 1,
    tokenizers: int = 1,
    detokenizers: int = 1,
) -> int:
    try:
        resolve_model(settings.model, settings.served_model_name)
        plan = worker_plan(workers, prefill_workers, decode_workers)
    except (ModelNotFoundError, ValueError) as e:
        return _fail(str(e))
    if min(schedulers, tokenizers, detokenizers) < 1:
        return _fail("--schedulers, --tokenizers and --detokenizers must be at least 1")
    if settings.threads == 0 and len(plan) > 1:
        # the workers share this machine's cores instead of each taking all of them
        share = max(1, (os.cpu_count() or 1) // len(plan))
        settings = dataclasses.replace(settings, threads=share)
    if not port_is_free(settings.host, settings.port):
        return _fail(
            f"port {settings.port} on {settings.host} is taken: stop what uses it or pass --port N"
        )

    def on_term(*_: object) -> None:
        raise _Stop

    signal.signal(signal.SIGTERM, on_term)
    infra: list[Server] = []
    procs: list[tuple[str, subprocess.Popen]] = []
    graceful = False
    try:
        print("kvflow: starting nats-server and redis-server ...", flush=True)
        nats = start_nats()
        infra.append(nats)
        redis = start_redis()
        infra.append(redis)
        settings = dataclasses.replace(settings, nats_url=nats.url, redis_url=redis.url)
        print(f"kvflow: nats {nats.url}, redis {redis.url}", flush=True)
        specs: dict[str, tuple[str, dict[str, str]]] = {}  # name -> (service, overrides)
        for wid, role in plan:
            specs[wid] = ("worker", {"worker_id": wid, "role": role})
        for i in range(schedulers):
            ha = {"scheduler_ha": "true"} if schedulers > 1 else {}
            specs[f"scheduler-{i}"] = ("scheduler", {**ha, "scheduler_id": f"scheduler-{i}"})
        for i in range(tokenizers):
            specs["tokenizer" if i == 0 else f"tokenizer-{i}"] = ("tokenizer", {})
        for i in range(detokenizers):
            specs["detokenizer" if i == 0 else f"detokenizer-{i}"] = ("detokenizer", {})
        if settings.ops_port:
            print(f"kvflow: ops endpoints (/health, /metrics): {_ops_ports(specs, settings)}")
        specs["gateway"] = ("gateway", {})
        for name, (service, overrides) in specs.items():
            procs.append((name, spawn_service(service, settings, **overrides)))
        print(
            "kvflow: loading the model in every service (first start converts the tokenizer) ...",
            flush=True,
        )
        health = f"http://{settings.host}:{settings.port}/health"
        start = time.monotonic()
        last_note = start
        while not _healthy(health, len(plan)):
            for name, p in procs:
                if p.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with code {p.returncode} during start-up (see its log above)"
                    )
            if time.monotonic() - start > STARTUP_TIMEOUT_S:
                raise RuntimeError(f"the stack was not ready after {STARTUP_TIMEOUT_S:.0f}s")
            if time.monotonic() - last_note > 10:
                print(f"kvflow: still starting ({time.monotonic() - start:.0f}s) ...", flush=True)
                last_note = time.monotonic()
            time.sleep(0.5)
        print(
            f"kvflow: ready in {time.monotonic() - start:.1f}s: OpenAI API at "
            f"http://{settings.host}:{settings.port}/v1 (Ctrl-C stops)",
            flush=True,
        )
        restarts: dict[str, list[float]] = {}
        while True:
            for i, (name, p) in enumerate(procs):
                if p.poll() is None:
                    continue
                # supervise: a service that dies after start-up is started again (the others
                # carry on: workers' sequences move elsewhere, a standby scheduler takes over)
                recent = [t for t in restarts.get(name, []) if time.monotonic() - t < 60]
                if len(recent) >= MAX_RESTARTS_PER_MINUTE:
                    raise RuntimeError(
                        f"{name} exited with code {p.returncode} "
                        f"{len(recent) + 1} times within a minute; giving up"
                    )
                restarts[name] = [*recent, time.monotonic()]
                print(
                    f"kvflow: {name} exited with code {p.returncode}; starting it again", flush=True
                )
                service, overrides = specs[name]
                procs[i] = (name, spawn_service(service, settings, **overrides))
            time.sleep(1.0)
    except KeyboardInterrupt:
        print("\nkvflow: stopping ...", flush=True)
        return 0
    except _Stop:
        print(
            "kvflow: SIGTERM: the gateway finishes its open requests, then all stop ...", flush=True
        )
        graceful = True
        return 0
    except RuntimeError as e:
        return _fail(str(e))
    finally:
        _stop(procs, graceful, settings.drain_timeout)
        for s in reversed(infra):
            s.stop()
