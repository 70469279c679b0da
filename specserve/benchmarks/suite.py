"""`specserve bench`: specserve against its peers, side by side, with a table and plots.

    specserve bench --quick                 # smoke run on the default pair, a few minutes
    specserve bench --preset vllm           # batch 1: specserve none / draft k=4 against vLLM's best
    specserve bench --preset batch          # library throughput at batch 1, 4, 8 and 16
    specserve bench --docs docs             # the full run, also written to docs/BENCHMARKS.md

Runs every system on the same prompts (HumanEval for code, MT-Bench for chat), the same models and
the same stop ids, greedy, in one run on this machine:
- library mode: specserve's methods, transformers (target only, assisted generation, prompt
  lookup) and vLLM's CPU build (none, draft_model, ngram) in its own venv, at each --batch-sizes,
  the systems taking turns in --repeats passes (A B .. B A); vLLM in the fastest of the engine
  settings tried (--vllm-settings), named in the report;
- service mode: specserve through `serve run` and HTTP, at each concurrency.
Writes results.json, results.md and PNG plots to --out, after each pass too (marked partial until
the run ends). A system that cannot run says why. --preset picks systems, modes and sizes for a
question (the older benchmark scripts are these presets).
"""

from __future__ import annotations

import argparse
import datetime as dt
import fnmatch
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

from specserve.benchmarks import library, presets, report, service, systems, vllm_runner, workloads
from specserve.benchmarks.plots import write_plots
from specserve.models import resolve_dtype
from specserve.protocol import SpecserveError

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
# Service mode uses shorter answers: a throughput or latency point needs steady streams, not long
# ones, and it is the longest phase.
FULL = {"prompts": 8, "max_tokens": 128, "concurrency": [1, 2, 4, 8], "service_requests": 4, "service_max_tokens": 64,
        "service_repeats": 1, "service_turns": "waves", "batch_sizes": [1], "repeats": 2, "vllm_settings": "auto", "modes": ["library", "service"],
        "workloads": list(workloads.WORKLOADS)}
# --quick's sizes win over a preset's; vLLM starts eager only (a compiled start alone takes ~2.5 minutes)
QUICK = {"prompts": 1, "max_tokens": 8, "concurrency": [1, 2], "service_requests": 2, "service_max_tokens": 8,
         "repeats": 1, "vllm_settings": "eager"}  # and service mode on the first workload only
