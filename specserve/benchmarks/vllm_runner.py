"""Run one vLLM configuration on token-id prompts, greedy, in batches: JSON in, JSON out.

Executed by `specserve bench` as a script with the vLLM environment's python (vLLM's CPU build
pins its own torch, so it lives in its own venv, `make vllm-env`); specserve imports this file
only for SETTINGS (it imports nothing outside the standard library at the top):

    .venv-vllm/bin/python -P specserve/benchmarks/vllm_runner.py REQUEST.json RESULT.json

REQUEST: {"model": DIR, "dtype": "bfloat16", "max_tokens": 128, "max_model_len": 4096,
          "stop_token_ids": [...], "settings": "eager" | "compiled", "kv_cache_gib": 2,
          "speculative_config": null | {...},
          "cells": [{"workload": "code", "batch": 4, "calls": [[[ids...], ...], ...]}, ...]}
RESULT:  {"status": "ok", "vllm": VERSION, "torch": VERSION, "settings": {...}, "load_s": S,
          "cells": [{"workload": "code", "batch": 4, "spec_decode": {...},
                     "calls": [{"token_ids": [[...], ...], "seconds": S}, ...]}, ...]}
     or  {"status": "failed", "error": "...", "traceback": "...", "settings": {...}}

One configuration and one engine per process: the settings decide how the engine starts (see
SETTINGS), and environment variables set before vLLM is imported are part of them. Every batch
size is warmed up once before anything is timed, and each cell starts with an empty prefix cache.
vLLM's sampled speculative path was unreliable on this machine (see DESIGN.md): greedy only.
"""

from __future__ import annotations

import os
import sys

# Run as a script, this file's folder comes first on sys.path, and its neighbour http.py would
# shadow the standard library's http module (the harness also runs it with `python -P`).
_HERE = os.path.dirname(os.path.abspath(__file__))
if __name__ == "__main__":
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

import gc  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

# How vLLM's engine starts. `specserve bench` tries each and keeps the fastest (DESIGN.md: on 2
# cores the eager in-process engine won; compiled multi-process is vLLM's default).
SETTINGS: dict[str, dict] = {
    "eager": {
        "description": "eager (enforce_eager=True), engine in process (VLLM_ENABLE_V1_MULTIPROCESSING=0, "
                       "distributed_executor_backend='uni')",
        "llm_args": {"enforce_eager": True, "distributed_executor_backend": "uni"},
        "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    },
    "compiled": {
        "description": "vLLM's defaults: torch.compile, engine core in its own process",
        "llm_args": {"enforce_eager": False},
        "env": {},
    },
}
WARM_UP_TOKENS = 4


def run_config(request: dict, settings: dict) -> dict:
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=request["model"], dtype=request.get("dtype", "bfloat16"),
              max_model_len=request.get("max_model_len", 4096), seed=0,
              speculative_config=request.get("speculative_config"), disable_log_stats=False,
              **settings["llm_args"])  # log stats on: they hold the spec-decode counters
    stop = request.get("stop_token_ids") or None

    def generate(batch: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=stop)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)
        return [list(out.outputs[0].token_ids) for out in outs], time.perf_counter() - start

    try:
        cells = request["cells"]
        first = cells[0]["calls"][0][0]
        for batch in sorted({cell["batch"] for cell in cells}):  # first calls of a shape pay for allocation
            generate([first[:16]] * batch, WARM_UP_TOKENS)
        load_s = time.perf_counter() - started
        results = [run_cell(llm, cell, generate, request["max_tokens"]) for cell in cells]
    finally:
        del llm
        gc.collect()
    return {"load_s": load_s, "cells": results}


def run_cell(llm, cell: dict, generate, max_tokens: int) -> dict:
    # Cells run the same prompts at other batch sizes: start each with vLLM's prefix cache empty, as
    # specserve starts each request (its worker keeps a request's cache until the request ends).
    llm.reset_prefix_cache()
    before = spec_counters(llm)
    calls = []
    for batch in cell["calls"]:
        token_ids, seconds = generate(batch, max_tokens)
        calls.append({"token_ids": token_ids, "seconds": seconds})
        print("vllm_runner: call done", file=sys.stderr, flush=True)
    after = spec_counters(llm)
    return {"workload": cell["workload"], "batch": cell["batch"], "calls": calls,
            "spec_decode": {name: after[name] - before.get(name, 0) for name in after}}


def spec_counters(llm) -> dict[str, int]:
    """vLLM's speculative decoding counters (num_drafts, num_draft_tokens, num_accepted_tokens)."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # metrics are a bonus; never fail a run over them
        return {}
    prefix = "vllm:spec_decode_"
    names = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    return {m.name[len(prefix):]: int(m.value) for m in metrics
            if m.name.startswith(prefix) and m.name[len(prefix):] in names and hasattr(m, "value")}


def failure(exc: BaseException) -> dict:
    return {"status": "failed", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


def describe(name: str) -> dict:
    """The settings as results.json records them: what a user would write to get the same engine."""
    settings = SETTINGS[name]
    return {"name": name, "description": settings["description"], **settings["llm_args"],
            **{f"env {key}": value for key, value in settings["env"].items()}}


def run(request: dict) -> dict:
    settings = SETTINGS[request.get("settings", "compiled")]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(request.get("kv_cache_gib", 2)))
    os.environ.update(settings["env"])  # before vLLM is imported: it reads them at import
    described = describe(request.get("settings", "compiled"))
    try:
        import torch
        import vllm

        return {"status": "ok", "vllm": vllm.__version__, "torch": torch.__version__, "settings": described,
                **run_config(request, settings)}
    except BaseException as exc:  # report every failure as data: the harness prints the reason
        return {**failure(exc), "settings": described}


def main(argv: list[str]) -> int:
    request_path, result_path = argv
    with open(request_path) as f:
        result = run(json.load(f))
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
