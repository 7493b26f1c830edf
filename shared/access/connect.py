"""A service's side of the grants: the NATS and Redis connection options of a role, built from
its settings (user, password file, TLS files), and the clear failure when a server refuses
them: the service exits with EXIT_REFUSED (78, EX_CONFIG) and a message naming what was
refused, and `kvflow serve` does not start it again (the same credentials would be refused)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvflow.shared.access.grants import inbox_prefix

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from kvflow.shared.config import BusSettings

EXIT_REFUSED = 78  # sysexits.h EX_CONFIG: restarting will not help


class AccessError(Exception):
    """Credentials unreadable or refused by NATS or Redis: the service cannot run as given."""


def read_secret(path: str, what: str) -> str:
    """The secret in file ``path`` (surrounding whitespace dropped)."""
    try:
        value = Path(path).read_text().strip()
    except OSError as e:
        raise AccessError(f"cannot read the {what} file {path}: {e.strerror}") from e
    if not value:
        raise AccessError(f"the {what} file {path} is empty")
    return value


def tls_context(ca: str = "", cert: str = "", key: str = "") -> ssl.SSLContext:
    """A client TLS context: trust ``ca`` (default: the system's CAs) and show ``cert``/``key``
    when given (servers that verify clients)."""
    try:
        ctx = ssl.create_default_context(cafile=ca or None)
        if cert or key:
            if not (cert and key):
                raise AccessError(
                    "a TLS client certificate needs both --*-tls-cert and --*-tls-key"
                )
            ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise AccessError(f"cannot load the TLS files ({e})") from e
    return ctx


@dataclass(frozen=True)
class NatsAuth:
    """How one role logs in to NATS."""

    role: str = ""
    user: str = ""
    password: str = ""
    tls: ssl.SSLContext | None = None

    def options(self) -> dict[str, Any]:
        """Keyword arguments for ``nats.connect``."""
        out: dict[str, Any] = {}
        if self.role:
            out["inbox_prefix"] = inbox_prefix(self.role)
        if self.user:
            out |= {"user": self.user, "password": self.password}
        if self.tls is not None:
            out["tls"] = self.tls
        return out

    def describe(self) -> str:
        return f"user {self.user!r}" if self.user else "no credentials"


def nats_auth(bus: BusSettings, role: str) -> NatsAuth:
    """The NATS login of a service of ``role`` from its settings: user (default: the role) and
    password file, TLS when CA/certificate files are given or the URL says ``tls://``."""
    user = password = ""
    if bus.nats_password_file:
        user = bus.nats_user or role
        password = read_secret(bus.nats_password_file, "NATS password")
    tls = None
    if bus.nats_tls_ca or bus.nats_tls_cert or bus.nats_url.startswith("tls://"):
        tls = tls_context(bus.nats_tls_ca, bus.nats_tls_cert, bus.nats_tls_key)
    return NatsAuth(role, user, password, tls)


def redis_options(bus: BusSettings, role: str) -> dict[str, Any]:
    """Keyword arguments for ``redis.asyncio.from_url(bus.redis_url, ...)`` of ``role``: its
    ACL user and password, and a CA for ``rediss://`` URLs."""
    out: dict[str, Any] = {}
    if bus.redis_password_file:
        out["username"] = bus.redis_user or role
        out["password"] = read_secret(bus.redis_password_file, "Redis password")
    if bus.redis_tls_ca:
        out["ssl_ca_certs"] = bus.redis_tls_ca
    return out


SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}  # scheme -> TLS


def parse_sentinel_url(url: str) -> tuple[list[tuple[str, int]], str, int, bool] | None:
    """``redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER[/DB]`` (``rediss+sentinel``: TLS to
    the sentinels and the servers) as (sentinels, master name, db, tls); None for any other
    URL. A ValueError says what is wrong with one."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in SENTINEL_SCHEMES:
        return None
    hosts, _, path = rest.partition("/")
    parts = [p for p in path.split("/") if p]
    form = f"a Sentinel URL is {scheme}://HOST:PORT[,HOST:PORT...]/MASTER[/DB]"
    if "@" in hosts or not hosts or not parts or len(parts) > 2:
        raise ValueError(
            f"{url!r}: {form} (the login comes from --redis-user/--redis-password-file)"
        )
    sentinels = []
    for hp in hosts.split(","):
        host, _, port = hp.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{url!r}: {hp!r} is not HOST:PORT; {form}")
        sentinels.append((host.strip("[]"), int(port)))
    db = parts[1] if len(parts) == 2 else "0"
    if not db.isdigit():
        raise ValueError(f"{url!r}: the database {db!r} is not a number; {form}")
    return sentinels, parts[0], int(db), SENTINEL_SCHEMES[scheme]


def redis_from_url(url: str, **kwargs: Any) -> aioredis.Redis:
    """A Redis client on ``url`` (``kwargs``: the login, timeouts, decoding: ``from_url``'s).
    A Sentinel URL gives a client of the primary that the sentinels name, asked again whenever
    a connection fails (a failover promoted a replica); it logs in to the sentinels with the
    same user and password."""
    import redis.asyncio as aioredis

    sentinel = parse_sentinel_url(url)
    if sentinel is None:
        return aioredis.from_url(url, **kwargs)
    from redis.asyncio.sentinel import Sentinel

    hosts, master, db, tls = sentinel
    opts = dict(kwargs)
    ca = opts.pop("ssl_ca_certs", None)
    secure = {"ssl": True, **({"ssl_ca_certs": ca} if ca else {})} if tls else {}
    login = {k: opts[k] for k in ("username", "password") if k in opts}
    timeouts = {k: v for k, v in opts.items() if k.startswith("socket_")}
    sentinels = Sentinel(hosts, sentinel_kwargs={**login, **timeouts, **secure})
    return sentinels.master_for(master, db=db, **opts, **secure)


def redis_client(bus: BusSettings, role: str, **kwargs: Any) -> aioredis.Redis:
    """A Redis client of ``role`` on ``bus.redis_url`` (``kwargs``: timeouts, decoding)."""
    return redis_from_url(bus.redis_url, **redis_options(bus, role), **kwargs)


async def verify_redis(client: aioredis.Redis, role: str, url: str) -> bool:
    """Log in once at start: refused credentials raise AccessError (the service cannot do its
    Redis work as given); an unreachable Redis returns False (the caller carries on without
    it, as when Redis goes away later)."""
    from redis.exceptions import AuthenticationError, NoPermissionError, RedisError

    try:
        await client.ping()
    except (AuthenticationError, NoPermissionError) as e:
        raise AccessError(
            f"Redis at {url} refused the {role} login ({e}): check --redis-user / "
            "--redis-password-file (`kvflow auth init` makes a role's credentials)"
        ) from e
    except (RedisError, OSError):
        return False
    return True