FULL_COMMAND = "specserve bench --out bench-results/full --docs docs"
VLLM_SETTINGS = {"auto": list(vllm_runner.SETTINGS), **{name: [name] for name in vllm_runner.SETTINGS}}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=list(presets.PRESETS), help=presets.describe())
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 prompt per workload, 8 tokens, one pass, vLLM eager only, service mode on "
                        "the first workload at concurrency 1 2")
    p.add_argument("--target", default=DEFAULT_TARGET, help="registry name or local directory")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model; 'none' for no draft")
    p.add_argument("--heads", nargs="+", default=["default"], metavar="DIR",
                   help="heads for the target's medusa, hydra and redrafter rows, one directory per method (each "
                        "records its method); default: $SPECSERVE_HOME/heads/<target>-<method> for every method "
                        "trained there (`make heads`, `specserve train-heads`); 'none' to skip them")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                   help="every system's dtype (default auto: bfloat16 on CPUs with native bf16 matrix products, "
                        "else float32; the report names the one used)")
    p.add_argument("--draft-quantize", choices=["int8", "none"],
                   help="the draft's linears (specserve's draft rows, library and service): int8 (default on CPU; "
                        "the output stays the target's, see the quantize pool option) or none (the draft's dtype)")
    p.add_argument("--workloads", nargs="+", choices=workloads.WORKLOADS, help="default: code chat")
    p.add_argument("--prompts", type=int, help=f"prompts per workload (default {FULL['prompts']})")
    p.add_argument("--max-tokens", type=int, help=f"new tokens per prompt (default {FULL['max_tokens']})")
    p.add_argument("--seed", type=int, default=0, help="picks the prompt subsets (default 0)")
    p.add_argument("--modes", nargs="+", choices=["library", "service"], help="default: library service")
    p.add_argument("--systems", nargs="+", metavar="PATTERN",
                   help="only systems whose name matches one of these shell patterns, e.g. 'specserve*' "
                        "(specserve none always runs: it is the baseline)")
    p.add_argument("--batch-sizes", type=int, nargs="+",
                   help="library mode: prompts per generate() call; at batch b each workload's first "
                        "b*ceil(prompts/b) prompts run in full batches (default 1)")
    p.add_argument("--repeats", type=int,
                   help=f"library mode: passes over the systems, in alternating order A B .. B A (default "
                        f"{FULL['repeats']}, 1 with --quick)")
    p.add_argument("--concurrency", type=int, nargs="+",
                   help=f"service mode streams (default {' '.join(map(str, FULL['concurrency']))})")
    p.add_argument("--service-requests", type=int,
                   help=f"service mode: each workload sends max(N, c) requests at concurrency c "
                        f"(default N = {FULL['service_requests']}, at most --prompts)")
    p.add_argument("--service-max-tokens", type=int,
                   help=f"service mode: new tokens per request (default {FULL['service_max_tokens']}, at most "
                        "--max-tokens)")
    p.add_argument("--service-repeats", type=int,
                   help=f"service mode: passes over the systems at each concurrency and workload, in alternating "
                        f"order A B .. B A, summed (default {FULL['service_repeats']})")
    p.add_argument("--service-turns", choices=service.TURN_MODES,
                   help="service mode: how the systems take turns. waves (default): a wave of as many requests as "
                        "streams each, rotated from wave to wave; streams: a whole pass each, the streams sending "
                        "every request of the level in a closed loop, which also reports the steady state (tok/s "
                        "while every stream was busy; give --service-requests well above the streams)")
    p.add_argument("--manifest", help="service mode: serve this config instead of a generated one for the pair")
    p.add_argument("--url", help="service mode: measure the server already running here (no `serve run`)")
    p.add_argument("--port", type=int, default=8311, help="port of the generated service config (default 8311)")
    p.add_argument("--vllm-python", help="python of the vLLM environment (default .venv-vllm/bin/python)")
    p.add_argument("--vllm-settings", choices=list(VLLM_SETTINGS),
                   help="vLLM engine settings: auto tries eager in-process and compiled multi-process in the first "
                        "pass and keeps the fastest per batch size (default; eager with --quick)")
    p.add_argument("--vllm-fast-start", dest="vllm_settings", action="store_const", const="eager",
                   help=argparse.SUPPRESS)  # older spelling of --vllm-settings eager
    p.add_argument("--threads", type=int, help="torch threads in library mode (default: all cores)")
    p.add_argument("--out", help="output directory (default bench-results/<time>)")
    p.add_argument("--docs", help="also write DOCS/BENCHMARKS.md and DOCS/bench/*.png")
    p.add_argument("--render", metavar="RESULTS_JSON", nargs="+",
                   help="only render a saved results.json again (to --out/--docs); several: runs of one setup and "
                        "the same measured code, each with its own workloads or levels (a long sweep run in "
                        "pieces), joined into one page (give --out)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def resolve_defaults(args: argparse.Namespace) -> None:
    """Fill what the command line left out: --quick's sizes, then the preset's, then the full run's."""
    preset = presets.PRESETS.get(args.preset or "", {})
    layers = [QUICK, preset, FULL] if args.quick else [preset, FULL]
    for key in ("prompts", "max_tokens", "concurrency", "batch_sizes", "repeats", "service_repeats", "service_turns",
                "vllm_settings", "modes",
                "workloads", "systems", "manifest"):
        if getattr(args, key) is None:
            setattr(args, key, next((layer[key] for layer in layers if key in layer), None))
    if args.draft_quantize is None:  # the bench runs on CPU: the draft's fastest exact setting there
        import torch

        from specserve.engine.torch_worker import can_quantize

        args.draft_quantize = "int8" if can_quantize(torch.device("cpu")) else "none"
    # service mode never asks for more requests or longer answers than library mode
    for key, cap in (("service_requests", args.prompts), ("service_max_tokens", args.max_tokens)):
        if getattr(args, key) is None:
            setattr(args, key, min(next(layer[key] for layer in layers if key in layer), cap))


def check_args(args: argparse.Namespace) -> None:
    for key in ("prompts", "max_tokens", "service_requests", "service_max_tokens", "repeats", "service_repeats"):
        if getattr(args, key) < 1:
            build_parser().error(f"--{key.replace('_', '-')} must be at least 1")
    if min(args.concurrency) < 1 or min(args.batch_sizes) < 1:
        build_parser().error("--concurrency and --batch-sizes must be at least 1")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.render:
        if len(args.render) > 1 and not args.out:
            raise SpecserveError("--render with several results.json files: give --out for the joined page")
        try:
            doc = report.join_runs([json.loads(Path(path).read_text()) for path in args.render],
                                   same_code=same_measured_code)
        except report.JoinError as exc:
            raise SpecserveError(f"--render: these runs cannot be joined: {exc}") from None
        write_outputs(doc, Path(args.out) if args.out else Path(args.render[0]).parent, args.docs)
        return 0
    resolve_defaults(args)
    check_args(args)
    args.dtype = resolve_dtype(args.dtype)  # one concrete dtype for every system, vLLM's included
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
    """Runs every phase; after each pass the results so far are written to --out, so an interrupted
    run keeps what it measured (the document says ``"partial": true`` until the end)."""
    from tqdm import tqdm

    from specserve import models

    started = dt.datetime.now(dt.timezone.utc)
    t0 = time.monotonic()
    preset = presets.PRESETS.get(args.preset or "", {})
    variants = preset.get("variants")
    lib_systems = selected(systems.all_systems(variants, preset.get("vllm_ks")), args.systems) if "library" in args.modes else []
    svc_systems = selected(systems.specserve_systems(variants), args.systems) if "service" in args.modes else []
    lib_workloads = workloads.load(args.workloads, library.prompts_needed(args.prompts, args.batch_sizes), args.seed)
    svc_prompts = max([args.service_requests, *args.concurrency])
    svc_names = args.workloads[:1] if args.quick else args.workloads
    svc_workloads = workloads.load(svc_names, svc_prompts, args.seed) if svc_systems else []
    tokenizer = models.load_tokenizer(args.target)
    stop_ids = stop_token_ids(args.target, tokenizer)
    cells = library.make_cells([(w, w.encode(tokenizer)) for w in lib_workloads], args.batch_sizes, args.prompts)
    svc_encoded = [(w, w.encode(tokenizer)) for w in svc_workloads]
    settings = VLLM_SETTINGS[args.vllm_settings]
    calls = sum(len(c.calls) for c in cells)
    n_vllm = sum(s.engine == "vllm" for s in lib_systems)
    total = (len(lib_systems) * args.repeats + n_vllm * (len(settings) - 1)) * calls \
        + service.turn_count(svc_systems, svc_encoded, concurrency=args.concurrency,
                             requests=args.service_requests, repeats=args.service_repeats,
                             turns=args.service_turns)
    bar = tqdm(total=total, disable=args.no_progress, file=sys.stderr, unit="call", dynamic_ncols=True)
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
            "target": args.target, "draft": args.draft, "dtype": args.dtype, "draft_quantize": args.draft_quantize,
            "max_tokens": args.max_tokens,
            "k": systems.K, "seed": args.seed, "greedy": True, "quick": args.quick, "preset": args.preset,
            "modes": args.modes, "stop_token_ids": stop_ids,
            "batch_sizes": args.batch_sizes if lib_systems else [], "repeats": args.repeats,
            "prompts": args.prompts, "vllm_settings_tried": settings if n_vllm else [],
            "vllm_kv_cache_gib": library.VLLM_KV_CACHE_GIB if n_vllm else None,
            "concurrency": args.concurrency if svc_systems else [],
            "service_requests": args.service_requests, "service_max_tokens": args.service_max_tokens,
            "service_repeats": args.service_repeats, "service_turns": service.TURNS[args.service_turns],
            "manifest": args.url or args.manifest,
            "workloads": [_describe(w) for w in lib_workloads] if lib_systems else [],
            "service_workloads": [_describe(w) for w in svc_workloads],
        },
        "library": [],
        "vllm_settings": [],
        "memory": {},
        "service": [],
        "notes": notes,
    }

    def save_partial(**fields) -> None:
        doc.update(fields, duration_s=time.monotonic() - t0)
        write_outputs(doc, out, None)

    if lib_systems:
        _library_mode(args, lib_systems, cells, stop_ids, doc, out, bar, save_partial)
    doc["service"] = _service_mode(args, svc_systems, svc_encoded, out, bar, doc["phases"], save_partial)
    bar.close()
    machine["load_average_at_end"] = round(os.getloadavg()[0], 2)
    doc.update(partial=False, duration_s=time.monotonic() - t0)
    return doc


