"""The one launcher's plan: which processes `kvflow serve` and `LLM()` start, with what
settings of their own, and how the cores are shared among workers."""

from __future__ import annotations

import os

import pytest

from kvflow.cli.launcher import Topology, plan, share_cores
from shared.config import Settings


def test_serve_plans_every_service_with_the_gateway_last() -> None:
    procs = plan(Topology(workers=1, schedulers=2, tokenizers=2))
    assert [(p.name, p.service) for p in procs] == [
        ("worker-0", "worker"),
        ("scheduler-0", "scheduler"),
        ("scheduler-1", "scheduler"),
        ("tokenizer", "tokenizer"),
        ("tokenizer-1", "tokenizer"),
        ("detokenizer", "detokenizer"),
        ("gateway", "gateway"),
    ]
    assert procs[0].overrides == {"worker_id": "worker-0", "role": "both"}
    assert procs[1].overrides == {"scheduler_ha": "true", "scheduler_id": "scheduler-0"}


def test_the_python_api_plans_no_gateway_and_one_scheduler_without_ha() -> None:
    procs = plan(Topology(workers=2, gateway=False))
    assert [p.service for p in procs] == [
        "worker",
        "worker",
        "scheduler",
        "tokenizer",
        "detokenizer",
    ]
    assert "scheduler_ha" not in procs[2].overrides


def test_disaggregated_roles_and_ops_ports_in_start_order() -> None:
    procs = plan(Topology(workers=0, prefill_workers=1, decode_workers=1), ops_port=9100)
    assert [(p.name, p.overrides.get("role")) for p in procs[:2]] == [
        ("prefill-0", "prefill"),
        ("decode-0", "decode"),
    ]
    ports = [p.overrides.get("ops_port") for p in procs]
    assert ports == ["9100", "9101", "9102", "9103", "9104", None]  # the gateway has --port


@pytest.mark.parametrize(
    "topology",
    [
        Topology(workers=0),
        Topology(workers=0, prefill_workers=1),
        Topology(workers=-1),
        Topology(tokenizers=0),
    ],
)
def test_bad_counts_are_refused(topology: Topology) -> None:
    with pytest.raises(ValueError):
        plan(topology)


def test_cores_are_divided_once_among_workers() -> None:
    cores = os.cpu_count() or 1
    assert share_cores(Settings(), 1).worker.threads == 0  # one worker takes all cores
    assert share_cores(Settings(), 2).worker.threads == max(1, cores // 2)
    assert share_cores(Settings.of(threads=3), 4).worker.threads == 3  # asked for: kept
