"""The suite's own layout: pytest imports test modules by basename (rootdir mode, no package
per folder), so two test files with one name in different folders stop collection."""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent


def test_test_module_names_are_unique_across_folders() -> None:
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert names, "no test modules found"
    assert [n for n, c in names.items() if c > 1] == []
