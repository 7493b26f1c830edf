"""The source tree's shape, read from its syntax trees (offline, about a second).

Issue 21: short functions, and services/ holding only the five services. A function past the
limit fails here with its path. Files have no length limit: they are cut by concept (what they
hold), never to fit a count (issue 33).

Issue 64, layers that hold (docs/architecture.md, "Source layout"): kernels/ imports nothing of
kvflow but kvflow.kernels; shared/ imports neither kvflow.kernels nor kvflow.services, nor names
one of their modules in a string; a service package never imports another one; no import circle
anywhere (every ``import`` in a module counts: under ``TYPE_CHECKING``, inside functions; a
package's ``__init__`` is that package's module); only shared/config.py reads ``KVFLOW_*``
variables; and everything kvflow installs is importable under ``kvflow.`` only: nothing imports
a top-level ``services``, ``shared``, ``kernels`` or ``benchmarks``, and a fresh interpreter
finds none of kvflow's under those names. Each failure names the file, the line and the rule."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from tests.helpers.paths import ROOT

# each source folder and the package name it installs as (setup.py's FOLDERS)
FOLDERS = {
    "kvflow": "kvflow",
    "services": "kvflow.services",
    "shared": "kvflow.shared",
    "kernels": "kvflow.kernels",
    "benchmarks": "kvflow.benchmarks",
}
OLD_TOP_LEVEL = ("services", "shared", "kernels", "benchmarks")  # kvflow.X only, never X
MAX_FUNCTION_LINES = 80  # outside kernels/: a Triton kernel is one long function by nature
SERVICES = {"gateway", "tokenizer", "scheduler", "worker", "detokenizer"}
SETTINGS_READER = "shared/config.py"  # the one module that reads KVFLOW_* variables
NAMES_A_LOWER_LAYER = re.compile(r"\bkvflow\.(services|kernels)\b")


@dataclass(frozen=True)
class Import:
    where: str  # the importer's file
    module: str  # the importer: kvflow.shared.messages (a package's __init__ is the package)
    line: int
    written: str  # the module as written (a relative import resolved)
    level: int  # 0: absolute
    target: str | None  # the module of the tree it loads (None: outside the tree)

    def say(self, rule: str) -> str:
        return f"{self.where}:{self.line} imports {self.target or self.written}: {rule}"


@dataclass
class Module:
    """What the rules read of one module, gathered in one walk of its syntax tree."""

    name: str
    where: str  # its path from the repository's root
    is_package: bool
    imports: list[Import] = field(default_factory=list)
    functions: list[tuple[int, str, int]] = field(default_factory=list)  # line, name, lines
    strings: list[tuple[int, str]] = field(default_factory=list)  # line, value (not docstrings)
    variable_reads: list[tuple[int, str]] = field(default_factory=list)  # line, the code


def _sources() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def _name(path: Path) -> tuple[str, bool]:
    folder, *rest = path.relative_to(ROOT).with_suffix("").parts
    is_package = rest[-1:] == ["__init__"]
    return ".".join([FOLDERS[folder], *(rest[:-1] if is_package else rest)]), is_package


@cache
def _modules() -> dict[str, Module]:
    names = {_name(p): p for p in _sources()}
    known = {name for name, _ in names}
    out = {}
    for (name, is_package), path in names.items():
        m = Module(name, str(path.relative_to(ROOT)), is_package)
        _read(m, ast.parse(path.read_text(), str(path)), known)
        out[name] = m
    return out


def _known(name: str, known: set[str]) -> str | None:
    """The module of the tree that ``import name`` loads last (its nearest enclosing one)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _base(m: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = m.name.split(".") if m.is_package else m.name.split(".")[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def _read(m: Module, tree: ast.Module, known: set[str]) -> None:
    """Every import statement anywhere (module level, ``TYPE_CHECKING`` blocks and function
    bodies alike), every function's length, every string that is not a docstring and every
    read of a ``KVFLOW_*`` variable."""
    prose: set[int] = set()  # docstrings: prose may mention a module, code may not
    strings = []
    for node in ast.walk(tree):  # breadth first: a docstring's owner comes before it
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _known(alias.name, known)
                m.imports.append(Import(m.where, m.name, node.lineno, alias.name, 0, target))
        elif isinstance(node, ast.ImportFrom):
            base = _base(m, node)
            for alias in node.names:
                full = f"{base}.{alias.name}"  # `from pkg import submodule` loads the submodule
                target = full if full in known else _known(base, known)
                m.imports.append(Import(m.where, m.name, node.lineno, base, node.level, target))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            strings.append(node)
        elif _reads_variable(node):
            m.variable_reads.append((node.lineno, ast.unparse(node)))
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                prose.add(id(body[0].value))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            m.functions.append((node.lineno, node.name, node.end_lineno - node.lineno + 1))
    m.strings = [(s.lineno, s.value) for s in strings if id(s) not in prose]


@cache
def _imports() -> list[Import]:
    return [imp for m in _modules().values() for imp in m.imports]


def _in(name: str | None, package: str) -> bool:
    return name is not None and (name == package or name.startswith(package + "."))


# --- issue 21 --------------------------------------------------------------------------------


def test_no_function_outside_kernels_is_over_the_limit() -> None:
    long = {
        f"{m.where}:{line} {name}": n
        for m in _modules().values()
        if not _in(m.name, "kvflow.kernels")
        for line, name, n in m.functions
        if n > MAX_FUNCTION_LINES
    }
    assert long == {}, f"functions over {MAX_FUNCTION_LINES} lines"


def test_services_holds_only_the_services() -> None:
    entries = {p.name for p in (ROOT / "services").iterdir() if p.name != "__pycache__"}
    assert entries - {"__init__.py"} == SERVICES


# --- issue 64: layers that hold --------------------------------------------------------------


def test_kernels_import_nothing_of_kvflow_but_kernels() -> None:
    rule = "kernels/ imports nothing of kvflow but kvflow.kernels (a caller passes what it needs)"
    bad = sorted(
        {
            imp.say(rule)
            for imp in _imports()
            if _in(imp.module, "kvflow.kernels")
            and _in(imp.target, "kvflow")
            and not _in(imp.target, "kvflow.kernels")
        }
    )
    assert bad == [], "\n".join(bad)


def test_shared_imports_neither_kernels_nor_services() -> None:
    rule = "shared/ imports neither kvflow.kernels nor kvflow.services"
    bad = sorted(
        {
            imp.say(rule)
            for imp in _imports()
            if _in(imp.module, "kvflow.shared")
            and (_in(imp.target, "kvflow.kernels") or _in(imp.target, "kvflow.services"))
        }
    )
    assert bad == [], "\n".join(bad)


def test_no_string_in_shared_names_a_kernels_or_services_module() -> None:
    rule = "shared/ names no kvflow.services or kvflow.kernels module, not even in a string"
    bad = [
        f"{m.where}:{line} names {value!r}: {rule}"
        for m in _modules().values()
        if _in(m.name, "kvflow.shared")
        for line, value in m.strings
        if NAMES_A_LOWER_LAYER.search(value)
    ]
    assert bad == [], "\n".join(bad)


def _service(name: str | None) -> str | None:
    parts = (name or "").split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["kvflow", "services"] else None


def test_no_service_imports_another_service() -> None:
    rule = "a service package never imports another one (services meet on the bus)"
    bad = sorted(
        {
            imp.say(rule)
            for imp in _imports()
            if _service(imp.module) is not None
            and _service(imp.target) not in (None, _service(imp.module))
        }
    )
    assert bad == [], "\n".join(bad)


def _import_graph() -> dict[str, dict[str, Import]]:
    """importer -> imported module -> the first import statement that makes the edge."""
    edges: dict[str, dict[str, Import]] = {name: {} for name in _modules()}
    for imp in sorted(_imports(), key=lambda i: i.line):
        if imp.target is not None and imp.target != imp.module:
            edges[imp.module].setdefault(imp.target, imp)
    return edges


def _components(edges: dict[str, dict[str, Import]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []
    for root in sorted(edges):
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        work = [(root, iter(sorted(edges[root])))]
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None and w not in index:
                index[w] = low[w] = len(index)
                stack.append(w)
                work.append((w, iter(sorted(edges[w]))))
            elif w is not None:
                if w in stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    cut = stack.index(v)
                    component, stack[cut:] = stack[cut:], []
                    if len(component) > 1:
                        out.append(sorted(component))
    return sorted(out)


def _shortest_cycle(start: str, inside: set[str], edges: dict[str, dict[str, Import]]) -> list:
    """The import statements of a shortest way from ``start`` back to itself (breadth first
    within its component)."""
    came: dict[str, Import] = {}
    frontier = [start]
    while frontier:
        step = []
        for v in frontier:
            for w, imp in sorted(edges[v].items()):
                if w not in inside or w in came:
                    continue
                came[w] = imp
                if w == start:
                    path, at = [], start
                    while True:
                        path.append(came[at])
                        at = came[at].module
                        if at == start:
                            return path[::-1]
                step.append(w)
        frontier = step
    return []


def test_no_import_circles() -> None:
    """Each circle is named by its modules and one shortest loop through it, statement by
    statement."""
    rule = "an import circle: no two modules import each other, however indirectly"
    edges = _import_graph()
    bad = []
    for component in _components(edges):
        loop = _shortest_cycle(component[0], set(component), edges)
        bad.append(
            f"{rule} ({len(component)} modules: {', '.join(component)})\n    "
            + "\n    ".join(imp.say("in the circle") for imp in loop)
        )
    assert bad == [], "\n".join(bad)


# --- issue 64: one reader of the environment -------------------------------------------------


def _is_environment(node: ast.expr) -> bool:
    """``os.environ``, ``environ`` or a name for one (``env``, ``environment``)."""
    if isinstance(node, ast.Attribute):
        return node.attr in ("environ", "environb")
    return isinstance(node, ast.Name) and "env" in node.id.lower()


def _kvflow_variable(node: ast.expr | None) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value.startswith("KVFLOW_")
    if isinstance(node, ast.JoinedStr) and node.values:  # f"KVFLOW_{name}"
        return _kvflow_variable(node.values[0])
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):  # "KVFLOW_" + name
        return _kvflow_variable(node.left)
    return False


def _reads_variable(node: ast.AST) -> bool:
    """``os.getenv(V)``, ``os.environ.get(V)`` (and setdefault, pop), ``os.environ[V]``,
    ``V in os.environ``, for a ``KVFLOW_*`` name V."""
    if isinstance(node, ast.Call) and node.args and _kvflow_variable(node.args[0]):
        f = node.func
        if (
            isinstance(f, ast.Attribute | ast.Name)
            and getattr(f, "attr", getattr(f, "id", "")) == "getenv"
        ):
            return True
        return (
            isinstance(f, ast.Attribute)
            and f.attr in ("get", "setdefault", "pop")
            and _is_environment(f.value)
        )
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
        return _is_environment(node.value) and _kvflow_variable(node.slice)
    if isinstance(node, ast.Compare) and any(isinstance(o, ast.In | ast.NotIn) for o in node.ops):
        return _kvflow_variable(node.left) and any(_is_environment(c) for c in node.comparators)
    return False


def test_only_the_settings_read_kvflow_variables() -> None:
    rule = f"only {SETTINGS_READER} reads KVFLOW_* variables (settings flow from there)"
    bad = [
        f"{m.where}:{line} reads {code}: {rule}"
        for m in _modules().values()
        if m.where != SETTINGS_READER
        for line, code in m.variable_reads
    ]
    assert bad == [], "\n".join(bad)


# --- issue 64: one importable name -----------------------------------------------------------


OLD_IMPORT = re.compile(rf"^\s*(?:from|import)\s+(?:{'|'.join(OLD_TOP_LEVEL)})\b", re.MULTILINE)


def test_nothing_imports_a_top_level_name_of_the_old_layout() -> None:
    """Package modules and tests alike: ``kvflow.shared``, never ``shared``."""
    rule = "kvflow's packages are imported as kvflow.X, never as a top-level X"
    bad = {
        imp.say(rule)
        for imp in _imports()
        if not imp.level and imp.written.split(".")[0] in OLD_TOP_LEVEL
    }
    for path in sorted((ROOT / "tests").rglob("*.py")):
        text = path.read_text()
        if not OLD_IMPORT.search(text):  # the few that might are parsed
            continue
        for node in ast.walk(ast.parse(text, str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            bad |= {
                f"{path.relative_to(ROOT)}:{node.lineno} imports {name}: {rule}"
                for name in names
                if name.split(".")[0] in OLD_TOP_LEVEL
            }
    assert sorted(bad) == [], "\n".join(sorted(bad))


FIND_SPECS = """
import importlib.metadata, importlib.util, json, sys
found = {}
for name in sys.argv[1:]:
    spec = importlib.util.find_spec(name)
    found[name] = [] if spec is None else (
        [spec.origin] if spec.origin else []) + list(spec.submodule_search_locations or [])
try:
    top = (importlib.metadata.distribution("kvflow").read_text("top_level.txt") or "").split()
except importlib.metadata.PackageNotFoundError:
    top = []
print(json.dumps({"found": found, "top_level": top, "prefix": sys.prefix}))
"""


def test_a_fresh_interpreter_finds_no_top_level_name_of_kvflows(tmp_path: Path) -> None:
    """``python -I`` (no current directory, no PYTHONPATH) from elsewhere: ``import kernels``
    must not find kvflow's kernels/ (Hugging Face's ``kernels``, which transformers imports,
    would be shadowed), nor may the installed kvflow declare such a top-level name."""
    out = subprocess.run(
        [sys.executable, "-I", "-c", FIND_SPECS, *OLD_TOP_LEVEL],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    got = json.loads(out.stdout)
    prefix = Path(got["prefix"]).resolve()
    bad = []
    for name, places in got["found"].items():
        for place in map(Path, places):
            place = place.resolve()
            if place.is_relative_to(ROOT) and not place.is_relative_to(prefix):
                bad.append(f"import {name} finds {place.relative_to(ROOT)}: kvflow.{name} only")
    bad += [f"kvflow installs the top-level name {t}" for t in got["top_level"] if t != "kvflow"]
    assert bad == [], "\n".join(bad)
