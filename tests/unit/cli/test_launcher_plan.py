"""The one launcher's plan: which processes `kvflow serve` and `LLM()` start, with what
settings of their own, and how the cores are shared among workers."""

from __future__ import annotations

import pytest

from kvflow.cli.launcher import Process, Stack, Topology, _supervise, plan, share_cores
from kvflow.shared.access.connect import EXIT_REFUSED
from kvflow.shared.access.render import nats_cluster_node
from kvflow.shared.config import Settings
from kvflow.shared.cpu_budget import usable_cpus


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
    cores = usable_cpus()  # affinity capped by the cgroup quota, not os.cpu_count()
    assert share_cores(Settings(), 1).worker.threads == 0  # one worker takes all cores
    assert share_cores(Settings(), 2).worker.threads == max(1, cores // 2)
    assert share_cores(Settings.of(threads=3), 4).worker.threads == 3  # asked for: kept


class _FakeStack:
    """What the supervisor sees of a Stack: children exiting with given codes, one by one."""

    def __init__(self, codes: list[int]) -> None:
        self.codes = codes
        self.restarted: list[int] = []
        self.notes: list[str] = []

    def exited(self) -> tuple[int, Process, int] | None:
        if not self.codes:
            raise KeyboardInterrupt  # ends _supervise's loop once every exit was seen
        return 0, Process("tokenizer", "tokenizer"), self.codes.pop(0)

    def restart(self, index: int) -> None:
        self.restarted.append(index)

    def note(self, message: str) -> None:
        self.notes.append(message)


def test_a_child_refused_its_credentials_is_not_restarted() -> None:
    stack = _FakeStack([EXIT_REFUSED])
    with pytest.raises(RuntimeError, match="refused its credentials"):
        _supervise(stack)  # type: ignore[arg-type]
    assert stack.restarted == []


def test_a_child_that_crashes_is_restarted_until_it_keeps_crashing() -> None:
    stack = _FakeStack([1])
    with pytest.raises(KeyboardInterrupt):
        _supervise(stack)  # type: ignore[arg-type]
    assert stack.restarted == [0]
    with pytest.raises(RuntimeError, match="times within a minute"):
        _supervise(_FakeStack([1, 1, 1, 1]))  # type: ignore[arg-type]


@pytest.mark.parametrize("nodes", [0, 2, 4])
def test_a_nats_cluster_is_an_odd_number_of_three_or_more_nodes(nodes: int) -> None:
    with pytest.raises(ValueError, match="3 or more nodes, an odd number"):
        Stack(Settings(), Topology(), nats_cluster=nodes)


def test_a_cluster_nodes_configuration_includes_the_users_and_joins_every_route() -> None:
    text = nats_cluster_node(1, 6223, ["127.0.0.1:6222", "127.0.0.1:6223"], "pw")
    assert 'include "nats.conf"' in text and 'server_name: "kvflow-1"' in text
    assert 'listen: "127.0.0.1:6223"' in text
    assert '"nats-route://route:pw@127.0.0.1:6222", "nats-route://route:pw@127.0.0.1:6223"' in text


@pytest.mark.parametrize("failed", [False, True])
def test_a_temporary_log_is_removed_at_stop_unless_something_failed(tmp_path, capsys, failed):
    log = tmp_path / "kvflow-llm-x" / "pipeline.log"
    log.parent.mkdir()
    log.write_text("worker: Traceback ...\n")
    stack = Stack(Settings(), Topology(workers=1, gateway=False), log, console=None)
    stack.temporary_log = True
    stack.failed = failed
    stack.stop()
    assert log.exists() == failed
    said = capsys.readouterr().out
    assert (f"its log is kept at {log}" in said) == failed
    stack.stop()  # a second stop says nothing more
    assert "kept" not in capsys.readouterr().out
