"""`specserve bench`: specserve against its peers, side by side, with a table and plots.

    specserve bench --quick                 # smoke run on the default pair, under 5 minutes
    specserve bench --docs docs             # the full run, also written to docs/BENCHMARKS.md

Runs every system on the same prompts (HumanEval for code, MT-Bench for chat) and the same
models, greedy, in one run on this machine:
- library mode: specserve's methods, transformers (target only, assisted generation, prompt
  lookup) and vLLM's CPU build (none, draft_model, ngram) in its own venv, batch 1;
- service mode: specserve through `serve run` and HTTP, at each concurrency.
Writes results.json, results.md and PNG plots to --out, after each phase too (marked partial until
the run ends). A system that cannot run says why.
"""

from __future__ import annotations

import argparse
import datetime as dt
import fnmatch
import gc
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

from specserve.benchmarks import library, report, service, systems, workloads
from specserve.benchmarks.plots import write_plots

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
# The full run fits in about 100 minutes on 2 cores. Service mode uses shorter answers: a throughput
# or latency point needs steady streams, not long ones, and it is the longest phase.
FULL = {"prompts": 8, "max_tokens": 128, "concurrency": [1, 2, 4, 8], "service_requests": 4, "service_max_tokens": 64}
QUICK = {"prompts": 1, "max_tokens": 8, "concurrency": [1, 2], "service_requests": 2,
         "service_max_tokens": 8}  # and service mode on the first workload only
