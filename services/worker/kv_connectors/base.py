"""The worker's half of a KV connector (``KvConnectorWorker``): serve this worker's blocks to
peers and pull a peer's blocks into this worker's cache, at an address only the connector
understands (a NATS subject, an in-process key, ...), which the worker announces in its heartbeat
(``kv_address``). Transports are named in shared/kv_connectors.py, with the scheduler's half;
factory.py's ``create_worker_connector`` builds this half.

A worker's KV tiers (host memory, Redis) are sources and sinks of blocks by hash (``KvTier``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvflow.shared.messages import KvPull

if TYPE_CHECKING:
    from kvflow.services.worker.kv_blocks import KvBlockIO
    from kvflow.shared.bus import Bus


@dataclass
class TransferResult:
    ok: bool
    num_bytes: int = 0
    seconds: float = 0.0
    error: str | None = None


class KvConnectorWorker(ABC):
    """A worker's half: serve this worker's blocks at ``address``, pull blocks from a peer's."""

    address: str  # opaque: where peers pull this worker's blocks (announced in heartbeats)

    def __init__(self, bus: Bus, io: KvBlockIO, worker_id: str) -> None:
        self.bus = bus
        self.io = io
        self.worker_id = worker_id

    @abstractmethod
    async def start(self) -> None:
        """Begin serving this worker's blocks to other workers."""

    @abstractmethod
    async def close(self) -> None:
        """Stop serving (the worker is leaving)."""

    @abstractmethod
    async def pull(self, order: KvPull) -> TransferResult:
        """Copy ``order.src_blocks`` of the worker at ``order.src_address`` into this worker's
        ``order.dst_blocks`` (pairwise); never raises: a failure is a result with ``error``."""


def order_error(order: KvPull) -> str | None:
    """Why an order cannot be carried out at all (before any transport is touched)."""
    if len(order.src_blocks) != len(order.dst_blocks):
        return "src_blocks and dst_blocks differ in length"
    return None


class KvTier(Protocol):
    """A tier below a worker's paged cache: a source and sink of whole blocks by hash. Values
    are a block's bytes (``KvBlockIO.read``); a tier may lose a block at any time."""

    name: str

    async def load(self, hashes: list[bytes]) -> list[bytes | None]:
        """Each block's bytes, or None where missing (or the tier is off); only the leading
        blocks are used, so a tier may answer None for everything after a miss."""
        ...

    async def store(self, items: list[tuple[bytes, bytes]]) -> int:
        """Keep each (hash, bytes); returns how many were written."""
        ...
