"""Run the gateway: uvicorn serving ``create_app(settings)`` on --host:--port. This is what
``kvflow run gateway`` calls; ``python -m kvflow.services.gateway.main --port 8000`` works too."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from types import FrameType

import uvicorn

from kvflow.services.gateway.app import create_app
from kvflow.shared import event_loop
from kvflow.shared.config import Settings
from kvflow.shared.logs import setup_logging
from kvflow.shared.telemetry import setup_tracing


def server(settings: Settings) -> uvicorn.Server:
    config = uvicorn.Config(
        create_app(settings),
        host=settings.gateway.host,
        port=settings.gateway.port,
        log_level=settings.ops.log_level,
        log_config=None,  # keep the service's own logging set-up (shared.logs)
        access_log=False,
        # after SIGTERM: no new connections, open requests get this long to finish
        timeout_graceful_shutdown=max(1, round(settings.ops.drain_timeout)),
    )
    return uvicorn.Server(config)


async def run(settings: Settings) -> None:
    """Serve until SIGINT/SIGTERM (uvicorn handles the signals and drains connections).
    Raises AccessError when NATS or Redis refused the gateway's credentials at start."""
    s = server(settings)
    await s.serve()
    refused = getattr(s.config.app.state, "refused", None)
    if refused is not None:
        raise refused


def _exit_cleanly(signum: int, frame: FrameType | None) -> None:
    sys.exit(0)


def main(settings: Settings) -> None:
    """Blocking entry point (``kvflow run gateway``). Exits with status 0 on SIGTERM: uvicorn
    drains, then re-raises the signal to the handler that was there before it, which here exits
    cleanly instead of dying with 143."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_cleanly)
    try:
        event_loop.run(run(settings))
    except KeyboardInterrupt:  # uvicorn re-raises the captured signal after a clean shutdown
        pass


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="kvflow-gateway", description=__doc__)
    Settings.add_arguments(parser)
    cli_settings = Settings.from_args(parser.parse_args())
    setup_logging("gateway", cli_settings.ops.log_level, cli_settings.ops.log_format)
    setup_tracing("gateway")
    main(cli_settings)