def _library_mode(args, lib_systems, cells, stop_ids, doc, out, bar, save_partial) -> None:
    """The interleaved passes, then (with a preset's ``derive``) the derived systems' phase."""
    started = time.monotonic()
    in_process = _load_in_process(args, lib_systems, stop_ids, doc, bar)
    vllm = _vllm(args, lib_systems, cells, stop_ids, doc["machine"], out)
    if vllm is not None and not os.path.exists(library.TCMALLOC):
        note = (f"vLLM ran without tcmalloc ({library.TCMALLOC} is missing: Debian's libtcmalloc-minimal4, "
                "which `make vllm-env` installs where it can): its CPU guide asks for it, and without it vLLM "
                "decoded 0-8% slower per prompt on a 2-core EPYC, so its rows may understate it")
        print(f"warning: {note}", file=sys.stderr, flush=True)
        doc["notes"].append(note)
    done: list[systems.LibraryRun] = []

    def save(runs: list[systems.LibraryRun]) -> None:
        systems.compare(done + runs)
        save_partial(library=[r.as_dict() for r in done + runs], vllm_settings=vllm.trials if vllm else [])

    done += library.run_library(lib_systems, cells, repeats=args.repeats, in_process=in_process, vllm=vllm,
                                bar=bar, save=save)
    derive = presets.PRESETS.get(args.preset or "", {}).get("derive")
    if derive and isinstance(in_process, library.InProcess):
        done += _derived_phase(args, derive, done, lib_systems, cells, in_process, doc, bar, save)
    save([])
    doc["phases"]["library_s"] = time.monotonic() - started
    if isinstance(in_process, library.InProcess):
        in_process.release()  # free the weights before the served pools load theirs


