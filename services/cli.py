"""The ``kvflow`` command: ``serve`` (the whole stack on this machine), ``run SERVICE`` (one
service against given NATS/Redis URLs, as compose and Kubernetes run it)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from shared import event_loop
from shared.config import Settings
from shared.logs import setup_logging
from shared.telemetry import setup_tracing

SERVICES = ("gateway", "tokenizer", "scheduler", "worker", "detokenizer")


def _run_service(name: str, settings: Settings) -> None:
    setup_logging(name, settings.log_level, settings.log_format)
    setup_tracing(name)
    os.environ.update(settings.to_env())  # the effective settings, for code that reads them later
    if name == "gateway":
        from services.gateway.main import main as gateway_main

        gateway_main(settings)
        return
    module = importlib.import_module(f"services.{name}.service")
    try:
        event_loop.run(module.run(settings))
    except KeyboardInterrupt:
        pass


def build_parser() -> argparse.ArgumentParser:
    """The ``kvflow`` command line (deployment tests parse compose/k8s commands with it)."""
    parser = argparse.ArgumentParser(prog="kvflow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the whole stack on this machine")
    Settings.add_arguments(serve)
    serve.add_argument(
        "--workers",
        type=int,
        default=None,
        help="workers of role 'both' (default: 1, or 0 with --prefill-workers/--decode-workers)",
    )
    serve.add_argument(
        "--prefill-workers", type=int, default=0, help="workers of role 'prefill' (disaggregated)"
    )
    serve.add_argument(
        "--decode-workers", type=int, default=0, help="workers of role 'decode' (disaggregated)"
    )
    serve.add_argument(
        "--tokenizers", type=int, default=1, help="tokenizers (a queue group shares requests)"
    )
    serve.add_argument(
        "--detokenizers", type=int, default=1, help="detokenizers (a queue group shares requests)"
    )
    serve.add_argument(
        "--schedulers",
        type=int,
        default=1,
        help="schedulers; with 2 or more, one leads and the others stand by (lease in Redis)",
    )

    run = sub.add_parser("run", help="run one service")
    run.add_argument("service", choices=SERVICES)
    Settings.add_arguments(run)

    from services import bench, keys_cli, trace_sink
    from services.scheduler import simulator

    bench.add_parser(sub)
    simulator.add_parser(sub)
    keys_cli.add_parser(sub)
    trace_sink.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        from services import bench

        return bench.main(args)
    if args.command == "simulate":
        from services.scheduler import simulator

        return simulator.main(args)
    if args.command == "keys":
        from services import keys_cli

        return keys_cli.main(args)
    if args.command == "traces":
        from services import trace_sink

        return trace_sink.main(args)
    settings = Settings.from_args(args)
    if args.command == "run":
        _run_service(args.service, settings)
        return 0
    from services.launcher import serve as serve_stack

    disaggregated = args.prefill_workers or args.decode_workers
    both = args.workers if args.workers is not None else (0 if disaggregated else 1)
    return serve_stack(
        settings,
        workers=both,
        prefill_workers=args.prefill_workers,
        decode_workers=args.decode_workers,
        schedulers=args.schedulers,
        tokenizers=args.tokenizers,
        detokenizers=args.detokenizers,
    )


if __name__ == "__main__":
    sys.exit(main())
