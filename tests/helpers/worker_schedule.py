"""How `make test`'s two pytest-xdist workers share the suite (tests/conftest.py installs it).

Units of work, each run by one worker from start to end (its module fixtures built once):

- the chain: every tests/e2e module that uses the session's stacks (tests/e2e/conftest.py's
  `stack`, `small_stack`, `guarded_stack`), in file order in one worker, so those stacks start
  once per run;
- every other module, one unit each, tests/e2e modules with stacks of their own (OWN_STACKS)
  among them: those run beside the chain's stacks. Two stacks at once are two sets of
  processes on their own free ports, with their own logs (named by the stack, one per module),
  credentials and NATS URL, which is how the tests find their processes;
- tests/e2e/test_compose.py (LAST), held back until every other test has run and handed to a
  worker then: its image build and 17 containers get the machine to themselves (beside the other
  worker's tests its setup once ran past 600 s on CI).

Order: the chain first (the longest unit), then every other unit by folder, heaviest first
(tests/e2e, integration, kernels, models, unit; within a folder in file order), so that what is
handed out last is short and both workers run out of work together."""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest
    from xdist.workermanage import WorkerController

E2E = "tests/e2e/"
CHAIN = "tests/e2e (the session's stacks)"
LAST = "tests/e2e/test_compose.py"
# tests/e2e modules that start every stack they use (a session stack requested by one of them
# fails: tests/e2e/conftest.py); a module not named here is in the chain
OWN_STACKS = frozenset(
    f"{E2E}test_{name}.py"
    for name in (
        "faults",
        "kv_tiers",
        "lora_adapters",
        "model_families_stack",
        "nats_cluster_stack",
        "observability",
        "pooling_stack",
        "quantization",
        "redis_sentinel_stack",
        "sim_stack",
        "tensor_parallel_groups",
    )
)
FOLDERS = ("tests/e2e/", "tests/integration/", "tests/kernels/", "tests/models/", "tests/unit/")


def unit_of(module: str) -> str:
    """The unit of work a test module belongs to: the chain, or the module itself."""
    if module.startswith(E2E) and module not in OWN_STACKS and module != LAST:
        return CHAIN
    return module


def _weight(unit: str) -> tuple[int, int]:
    """Sort key: the chain, then each folder in FOLDERS' order, then anything else."""
    if unit == CHAIN:
        return (0, 0)
    folder = next((i for i, f in enumerate(FOLDERS) if unit.startswith(f)), len(FOLDERS))
    return (1, folder)


def scheduler(config: pytest.Config, log: object) -> object:
    """The scheduler for ``pytest_xdist_make_scheduler`` (xdist imported only under xdist: the
    GPU machine's image may lack it)."""
    from xdist.scheduler import LoadScopeScheduling

    class SessionStacksThenTheRest(LoadScopeScheduling):
        """LoadScopeScheduling with the units and order above, and LAST held back."""

        _held: tuple[str, dict[str, bool]] | None = None  # LAST's unit until it is handed out
        _keeper: WorkerController | None = None  # the worker that will run LAST

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid.split("::", 1)[0])

        def schedule(self) -> None:
            assert self.collection_is_completed
            if self.collection is not None:  # a node added later: as LoadScopeScheduling does
                for node in self.nodes:
                    self._reschedule(node)
                return
            if not self._check_nodes_have_same_collection():
                self.log("**Different tests collected, aborting run**")
                return
            self.collection = list(next(iter(self.registered_collections.values())))
            units: dict[str, dict[str, bool]] = {}
            for nodeid in self.collection:
                units.setdefault(self._split_scope(nodeid), {})[nodeid] = False
            held = units.pop(LAST, None)
            self._held = (LAST, held) if held else None
            # sorted is stable: file order within a folder
            self.workqueue = OrderedDict(sorted(units.items(), key=lambda u: _weight(u[0])))
            for node in self.nodes:  # one unit each, then more for those that have few tests
                if self.workqueue:
                    self._assign_work_unit(node)
            for node in self.nodes:
                self._reschedule(node)

        def _pending(self, node: WorkerController) -> int:
            return self._pending_of(self.assigned_work[node])

        def _reschedule(self, node: WorkerController) -> None:
            if node.shutting_down:
                return
            if self.workqueue:
                if self._pending(node) <= 2:  # LoadScopeScheduling's heuristic: refill before empty
                    self._assign_work_unit(node)
            elif self._held is not None:
                self._hand_out_last()
            else:
                node.shutdown()

        def mark_test_complete(
            self, node: WorkerController, item_index: int, duration: float = 0
        ) -> None:
            super().mark_test_complete(node, item_index, duration)
            if not self.workqueue and self._held is not None:  # ``node`` may be shutting down
                self._hand_out_last()

        def _hand_out_last(self) -> None:
            """Once every other unit is handed out: one worker (the one with the most tests left)
            keeps running, the others finish theirs and stop; when they are done, LAST goes to the
            keeper. (A worker holds its last test until it is sent more or told to stop: it must
            know the next test to tear down the right fixtures.)"""
            live = [n for n in self.nodes if not n.shutting_down]
            if self._keeper not in live:
                self._keeper = max(live, key=self._pending) if live else None
            if self._keeper is None:  # every worker is stopping: nothing can run it
                return
            for node in live:
                if node is not self._keeper:
                    node.shutdown()
            if any(self._pending(n) for n in self.nodes if n is not self._keeper):
                return
            scope, unit = self._held
            self._held = None
            self.workqueue[scope] = unit
            self._assign_work_unit(self._keeper)
            self._keeper.shutdown()

        @property
        def tests_finished(self) -> bool:
            return self._held is None and super().tests_finished

        @property
        def has_pending(self) -> bool:
            return self._held is not None or super().has_pending

    return SessionStacksThenTheRest(config, log)
