#!/usr/bin/env bash
# The GPU path checked in one prepared run (an H100 lent for minutes, no network):
#   scripts/gpu-check.sh [--cpu] [--only STEP,...] [OUT_DIR]   (make gpu-check; OUT_DIR: $OUT or gpu-check)
# Steps, each capped in time and all within GPU_CHECK_BUDGET seconds (470: one hang cannot eat the
# device time), logged to steps.tsv (GPU_CHECK_TESTS="ids ..." reruns only those tests):
#   env      versions, nvidia-smi, device-to-device copy bandwidth
#   tests    tests/kernels, the CUDA-graph and fp8 unit tests, natively (pytest-timeout per test)
#   greedy   ModelRunner (Triton, CUDA graphs, fp32) == transformers' greedy, token for token
#   kernels  python -m kvflow.benchmarks.kernels (per-kernel table, device-only decode loop)
#   splits   paged decode attention at each split count (the data default_num_splits is tuned on)
#   decode   python -m kvflow.benchmarks.decode --device cuda --random-llama, graphs then eager
#   sampling python -m kvflow.benchmarks.sampling: one step's sampling on the GPU vs copied to the host
#   profile  cProfile of the worker's decode steps at batch 64 (where the host's time goes)
#   stack    kvflow serve --device cuda at 1/32/256 streams (TPOT, the worker's busy fraction, CPU
#            per token), then transformers on the same weights
#   pipeline kvflow bench pipeline (simulated worker, 5 and 0 ms steps) on this machine's cores
#   summary  summary.md + summary.json (the issue's targets checked), results.tar.gz of the rest
# GPU_CHECK_PY_SPY=SECONDS: py-spy samples the stack's worker for that long in each timed run.
# On the GPU machine the Python packages its image lacks come from .gpu/wheels (made here by
# scripts/gpu-wheels.sh) and SmolLM2's tokenizer from .gpu/tokenizer. --cpu: the same steps with
# tiny models and workloads on this machine's venv (the test suite runs it, so it cannot rot).
set -uo pipefail
cd "$(dirname "$0")/.."
CPU=0
ONLY=""  # --only env,tests,...: a rerun of some steps (after a fix, in what device time is left)
while [[ $# -gt 0 ]]; do
  case $1 in
    --cpu) CPU=1; shift ;;
    --only) ONLY=",$2,"; shift 2 ;;
    *) break ;;
  esac
done
BUDGET=${GPU_CHECK_BUDGET:-470}  # seconds for all steps: the run ends inside 8 minutes
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
  local t0=$(date +%s) rc note="" left
  if [[ -n $ONLY && $ONLY != *",$name,"* ]]; then return 0; fi
  left=$((START + BUDGET - t0))
  if ((left < 5)); then
    printf '%s\t%s\t%s\t%s\n' "$name" 124 0 "not run: the ${BUDGET}s budget was spent" >>"$OUTDIR/steps.tsv"
    return 0
  fi
  ((cap > left)) && cap=$left
  echo "== $name (cap ${cap}s): $*"
  timeout -k 10 "$cap" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  if [[ $rc == 124 ]] || [[ $rc == 137 && $(($(date +%s) - t0)) -ge $cap ]]; then
    note="stopped at its ${cap}s cap"
  elif ((rc > 128)); then
    note="killed by signal $((rc - 128))"  # 9 before the cap: the kernel's OOM killer, say
  fi
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" "$note" >>"$OUTDIR/steps.tsv"
  tail -n 25 "$LOGS/$name.log"
  echo "== $name: exit $rc after $(($(date +%s) - t0))s $note"
  # on the lent machine nothing else runs: whatever a step left behind (a stack's services and
  # servers, in sessions of their own) must not run into the next step
  if [[ $CPU == 0 ]]; then pkill -9 -f "kvflow.cli.main|nats-server|redis-server" 2>/dev/null; fi
  return 0
}

if [[ $CPU == 1 ]]; then
  TESTS=(tests/unit/worker/test_cuda_graphs.py tests/kernels/test_kernels_triton.py -k "rms_norm or cuda_graph or capture or padded or pack or backend")
  XDIST=()
  STREAMS=(--streams 1 4 --waves 1 --input-len 16 --output-len 8)
  DECODE=(--device cpu --random-llama --hidden 128 --layers 2 --intermediate 256 --batch 1 8 --context 32 --steps 3 --warmup 1)
  SAMPLING=(--device cpu --rows 1 8 --vocab 4096 --steps 3 --warmup 1)
elif [[ -n ${GPU_CHECK_TESTS:-} ]]; then
  read -r -a TESTS <<<"$GPU_CHECK_TESTS"  # a rerun of some tests: their ids, space-separated
else
  TESTS=(tests/kernels tests/unit/worker/test_cuda_graphs.py tests/unit/kernels/test_fp8_linear.py)
fi
if [[ $CPU == 0 ]]; then
  XDIST=()
  "$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 8)
  STREAMS=(--streams 1 32 256)
  DECODE=(--device cuda --random-llama --batch 1 8 32 64 256 --context 512 --steps 20)
  SAMPLING=(--device cuda --rows 1 64 256 --steps 20)
fi

step env 30 "$PY" -m kvflow.benchmarks.gpu_check env --out "$OUTDIR"
step tests 120 "$PY" -m pytest -q -p no:cacheprovider \
  --timeout 90 "${XDIST[@]}" --junitxml "$OUTDIR/junit.xml" "${TESTS[@]}"
step greedy 45 "$PY" -m kvflow.benchmarks.gpu_check greedy $TINY --out "$OUTDIR"
step kernels 60 "$PY" -m kvflow.benchmarks.kernels --json "$OUTDIR/kernels.json"
step splits 40 "$PY" -m kvflow.benchmarks.gpu_check splits --out "$OUTDIR"
step decode 45 "$PY" -m kvflow.benchmarks.decode "${DECODE[@]}" --json "$OUTDIR/decode.json"
step decode-eager 30 "$PY" -m kvflow.benchmarks.decode "${DECODE[@]}" --enforce-eager --json "$OUTDIR/decode-eager.json"
step sampling 25 "$PY" -m kvflow.benchmarks.sampling "${SAMPLING[@]}" --json "$OUTDIR/sampling.json"
step profile 30 "$PY" -m kvflow.benchmarks.gpu_check profile $TINY --out "$OUTDIR"
step stack 150 "$PY" -m kvflow.benchmarks.gpu_check stack $TINY "${STREAMS[@]}" ${GPU_CHECK_STACK_ARGS:-} --out "$OUTDIR"
step pipeline 100 "$PY" -m kvflow.benchmarks.gpu_check pipeline $TINY "${STREAMS[@]}" --out "$OUTDIR"
"$PY" -m kvflow.benchmarks.gpu_check summary --out "$OUTDIR" >"$LOGS/summary.log" 2>&1
echo "total: $(($(date +%s) - START))s" >>"$OUTDIR/summary.md"
cp "$OUTDIR/summary.md" "$OUTDIR/summary.json" "$DEST"/
tar -czf "$DEST/results.tar.gz" -C "$OUTDIR" .
rm -rf "$OUTDIR"
cat "$DEST/summary.md"
