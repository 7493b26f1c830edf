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

STARTUP_TIMEOUT_S = 300.0


class _Stop(Exception):
    pass


def _fail(msg: str) -> int:
    print(f"kvflow: error: {msg}", file=sys.stderr)
    return 2


def _spawn(
    service: str, settings: Settings, worker_id: str = "", role: str = ""
) -> subprocess.Popen:
    env = {**os.environ, **settings.to_env(), "PYTHONUNBUFFERED": "1"}
    if worker_id:
        env["KVFLOW_WORKER_ID"] = worker_id
    if role:
        env["KVFLOW_ROLE"] = role
    return subprocess.Popen([sys.executable, "-m", "services.cli", "run", service], env=env)


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
    settings: Settings, workers: int = 1, prefill_workers: int = 0, decode_workers: int = 0
) -> int:
    try:
        resolve_model(settings.model, settings.served_model_name)
        plan = worker_plan(workers, prefill_workers, decode_workers)
    except (ModelNotFoundError, ValueError) as e:
        return _fail(str(e))
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
    try:
        print("kvflow: starting nats-server and redis-server ...", flush=True)
        nats = start_nats()
        infra.append(nats)
        redis = start_redis()
        infra.append(redis)
        settings = dataclasses.replace(settings, nats_url=nats.url, redis_url=redis.url)
        print(f"kvflow: nats {nats.url}, redis {redis.url}", flush=True)
        for wid, role in plan:
            procs.append((wid, _spawn("worker", settings, wid, role)))
        for name in ("scheduler", "tokenizer", "detokenizer", "gateway"):
            procs.append((name, _spawn(name, settings)))
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
        while True:
            for name, p in procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with code {p.returncode}")
            time.sleep(1.0)
    except (KeyboardInterrupt, _Stop):
        print("\nkvflow: stopping ...", flush=True)
        return 0
    except RuntimeError as e:
        return _fail(str(e))
    finally:
        for _name, p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 10
        for _name, p in reversed(procs):
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for s in reversed(infra):
            s.stop()
