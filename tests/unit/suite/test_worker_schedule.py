"""tests/helpers/worker_schedule.py with pytest-xdist's protocol simulated: workers that hold their last
test until they are sent more or told to stop (as xdist's worker loop does), the controller's
shutdown once the scheduler says the tests are finished. Every test runs once; the session-stack
modules run in one worker in file order; test_compose.py runs only after every other test has,
whichever worker ends first; nothing waits for ever."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from tests.helpers.worker_schedule import CHAIN, LAST, OWN_STACKS, scheduler, unit_of

CHAIN_MODULES = ["tests/e2e/test_api_guards.py", "tests/e2e/test_engine.py"]
OWN = "tests/e2e/test_faults.py"
OTHERS = [
    "tests/integration/bus/test_bus.py",
    "tests/unit/worker/test_sampler.py",
    "tests/models/test_x.py",
]


def collection(tests_per_module: dict[str, int]) -> list[str]:
    return [f"{m}::test_{i}" for m, n in tests_per_module.items() for i in range(n)]


@dataclass
class Node:
    """A worker as the scheduler sees it, running what it is sent as xdist's worker does."""

    name: str
    sent: list[int] = field(default_factory=list)
    shutting_down: bool = False
    ran: list[int] = field(default_factory=list)

    @property
    def gateway(self) -> SimpleNamespace:  # what the scheduler names a worker by
        return SimpleNamespace(id=self.name)

    def send_runtest_some(self, indices: list[int]) -> None:
        assert not self.shutting_down, f"{self.name}: tests sent after shutdown"
        self.sent += indices

    def shutdown(self) -> None:
        self.shutting_down = True

    def runnable(self) -> bool:
        """xdist's worker runs a test once it knows the next one, or that none follows."""
        left = len(self.sent) - len(self.ran)
        return left >= 2 or (left == 1 and self.shutting_down)

    def __hash__(self) -> int:
        return hash(self.name)


class Config:
    def getvalue(self, name: str) -> list[str]:
        assert name == "tx"
        return ["2*popen"]


def run(items: list[str], order: list[int]) -> tuple[list[str], dict[str, list[str]]]:
    """The whole session: ``order`` says which worker moves next (its index modulo the runnable
    ones). Returns every test in the order it ended and what each worker ran."""
    sched = scheduler(Config(), None)
    nodes = [Node("gw0"), Node("gw1")]
    for node in nodes:
        sched.add_node(node)
        sched.add_node_collection(node, items)
    sched.schedule()
    timeline: list[str] = []
    for pick in itertools.cycle(order):
        if sched.tests_finished:  # the controller's loop
            for node in nodes:
                node.shutdown()
        runnable = [n for n in nodes if n.runnable()]
        if not runnable:
            assert all(len(n.ran) == len(n.sent) and n.shutting_down for n in nodes), [
                (n.name, len(n.sent) - len(n.ran), n.shutting_down) for n in nodes
            ]  # everyone done and stopped, or something waits for ever
            break
        node = runnable[pick % len(runnable)]
        index = node.sent[len(node.ran)]
        node.ran.append(index)
        timeline.append(items[index])
        sched.mark_test_complete(node, index)
    return timeline, {n.name: [items[i] for i in n.ran] for n in nodes}


@pytest.mark.parametrize(
    "order", [[0], [1], [0, 0, 1], [1, 1, 1, 0], [0, 1, 1, 1, 1, 1, 1]], ids=str
)
@pytest.mark.parametrize("chain_tests", [1, 2, 12])
def test_every_test_once_the_chain_together_and_compose_after_everything(
    order: list[int], chain_tests: int
) -> None:
    per_module = {m: chain_tests for m in CHAIN_MODULES} | {OWN: 3, LAST: 4}
    per_module |= dict.fromkeys(OTHERS, 2)
    items = collection(per_module)
    timeline, ran = run(items, order)
    assert sorted(timeline) == sorted(items)
    compose = [t for t in timeline if t.startswith(LAST)]
    assert timeline[-len(compose) :] == compose == [t for t in items if t.startswith(LAST)]
    chain = [t for t in items if t.split("::")[0] in CHAIN_MODULES]
    assert chain in ([t for t in r if t in chain] for r in ran.values())  # one worker, in order


def test_compose_alone_or_beside_only_short_modules() -> None:
    items = collection({LAST: 2}) + collection({"tests/unit/worker/test_sampler.py": 1})
    timeline, _ = run(items, [0, 1])
    assert timeline[-2:] == [f"{LAST}::test_0", f"{LAST}::test_1"]
    timeline, _ = run(collection({LAST: 3}), [1])
    assert timeline == [f"{LAST}::test_{i}" for i in range(3)]


def test_units_and_their_order() -> None:
    assert {unit_of(m) for m in CHAIN_MODULES} == {CHAIN}
    assert unit_of(OWN) == OWN and OWN in OWN_STACKS
    assert unit_of(LAST) == LAST and unit_of(OTHERS[0]) == OTHERS[0]
    sched = scheduler(Config(), None)
    nodes = [Node("gw0"), Node("gw1")]
    items = collection(dict.fromkeys(["tests/unit/test_a.py", *OTHERS, OWN, *CHAIN_MODULES], 1))
    for node in nodes:
        sched.add_node(node)
        sched.add_node_collection(node, items)
    sched.schedule()
    handed = {n.name: [unit_of(items[i].split("::")[0]) for i in n.sent] for n in nodes}
    # the chain first, then the whole-stack modules, then folder by folder, in file order; a
    # worker with two tests or fewer left is sent the next unit
    assert handed == {"gw0": [CHAIN, CHAIN, OTHERS[0]], "gw1": [OWN, OTHERS[2]]}
    assert list(sched.workqueue) == ["tests/unit/test_a.py", OTHERS[1]]
