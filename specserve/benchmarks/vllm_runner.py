"""Run vLLM configurations on token-id prompts, batch 1, greedy: JSON in, JSON out.

Executed by `specserve bench` as a script with the vLLM environment's python (vLLM's CPU build
pins its own torch, so it lives in its own venv, `make vllm-env`), never imported by specserve:

    .venv-vllm/bin/python -P specserve/benchmarks/vllm_runner.py REQUEST.json RESULT.json

REQUEST: {"model": DIR, "dtype": "bfloat16", "max_tokens": 128, "max_model_len": 4096,
          "stop_token_ids": [...], "prompts": {"code": [[ids...], ...], ...},
          "enforce_eager": false, "in_process_engine": false,
          "configs": [{"name": "vllm none", "speculative_config": null}, ...]}
RESULT:  {"status": "ok", "vllm": VERSION, "torch": VERSION,
          "configs": {NAME: {"status": "ok", "load_s": S, "spec_decode": {"code": {...}},
                             "runs": {"code": [{"token_ids": [...], "seconds": S}, ...]}}
                      or {"status": "failed", "error": "...", "traceback": "..."}}}
     or  {"status": "failed", "error": "...", "traceback": "..."}  (vLLM did not even import)

The harness sends one configuration per process for measurements, and all of them to one
process with ``in_process_engine`` (no engine-core and worker processes to start) for --quick.
Only the standard library and vLLM are imported here (this file runs outside specserve's venv).
vLLM's sampled speculative path was unreliable on this machine (see DESIGN.md): greedy only.
"""

from __future__ import annotations

import os
import sys

# Run as a script, this file's folder comes first on sys.path, and its neighbour http.py would
# shadow the standard library's http module (the harness also runs it with `python -P`).
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

import gc  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402


def run_config(request: dict, config: dict) -> dict:
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    extra = {"distributed_executor_backend": "uni"} if request.get("in_process_engine") else {}
    llm = LLM(model=request["model"], dtype=request.get("dtype", "bfloat16"),
              max_model_len=request.get("max_model_len", 4096), seed=0,
              speculative_config=config.get("speculative_config"), enforce_eager=request.get("enforce_eager", False),
              disable_log_stats=False, **extra)  # log stats on: they hold the spec-decode counters
    load_s = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"],
                            stop_token_ids=request.get("stop_token_ids") or None)

    def generate(ids: list[int]) -> tuple[list[int], float]:
        start = time.perf_counter()
        [out] = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        return list(out.outputs[0].token_ids), time.perf_counter() - start

    try:
        first = next(p for prompts in request["prompts"].values() for p in prompts)
        generate(first[:16])  # warm-up: first calls pay for allocation and kernel selection
        runs, spec = {}, {}
        for workload, prompts in request["prompts"].items():
            runs[workload] = []
            before = spec_counters(llm)
            for ids in prompts:
                token_ids, seconds = generate(ids)
                runs[workload].append({"token_ids": token_ids, "seconds": seconds})
                print("vllm_runner: prompt done", file=sys.stderr, flush=True)
            after = spec_counters(llm)
            spec[workload] = {name: after[name] - before.get(name, 0) for name in after}
    finally:
        del llm
        gc.collect()
    return {"status": "ok", "load_s": load_s, "runs": runs, "spec_decode": spec}


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


def run(request: dict) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(request.get("kv_cache_gib", 2)))
    if request.get("in_process_engine"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        import torch
        import vllm
    except BaseException as exc:
        return failure(exc)
    configs = {}
    for config in request["configs"]:
        try:
            configs[config["name"]] = run_config(request, config)
        except BaseException as exc:  # report every failure as data: the harness prints the reason
            configs[config["name"]] = failure(exc)
    return {"status": "ok", "vllm": vllm.__version__, "torch": torch.__version__, "configs": configs}


def main(argv: list[str]) -> int:
    request_path, result_path = argv
    with open(request_path) as f:
        result = run(json.load(f))
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
