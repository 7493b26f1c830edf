"""The servers' side of the grants: a nats-server configuration (users with bcrypt-hashed
passwords and their subject permissions) and a Redis ACL file (users with SHA-256-hashed
passwords, key patterns and commands; the default user may only PING, for health checks)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import bcrypt

from shared.access.grants import NATS_GRANTS, REDIS_GRANTS


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


def redis_acl(passwords: Mapping[str, str]) -> str:
    """A Redis ACL file (``redis-server --aclfile``) for the roles in ``passwords``."""
    # no comments: an ACL file holds only `user` lines
    lines = ["user default on nopass resetkeys resetchannels -@all +ping"]
    for role, password in passwords.items():
        grant = REDIS_GRANTS[role]
        digest = hashlib.sha256(password.encode()).hexdigest()
        keys = " ".join(f"~{k}" for k in grant.keys)
        commands = " ".join(f"+{c}" for c in grant.commands)
        lines.append(f"user {role} on #{digest} resetkeys {keys} resetchannels -@all {commands}")
    return "\n".join(lines) + "\n"
