"""The in-process KV connector (``kv_connector = "inproc"``): workers in one process (tests, a
future shared-memory transport) share a hub mapping each serving worker's address to its cache,
and a pull copies block bytes directly from the source's cache into this one. Same contract as
NATS: equal layouts only, a failure is a result, never an exception."""

from __future__ import annotations

import asyncio
import time

from kvflow.services.worker.kv_blocks import KvBlockIO
from kvflow.services.worker.kv_connectors.base import KvConnectorWorker, TransferResult, order_error
from kvflow.shared.bus import Bus
from kvflow.shared.messages import KvPull


class InProcHub:
    """The workers of this process that serve their blocks: address -> their cache."""

    def __init__(self) -> None:
        self.sources: dict[str, KvBlockIO] = {}


HUB = InProcHub()  # the process's hub, unless a connector is given its own


class InProcKvConnector(KvConnectorWorker):
    def __init__(
        self, bus: Bus, io: KvBlockIO, worker_id: str, *, hub: InProcHub | None = None
    ) -> None:
        super().__init__(bus, io, worker_id)
        self.hub = hub if hub is not None else HUB
        self.address = f"inproc:{worker_id}"

    async def start(self) -> None:
        self.hub.sources[self.address] = self.io

    async def close(self) -> None:
        if self.hub.sources.get(self.address) is self.io:
            del self.hub.sources[self.address]

    async def pull(self, order: KvPull) -> TransferResult:
        t0 = time.monotonic()
        src = self.hub.sources.get(order.src_address)
        if error := order_error(order):
            return TransferResult(False, error=error)
        if src is None:
            error = f"no worker of this process serves {order.src_address!r}"
        elif src.layout() != self.io.layout():
            error = f"layout {src.layout()} differs from {self.io.layout()}"
        if error:
            return TransferResult(False, seconds=time.monotonic() - t0, error=error)
        n = 0
        for sb, db in zip(order.src_blocks, order.dst_blocks, strict=True):
            data = src.read(sb)
            self.io.write(db, data)
            n += len(data)
            await asyncio.sleep(0)  # one block at a time: the event loop keeps serving
        return TransferResult(True, n, time.monotonic() - t0)