def _load_in_process(args, lib_systems, stop_ids, doc, bar) -> library.InProcess | str | None:
    """The pair for specserve and transformers, with a decoder that stops on ``stop_ids``; or why
    it could not load (every in-process system then reports it)."""
    if all(s.engine == "vllm" for s in lib_systems):
        return None
    from specserve.decoder import SpeculativeDecoder
    from specserve.loading import load_pair, set_torch_threads

    set_torch_threads(args.threads)
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # generate()'s deprecation chatter would break the progress bar
    doc["machine"]["torch_threads"] = torch.get_num_threads()
    heads = _heads(args)

    def load():
        pair = load_pair(args.target, args.draft, dtype=args.dtype,
                         draft_quantize=args.draft_quantize,
                         release_model_weights=not any(s.engine == "transformers" for s in lib_systems))
        pair.add_heads(heads.values())
        return pair, SpeculativeDecoder(pair.verifier(), pair.proposer(), tokenizer=pair.tokenizer,
                                        eos_token_ids=stop_ids, method="none", max_context=pair.max_context)

    bar.set_description("loading models")
    in_process = library.InProcess(load, stop_ids, args.max_tokens)
    try:
        in_process.ensure_loaded()
    except Exception as exc:
        return f"could not load the models: {type(exc).__name__}: {exc}".splitlines()[0]
    pair = in_process.pair
    if set(pair.eos_token_ids) != set(stop_ids):
        doc["notes"].append(f"specserve's loader alone would stop at {sorted(pair.eos_token_ids)}; every system "
                            f"here stops at {stop_ids}.")
    doc["memory"] = memory_per_token(pair, args.dtype)
    if pair.heads_by_method:
        note = _trained_on_note(doc["setup"]["workloads"])
        if note:
            doc["notes"].append(note)
    return in_process


