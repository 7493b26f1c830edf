"""The worker's half of the KV connector factory: each transport's ``KvConnectorWorker`` by the
name the setting ``kv_connector`` gives. The names, and the scheduler's halves, are
shared/kv_connectors.py's; every name registered there has its worker half here (one line
below per transport)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvflow.services.worker.kv_connectors.base import KvConnectorWorker
from kvflow.services.worker.kv_connectors.inproc import InProcKvConnector
from kvflow.services.worker.kv_connectors.nats import NatsKvConnector
from kvflow.shared.kv_connectors import connector_spec

if TYPE_CHECKING:
    from kvflow.services.worker.kv_blocks import KvBlockIO
    from kvflow.shared.bus import Bus

_WORKER_HALVES: dict[str, type[KvConnectorWorker]] = {}


def register_worker_half(name: str, worker: type[KvConnectorWorker]) -> None:
    """The worker half of the registered transport ``name`` (ValueError for a name that
    shared/kv_connectors.py does not know, or one given a worker half already)."""
    connector_spec(name)
    if name in _WORKER_HALVES:
        raise ValueError(f"KV connector {name!r} already has its worker half")
    _WORKER_HALVES[name] = worker


def worker_halves() -> list[str]:
    return sorted(_WORKER_HALVES)


def create_worker_connector(
    name: str, bus: Bus, io: KvBlockIO, worker_id: str, **options: Any
) -> KvConnectorWorker:
    """The worker half of connector ``name`` for this worker's cache; ValueError naming the
    known transports for an unknown name."""
    connector_spec(name)
    half = _WORKER_HALVES.get(name)
    if half is None:  # registered for the scheduler only: a transport left half done
        raise ValueError(
            f"KV connector {name!r} has no worker half (services/worker/kv_connectors)"
        )
    return half(bus, io, worker_id, **options)


# One line per transport.
register_worker_half("nats", NatsKvConnector)
register_worker_half("inproc", InProcKvConnector)
