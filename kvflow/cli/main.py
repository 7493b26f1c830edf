"""The ``kvflow`` command: ``serve`` (the whole stack on this machine), ``run SERVICE`` (one
service against given NATS/Redis URLs, as compose and Kubernetes run it)."""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import sys

from kvflow.shared import event_loop
from kvflow.shared.access.connect import EXIT_REFUSED, AccessError
from kvflow.shared.config import Settings
from kvflow.shared.heap import tune_collector
from kvflow.shared.logs import setup_logging
from kvflow.shared.lora import LoRAError
from kvflow.shared.speculative import SpeculativeConfigError
from kvflow.shared.telemetry import setup_tracing

SERVICES = ("gateway", "tokenizer", "scheduler", "worker", "detokenizer")
# Commands beside serve/run, each in its own module (add_arguments, main), imported only when it
# is the command: a service never loads the benchmark clients or the simulator.
TOOLS = {
    "bench": (
        "kvflow.benchmarks.serving",
        "kvflow against Hugging Face generate on the same requests; "
        "`kvflow bench pipeline`: the pipeline's own cost with a simulated worker",
    ),
    "simulate": (
        "kvflow.services.scheduler.simulator",
        "the real scheduler on a cost model: capacity questions",
    ),
    "keys": ("kvflow.cli.keys", "manage API keys kept in Redis (gateway --key-store redis)"),
    "traces": ("kvflow.cli.traces", "receive OTLP/HTTP traces and print request timelines"),
    "auth": (
        "kvflow.cli.auth",
        "make per-role NATS and Redis credentials and the servers' configurations "
        "(compose, Kubernetes)",
    ),
}


def _run_service(name: str, settings: Settings) -> int:
    """Run one service until it stops; its exit status (EXIT_REFUSED when NATS or Redis
    refused its credentials: restarting it would not help)."""
    refused = _check_model(name, settings)  # before logging and tracing are set up
    if refused:
        print(f"kvflow: {name}: {refused}", file=sys.stderr, flush=True)
        return EXIT_REFUSED
    setup_logging(name, settings.ops.log_level, settings.ops.log_format)
    setup_tracing(name)
    faulthandler.enable()  # a crash in native code still leaves the Python stacks in the log
    tune_collector()
    try:
        if name == "gateway":
            from kvflow.services.gateway.main import main as gateway_main

            gateway_main(settings)
            return 0
        module = importlib.import_module(f"kvflow.services.{name}.service")
        event_loop.run(module.run(settings))
    except KeyboardInterrupt:
        pass
    except (AccessError, SpeculativeConfigError, LoRAError) as e:  # restarting would not help
        print(f"kvflow: {name}: {e}", file=sys.stderr, flush=True)
        return EXIT_REFUSED
    return 0


def _check_model(name: str, settings: Settings) -> str:
    """Why the model cannot be served ("" when it can), found from its config alone before the
    service connects or loads anything (restarting would not help)."""
    if name == "gateway":
        return ""
    from kvflow.shared.model_config import check_settings_model
    from kvflow.shared.model_source import ModelNotFoundError

    try:
        check_settings_model(settings)
    except (ModelNotFoundError, ValueError) as e:
        return str(e)
    return ""


def build_parser(tool_name: str | None = None) -> argparse.ArgumentParser:
    """The ``kvflow`` command line (deployment tests parse compose/k8s commands with it), with
    the arguments of the tool ``tool_name`` (one of TOOLS) when it is the command."""
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

    serve.add_argument(
        "--nats-server-tls-cert",
        default="",
        help="certificate file for the stack's nats-server: every bus connection is TLS "
        "(give the services its CA with --nats-tls-ca)",
    )
    serve.add_argument("--nats-server-tls-key", default="", help="key of --nats-server-tls-cert")
    serve.add_argument(
        "--nats-cluster",
        type=int,
        default=1,
        metavar="N",
        help="N nats-servers (3 or more, odd) joined into one cluster instead of one: every "
        "service is given them all and moves to another when its own dies; what the lost one "
        "dropped is published again",
    )
    serve.add_argument(
        "--redis-sentinel",
        action="store_true",
        help="Redis as a primary, a replica and three sentinels instead of one redis-server: "
        "the sentinels promote the replica when the primary dies (in about 2 s) and every "
        "service follows them",
    )

    run = sub.add_parser("run", help="run one service")
    run.add_argument("service", choices=SERVICES)
    Settings.add_arguments(run)

    for name, (module, text) in TOOLS.items():
        tool = sub.add_parser(name, help=text, description=text)
        if name == tool_name:
            importlib.import_module(module).add_arguments(tool)
        else:  # listed for --help; its module (and what it imports) loads only when it runs
            tool.add_argument("tool_args", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    tool_name = argv[0] if argv and argv[0] in TOOLS else None
    args = build_parser(tool_name).parse_args(argv)
    if tool_name is not None:
        return importlib.import_module(TOOLS[tool_name][0]).main(args)
    try:
        settings = Settings.from_args(args)
    except ValueError as e:  # a KVFLOW_* variable that does not parse
        print(f"kvflow: error: {e}", file=sys.stderr)
        return 2
    if args.command == "run":
        return _run_service(args.service, settings)
    from kvflow.cli.launcher import Topology, serve

    disaggregated = args.prefill_workers or args.decode_workers
    both = args.workers if args.workers is not None else (0 if disaggregated else 1)
    topology = Topology(
        workers=both,
        prefill_workers=args.prefill_workers,
        decode_workers=args.decode_workers,
        schedulers=args.schedulers,
        tokenizers=args.tokenizers,
        detokenizers=args.detokenizers,
    )
    cert, key = args.nats_server_tls_cert, args.nats_server_tls_key
    if bool(cert) != bool(key):
        print("kvflow: error: --nats-server-tls-cert and --nats-server-tls-key go together")
        return 2
    tls = (cert, key) if cert else None
    return serve(settings, topology, tls, args.redis_sentinel, args.nats_cluster)


if __name__ == "__main__":
    sys.exit(main())
