"""The suite's own layout (issue 64, docs/architecture.md "The test suite").

- Tiers at the top (unit, integration, models, kernels, e2e: what a test needs to run), and in
  the unit and integration tiers one folder per component: no test module lies loose in them.
- What test modules share lives in tests/helpers/ (or is a conftest fixture): a test module
  never imports another test module or a conftest, and no helper lives beside the tests.
- pytest imports test modules by basename (rootdir mode, no package per folder), so two test
  files with one name in different folders would stop collection."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

from tests.helpers.paths import ROOT

TESTS = ROOT / "tests"
TIERS = ("unit", "integration", "models", "kernels", "e2e")
BY_COMPONENT = ("unit", "integration")  # tiers with a folder per component


def _modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def _imported(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import in ``path``, function-level ones included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def test_test_module_names_are_unique_across_folders() -> None:
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert len(names) > 100, "test modules not found"
    assert [n for n, c in names.items() if c > 1] == []


def test_tests_live_in_a_tier_and_unit_and_integration_in_a_component_folder() -> None:
    wrong = []
    for p in TESTS.rglob("test_*.py"):
        parts = p.relative_to(TESTS).parts
        if parts[0] not in TIERS:
            wrong.append(f"{p.relative_to(ROOT)}: not in a tier ({', '.join(TIERS)})")
        elif parts[0] in BY_COMPONENT and len(parts) != 3:
            wrong.append(f"{p.relative_to(ROOT)}: not in one component folder of tests/{parts[0]}")
    assert wrong == []


def test_test_modules_import_helpers_never_other_tests() -> None:
    """Shared code is in tests/helpers/ (a package) or a conftest fixture; importing a test module
    or a conftest runs its collection-time code twice and ties tiers together."""
    wrong = []
    for p in _modules():
        for line, name in _imported(p):
            if name.startswith("tests.") and not name.startswith("tests.helpers"):
                wrong.append(f"{p.relative_to(ROOT)}:{line} imports {name}")
    assert wrong == []


def test_only_tests_and_conftests_beside_the_tests() -> None:
    """A module under a tier is a test module or a conftest: helpers go to tests/helpers/."""
    loose = [
        str(p.relative_to(ROOT))
        for p in _modules()
        if p.relative_to(TESTS).parts[0] in TIERS
        and not (p.name.startswith("test_") or p.name == "conftest.py")
    ]
    assert loose == []


def test_the_layout_rules_catch_what_they_name(tmp_path: Path) -> None:
    """The import rule reads function-level imports and ``from tests.x import y`` forms."""
    bad = tmp_path / "test_bad.py"
    bad.write_text("def f():\n    from tests.unit.scheduler import test_x\n")
    names = [n for _, n in _imported(bad)]
    assert "tests.unit.scheduler" in names and "tests.unit.scheduler.test_x" in names
