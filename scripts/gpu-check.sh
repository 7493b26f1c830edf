#!/usr/bin/env bash
# The GPU path checked in one prepared run (an H100 lent for minutes, no network):
#   scripts/gpu-check.sh [--cpu] [OUT_DIR]          (make gpu-check; OUT_DIR default: $OUT or gpu-check)
# Steps, each capped in time (one hang cannot eat the budget) and logged to steps.tsv:
#   env      versions, nvidia-smi, device-to-device copy bandwidth
#   tests    tests/kernels, the CUDA-graph and fp8 unit tests, natively (pytest-timeout per test)
#   greedy   ModelRunner (Triton, CUDA graphs, fp32) == transformers' greedy, token for token
#   kernels  python -m benchmarks.kernels (per-kernel table, device-only decode loop)
#   decode   python -m benchmarks.decode --device cuda --random-llama, graphs then eager
#   stack    kvflow serve --device cuda at 1/32/256 streams, then transformers on the same weights
#   summary  summary.md + summary.json (the issue's targets checked), results.tar.gz of the rest
# On the GPU machine the Python packages its image lacks come from .gpu/wheels (made here by
# scripts/gpu-wheels.sh) and SmolLM2's tokenizer from .gpu/tokenizer. --cpu: the same steps with
# tiny models and workloads on this machine's venv (the test suite runs it, so it cannot rot).
set -uo pipefail
cd "$(dirname "$0")/.."
CPU=0
if [[ "${1:-}" == "--cpu" ]]; then CPU=1; shift; fi
DEST=${1:-${OUT:-gpu-check}}
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)
# the steps work in a scratch folder; DEST gets three files (a device call returns at most 8):
# summary.md, summary.json (every step's figures) and results.tar.gz (every file and log)
OUTDIR=$(mktemp -d /tmp/kvflow-gpu-check.XXXXXX)
LOGS="$OUTDIR/logs"
mkdir -p "$LOGS"
: >"$OUTDIR/steps.tsv"
START=$(date +%s)

if [[ $CPU == 1 ]]; then
  PY=${PYTHON:-.venv/bin/python}
  TINY=--tiny
  export TRITON_INTERPRET=1
else
  PY=${PYTHON:-python3}
  TINY=
  if compgen -G ".gpu/wheels/*.whl" >/dev/null; then
    SITE=/tmp/kvflow-site
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" .gpu/wheels/*.whl >"$LOGS/pip.log" 2>&1 || { cat "$LOGS/pip.log"; exit 1; }
    export PYTHONPATH="$SITE:$PWD" PATH="$SITE/bin:$PATH"
  fi
fi
export PYTHONPATH="${PYTHONPATH:-$PWD}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# step NAME CAP_SECONDS COMMAND...: run it in its own process group, killed (all of it) at the cap
step() {
  local name=$1 cap=$2; shift 2
  local t0=$(date +%s) rc note=""
  echo "== $name (cap ${cap}s): $*"
  timeout -k 10 "$cap" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  [[ $rc == 124 || $rc == 137 ]] && note="stopped at its ${cap}s cap"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" "$note" >>"$OUTDIR/steps.tsv"
  tail -n 25 "$LOGS/$name.log"
  echo "== $name: exit $rc after $(($(date +%s) - t0))s $note"
  # on the lent machine nothing else runs: whatever a step left behind (a stack's services and
  # servers, in sessions of their own) must not run into the next step
  if [[ $CPU == 0 ]]; then pkill -9 -f "kvflow.cli.main|nats-server|redis-server" 2>/dev/null; fi
  return 0
}

if [[ $CPU == 1 ]]; then
  TESTS=(tests/unit/test_cuda_graphs.py tests/kernels/test_kernels_triton.py -k "rms_norm or cuda_graph or capture or padded or pack or backend")
  XDIST=()
  STREAMS=(--streams 1 4 --waves 1 --input-len 16 --output-len 8)
  DECODE=(--device cpu --random-llama --hidden 128 --layers 2 --intermediate 256 --batch 1 8 --context 32 --steps 3 --warmup 1)
else
  TESTS=(tests/kernels tests/unit/test_cuda_graphs.py tests/unit/test_fp8_linear.py)
  XDIST=()
  "$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 8)
  STREAMS=(--streams 1 32 256)
  DECODE=(--device cuda --random-llama --batch 1 8 32 64 256 --context 512 --steps 20)
fi

step env 60 "$PY" -m benchmarks.gpu_check env --out "$OUTDIR"
step tests "$([[ $CPU == 1 ]] && echo 120 || echo 150)" "$PY" -m pytest -q -p no:cacheprovider \
  --timeout 90 "${XDIST[@]}" --junitxml "$OUTDIR/junit.xml" "${TESTS[@]}"
step greedy 60 "$PY" -m benchmarks.gpu_check greedy $TINY --out "$OUTDIR"
step kernels 75 "$PY" -m benchmarks.kernels --json "$OUTDIR/kernels.json"
step decode 60 "$PY" -m benchmarks.decode "${DECODE[@]}" --json "$OUTDIR/decode.json"
step decode-eager 45 "$PY" -m benchmarks.decode "${DECODE[@]}" --enforce-eager --json "$OUTDIR/decode-eager.json"
step stack 150 "$PY" -m benchmarks.gpu_check stack $TINY "${STREAMS[@]}" --out "$OUTDIR"
"$PY" -m benchmarks.gpu_check summary --out "$OUTDIR" >"$LOGS/summary.log" 2>&1
echo "total: $(($(date +%s) - START))s" >>"$OUTDIR/summary.md"
cp "$OUTDIR/summary.md" "$OUTDIR/summary.json" "$DEST"/
tar -czf "$DEST/results.tar.gz" -C "$OUTDIR" .
rm -rf "$OUTDIR"
cat "$DEST/summary.md"
