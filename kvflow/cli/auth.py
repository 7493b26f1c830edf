"""``kvflow auth init DIR``: fresh per-role credentials and the servers' configurations.

    DIR/<role>/nats-password, DIR/<role>/redis-password   one directory per role
    DIR/nats/nats.conf                                     nats-server -c (users, permissions)
    DIR/nats/cluster.conf, DIR/nats/route-password         a NATS cluster node's -c (routes)
    DIR/nats/cluster-tls.conf                              the same with TLS routes
    DIR/redis/users.acl                                    redis-server --aclfile
    DIR/redis/replication.conf                             redis-server FILE (with Sentinel)
    DIR/redis/sentinel.conf                                a sentinel's, after its monitor line

Compose's init service runs it into one volume per role; for Kubernetes, run it into
k8s/base/secrets before `kubectl apply -k` (kustomize makes the Secrets from the files).
`kvflow serve` needs none of this: it makes its own at every start."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvflow.shared.access.credentials import NATS_ROUTE_TLS_DIR, NATS_ROUTES, Credentials, generate
from kvflow.shared.access.grants import ROLES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``kvflow auth``'s arguments."""
    ops = parser.add_subparsers(dest="auth_command", required=True)
    init = ops.add_parser("init", help="write new credentials and configurations into DIR")
    init.add_argument("dir", type=Path)
    init.add_argument(
        "--if-missing",
        action="store_true",
        help="do nothing when DIR already holds every file (compose's init service); where "
        "some are missing (made by an older kvflow), write new ones for every role",
    )
    init.add_argument("--force", action="store_true", help="replace credentials already in DIR")
    init.add_argument(
        "--mode",
        default="600",
        help="octal mode of the files (600; compose's init service uses 644 so that the "
        "unprivileged containers mounting a role's directory can read it)",
    )
    init.add_argument("--nats-tls-cert", default="", help="nats-server's certificate (its path)")
    init.add_argument("--nats-tls-key", default="", help="its key (path as nats-server sees it)")
    init.add_argument(
        "--nats-tls-ca", default="", help="CA of client certificates (nats-server verifies them)"
    )
    init.add_argument(
        "--nats-routes",
        default=",".join(NATS_ROUTES),
        help="HOST:PORT of every NATS cluster node's cluster port, comma-separated, for "
        "nats/cluster.conf (default: the names compose and k8s/ give the three nodes)",
    )
    init.add_argument(
        "--nats-route-tls-dir",
        default=NATS_ROUTE_TLS_DIR,
        help="where nats/cluster-tls.conf's nodes find tls.crt, tls.key and ca.crt for TLS "
        f"routes (default {NATS_ROUTE_TLS_DIR}: where k8s/components/nats-tls mounts them)",
    )


def main(args: argparse.Namespace) -> int:
    """Run ``kvflow auth``."""
    files = Credentials(args.dir).files()
    missing = [f for f in files if not f.exists()]
    if len(missing) < len(files):  # some are there
        if args.if_missing and not missing:
            print(f"kvflow: credentials already in {args.dir}: kept", file=sys.stderr)
            return 0
        if args.if_missing:
            names = ", ".join(str(p.relative_to(args.dir)) for p in missing)
            print(
                f"kvflow: {args.dir} lacks {names} (an older kvflow made it): new credentials "
                "for every role",
                file=sys.stderr,
            )
        elif not args.force:
            print(
                f"kvflow: error: {args.dir} already holds credentials; pass --force to replace "
                "them (every service must then be given the new ones)",
                file=sys.stderr,
            )
            return 2
    try:
        mode = int(args.mode, 8)
        creds = generate(
            args.dir,
            mode=mode,
            tls_cert=args.nats_tls_cert,
            tls_key=args.nats_tls_key,
            tls_ca=args.nats_tls_ca,
            nats_routes=tuple(r.strip() for r in args.nats_routes.split(",") if r.strip()),
            nats_route_tls_dir=args.nats_route_tls_dir,
        )
    except ValueError as e:
        print(f"kvflow: error: {e}", file=sys.stderr)
        return 2
    print(f"kvflow: credentials for {', '.join(ROLES)} in {creds.root}", file=sys.stderr)
    return 0