FULL_COMMAND = "specserve bench --out bench-results/full --docs docs"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="smoke run (under 5 minutes on 2 cores): 1 prompt per workload, 8 tokens, vLLM fast "
                        "start, service mode on the first workload at concurrency 1 2")
    p.add_argument("--target", default=DEFAULT_TARGET, help="registry name or local directory")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model; 'none' for no draft")
    p.add_argument("--heads", default="default",
                   help="Medusa heads for the target's medusa rows (default: $SPECSERVE_HOME/heads/<target>-medusa, "
                        "from `make heads`; 'none' to skip them)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--workloads", nargs="+", default=list(workloads.WORKLOADS), choices=workloads.WORKLOADS)
    p.add_argument("--prompts", type=int, help=f"prompts per workload (default {FULL['prompts']})")
    p.add_argument("--max-tokens", type=int, help=f"new tokens per prompt (default {FULL['max_tokens']})")
    p.add_argument("--seed", type=int, default=0, help="picks the prompt subsets (default 0)")
    p.add_argument("--modes", nargs="+", default=["library", "service"], choices=["library", "service"])
    p.add_argument("--systems", nargs="+", metavar="PATTERN",
                   help="only systems whose name matches one of these shell patterns, e.g. 'specserve*' "
                        "(specserve none always runs: it is the baseline)")
    p.add_argument("--concurrency", type=int, nargs="+",
                   help=f"service mode streams (default {' '.join(map(str, FULL['concurrency']))})")
    p.add_argument("--service-requests", type=int,
                   help=f"service mode: each workload sends max(N, c) requests at concurrency c "
                        f"(default N = {FULL['service_requests']}, at most --prompts)")
    p.add_argument("--service-max-tokens", type=int,
                   help=f"service mode: new tokens per request (default {FULL['service_max_tokens']}, at most "
                        "--max-tokens)")
    p.add_argument("--manifest", help="service mode: serve this config instead of a generated one for the pair")
    p.add_argument("--port", type=int, default=8311, help="port of the generated service config (default 8311)")
    p.add_argument("--vllm-python", help="python of the vLLM environment (default .venv-vllm/bin/python)")
    p.add_argument("--vllm-fast-start", action="store_true",
                   help="vLLM without torch.compile, engine in process, every configuration in one process "
                        "(default with --quick; measurements use vLLM's defaults, one process each)")
    p.add_argument("--threads", type=int, help="torch threads in library mode (default: all cores)")
    p.add_argument("--out", help="output directory (default bench-results/<time>)")
    p.add_argument("--docs", help="also write DOCS/BENCHMARKS.md and DOCS/bench/*.png")
    p.add_argument("--render", metavar="RESULTS_JSON", help="only render a saved results.json again (to --out/--docs)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.render:
        doc = json.loads(Path(args.render).read_text())
        out = Path(args.out) if args.out else Path(args.render).parent
        write_outputs(doc, out, args.docs)
        return 0
    defaults = QUICK if args.quick else FULL
    for key in ("prompts", "max_tokens", "concurrency"):
        if getattr(args, key) is None:
            setattr(args, key, defaults[key])
    # service mode never asks for more requests or longer answers than library mode
    if args.service_requests is None:
        args.service_requests = min(defaults["service_requests"], args.prompts)
    if args.service_max_tokens is None:
        args.service_max_tokens = min(defaults["service_max_tokens"], args.max_tokens)
    for key in ("prompts", "max_tokens", "service_requests", "service_max_tokens"):
        if getattr(args, key) < 1:
            build_parser().error(f"--{key.replace('_', '-')} must be at least 1")
    if min(args.concurrency) < 1:
        build_parser().error("--concurrency must be at least 1")
    if args.draft in ("none", ""):
        args.draft = None
    out = Path(args.out or f"bench-results/{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    doc = run(args, out, command="specserve bench " + shlex.join(argv))
    write_outputs(doc, out, args.docs)
    print(f"specserve bench: wrote {out}/results.json, results.md and plots"
          + (f"; {args.docs}/BENCHMARKS.md" if args.docs else ""), file=sys.stderr)
    return 0


def selected(all_systems: list[systems.System], patterns: list[str] | None) -> list[systems.System]:
    return [s for s in all_systems
            if patterns is None or (s.engine == "specserve" and s.method == "none")
            or any(fnmatch.fnmatchcase(s.name, p) for p in patterns)]


def run(args: argparse.Namespace, out: Path, command: str) -> dict:
    """Runs every phase; after each one the results so far are written to --out, so an interrupted
    run keeps what it measured (the document says ``"partial": true`` until the end)."""
    from tqdm import tqdm

    from specserve import models

    started = dt.datetime.now(dt.timezone.utc)
    t0 = time.monotonic()
    lib_systems = selected(systems.all_systems(), args.systems) if "library" in args.modes else []
    svc_systems = selected(systems.specserve_systems(), args.systems) if "service" in args.modes else []
    lib_workloads = workloads.load(args.workloads, args.prompts, args.seed)
    svc_prompts = max([args.service_requests, *args.concurrency])
    svc_names = args.workloads[:1] if args.quick else args.workloads
    svc_workloads = workloads.load(svc_names, svc_prompts, args.seed) if svc_systems else []
    tokenizer = models.load_tokenizer(args.target)
    lib_encoded = [(w, w.encode(tokenizer)) for w in lib_workloads]
    svc_encoded = [(w, w.encode(tokenizer)) for w in svc_workloads]
    n_prompts = sum(len(w.prompts) for w in lib_workloads)
    total = len(lib_systems) * n_prompts + len(svc_systems) * len(svc_encoded) * len(args.concurrency)
    bar = tqdm(total=total, disable=args.no_progress, file=sys.stderr, unit="step", dynamic_ncols=True)
    machine = machine_info(args)
    notes = []
    if svc_systems:
        notes.append("Service mode measures specserve only: vLLM's OpenAI server and transformers have no "
                     "service-mode runs in this harness yet (library mode compares them).")
    doc = {
        "command": command,
        "full_command": FULL_COMMAND,
        "started": started.isoformat(timespec="seconds"),
        "duration_s": 0.0,
        "partial": True,
        "phases": {},  # wall time of each phase, to plan runs
        "machine": machine,
        "setup": {
            "target": args.target, "draft": args.draft, "dtype": args.dtype, "max_tokens": args.max_tokens,
            "k": systems.K, "seed": args.seed, "greedy": True, "quick": args.quick, "modes": args.modes,
            "concurrency": args.concurrency if svc_systems else [],
            "service_requests": args.service_requests, "service_max_tokens": args.service_max_tokens,
            "manifest": args.manifest,
            "workloads": [_describe(w) for w in lib_workloads] if lib_systems else [],
            "service_workloads": [_describe(w) for w in svc_workloads],
        },
        "library": [],
        "service": [],
        "notes": notes,
    }

    def save_partial(**phase_runs) -> None:
        doc.update(phase_runs, duration_s=time.monotonic() - t0)
        write_outputs(doc, out, None)

    runs = _library_mode(args, lib_systems, lib_encoded, tokenizer, machine, out, bar, doc["phases"],
                         save_partial=lambda runs: save_partial(library=runs))
    save_partial(library=runs)
    doc["service"] = _service_mode(args, svc_systems, svc_encoded, out, bar, doc["phases"])
    bar.close()
    machine["load_average_at_end"] = round(os.getloadavg()[0], 2)
    doc.update(partial=False, duration_s=time.monotonic() - t0)
    return doc


def _library_mode(args, lib_systems, encoded, tokenizer, machine, out, bar, phases, save_partial) -> list[dict]:
    started = time.monotonic()
    runs = _run_in_process([s for s in lib_systems if s.engine != "vllm"], encoded, args, bar, machine)
    phases["library_in_process_s"] = time.monotonic() - started
    systems.compare(runs)
    save_partial([r.as_dict() for r in runs])  # before vLLM's long start-ups
    vllm = [s for s in lib_systems if s.engine == "vllm"]
    if vllm:
        started = time.monotonic()
        python = library.vllm_python(args.vllm_python)
        machine["vllm"] = (library.vllm_version(python) if python else None) or "not installed"
        runs += library.run_vllm(
            vllm, encoded, target_dir=_local_dir(args.target), draft_dir=_local_dir(args.draft),
            dtype=args.dtype, max_tokens=args.max_tokens, stop_token_ids=sorted(_eos_ids(args.target, tokenizer)),
            python=python, fast_start=args.vllm_fast_start or args.quick, log_path=out / "vllm.log", bar=bar)
        phases["library_vllm_s"] = time.monotonic() - started
    systems.compare(runs)
    return [r.as_dict() for r in runs]


def _service_mode(args, svc_systems, encoded, out, bar, phases) -> list[dict]:
    if not svc_systems:
        return []
    started = time.monotonic()
    manifest = args.manifest
    if manifest is None:
        import yaml

        manifest = str(out / "serve-config.yaml")
        # registry names as they are: the pools resolve them, with the registry's EOS ids
        config = service.serve_config(args.target, args.draft, args.dtype, args.port, heads=_heads(args))
        Path(manifest).write_text(yaml.safe_dump(config, sort_keys=False))
    runs = service.run_service(svc_systems, encoded, manifest=manifest,
                               url=f"http://127.0.0.1:{service.manifest_port(manifest)}",
                               max_tokens=args.service_max_tokens, requests=args.service_requests,
                               concurrency=args.concurrency, log_path=out / "serve.log", bar=bar)
    systems.compare_service(runs)
    phases["service_s"] = time.monotonic() - started
    return [r.as_dict() for r in runs]


def _describe(workload: workloads.Workload) -> dict:
    return {"name": workload.name, "source": workload.source, "prompts": [p.id for p in workload.prompts]}


def _run_in_process(in_process, encoded, args, bar, machine) -> list[systems.LibraryRun]:
    if not in_process:
        return []
    from specserve.benchmarks.library import run_in_process
    from specserve.decoder import SpeculativeDecoder
    from specserve.loading import load_pair, set_torch_threads

    set_torch_threads(args.threads)
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # generate()'s deprecation chatter would break the progress bar

    machine["torch_threads"] = torch.get_num_threads()
    bar.set_description("loading models")
    try:
        pair = load_pair(args.target, args.draft, heads=_heads(args), dtype=args.dtype)
    except Exception as exc:
        bar.update(len(in_process) * sum(len(ids) for _, ids in encoded))
        reason = f"could not load the models: {type(exc).__name__}: {exc}".splitlines()[0]
        return [systems.LibraryRun(s.name, s.engine, s.method, w.name, status=systems.CANNOT_RUN, reason=reason)
                for s in in_process for w, _ in encoded]
    decoder = SpeculativeDecoder(pair.verifier(), pair.proposer(), tokenizer=pair.tokenizer,
                                 eos_token_ids=pair.eos_token_ids, method="none", max_context=pair.max_context)
    runs = run_in_process(in_process, encoded, pair, decoder, args.max_tokens, bar)
    del decoder, pair  # free the weights before vLLM and the served pools load theirs
    gc.collect()
    return runs


def _heads(args: argparse.Namespace) -> str | None:
    """The heads directory for the medusa rows, or None when there are none (they then report
    "cannot run" with the command that trains them)."""
    from specserve.heads import find_heads

    if args.heads in (None, "", "none"):
        return None
    directory = find_heads(args.target, args.heads)
    return str(directory) if directory is not None else None


def _local_dir(ref: str | None) -> str | None:
    from specserve import models

    if ref is None:
        return None
    try:
        path = models.resolve(ref)
    except models.ModelError:
        return None
    return path if os.path.isdir(path) else None


def _eos_ids(target: str, tokenizer) -> set[int]:
    """The ids specserve stops at: the registry's upstream EOS ids, the generation config's, the tokenizer's."""
    from specserve import models

    ids = set(models.REGISTRY[target].eos_token_ids) if target in models.REGISTRY else set()
    path = _local_dir(target)
    if path and os.path.exists(os.path.join(path, "generation_config.json")):
        eos = json.loads(Path(path, "generation_config.json").read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine_info(args: argparse.Namespace) -> dict:
    cpu = platform.processor() or "unknown"
    memory = None
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                   cpu)
        meminfo = Path("/proc/meminfo").read_text()
        memory = round(int(meminfo.split("MemTotal:")[1].split()[0]) / 2**20, 1)
    except (OSError, IndexError, ValueError):
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        commit = "unknown"
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": memory,
            "load_average_at_start": round(os.getloadavg()[0], 2),  # other work on the machine skews timings
            "platform": platform.platform(),
            "python": platform.python_version(), "torch": _version("torch"), "transformers": _version("transformers"),
            "ray": _version("ray"), "vllm": "not used", "dtype": args.dtype, "git_commit": commit}


def write_outputs(doc: dict, out: Path, docs: str | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    doc["plots"] = write_plots(doc, out)
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    (out / "results.md").write_text(report.markdown(doc))
    if docs:
        images = Path(docs) / "bench"
        images.mkdir(parents=True, exist_ok=True)
        write_plots(doc, images)
        (Path(docs) / "BENCHMARKS.md").write_text(report.markdown(doc, image_prefix="bench/"))