def _vllm(args, lib_systems, cells, stop_ids, machine, out) -> library.Vllm | None:
    if not any(s.engine == "vllm" for s in lib_systems):
        return None
    python = library.vllm_python(args.vllm_python)
    machine["vllm"] = (library.vllm_version(python) if python else None) or "not installed"
    longest = max(len(ids) for cell in cells for _, batch in cell.calls for ids in batch)
    medusa = _heads(args).get("medusa") if any(systems.MEDUSA_HEADS in s.options.values() for s in lib_systems) \
        else None
    if medusa is not None:  # the same heads as specserve's medusa rows, in the layout vLLM loads
        from specserve.heads.medusa import exported_for_vllm

        print(f"vLLM's Medusa rows: the heads of {medusa} in vLLM's layout ...", flush=True)
        medusa = str(exported_for_vllm(medusa, args.target))
    return library.Vllm(python=python, target_dir=_local_dir(args.target), draft_dir=_local_dir(args.draft),
                        dtype=args.dtype, max_tokens=args.max_tokens, stop_ids=stop_ids,
                        max_model_len=max(512, longest + args.max_tokens + 64),
                        settings=VLLM_SETTINGS[args.vllm_settings], log_path=out / "vllm.log", medusa_dir=medusa)


def _derived_phase(args, derive, done, lib_systems, cells, in_process, doc, bar, save) -> list[systems.LibraryRun]:
    """Static trees from the per-rank acceptance that ``derive["from"]`` measured (smallest batch),
    one per budget, run after the main passes with a target-only baseline of their own."""
    from specserve.protocol import TreeSpec
    from specserve.trees import add_counts, rank_acceptance, shape_from_acceptance

    batch = min(c.batch for c in cells)
    source = next((s for s in lib_systems if s.name == derive["from"]), None)
    runs = [r for r in done if r.system == derive["from"] and r.batch == batch and r.status == systems.OK]
    if source is None or not runs:
        doc["notes"].append(f"No static trees derived: {derive['from']} did not run.")
        return []
    accepted: list[int] = []
    reached: list[int] = []
    for run in runs:
        add_counts(accepted, run.num_accepted_tokens_per_rank)
        add_counts(reached, run.num_reached_tokens_per_rank)
    rates = rank_acceptance(accepted, reached)
    depth = (source.options.get("tree") or {}).get("depth", TreeSpec().depth)
    options = {key: value for key, value in source.options.items() if key != "tree"}
    derived = {}
    for budget in derive["budgets"]:
        shape = shape_from_acceptance(rates, budget=budget, depth=depth)
        if shape and shape not in derived:
            derived[shape] = systems.specserve_system(source.method, {**options, "tree": {"shape": [list(p) for p in shape]}},
                                                      name=f"specserve {source.method} static from acceptance ({len(shape)})")
    doc["derived"] = {"from": derive["from"], "rank_acceptance": [round(r, 4) for r in rates],
                      "shapes": {s.name: s.options["tree"]["shape"] for s in derived.values()}}
    if not derived:
        return []
    phase = [systems.specserve_system("none", {}, name="specserve none (again)"), *derived.values()]
    phase_cells = [c for c in cells if c.batch == batch]
    bar.total += len(phase) * args.repeats * sum(len(c.calls) for c in phase_cells)
    bar.refresh()
    return library.run_library(phase, phase_cells, repeats=args.repeats, in_process=in_process, vllm=None, bar=bar,
                               save=save, phase=1)


