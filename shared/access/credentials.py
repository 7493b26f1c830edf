"""Fresh credentials for every role, written where the servers and services read them:

    DIR/<role>/nats-password    DIR/<role>/redis-password    (one directory per role)
    DIR/nats/nats.conf          DIR/redis/users.acl          (the servers' configurations)
    DIR/nats/route-password     DIR/nats/cluster.conf        (a NATS cluster's nodes: the
                                                              password; compose's and
                                                              Kubernetes' nodes' -c, which
                                                              includes nats.conf)
    DIR/redis/replication.conf  DIR/redis/sentinel.conf      (Redis with Sentinel: every Redis
                                                              server's and every sentinel's)

`kvflow serve` makes them at start in a private temporary directory; `kvflow auth init DIR`
makes them for compose (its init service) and Kubernetes (Secrets generated from the files).
A service is given only its own role's directory (compose volume, Kubernetes Secret), and
reads the password from a file (``--nats-password-file``): never a command line or an image."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from kvflow.shared.access.grants import NATS_ROLES, REDIS_ROLES, ROLES
from kvflow.shared.access.render import (
    nats_cluster,
    nats_config,
    redis_acl,
    redis_replication_config,
    sentinel_config,
)

NATS_PASSWORD = "nats-password"
REDIS_PASSWORD = "redis-password"
NATS_CONF = Path("nats") / "nats.conf"
NATS_ROUTE_PASSWORD = Path("nats") / "route-password"
NATS_CLUSTER_CONF = Path("nats") / "cluster.conf"
NATS_CLUSTER_TLS_CONF = Path("nats") / "cluster-tls.conf"
# where cluster-tls.conf's nodes find their certificate, key and CA: cert-manager's Secret (k8s
# components/nats-tls mounts it there)
NATS_ROUTE_TLS_DIR = "/etc/nats/tls"
# the cluster ports of the three nodes compose and Kubernetes run (the StatefulSet's pods behind
# its headless Service `nats-cluster`; compose gives its containers the same names as aliases)
NATS_ROUTES = tuple(f"nats-{i}.nats-cluster:6222" for i in range(3))
REDIS_ACL = Path("redis") / "users.acl"
REDIS_REPLICATION_CONF = Path("redis") / "replication.conf"
SENTINEL_CONF = Path("redis") / "sentinel.conf"


@dataclass(frozen=True)
class Credentials:
    """A directory made by ``generate``."""

    root: Path

    def nats_password_file(self, role: str) -> Path:
        return self.root / role / NATS_PASSWORD

    def redis_password_file(self, role: str) -> Path:
        return self.root / role / REDIS_PASSWORD

    @property
    def nats_conf(self) -> Path:
        return self.root / NATS_CONF

    @property
    def nats_route_password(self) -> Path:
        """What the nodes of a NATS cluster log in to one another with (user "route")."""
        return self.root / NATS_ROUTE_PASSWORD

    @property
    def nats_cluster_conf(self) -> Path:
        """A cluster node's configuration (compose, Kubernetes): ``nats.conf`` and the routes."""
        return self.root / NATS_CLUSTER_CONF

    @property
    def nats_cluster_tls_conf(self) -> Path:
        """``nats_cluster_conf`` with TLS routes (k8s components/nats-tls)."""
        return self.root / NATS_CLUSTER_TLS_CONF

    @property
    def redis_acl(self) -> Path:
        return self.root / REDIS_ACL

    @property
    def redis_replication_conf(self) -> Path:
        return self.root / REDIS_REPLICATION_CONF

    @property
    def sentinel_conf(self) -> Path:
        """Every sentinel's configuration after its ``sentinel_monitor`` lines."""
        return self.root / SENTINEL_CONF

    def files(self) -> list[Path]:
        """Every file ``generate`` writes."""
        files = [self.nats_password_file(r) for r in NATS_ROLES]
        files += [self.redis_password_file(r) for r in REDIS_ROLES]
        files += [self.nats_conf, self.nats_route_password, self.nats_cluster_conf]
        files += [self.nats_cluster_tls_conf]
        return files + [self.redis_acl, self.redis_replication_conf, self.sentinel_conf]

    def service_settings(self, role: str) -> dict[str, str]:
        """The flat settings that make a service of ``role`` log in (user = its role)."""
        out: dict[str, str] = {}
        if role in NATS_ROLES:
            out |= {"nats_user": role, "nats_password_file": str(self.nats_password_file(role))}
        if role in REDIS_ROLES:
            out |= {"redis_user": role, "redis_password_file": str(self.redis_password_file(role))}
        return out


def _write(path: Path, text: str, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, mode)  # an existing file keeps its old mode through os.open


def generate(
    root: Path | str,
    *,
    mode: int = 0o600,
    tls_cert: str = "",
    tls_key: str = "",
    tls_ca: str = "",
    max_payload: int | None = None,
    nats_routes: tuple[str, ...] = NATS_ROUTES,
    nats_route_tls_dir: str = NATS_ROUTE_TLS_DIR,
) -> Credentials:
    """New random passwords for every role and the servers' configurations under ``root``.
    ``mode``: of every file (0o600: only this user; compose's init service widens it so the
    unprivileged containers that mount a role's directory can read it). ``nats_routes``: every
    cluster node's HOST:6222, for ``cluster.conf`` and ``cluster-tls.conf`` (whose routes are
    TLS with ``tls.crt``, ``tls.key`` and ``ca.crt`` in ``nats_route_tls_dir``). ``tls_*``:
    paths, as nats-server will see them, of its certificate, key and client CA."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    nats = {r: secrets.token_urlsafe(24) for r in NATS_ROLES}
    redis = {r: secrets.token_urlsafe(24) for r in REDIS_ROLES}
    creds = Credentials(root)
    for role in ROLES:
        if role in nats:
            _write(creds.nats_password_file(role), nats[role] + "\n", mode)
        if role in redis:
            _write(creds.redis_password_file(role), redis[role] + "\n", mode)
    conf = nats_config(
        nats, tls_cert=tls_cert, tls_key=tls_key, tls_ca=tls_ca, max_payload=max_payload
    )
    _write(creds.nats_conf, conf, mode)
    route_password = secrets.token_urlsafe(24)
    _write(creds.nats_route_password, route_password + "\n", mode)
    head = "# kvflow: a NATS cluster's node; made by `kvflow auth init`\n"
    cluster = nats_cluster(nats_routes, route_password, listen="0.0.0.0:6222")
    _write(creds.nats_cluster_conf, head + cluster, mode)
    tls = tuple(f"{nats_route_tls_dir}/{f}" for f in ("tls.crt", "tls.key", "ca.crt"))
    cluster = nats_cluster(nats_routes, route_password, listen="0.0.0.0:6222", tls=tls)
    _write(creds.nats_cluster_tls_conf, head + cluster, mode)
    server = {u: secrets.token_urlsafe(24) for u in ("replication", "sentinel")}
    _write(creds.redis_acl, redis_acl(redis, server), mode)
    _write(creds.redis_replication_conf, redis_replication_config(server["replication"]), mode)
    _write(creds.sentinel_conf, sentinel_config(redis, server["sentinel"]), mode)
    return creds
