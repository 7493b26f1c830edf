"""`pip install kvflow` without extras runs every `kvflow` command: every package that kvflow's own
modules import is a runtime dependency (or one of theirs), and the C source the worker compiles
ships as package data. (A module-level `import httpx`, a dev-only package then, crash-looped every
container of the compose stack.)"""

from __future__ import annotations

import ast
import importlib.metadata as md
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.helpers.paths import ROOT

PACKAGES = ("services", "shared", "kernels", "kvflow", "benchmarks")


def _runtime_distributions() -> set[str]:
    """The distributions `pip install kvflow` installs: the declared dependencies and theirs."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    todo = [Requirement(r) for r in project["dependencies"]]
    seen: set[str] = set()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        try:
            todo += [Requirement(r) for r in md.requires(name) or []]
        except md.PackageNotFoundError:
            pass  # not installed on this platform (a marker of its parent excluded it)
    return seen


def _guarded(tree: ast.AST) -> set[int]:
    """Nodes inside `try: ... except ImportError` (optional imports with a fallback)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
            isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
            for h in node.handlers
        ):
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def _third_party_imports() -> dict[str, list[str]]:
    """Top-level module name -> where kvflow imports it (outside optional-import guards)."""
    found: dict[str, list[str]] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            guarded = _guarded(tree)
            for node in ast.walk(tree):
                if id(node) in guarded:
                    continue
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top in sys.stdlib_module_names or top in PACKAGES:
                        continue
                    found.setdefault(top, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_every_imported_package_is_a_runtime_dependency() -> None:
    runtime = _runtime_distributions()
    owners = md.packages_distributions()
    imports = _third_party_imports()
    assert "torch" in imports and "httpx" in imports  # the scan sees real imports
    missing = {
        top: where
        for top, where in imports.items()
        if not {canonicalize_name(d) for d in owners.get(top, [])} & runtime
    }
    assert not missing, f"imported but not in [project.dependencies]: {missing}"


def test_the_wheel_ships_the_native_kernel_source(tmp_path: Path) -> None:
    src = tmp_path / "src"  # a copy: an in-tree build/ folder would carry files from earlier builds
    for name in ("pyproject.toml", "setup.py", "README.md"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, src / name)
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["-w", str(tmp_path), str(src)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = tmp_path.glob("kvflow-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for source in ("paged_attention_cpu.c", "thread_pool.c", "kvf_pool.h"):  # what cc needs
        assert f"kvflow/kernels/csrc/{source}" in names, source
    assert "kvflow/cli/main.py" in names and "kvflow/__init__.py" in names
