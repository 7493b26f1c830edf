"""The servers' side of the grants: a nats-server configuration (users with bcrypt-hashed
passwords and their subject permissions), a Redis ACL file (users with SHA-256-hashed
passwords, key patterns and commands; the default user may only PING, for health checks) and,
for Redis with Sentinel, what the replicas and the sentinels log in with and the sentinels'
own users."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence

import bcrypt

from kvflow.shared.access.grants import (
    NATS_GRANTS,
    REDIS_GRANTS,
    REDIS_SERVER_GRANTS,
    SENTINEL_CLIENT_COMMANDS,
    SENTINEL_MASTER,
    RedisGrant,
)


def _q(value: str) -> str:
    return json.dumps(value)  # NATS config strings take JSON's quoting


def _list(items: tuple[str, ...]) -> str:
    return "[" + ", ".join(_q(i) for i in items) + "]"


def nats_authorization(passwords: Mapping[str, str], bcrypt_rounds: int = 10) -> str:
    """The ``authorization`` block for the roles in ``passwords`` (role -> password)."""
    users = []
    for role, password in passwords.items():
        grant = NATS_GRANTS[role]
        hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(bcrypt_rounds)).decode()
        users.append(
            f"    {{\n      user: {_q(role)}\n      password: {_q(hashed)}\n"
            "      permissions: {\n"
            f"        publish: {{ allow: {_list(grant.publish)} }}\n"
            f"        subscribe: {{ allow: {_list(grant.subscribe)} }}\n"
            "        allow_responses: true\n"
            "      }\n    }"
        )
    return "authorization {\n  users: [\n" + "\n".join(users) + "\n  ]\n}\n"


def nats_config(
    passwords: Mapping[str, str],
    *,
    tls_cert: str = "",
    tls_key: str = "",
    tls_ca: str = "",
    max_payload: int | None = None,
) -> str:
    """A whole nats-server configuration: the users and, with ``tls_cert``/``tls_key``, TLS
    for every client connection (``tls_ca``: clients must show a certificate it signed)."""
    text = "# kvflow: one user per role (shared/access/grants.py); made by `kvflow auth init`\n"
    text += nats_authorization(passwords)
    if tls_cert or tls_key:
        if not (tls_cert and tls_key):
            raise ValueError("NATS TLS needs both a certificate and its key")
        text += f"tls {{\n  cert_file: {_q(tls_cert)}\n  key_file: {_q(tls_key)}\n"
        if tls_ca:
            text += f"  ca_file: {_q(tls_ca)}\n  verify: true\n"
        text += "  timeout: 5\n}\n"
    if max_payload is not None:
        text += f"max_payload: {int(max_payload)}\n"
    return text


def nats_cluster(
    routes: Sequence[str], route_password: str, listen: str, tls: tuple[str, str, str] | None = None
) -> str:
    """What makes nats-server a node of a NATS cluster, written beside ``nats.conf`` (its users,
    permissions and TLS, included): it listens for the other nodes on ``listen`` ("HOST:PORT")
    and joins the ``routes`` ("HOST:PORT" of every node's cluster port, its own among them: a
    node ignores a route to itself), nodes logging in to one another as "route". ``tls``:
    (certificate, key, CA) paths as nats-server sees them: routes in TLS, each node verifying
    the other's certificate (for the route's host name) and presenting its own. No
    ``server_name``: each node is given its own (``--name``)."""
    urls = ", ".join(_q(f"nats-route://route:{route_password}@{r}") for r in routes)
    block = ""
    if tls:
        cert, key, ca = tls
        block = (
            f"  tls {{\n    cert_file: {_q(cert)}\n    key_file: {_q(key)}\n"
            f"    ca_file: {_q(ca)}\n    verify: true\n    timeout: 5\n  }}\n"
        )
    return (
        'include "nats.conf"\n'
        "cluster {\n"
        '  name: "kvflow"\n'
        f"  listen: {_q(listen)}\n"
        f'  authorization {{ user: "route", password: {_q(route_password)} }}\n'
        f"  routes: [{urls}]\n"
        f"{block}"
        "}\n"
    )


def nats_cluster_node(
    index: int,
    cluster_port: int,
    routes: list[str],
    route_password: str,
    host: str = "127.0.0.1",
    tls: tuple[str, str, str] | None = None,
) -> str:
    """The configuration of node ``index`` of ``kvflow serve --nats-cluster``: ``nats_cluster``
    listening on ``host:cluster_port``, named ``kvflow-INDEX``."""
    return (
        "# kvflow: one node of a NATS cluster; made by `kvflow serve --nats-cluster`\n"
        f"server_name: {_q(f'kvflow-{index}')}\n"
        + nats_cluster(routes, route_password, f"{host}:{cluster_port}", tls)
    )


def _redis_user(name: str, password: str, grant: RedisGrant) -> str:
    digest = hashlib.sha256(password.encode()).hexdigest()
    keys = "".join(f" ~{k}" for k in grant.keys)
    channels = "".join(f" &{c}" for c in grant.channels)
    commands = " ".join(f"+{c}" for c in grant.commands)
    return f"user {name} on #{digest} resetkeys{keys} resetchannels{channels} -@all {commands}"


def redis_acl(passwords: Mapping[str, str], server_passwords: Mapping[str, str] = {}) -> str:  # noqa: B006 - read only
    """A Redis ACL file (``redis-server --aclfile``) for the roles in ``passwords`` and Redis's
    own users in ``server_passwords`` (``replication``, ``sentinel``)."""
    # no comments: an ACL file holds only `user` lines
    lines = ["user default on nopass resetkeys resetchannels -@all +ping"]
    lines += [_redis_user(role, pw, REDIS_GRANTS[role]) for role, pw in passwords.items()]
    lines += [_redis_user(n, pw, REDIS_SERVER_GRANTS[n]) for n, pw in server_passwords.items()]
    return "\n".join(lines) + "\n"


def redis_replication_config(password: str) -> str:
    """The lines every Redis server of a Sentinel deployment starts with (``redis-server
    FILE``): how it logs in to its primary when it is (or becomes) a replica."""
    return f"masteruser replication\nmasterauth {_q(password)}\n"


def sentinel_monitor(host: str, port: int, quorum: int = 2) -> str:
    """The lines a sentinel's configuration starts with: the primary it watches as
    SENTINEL_MASTER (a host name is resolved: compose and Kubernetes name their servers);
    ``sentinel_config``'s lines follow them."""
    return (
        "sentinel resolve-hostnames yes\n"
        f"sentinel monitor {SENTINEL_MASTER} {host} {port} {quorum}\n"
    )


