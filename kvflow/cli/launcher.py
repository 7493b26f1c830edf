"""One launcher for a whole stack on this machine, used by ``kvflow serve`` (with the gateway on
--host/--port) and by the Python API's ``LLM()`` (without: the LLM object is the pipeline's
client). ``plan`` lists the processes to start, ``share_cores`` divides this machine's cores
among the workers, and ``Stack`` starts nats-server (and redis-server) on free ports and every
planned service as its own process (``kvflow run SERVICE``), restarts one, and stops them all:
the gateway first, infrastructure last. The stack is closed: at every start it makes fresh
per-role credentials in a private directory (shared/access), runs nats-server and
redis-server with them on loopback, and gives each process only its own role's. ``serve`` is the command: start, wait until the
gateway's /health says the pipeline can serve, supervise until Ctrl-C or SIGTERM. Nothing here
reaches into a service's internals: services are processes that meet on the bus."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TextIO

from kvflow.shared.access.connect import EXIT_REFUSED
from kvflow.shared.access.credentials import Credentials, generate
from kvflow.shared.config import Settings, check_stream_interval
from kvflow.shared.cpu_budget import usable_cpus
from kvflow.shared.infra import (
    Server,
    port_is_free,
    start_nats,
    start_nats_cluster,
    start_redis,
    start_redis_sentinel,
)
from kvflow.shared.lora import check_lora_settings
from kvflow.shared.model_config import check_settings_model
from kvflow.shared.model_source import ModelNotFoundError
from kvflow.shared.parallel import check_parallel_settings
from kvflow.shared.processes import spawn_service, stop_processes
from kvflow.shared.speculative import parse_speculative_config

STARTUP_TIMEOUT_S = 300.0
MAX_RESTARTS_PER_MINUTE = 3


@dataclass(frozen=True)
class Topology:
    """How many processes of each service to start."""

    workers: int = 1  # role 'both'
    prefill_workers: int = 0
    decode_workers: int = 0
    schedulers: int = 1
    tokenizers: int = 1
    detokenizers: int = 1
    gateway: bool = True

    @property
    def num_workers(self) -> int:
        return self.workers + self.prefill_workers + self.decode_workers


@dataclass
class Process:
    """One planned child: its name, the service it runs and its own settings (flat names)."""

    name: str
    service: str
    overrides: dict[str, str] = field(default_factory=dict)


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


def plan(topology: Topology, ops_port: int = 0) -> list[Process]:
    """Workers, schedulers, tokenizers, detokenizers, then the gateway (if any); a ValueError
    says what is wrong with the counts. With ``ops_port``, each non-gateway child gets its own
    ops port: ``ops_port`` for the first, then the next ones in start order."""
    t = topology
    if min(t.schedulers, t.tokenizers, t.detokenizers) < 1:
        raise ValueError("--schedulers, --tokenizers and --detokenizers must be at least 1")
    procs = [
        Process(wid, "worker", {"worker_id": wid, "role": role})
        for wid, role in worker_plan(t.workers, t.prefill_workers, t.decode_workers)
    ]
    for i in range(t.schedulers):
        ha = {"scheduler_ha": "true"} if t.schedulers > 1 else {}
        procs.append(
            Process(f"scheduler-{i}", "scheduler", {**ha, "scheduler_id": f"scheduler-{i}"})
        )
    procs += [
        Process("tokenizer" + (f"-{i}" if i else ""), "tokenizer") for i in range(t.tokenizers)
    ]
    procs += [
        Process("detokenizer" + (f"-{i}" if i else ""), "detokenizer")
        for i in range(t.detokenizers)
    ]
    if ops_port:
        for i, p in enumerate(procs):
            p.overrides["ops_port"] = str(ops_port + i)
    if t.gateway:
        procs.append(Process("gateway", "gateway"))
    return procs


def share_cores(settings: Settings, num_workers: int) -> Settings:
    """With more than one worker rank (workers x ``--tensor-parallel-size``) and
    ``--threads 0``, each rank takes its share of this machine's cores instead of all of them."""
    ranks = num_workers * settings.worker.tensor_parallel_size
    if settings.worker.threads != 0 or ranks <= 1:
        return settings
    return settings.replace(threads=max(1, usable_cpus() // ranks))


class Stack:
    """The infrastructure and the planned processes of one stack. ``log``: a file that takes
    the children's output (default: this console); notes go to ``console``."""

    def __init__(
        self,
        settings: Settings,
        topology: Topology,
        log_path: Path | None = None,
        console: TextIO | None = None,
        nats_tls: tuple[str, str] | None = None,
        redis_sentinel: bool = False,
        nats_cluster: int = 1,
    ) -> None:
        """``nats_tls``: (certificate, key) files for nats-server: every client connection is
        then TLS (the services verify it with ``--nats-tls-ca``). ``redis_sentinel``: Redis as
        a primary, a replica and three sentinels (every Redis client follows a failover)
        instead of one redis-server. ``nats_cluster``: nats-servers joined into one cluster
        (every service is given them all and moves to another when its own is lost). Settings
        that cannot be served raise ValueError here, before anything starts."""
        if nats_cluster < 1 or (nats_cluster > 1 and (nats_cluster < 3 or nats_cluster % 2 == 0)):
            raise ValueError(
                f"--nats-cluster {nats_cluster}: a NATS cluster is 3 or more nodes, an odd "
                "number (1: one nats-server, the default)"
            )
        parse_speculative_config(settings.model.speculative_config)
        ms = settings.model
        check_lora_settings(ms.enable_lora, ms.lora_modules, ms.max_loras, ms.max_lora_rank)
        check_parallel_settings(settings)
        check_stream_interval(settings)
        self.topology = topology
        self.plan = plan(topology, settings.ops.ops_port)
        self.settings = share_cores(settings, topology.num_workers)
        self.log_path = log_path
        self.console = console or sys.stdout
        self.servers: list[Server] = []
        self.procs: list[tuple[Process, subprocess.Popen]] = []
        self.nats_tls = nats_tls
        self.redis_sentinel = redis_sentinel
        self.nats_cluster = nats_cluster
        self.credentials: Credentials | None = None
        self._log: IO[bytes] | None = None
        # a log in a folder of its own that ``stop`` removes when nothing failed (the Python
        # API's); kept, and its path said, when a child died or the start-up failed
        self.temporary_log = False
        self.failed = False

    @property
    def nats_url(self) -> str:
        """The stack's NATS server (after ``start``)."""
        return self.settings.bus.nats_url

    def note(self, message: str) -> None:
        print(f"kvflow: {message}", file=self.console, flush=True)

    def role_settings(self, role: str) -> Settings:
        """The settings a process of ``role`` runs with: the stack's, logged in as ``role``."""
        if self.credentials is None:
            return self.settings
        return self.settings.replace(**self.credentials.service_settings(role))

    def start(self, redis: bool = True) -> None:
        """Fresh credentials, nats-server, redis-server (when ``redis``, or when the Redis KV
        tier needs one and no --redis-url is given), then every planned process."""
        cert, key = self.nats_tls or ("", "")
        self.credentials = generate(
            tempfile.mkdtemp(prefix="kvflow-auth-"), tls_cert=cert, tls_key=key
        )
        if self.nats_cluster > 1:
            c = self.credentials
            password = c.nats_route_password.read_text().strip()
            nodes = start_nats_cluster(c.nats_conf.parent, self.nats_cluster, password).nodes
        else:
            nodes = [start_nats(config=self.credentials.nats_conf)]
        self.servers += nodes
        scheme = "tls" if self.nats_tls else "nats"
        urls = ",".join(f"{scheme}://127.0.0.1:{n.port}" for n in nodes)
        self.settings = self.settings.replace(nats_url=urls)
        if redis or (self.settings.cache.kv_redis_tier and not self.settings.bus.redis_url):
            c = self.credentials
            if self.redis_sentinel:
                rs = start_redis_sentinel(c.redis_acl, c.redis_replication_conf, c.sentinel_conf)
                self.servers += [*rs.servers, *rs.sentinels]  # stopped in reverse: sentinels first
                self.settings = self.settings.replace(redis_url=rs.url)
            else:
                server = start_redis(aclfile=c.redis_acl)
                self.servers.append(server)
                self.settings = self.settings.replace(redis_url=server.url)
        if self.log_path is not None:
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        for p in self.plan:
            self.procs.append((p, self._spawn(p)))

    def _spawn(self, p: Process) -> subprocess.Popen:
        return spawn_service(p.service, self.role_settings(p.service), self._log, **p.overrides)

    def exited(self) -> tuple[int, Process, int] | None:
        """(index, process, exit code) of the first child that has exited, if any."""
        for i, (p, popen) in enumerate(self.procs):
            if popen.poll() is not None:
                return i, p, popen.returncode
        return None

    def restart(self, index: int) -> None:
        p = self.procs[index][0]
        self.procs[index] = (p, self._spawn(p))

    def wait_until(self, ready: Callable[[], bool], poll_s: float = 0.5) -> float:
        """Until ``ready()``; raises RuntimeError when a child exits or time runs out. Returns
        the seconds it took."""
        start = last_note = time.monotonic()
        while not ready():
            gone = self.exited()
            if gone is not None:
                self.failed = True
                raise RuntimeError(self._exit_message(gone[1].name, gone[2]))
            if time.monotonic() - start > STARTUP_TIMEOUT_S:
                self.failed = True
                where = f"; log: {self.log_path}" if self.log_path else ""
                raise RuntimeError(f"the stack was not ready after {STARTUP_TIMEOUT_S:.0f}s{where}")
            if time.monotonic() - last_note > 10:
                self.note(f"still starting ({time.monotonic() - start:.0f}s) ...")
                last_note = time.monotonic()
            time.sleep(poll_s)
        return time.monotonic() - start

    def _exit_message(self, name: str, code: int) -> str:
        if self.log_path is None:
            return f"{name} exited with code {code} during start-up (see its log above)"
        return f"{name} exited with code {code}; its log: {self.log_path}\n{self.log_tail()}"

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:] if self.log_path else ""
        except OSError:
            return ""

    def stop(self, graceful: bool = False) -> None:
        """Stop children in order. Graceful (SIGTERM to `kvflow serve`): the gateway first,
        with SIGTERM, so it takes no new request and finishes the open ones while the rest of
        the pipeline still runs; then the others. Quick (Ctrl-C): everyone at once. A second
        Ctrl-C or SIGTERM meanwhile is ignored, so the children, the servers and the
        credentials always go too (a second SIGTERM used to leave the children running)."""
        with _ignoring_stop_signals():
            try:
                self.failed = self.failed or self.exited() is not None
                self._stop_children(graceful)
            finally:
                for s in reversed(self.servers):
                    s.stop()
                self.servers = []
                if self.credentials is not None:
                    shutil.rmtree(self.credentials.root, ignore_errors=True)
                    self.credentials = None
                if self._log is not None:
                    self._log.close()
                    self._log = None
                self._remove_temporary_log()

    def _remove_temporary_log(self) -> None:
        if not (self.temporary_log and self.log_path):
            return
        if self.failed:
            self.note(f"a process failed: its log is kept at {self.log_path}")
        else:
            shutil.rmtree(self.log_path.parent, ignore_errors=True)
        self.temporary_log = False

    def _stop_children(self, graceful: bool) -> None:
        rest = [popen for _p, popen in self.procs]
        if graceful:
            drain_s = self.settings.ops.drain_timeout
            for p, popen in self.procs:
                if p.service == "gateway" and popen.poll() is None:
                    popen.send_signal(signal.SIGTERM)
                    try:
                        popen.wait(drain_s + 5)
                    except subprocess.TimeoutExpired:
                        popen.kill()
                        popen.wait()
            rest = [popen for p, popen in self.procs if p.service != "gateway"]
        stop_processes(rest)
        self.procs = []


@contextlib.contextmanager
def _ignoring_stop_signals() -> Iterator[None]:
    """SIGINT and SIGTERM ignored inside the block (main thread only: elsewhere signals cannot
    be set)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class _Stop(Exception):
    pass


def _fail(msg: str) -> int:
    print(f"kvflow: error: {msg}", file=sys.stderr)
    return 2


def _healthy(url: str, num_workers: int = 1) -> bool:
    """The gateway answers /health with 200 and the scheduler knows ``num_workers`` workers."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            if r.status != 200:
                return False
            return json.loads(r.read()).get("num_workers", 0) >= num_workers
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _supervise(stack: Stack) -> None:
    """Start again a service that dies after start-up (the others carry on: workers' sequences
    move elsewhere, a standby scheduler takes over); give up on one that keeps dying."""
    restarts: dict[str, list[float]] = {}
    while True:
        gone = stack.exited()
        if gone is None:
            time.sleep(1.0)
            continue
        i, p, code = gone
        if code == EXIT_REFUSED:
            raise RuntimeError(
                f"{p.name} exited: NATS or Redis refused its credentials (see its log); "
                "not starting it again"
            )
        recent = [t for t in restarts.get(p.name, []) if time.monotonic() - t < 60]
        if len(recent) >= MAX_RESTARTS_PER_MINUTE:
            raise RuntimeError(
                f"{p.name} exited with code {code} {len(recent) + 1} times within a minute; "
                "giving up"
            )
        restarts[p.name] = [*recent, time.monotonic()]
        stack.note(f"{p.name} exited with code {code}; starting it again")
        stack.restart(i)


def _run(stack: Stack) -> None:
    """Start the stack, wait for the gateway, supervise (until an exception)."""
    redis = (
        "Redis with Sentinel (a primary, a replica, 3 sentinels)"
        if stack.redis_sentinel
        else "redis-server"
    )
    stack.note(f"starting nats-server and {redis} ...")
    stack.start()
    s = stack.settings
    stack.note(f"nats {s.bus.nats_url}, redis {s.bus.redis_url}")
    if stack.credentials is not None:
        stack.note(
            f"credentials (one per role, removed at exit): {stack.credentials.root}; "
            "kvflow keys: --redis-user admin --redis-password-file "
            f"{stack.credentials.redis_password_file('admin')}"
        )
    if s.ops.ops_port:
        ports = ", ".join(
            f"{p.name} :{p.overrides['ops_port']}" for p in stack.plan if "ops_port" in p.overrides
        )
        stack.note(f"ops endpoints (/health, /metrics): {ports}")
    stack.note("loading the model in every service (first start converts the tokenizer) ...")
    health = f"http://{s.gateway.host}:{s.gateway.port}/health"
    took = stack.wait_until(lambda: _healthy(health, stack.topology.num_workers))
    stack.note(
        f"ready in {took:.1f}s: OpenAI API at http://{s.gateway.host}:{s.gateway.port}/v1 "
        "(Ctrl-C stops)"
    )
    _supervise(stack)


def serve(
    settings: Settings,
    topology: Topology | None = None,
    nats_tls: tuple[str, str] | None = None,
    redis_sentinel: bool = False,
    nats_cluster: int = 1,
) -> int:
    """``kvflow serve``: the whole stack with a gateway, until Ctrl-C or SIGTERM."""
    topology = topology or Topology()
    try:
        check_settings_model(settings)
        stack = Stack(
            settings,
            topology,
            nats_tls=nats_tls,
            redis_sentinel=redis_sentinel,
            nats_cluster=nats_cluster,
        )
    except (ModelNotFoundError, ValueError) as e:
        return _fail(str(e))
    host, port = settings.gateway.host, settings.gateway.port
    if not port_is_free(host, port):
        return _fail(f"port {port} on {host} is taken: stop what uses it or pass --port N")

    def on_term(*_: object) -> None:
        raise _Stop

    signal.signal(signal.SIGTERM, on_term)
    graceful = False
    try:
        _run(stack)
    except KeyboardInterrupt:
        print("\nkvflow: stopping ...", flush=True)
    except _Stop:
        stack.note("SIGTERM: the gateway finishes its open requests, then all stop ...")
        graceful = True
    except RuntimeError as e:
        return _fail(str(e))
    finally:
        stack.stop(graceful)
    return 0


def start_pipeline(settings: Settings, workers: int = 1) -> Stack:
    """The Python API's pipeline: no gateway (the ``LLM`` object is the pipeline's client) and
    redis-server only when a setting needs one. The children's logs go to a file (the path is
    printed) so the caller's console stays clean; notes go to stderr."""
    if workers < 1:
        raise ValueError("workers must be at least 1")
    log_path = Path(tempfile.mkdtemp(prefix="kvflow-llm-")) / "pipeline.log"
    stack = Stack(settings, Topology(workers=workers, gateway=False), log_path, sys.stderr)
    stack.temporary_log = True
    stack.note("starting the pipeline (nats-server, tokenizer, scheduler, detokenizer, worker)")
    try:
        stack.start(redis=False)
    except BaseException:
        stack.failed = True
        stack.stop()
        raise
    stack.note(f"loading the model in every process; logs: {log_path} (removed at close)")
    return stack
