"""Who may use the API: ``--api-key`` (one key, as vLLM's flag) and/or keys kept in Redis
(``--key-store redis``) with per-key rate limits and usage. Without either, the API is open.

Routes call ``Auth.check`` first: 401 without a valid key, 429 with ``Retry-After`` over a
limit, 503 if Redis cannot be reached. ``/health``, ``/metrics``, ``/version``, ``/stats`` and
``/openapi.json`` stay open (as in vLLM)."""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Any

from starlette.requests import Request

from kvflow.services.gateway.errors import APIError
from kvflow.services.gateway.keys import KeyStore
from kvflow.shared.access.connect import redis_client, verify_redis
from kvflow.shared.config import Settings

log = logging.getLogger("kvflow.gateway")


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, "AuthenticationError", headers={"WWW-Authenticate": "Bearer"})


class Auth:
    def __init__(self, settings: Settings, redis: Any = None) -> None:
        self.static_key = settings.gateway.api_key
        self.store: KeyStore | None = None
        self._own_login = ""  # the Redis URL of a key store this gateway logs in to itself
        if settings.gateway.key_store not in ("", "redis"):
            raise ValueError(
                f"--key-store must be '' or 'redis', not {settings.gateway.key_store!r}"
            )
        if settings.gateway.key_store == "redis":
            if redis is None:
                if not settings.bus.redis_url:
                    raise ValueError("--key-store redis needs --redis-url")
                redis = redis_client(settings.bus, "gateway", decode_responses=True)
                self._own_login = settings.bus.redis_url
            self.store = KeyStore(redis)
        self._tasks: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        """Log in to the key store once: refused credentials stop the gateway (AccessError)."""
        if self.store is not None and self._own_login:
            await verify_redis(self.store.redis, "gateway", self._own_login)

    @property
    def enabled(self) -> bool:
        return bool(self.static_key) or self.store is not None

    async def check(self, request: Request) -> str | None:
        """Admit the request or raise APIError; returns the Redis key's hash (for usage), or
        None (open API, or the static key, which has no limits)."""
        if not self.enabled:
            return None
        token = bearer_token(request)
        if token is None:
            raise _unauthorized("missing API key: send the header 'Authorization: Bearer KEY'")
        if self.static_key and hmac.compare_digest(token.encode(), self.static_key.encode()):
            return None
        if self.store is None:
            raise _unauthorized("invalid API key")
        try:
            adm = await self.store.admit(token)
        except Exception as e:  # noqa: BLE001 - Redis down or unreachable
            log.warning("key store unavailable: %s", e)
            raise APIError(
                503, "the API key store is unavailable", "ServiceUnavailableError"
            ) from e
        if adm.status == "unknown":
            raise _unauthorized("invalid API key")
        if adm.status == "limited":
            raise APIError(
                429,
                f"rate limit reached for key {adm.name!r}: {adm.limit} per minute; "
                f"retry in {adm.retry_after} s",
                "RateLimitError",
                headers={"Retry-After": str(adm.retry_after)},
            )
        return adm.key_hash

    def record(self, key_hash: str | None, prompt_tokens: int, completion_tokens: int) -> None:
        """Count a finished request's tokens against its key (in the background: callers are
        often closing, possibly cancelled, tasks)."""
        if key_hash is None or self.store is None:
            return
        task = asyncio.get_running_loop().create_task(
            self._record(key_hash, prompt_tokens, completion_tokens)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _record(self, key_hash: str, prompt_tokens: int, completion_tokens: int) -> None:
        assert self.store is not None
        try:
            await self.store.record(key_hash, prompt_tokens, completion_tokens)
        except Exception as e:  # noqa: BLE001 - usage is lost, the request was served
            log.warning("usage of a key not recorded: %s", e)

    async def close(self) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=2.0)
        if self.store is not None:
            await self.store.redis.aclose()
