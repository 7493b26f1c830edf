"""`kvflow serve`'s stop is not cut short by a second signal: a SIGTERM or Ctrl-C that arrives
while the children are being stopped (an impatient operator, an orchestrator's repeated TERM)
used to raise out of the stop and leave the pipeline's processes running."""

from __future__ import annotations

import os
import signal

import pytest

from kvflow.cli import launcher


class Server:
    stopped = False

    def stop(self) -> None:
        self.stopped = True


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_during_stop_is_ignored(sig) -> None:
    stack = object.__new__(launcher.Stack)
    server = Server()
    stack.servers, stack.credentials, stack._log, stack.procs = [server], None, None, []
    stack.temporary_log, stack.failed, stack.log_path = False, False, None
    stopped = []

    def stop_children(graceful: bool) -> None:
        os.kill(os.getpid(), sig)  # arrives in the middle of stopping the children
        stopped.append(graceful)

    stack._stop_children = stop_children

    def on_term(*_: object) -> None:
        raise launcher._Stop

    sigint = signal.getsignal(signal.SIGINT)  # SIG_IGN when pytest runs in the background
    previous = signal.signal(signal.SIGTERM, on_term)  # as serve() installs it
    try:
        stack.stop(graceful=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped == [True] and server.stopped
    # the handlers are back after the stop
    assert signal.getsignal(signal.SIGTERM) is previous
    assert signal.getsignal(signal.SIGINT) is sigint