def sentinel_config(passwords: Mapping[str, str], sentinel_password: str) -> str:
    """The rest of a sentinel's configuration (after ``sentinel_monitor``; the sentinel rewrites
    its file, so each gets its own copy): it logs in to the servers and to the other sentinels as
    "sentinel" and lets each role in ``passwords`` ask only where the primary is; anyone may
    PING (health checks). A primary is given up after a second without answer (a sentinel's
    default is 30 s)."""
    m = SENTINEL_MASTER
    lines = [
        f"sentinel down-after-milliseconds {m} 1000",
        # also how long sentinels whose votes split (each for itself: they see the primary go
        # down in the same second) wait before trying again, twice this: 6 s
        f"sentinel failover-timeout {m} 3000",
        f"sentinel auth-user {m} sentinel",
        f"sentinel auth-pass {m} {_q(sentinel_password)}",
        "sentinel sentinel-user sentinel",
        f"sentinel sentinel-pass {_q(sentinel_password)}",
        "user default on nopass resetchannels -@all +ping",
        f"user sentinel on #{hashlib.sha256(sentinel_password.encode()).hexdigest()} "
        "resetchannels &* +@all",
    ]
    client = RedisGrant(keys=(), commands=SENTINEL_CLIENT_COMMANDS)
    lines += [_redis_user(role, pw, client) for role, pw in passwords.items()]
    return "\n".join(lines) + "\n"
