"""The pipeline the Python API starts for its caller: nats-server (and redis-server when a
setting needs it) on free ports, then tokenizer, scheduler, detokenizer and workers as child
processes. No gateway: the ``LLM`` object is the pipeline's client. Their logs go to a file
(the path is printed) so the caller's console stays clean; progress goes to stderr."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

from shared.config import Settings
from shared.infra import Server, start_nats, start_redis
from shared.processes import spawn_service, stop_processes

STARTUP_TIMEOUT_S = 300.0


class EmbeddedStack:
    def __init__(self, settings: Settings, workers: int = 1) -> None:
        if workers < 1:
            raise ValueError("workers must be at least 1")
        self.settings = settings
        self.workers = workers
        self.servers: list[Server] = []
        self.procs = []
        self.log_path = Path(tempfile.mkdtemp(prefix="kvflow-llm-")) / "pipeline.log"
        self._log = None
        self.nats_url = ""

    def start(self) -> None:
        note = lambda m: print(f"kvflow: {m}", file=sys.stderr, flush=True)  # noqa: E731
        note("starting the pipeline (nats-server, tokenizer, scheduler, detokenizer, worker)")
        nats = start_nats()
        self.servers.append(nats)
        settings = dataclasses.replace(self.settings, nats_url=nats.url)
        if settings.kv_redis_tier and not settings.redis_url:
            redis = start_redis()
            self.servers.append(redis)
            settings = dataclasses.replace(settings, redis_url=redis.url)
        if self.workers > 1 and settings.threads == 0:
            import os

            settings = dataclasses.replace(
                settings, threads=max(1, (os.cpu_count() or 1) // self.workers)
            )
        self.nats_url = nats.url
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        for name in ("tokenizer", "scheduler", "detokenizer"):
            self.procs.append(spawn_service(name, settings, self._log))
        for i in range(self.workers):
            self.procs.append(
                spawn_service("worker", settings, self._log, worker_id=f"llm-worker-{i}")
            )
        note(f"loading the model in every process; logs: {self.log_path}")

    async def wait_ready(self, client) -> None:  # noqa: ANN001 - a PipelineClient
        """Until the scheduler knows every worker; raises if a process dies or time runs out."""
        t0 = last = time.monotonic()
        while True:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(
                        f"a pipeline process exited with code {p.returncode}; "
                        f"its log: {self.log_path}\n{self.log_tail()}"
                    )
            try:
                stats = await client.stats(timeout=1.0)
                if stats.num_workers >= self.workers:
                    print(
                        f"kvflow: pipeline ready in {time.monotonic() - t0:.1f}s",
                        file=sys.stderr,
                        flush=True,
                    )
                    return
            except Exception:  # noqa: BLE001 - no scheduler answering yet
                pass
            if time.monotonic() - t0 > STARTUP_TIMEOUT_S:
                raise RuntimeError(
                    f"the pipeline was not ready after {STARTUP_TIMEOUT_S:.0f}s; log: {self.log_path}"
                )
            if time.monotonic() - last > 10:
                print(
                    f"kvflow: still starting ({time.monotonic() - t0:.0f}s) ...",
                    file=sys.stderr,
                    flush=True,
                )
                last = time.monotonic()
            await asyncio.sleep(0.25)

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        stop_processes(self.procs)
        self.procs = []
        for s in reversed(self.servers):
            s.stop()
        self.servers = []
        if self._log is not None:
            self._log.close()
            self._log = None
