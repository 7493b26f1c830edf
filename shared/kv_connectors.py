"""KV connectors by name: the transports a setting may name, and the scheduler's half of each.

A connector moves KV blocks between workers (disaggregated prefill -> decode) and has two halves,
as vLLM's KVConnectorFactory builds one class per role:

- the worker half (services/worker/kv_connectors/: ``KvConnectorWorker``, built by its factory
  from the same names) serves this worker's blocks to peers and pulls a peer's blocks into this
  worker's cache, at an address only the connector understands (a NATS subject, an in-process
  key, ...), which the worker announces in its heartbeat (``kv_address``);
- the scheduler half (``KvConnectorScheduler`` here) is what the scheduler needs from a
  transport: today, each worker's address, put into the KvPull order as ``src_address``.

The names are shared (both services check the setting ``kv_connector`` against them), so they
live here with the scheduler's halves; the worker's halves live in the worker, which this
module does not name. Adding a transport is its worker module, one ``register_connector`` line
below and one line in the worker's factory. This module imports no torch and no transport.
"""

from __future__ import annotations

from dataclasses import dataclass


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


@dataclass(frozen=True)
class ConnectorSpec:
    """A registered transport: its scheduler half (the worker's is the worker factory's)."""

    scheduler: type[KvConnectorScheduler]


DEFAULT_SCHEDULER = KvConnectorScheduler
_REGISTRY: dict[str, ConnectorSpec] = {}


def register_connector(
    name: str, scheduler: type[KvConnectorScheduler] = DEFAULT_SCHEDULER
) -> None:
    """Make the transport ``name`` one the setting may name, with its scheduler half."""
    if name in _REGISTRY:
        raise ValueError(f"KV connector {name!r} is already registered")
    _REGISTRY[name] = ConnectorSpec(scheduler)


def known_connectors() -> list[str]:
    return sorted(_REGISTRY)


def connector_spec(name: str) -> ConnectorSpec:
    """The registered connector ``name``; ValueError naming the known ones otherwise."""
    spec = _REGISTRY.get(name)
    if spec is None:
        known = ", ".join(known_connectors())
        raise ValueError(f"unknown KV connector {name!r} (--kv-connector): known are {known}")
    return spec


def create_scheduler_connector(name: str) -> KvConnectorScheduler:
    """The scheduler half of connector ``name``."""
    return connector_spec(name).scheduler()


# One line per transport.
register_connector("nats")
register_connector("inproc")
