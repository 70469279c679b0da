# specserve developer entry points. `make serve` and `make test` work on a fresh machine.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

export RAY_AUTH_MODE ?= disabled

.PHONY: setup models serve generate test test-fast bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

models: setup
	$(VENV)/bin/specserve models pull qwen2.5-coder-1.5b-instruct
	$(VENV)/bin/specserve models pull qwen2.5-coder-0.5b-instruct

# The main job: the embedded default pair (Qwen2.5-Coder 1.5B target, 0.5B draft) on CPU.
serve: models
	$(VENV)/bin/specserve generate --target qwen2.5-coder-1.5b-instruct \
	    --draft qwen2.5-coder-0.5b-instruct --method draft -k 4 --max-tokens 128 --chat \
	    --prompt "Write a Python function that checks whether a number is prime."

test: setup
	$(VENV)/bin/specserve models pull smollm2-135m-instruct
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
