"""API keys in Redis, with per-key rate limits and usage counters (the gateway and ``kvflow keys``).

Layout (only a key's SHA-256 is stored; the key itself is shown once, when it is made):

    kvflow:keys              hash  name -> key hash
    kvflow:key:<hash>        hash  name, rpm, tpm, created, requests, prompt_tokens, completion_tokens
    kvflow:rate:<hash>:<w>   hash  req, tok: requests and tokens in minute window w (expires)

Limits are fixed one-minute windows. Admission (key known? under both limits? count it) is one
Lua script, so concurrent gateways can never admit more than ``rpm`` requests in a window. The
token limit counts prompt + generated tokens when a request ends (they are not known before), so
a request is refused once the window's tokens have reached ``tpm``, as OpenAI does."""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass
from typing import Any

KEY_PREFIX = "sk-kvflow-"
NAMES = "kvflow:keys"
WINDOW_S = 60

_ADMIT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, 0, '', ''} end
local rec = redis.call('HMGET', KEYS[1], 'name', 'rpm', 'tpm')
local rpm = tonumber(rec[2] or '0') or 0
local tpm = tonumber(rec[3] or '0') or 0
local win = redis.call('HMGET', KEYS[2], 'req', 'tok')
local req = tonumber(win[1] or '0') or 0
local tok = tonumber(win[2] or '0') or 0
if rpm > 0 and req >= rpm then return {2, tonumber(ARGV[2]), rec[1], 'requests'} end
if tpm > 0 and tok >= tpm then return {2, tonumber(ARGV[2]), rec[1], 'tokens'} end
redis.call('HINCRBY', KEYS[2], 'req', 1)
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[1]))
redis.call('HINCRBY', KEYS[1], 'requests', 1)
return {1, 0, rec[1], ''}
"""

# tokens of a finished request: to the window, and to the key's usage if the key still exists
_RECORD = """
redis.call('HINCRBY', KEYS[2], 'tok', tonumber(ARGV[1]) + tonumber(ARGV[2]))
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[3]))
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HINCRBY', KEYS[1], 'prompt_tokens', tonumber(ARGV[1]))
  redis.call('HINCRBY', KEYS[1], 'completion_tokens', tonumber(ARGV[2]))
end
return 1
"""


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _record(h: str) -> str:
    return f"kvflow:key:{h}"


def _window(h: str, now: float) -> tuple[str, int]:
    """The rate key of the current window and the whole seconds left in it (at least 1)."""
    w = int(now // WINDOW_S)
    left = max(1, int((w + 1) * WINDOW_S - now + 0.999))
    return f"kvflow:rate:{h}:{w}", left


@dataclass
class KeyInfo:
    name: str
    rpm: int
    tpm: int
    created: float
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class Admission:
    """``status``: "ok", "unknown" (no such key) or "limited" (then ``retry_after`` seconds
    and which limit: "requests" or "tokens")."""

    status: str
    name: str = ""
    retry_after: int = 0
    limit: str = ""
    key_hash: str = ""


class KeyStore:
    """The keys of one Redis (a ``redis.asyncio.Redis`` client with decode_responses=True)."""

    def __init__(self, redis: Any) -> None:
        self.redis = redis
        self._admit = redis.register_script(_ADMIT)
        self._record = redis.register_script(_RECORD)

    async def add(self, name: str, rpm: int = 0, tpm: int = 0) -> str:
        """Make a key for ``name`` (0 = no limit); returns the key (only its hash is kept)."""
        if not name or rpm < 0 or tpm < 0:
            raise ValueError("a key needs a name, and limits >= 0 (0 = unlimited)")
        key = KEY_PREFIX + secrets.token_hex(24)
        h = key_hash(key)
        if not await self.redis.hsetnx(NAMES, name, h):
            raise ValueError(f"a key named {name!r} exists already")
        fields = {"name": name, "rpm": rpm, "tpm": tpm, "created": time.time()}
        await self.redis.hset(_record(h), mapping=fields)
        return key

    async def remove(self, name: str) -> bool:
        h = await self.redis.hget(NAMES, name)
        if h is None:
            return False
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hdel(NAMES, name)
            pipe.delete(_record(h))
            await pipe.execute()
        return True

    async def list(self) -> list[KeyInfo]:
        out = []
        for _name, h in sorted((await self.redis.hgetall(NAMES)).items()):
            rec = await self.redis.hgetall(_record(h))
            if rec:
                out.append(
                    KeyInfo(
                        rec["name"],
                        int(rec.get("rpm", 0)),
                        int(rec.get("tpm", 0)),
                        float(rec.get("created", 0)),
                        int(rec.get("requests", 0)),
                        int(rec.get("prompt_tokens", 0)),
                        int(rec.get("completion_tokens", 0)),
                    )
                )
        return out

    async def admit(self, key: str, now: float | None = None) -> Admission:
        """Check ``key`` and its limits and count the request, atomically."""
        h = key_hash(key)
        window, left = _window(h, time.time() if now is None else now)
        status, retry, name, limit = await self._admit(
            keys=[_record(h), window], args=[2 * WINDOW_S, left]
        )
        kind = {0: "unknown", 1: "ok", 2: "limited"}[int(status)]
        return Admission(kind, name or "", int(retry), limit or "", h)

    async def record(
        self, h: str, prompt_tokens: int, completion_tokens: int, now: float | None = None
    ) -> None:
        """Add a finished request's tokens to the key's usage and to the current window."""
        window, _ = _window(h, time.time() if now is None else now)
        await self._record(
            keys=[_record(h), window], args=[prompt_tokens, completion_tokens, 2 * WINDOW_S]
        )
