"""One owner per piece of the scheduler's state (issue 64), read from the source: a sequence's
placement and progress are written only by worker_state.py, a WorkerState's fields only by
itself, and the waiting queue is changed only by the core. A write is an assignment, an
augmented assignment or a ``del`` of ``x.field`` (or ``x.field[...]``), or a mutating method
called on ``x.field``, with ``x`` anything but ``self``."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.paths import ROOT

SOURCES = [
    *sorted((ROOT / "services" / "scheduler").glob("*.py")),
    ROOT / "benchmarks" / "scheduler.py",
]
MUTATORS = {"append", "extend", "pop", "popleft", "remove", "insert", "clear", "add", "update"}
# what changes once a sequence is placed (sequence.py; its request fields are set when made)
SEQUENCE_FIELDS = {
    "token_ids", "status", "num_computed", "blocks", "hashes", "worker_id", "reservation",
    "transfer", "load", "announced", "sent_blocks", "aborted", "num_preemptions", "spec",
}  # fmt: skip
WORKER_STATE_FIELDS = {
    "bm", "deferred_free", "draining", "in_flight", "running", "to_forget", "must_sync",
    "num_reserved", "step_id", "num_preemptions", "num_prefills", "num_decodes", "loras",
}  # fmt: skip


def _writes(path: Path, fields: set[str]) -> list[str]:
    """``receiver.field`` written in ``path`` (receiver not ``self``), with their lines."""

    def target(node: ast.AST) -> str | None:
        if isinstance(node, ast.Subscript):
            node = node.value
        if isinstance(node, ast.Attribute) and node.attr in fields:
            if not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                return f"{ast.unparse(node)} (line {node.lineno})"
        return None

    out = []
    for n in ast.walk(ast.parse(path.read_text())):
        targets: list[ast.AST] = []
        if isinstance(n, ast.Assign):
            for t in n.targets:
                targets += t.elts if isinstance(t, ast.Tuple) else [t]
        elif isinstance(n, ast.AugAssign | ast.AnnAssign):
            targets = [n.target]
        elif isinstance(n, ast.Delete):
            targets = n.targets
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            if n.func.attr in MUTATORS:
                targets = [n.func.value]
        out += [w for t in targets if (w := target(t))]
    return out


def _writers(fields: set[str]) -> dict[str, list[str]]:
    found = {p.name: _writes(p, fields) for p in SOURCES}
    return {name: w for name, w in found.items() if w}


def test_only_the_worker_state_places_sequences() -> None:
    assert set(_writers(SEQUENCE_FIELDS)) == {"worker_state.py"}


def test_a_worker_state_is_changed_only_through_its_methods() -> None:
    # worker_state.py's own writes are of its sequences' fields of the same names
    assert set(_writers(WORKER_STATE_FIELDS)) <= {"worker_state.py"}


def test_only_the_core_changes_the_waiting_queue() -> None:
    changed = {}
    for p in SOURCES:
        for n in ast.walk(ast.parse(p.read_text())):
            if (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr in {"push", "remove"}
                and isinstance(n.func.value, ast.Attribute)
                and n.func.value.attr == "waiting"
            ):
                changed.setdefault(p.name, []).append(n.lineno)
    assert set(changed) == {"core.py"}
