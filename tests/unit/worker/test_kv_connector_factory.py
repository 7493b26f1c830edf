"""The KV connector factory: the setting ``kv_connector`` names a registered transport, whose
worker half (the worker's factory) and scheduler half (shared/kv_connectors.py) it builds; an
unknown name fails with the known ones listed. And the renamed address fields keep their place
on the wire."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest
import torch

from kvflow.services.scheduler.core import SchedulerCore
from kvflow.services.scheduler.limits import SchedulerLimits
from kvflow.services.worker.kv_blocks import KvBlockIO
from kvflow.services.worker.kv_connectors import factory
from kvflow.services.worker.kv_connectors.base import KvConnectorWorker
from kvflow.services.worker.kv_connectors.factory import (
    create_worker_connector,
    register_worker_half,
    worker_halves,
)
from kvflow.services.worker.kv_connectors.inproc import InProcHub, InProcKvConnector
from kvflow.services.worker.kv_connectors.nats import NatsKvConnector
from kvflow.shared import kv_connectors as registry
from kvflow.shared.bus import Bus
from kvflow.shared.config import Settings
from kvflow.shared.kv_connectors import (
    KvConnectorScheduler,
    connector_spec,
    create_scheduler_connector,
    known_connectors,
    register_connector,
)
from kvflow.shared.messages import KvPull, WorkerHeartbeat, decode, encode
from tests.helpers.scheduler import PROMPTS, FakeWorker, req


def io() -> KvBlockIO:
    return KvBlockIO([(torch.zeros(4, 16, 2, 8), torch.zeros(4, 16, 2, 8)) for _ in range(2)])


def test_the_default_setting_names_a_known_connector() -> None:
    assert {"nats", "inproc"} <= set(known_connectors())
    assert Settings().cache.kv_connector in known_connectors()


def test_every_transport_has_its_worker_half() -> None:
    assert worker_halves() == known_connectors() == ["inproc", "nats"]


@pytest.mark.parametrize(
    ("name", "cls"), [("nats", NatsKvConnector), ("inproc", InProcKvConnector)]
)
def test_known_names_build_their_worker_half(name: str, cls: type) -> None:
    half = create_worker_connector(name, Bus("w"), io(), "w1")
    assert type(half) is cls and isinstance(half, KvConnectorWorker)
    assert half.worker_id == "w1" and half.address


def test_options_reach_the_worker_half() -> None:
    hub = InProcHub()
    half = create_worker_connector("inproc", Bus("w"), io(), "w1", hub=hub)
    assert isinstance(half, InProcKvConnector) and half.hub is hub
    nats = create_worker_connector("nats", Bus("w"), io(), "w1", window=3)
    assert isinstance(nats, NatsKvConnector) and nats.window == 3


def test_an_unknown_name_fails_listing_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown KV connector 'rdma'") as e:
        create_worker_connector("rdma", Bus("w"), io(), "w1")
    assert all(name in str(e.value) for name in known_connectors())
    with pytest.raises(ValueError, match="inproc, nats"):
        create_scheduler_connector("rdma")


def test_the_scheduler_half_passes_each_workers_address_into_pulls() -> None:
    sched = create_scheduler_connector("nats")
    assert type(sched) is KvConnectorScheduler
    sched.add_worker("w1", "kvflow.worker.w1.kv")
    assert sched.source_address("w1") == "kvflow.worker.w1.kv"
    sched.remove_worker("w1")
    assert sched.source_address("w1") == ""


def test_a_new_transport_is_one_registry_line_a_side(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its name (and scheduler half) in shared/kv_connectors.py, its worker half in the worker's
    factory: shared/ names no worker module."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(factory, "_WORKER_HALVES", dict(factory._WORKER_HALVES))
    with pytest.raises(ValueError, match="unknown KV connector 'loop'"):
        register_worker_half("loop", InProcKvConnector)  # the shared name comes first
    register_connector("loop")
    with pytest.raises(ValueError, match="'loop' has no worker half"):
        create_worker_connector("loop", Bus("w"), io(), "w")
    register_worker_half("loop", InProcKvConnector)
    assert "loop" in known_connectors()
    assert isinstance(create_worker_connector("loop", Bus("w"), io(), "w"), InProcKvConnector)
    assert connector_spec("loop").scheduler is registry.DEFAULT_SCHEDULER
    with pytest.raises(ValueError, match="already registered"):
        register_connector("loop")
    with pytest.raises(ValueError, match="already has its worker half"):
        register_worker_half("loop", NatsKvConnector)


def test_the_scheduler_can_import_the_factory_without_torch() -> None:
    code = (
        "import sys; import kvflow.shared.kv_connectors as k; "
        "k.create_scheduler_connector('nats'); assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_address_fields_keep_their_wire_position() -> None:
    """``src_address`` / ``kv_address`` replaced ``src_subject`` / ``kv_subject`` in place."""
    pull = KvPull("t", "r", "w1", "kvflow.worker.w1.kv", [1], [2])
    assert msgspec.msgpack.decode(encode(pull))[4] == "kvflow.worker.w1.kv"
    hb = WorkerHeartbeat("w1", "both", 8, 16, "m", "s", 64, kv_address="inproc:w1")
    assert msgspec.msgpack.decode(encode(hb))[8] == "inproc:w1"
    assert decode(encode(pull)) == pull


def test_the_scheduler_takes_pull_addresses_from_its_connector_half() -> None:
    class Tagged(KvConnectorScheduler):
        def source_address(self, worker_id: str) -> str:
            return "tagged:" + super().source_address(worker_id)

    half = Tagged()
    core = SchedulerCore(SchedulerLimits(), model="m", kv_connector=half)
    core.add_worker("p", 64, 4, role="prefill", kv_address="kv.p")
    core.add_worker("d", 64, 4, role="decode", kv_address="kv.d")
    core.add_request(req("r", PROMPTS["r1"], 3))
    plan = core.schedule(core.workers["p"])[0]
    assert plan is not None
    result = FakeWorker(4).execute(plan)
    result.worker_id = "p"
    [(dst, pull)] = core.on_result(result).pulls
    assert dst == "d" and pull.src_worker == "p" and pull.src_address == "tagged:kv.p"
    core.remove_worker("d")
    assert half.addresses == {"p": "kv.p"}
