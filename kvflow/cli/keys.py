"""``kvflow keys``: API keys kept in Redis for gateways started with ``--key-store redis``.

    kvflow keys add NAME [--rpm 60] [--tpm 10000]   prints the new key (shown only once)
    kvflow keys list                                 names, limits and usage
    kvflow keys remove NAME

The Redis URL comes from ``--redis-url`` or ``KVFLOW_REDIS_URL``; the login is Redis's ``admin``
role (``--redis-user``, ``--redis-password-file`` or KVFLOW_REDIS_USER /
KVFLOW_REDIS_PASSWORD_FILE). ``kvflow serve`` prints its Redis URL and the admin password file;
compose and Kubernetes keep the admin credentials apart from every service (see README)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from kvflow.services.gateway.keys import KeyStore
from kvflow.shared.access.connect import EXIT_REFUSED, AccessError, redis_client, verify_redis
from kvflow.shared.config import BusSettings, Settings


def add_arguments(keys: argparse.ArgumentParser) -> None:
    """``kvflow keys``'s arguments."""
    keys.add_argument(
        "--redis-url",
        default=None,
        help="Redis URL (default: KVFLOW_REDIS_URL)",
    )
    keys.add_argument(
        "--redis-user",
        default=None,
        help="Redis ACL user (default: admin, when a password file is given)",
    )
    keys.add_argument(
        "--redis-password-file",
        default=None,
        help="file holding the admin role's Redis password",
    )
    keys.add_argument(
        "--redis-tls-ca",
        default=None,
        help="CA of a rediss:// server's certificate",
    )
    ops = keys.add_subparsers(dest="keys_command", required=True)
    add = ops.add_parser("add", help="make a key and print it")
    add.add_argument("name")
    add.add_argument("--rpm", type=int, default=0, help="requests per minute (0: no limit)")
    add.add_argument("--tpm", type=int, default=0, help="tokens per minute (0: no limit)")
    ops.add_parser("list", help="list keys with their limits and usage")
    rm = ops.add_parser("remove", help="remove a key")
    rm.add_argument("name")


REDIS_OPTIONS = ("redis_url", "redis_user", "redis_password_file", "redis_tls_ca")


def redis_settings(args: argparse.Namespace) -> BusSettings:
    """The Redis connection as the services read it (KVFLOW_REDIS_* through Settings), with
    the flags given here over it."""
    given = {n: getattr(args, n) for n in REDIS_OPTIONS if getattr(args, n, None) is not None}
    return Settings.from_env().replace(**given).bus


async def _run(bus: BusSettings, args: argparse.Namespace) -> int:
    try:
        client = redis_client(bus, "admin", decode_responses=True)
        await verify_redis(client, "admin", bus.redis_url)
    except AccessError as e:
        print(f"kvflow: error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    store = KeyStore(client)
    try:
        if args.keys_command == "add":
            key = await store.add(args.name, args.rpm, args.tpm)
            print(key)
        elif args.keys_command == "remove":
            if not await store.remove(args.name):
                print(f"kvflow: no key named {args.name!r}", file=sys.stderr)
                return 1
        else:
            print(
                f"{'name':20} {'rpm':>6} {'tpm':>8} {'requests':>9} {'prompt':>9} {'completion':>10}  created"
            )
            for k in await store.list():
                created = time.strftime("%Y-%m-%d %H:%M", time.localtime(k.created))
                print(
                    f"{k.name:20} {k.rpm:>6} {k.tpm:>8} {k.requests:>9} {k.prompt_tokens:>9} "
                    f"{k.completion_tokens:>10}  {created}"
                )
        return 0
    finally:
        await client.aclose()


def main(args: argparse.Namespace) -> int:
    try:
        bus = redis_settings(args)
    except ValueError as e:
        print(f"kvflow: error: {e}", file=sys.stderr)
        return 2
    if not bus.redis_url:
        print("kvflow: error: give --redis-url or set KVFLOW_REDIS_URL", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_run(bus, args))
    except ValueError as e:
        print(f"kvflow: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"kvflow: error: cannot reach Redis at {bus.redis_url}: {e}", file=sys.stderr)
        return 2