def memory_per_token(pair, dtype: str) -> dict:
    """KV cache bytes per cached token: what specserve's worker reports, if it does
    (``TorchWorker.kv_bytes_per_token``), and the floor, K and V of every layer in ``dtype`` (what a
    paged cache such as vLLM's holds per token)."""
    from specserve.models import parse_dtype

    itemsize = parse_dtype(dtype).itemsize
    out = {}
    for role, worker in (("target", pair.target), ("draft", pair.draft)):
        if worker is None:
            continue
        measured = getattr(worker, "kv_bytes_per_token", None)
        try:
            measured = measured() if callable(measured) else measured
        except Exception as exc:  # a bonus figure: never fail a run over it
            measured = f"{type(exc).__name__}: {exc}"
        out[role] = {"specserve_kv_bytes_per_token": measured,
                     "k_and_v_bytes_per_token": kv_floor(worker.model.config, itemsize)}
    return out


def kv_floor(config, itemsize: int) -> int | None:
    """2 (K and V) x layers x KV heads x head size x bytes: Qwen2.5-1.5B in bf16 holds 28 KiB a token."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return 2 * config.num_hidden_layers * kv_heads * head_dim * itemsize
    except AttributeError:
        return None


def _trained_on_note(described: list[dict]) -> str | None:
    """Heads trained on a benchmark prompt would flatter their acceptance: say so."""
    from specserve.heads.data import held_out

    excluded = held_out()
    seen = [p for w in described for p in w["prompts"]
            if (p.startswith("HumanEval/") and p not in excluded.humaneval)
            or (p.startswith("mtbench/") and int(p.split("/")[1]) not in excluded.mtbench)]
    return (f"Medusa heads may have trained on {len(seen)} of these prompts ({', '.join(seen[:5])} ...): their "
            "acceptance may look better than it is.") if seen else None


def _service_mode(args, svc_systems, encoded, out, bar, phases, save_partial) -> list[dict]:
    if not svc_systems:
        return []
    started = time.monotonic()
    manifest = args.manifest
    if manifest is None and not args.url:
        import yaml

        manifest = str(out / "serve-config.yaml")
        # registry names as they are: the pools resolve them, with the registry's EOS ids
        config = service.serve_config(args.target, args.draft, args.dtype, args.port,
                                      heads=_heads(args).get("medusa"), draft_quantize=args.draft_quantize)
        Path(manifest).write_text(yaml.safe_dump(config, sort_keys=False))
    url = args.url or f"http://127.0.0.1:{service.manifest_port(manifest)}"
    runs = service.run_service(svc_systems, encoded, manifest=None if args.url else manifest, url=url.rstrip("/"),
                               max_tokens=args.service_max_tokens, requests=args.service_requests,
                               repeats=args.service_repeats, turns=args.service_turns,
                               concurrency=args.concurrency, log_path=out / "serve.log", bar=bar,
                               level_done=lambda finished: save_partial(service=_compared(finished)))
    phases["service_s"] = time.monotonic() - started
    return _compared(runs)


# What a run does not measure: the harness that drives it, the docs and the tests.
NOT_MEASURED = (":(exclude)specserve/benchmarks", ":(exclude)docs", ":(exclude)tests", ":(exclude)*.md")


def same_measured_code(commit_a: str, commit_b: str) -> bool:
    """Whether git finds no change between the commits outside `NOT_MEASURED` (false where it
    cannot tell: not a checkout, or a commit it does not have)."""
    root = Path(__file__).resolve().parents[2]
    try:
        diff = subprocess.run(["git", "-C", str(root), "diff", "--quiet", commit_a, commit_b, "--", ".",
                               *NOT_MEASURED], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return diff.returncode == 0


def _compared(runs: list) -> list[dict]:
    """Speedups against the same level's target-only run, as the document's dicts."""
    systems.compare_service(runs)
    return [r.as_dict() for r in runs]


def _describe(workload: workloads.Workload) -> dict:
    return {"name": workload.name, "source": workload.source, "prompts": [p.id for p in workload.prompts]}


def _heads(args: argparse.Namespace) -> dict[str, str]:
    """Method -> heads directory for the head rows (medusa, hydra, redrafter); a method with
    none reports "cannot run" with the command that trains them. A directory named that holds
    no heads is refused."""
    from specserve.heads import HEAD_METHODS, find_heads, heads_method

    names = [args.heads] if isinstance(args.heads, str) else list(args.heads)
    if names in ([], ["none"], [""]):
        return {}
    if names == ["default"]:
        found = {method: find_heads(args.target, "default", method) for method in HEAD_METHODS}
        return {method: str(d) for method, d in found.items() if d is not None}
    out = {}
    for name in names:
        directory = find_heads(args.target, name)
        if directory is None:
            raise SpecserveError(f"--heads {name}: no heads there (no config.json)")
        out[heads_method(directory)] = str(directory)
    return out


def _local_dir(ref: str | None) -> str | None:
    from specserve import models

    if ref is None:
        return None
    try:
        path = models.resolve(ref, pull_missing=False)  # the tokenizer's load pulled the target already
    except models.ModelError:
        return None
    return path if os.path.isdir(path) else None


def stop_token_ids(target: str, tokenizer) -> list[int]:
    """The ids every system stops on: the registry's EOS ids for the target, those its
    generation_config.json lists, and the tokenizer's EOS id. specserve's decoder, transformers'
    ``generate(eos_token_id=...)`` and vLLM's ``SamplingParams(stop_token_ids=...)`` all get this
    list (vLLM also stops on the config's and tokenizer's own, which it holds)."""
    from specserve import models

    ids = set(models.REGISTRY[target].eos_token_ids) if target in models.REGISTRY else set()
    path = _local_dir(target)
    if path and os.path.exists(os.path.join(path, "generation_config.json")):
        eos = json.loads(Path(path, "generation_config.json").read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


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
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": memory,
            "load_average_at_start": round(os.getloadavg()[0], 2),  # other work on the machine skews timings
            "platform": platform.platform(),
            "python": platform.python_version(), "torch": _version("torch"), "transformers": _version("transformers"),
            "ray": _version("ray"), "vllm": "not used", "dtype": args.dtype, "git_commit": git_commit()}


def git_commit(cwd: str | Path | None = None) -> str:
    """The checkout's short commit, with "+modified" where tracked files under specserve/
    differ from it: a run on uncommitted code must not pass for the commit's own."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, cwd=cwd).stdout.strip()
    try:
        commit = git("rev-parse", "--short", "HEAD")
        if not commit:
            return "unknown"
        return commit + ("+modified" if git("status", "--porcelain", "--untracked-files=no", "--", "specserve") else "")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def write_outputs(doc: dict, out: Path, docs: str | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    doc["plots"] = write_plots(doc, out)
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    (out / "results.md").write_text(report.markdown(doc))
    if docs:
        images = Path(docs) / "bench"
        images.mkdir(parents=True, exist_ok=True)
        write_plots(doc, images)
        page = Path(docs) / "BENCHMARKS.md"
        kept = report.kept_sections(page.read_text()) if page.exists() else []
        page.write_text(report.markdown(doc, image_prefix="bench/", runs_index="bench/README.md")
                        + "".join(f"\n{k}\n" for k in kept))
