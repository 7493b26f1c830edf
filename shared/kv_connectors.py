"""KV connectors by name: the registry, and the scheduler's half of each.

A connector moves KV blocks between workers (disaggregated prefill -> decode) and has two halves,
as vLLM's KVConnectorFactory builds one class per role:

- the worker half (services/worker/kv_connectors/: ``KvConnectorWorker``) serves this worker's
  blocks to peers and pulls a peer's blocks into this worker's cache, at an address only the
  connector understands (a NATS subject, an in-process key, ...), which the worker announces in
  its heartbeat (``kv_address``);
- the scheduler half (``KvConnectorScheduler`` here) is what the scheduler needs from a
  transport: today, each worker's address, put into the KvPull order as ``src_address``.

The registry is shared (both services look a name up in it; each builds only its own half), so
it lives here: adding a transport is one worker module and one ``register_connector`` line below;
the setting ``kv_connector`` picks it. This module imports no torch and no transport: the halves
are loaded by module path when built.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


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


def load_half(path: str) -> Any:  # noqa: ANN401 - a class named by a registry entry
    """The class a registry entry names (``module:Class``)."""
    module, _, cls = path.partition(":")
    return getattr(importlib.import_module(module), cls)


def create_scheduler_connector(name: str) -> KvConnectorScheduler:
    """The scheduler half of connector ``name``."""
    return load_half(connector_spec(name).scheduler)()


# One line per transport.
register_connector("nats", "kvflow.services.worker.kv_connectors.nats:NatsKvConnector")
register_connector("inproc", "kvflow.services.worker.kv_connectors.inproc:InProcKvConnector")
