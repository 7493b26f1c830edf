"""The KV connector interfaces and the factory that builds a connector by name.

A connector moves KV blocks between workers (disaggregated prefill -> decode) and has two halves,
as vLLM's KVConnectorFactory builds one class per role:

- the worker half (``KvConnectorWorker``) serves this worker's blocks to peers and pulls a peer's
  blocks into this worker's cache, at an address only the connector understands (a NATS subject,
  an in-process key, ...), which the worker announces in its heartbeat (``kv_address``);
- the scheduler half (``KvConnectorScheduler``) is what the scheduler needs from a transport:
  today, each worker's address, put into the KvPull order as ``src_address``.

A worker's KV tiers (host memory, Redis) are sources and sinks of blocks by hash (``KvTier``).

Adding a transport is one module and one ``register_connector`` line below; the setting
``kv_connector`` picks it. This module imports no torch and no transport, so the scheduler can
import it cheaply: the halves are loaded by module path when built.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from shared.messages import KvPull

if TYPE_CHECKING:
    from services.worker.kv_blocks import KvBlockIO
    from shared.bus import Bus


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


class KvConnectorScheduler:
    """The scheduler's half: the address each worker serves its blocks at, from its heartbeat.

    The default passes the worker's announced address through unchanged, which is all NATS and
    the in-process transport need; a transport that must set up a channel per pair of workers
    (an RDMA queue pair, a shared-memory segment) overrides these methods."""

    def __init__(self) -> None:
        self.addresses: dict[str, str] = {}  # worker id -> where it serves its blocks

    def add_worker(self, worker_id: str, address: str) -> None:
        """A worker joined (or announced a new address)."""
        self.addresses[worker_id] = address

    def remove_worker(self, worker_id: str) -> None:
        """A worker left: forget its address."""
        self.addresses.pop(worker_id, None)

    def source_address(self, worker_id: str) -> str:
        """The ``src_address`` of a KvPull from ``worker_id`` ("" when unknown)."""
        return self.addresses.get(worker_id, "")


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


# -- the factory ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConnectorSpec:
    """Where a connector's halves live, as ``module:Class`` (imported when built)."""

    worker: str
    scheduler: str


DEFAULT_SCHEDULER = f"{__name__}:KvConnectorScheduler"
_REGISTRY: dict[str, ConnectorSpec] = {}


def register_connector(name: str, worker: str, scheduler: str = DEFAULT_SCHEDULER) -> None:
    """Make the connector ``name`` buildable (``worker`` and ``scheduler`` as module:Class)."""
    if name in _REGISTRY:
        raise ValueError(f"KV connector {name!r} is already registered")
    _REGISTRY[name] = ConnectorSpec(worker, scheduler)


def known_connectors() -> list[str]:
    return sorted(_REGISTRY)


def connector_spec(name: str) -> ConnectorSpec:
    """The registered connector ``name``; ValueError naming the known ones otherwise."""
    spec = _REGISTRY.get(name)
    if spec is None:
        known = ", ".join(known_connectors())
        raise ValueError(f"unknown KV connector {name!r} (--kv-connector): known are {known}")
    return spec


def _load(path: str) -> Any:  # noqa: ANN401 - a class named by a registry entry
    module, _, cls = path.partition(":")
    return getattr(importlib.import_module(module), cls)


def create_worker_connector(
    name: str, bus: Bus, io: KvBlockIO, worker_id: str, **options: Any
) -> KvConnectorWorker:
    """The worker half of connector ``name`` for this worker's cache."""
    return _load(connector_spec(name).worker)(bus, io, worker_id, **options)


def create_scheduler_connector(name: str) -> KvConnectorScheduler:
    """The scheduler half of connector ``name``."""
    return _load(connector_spec(name).scheduler)()


# One line per transport.
register_connector("nats", "services.worker.kv_connectors.nats:NatsKvConnector")
register_connector("inproc", "services.worker.kv_connectors.inproc:InProcKvConnector")
