# specserve developer entry points. `make serve` and `make test` work on a fresh machine.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEFAULT_MODELS := qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct

# Ray 2.60 turns token auth on by default; a local single-user cluster does not need it.
export RAY_AUTH_MODE ?= disabled

.PHONY: setup models serve generate test test-fast bench bench-http clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

models: setup
	$(VENV)/bin/specserve models pull $(DEFAULT_MODELS)

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

bench-http: models
	$(PY) -m specserve.benchmarks.http --manifest manifests/local.yaml --prompts 4 --max-tokens 128 --concurrency 1 4

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
