"""The source tree's shape (issue 21): short functions, and services/ holding only the five
services. A function past the limit fails here with its path. Files have no length limit: they
are cut by concept (what they hold), never to fit a count (issue 33)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("services", "shared", "kvflow", "benchmarks", "kernels")
MAX_FUNCTION_LINES = 80  # outside kernels/: a Triton kernel is one long function by nature
SERVICES = {"gateway", "tokenizer", "scheduler", "worker", "detokenizer"}


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_no_function_outside_kernels_is_over_the_limit() -> None:
    long = {}
    for p in _sources():
        if p.relative_to(ROOT).parts[0] == "kernels":
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{p.relative_to(ROOT)}:{node.lineno} {node.name}"] = n
    assert long == {}, f"functions over {MAX_FUNCTION_LINES} lines"


def test_services_holds_only_the_services() -> None:
    entries = {p.name for p in (ROOT / "services").iterdir() if p.name != "__pycache__"}
    assert entries - {"__init__.py"} == SERVICES
