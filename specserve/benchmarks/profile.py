"""Where a decode step and a prefill go: matmuls, attention, output layer, the rest.

    python -m specserve.benchmarks.profile --target qwen2.5-coder-1.5b-instruct --context 256

Runs the torch engine under torch.profiler for a few decode steps (batch 1, and a batch) and
one prefill, and splits each pass's wall time into:

- ``matmuls``: the model's linear layers (projections and MLPs), eager or prepacked;
- ``output layer``: the vocabulary projection (a linear whose output is the vocabulary);
- ``attention``: scaled-dot-product attention and the KV gathers and writes around it;
- ``other``: everything else, including Python between kernels (wall time minus the above).

Only top-level kernels are counted, so a linear's own inner `addmm` is not counted twice.
Prints a markdown table and, with --json, the raw figures. With --docs DIR it writes the
"Where a pass goes" section of DIR/BENCHMARKS.md (this run, and --before, an earlier run's
JSON, for comparison); `specserve bench --docs` keeps that section when it rewrites the page.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from specserve.benchmarks.report import kept_sections

LINEAR_OPS = {"aten::linear", "aten::addmm", "aten::mm", "aten::matmul", "mkldnn::_linear_pointwise",
              "aten::bmm"}
ATTENTION_OPS = {"aten::scaled_dot_product_attention", "aten::index_select", "aten::index_copy_",
                 "aten::index_put_", "aten::stack"}
CATEGORIES = ("matmuls", "output layer", "attention", "other")


def _output_dim(event) -> int | None:
    """The output width of a linear-like event from its recorded input shapes."""
    shapes = [s for s in (event.input_shapes or []) if s]
    if event.name in ("aten::linear", "mkldnn::_linear_pointwise") and len(shapes) >= 2:
        return shapes[1][0] if event.name == "aten::linear" else None
    if event.name == "aten::addmm" and len(shapes) >= 3:
        return shapes[2][-1]
    if event.name in ("aten::mm", "aten::matmul") and len(shapes) >= 2:
        return shapes[1][-1]
    return None


def categorise(events, vocab_size: int, wall_us: float) -> dict[str, float]:
    """Split `wall_us` over CATEGORIES from profiler events (top-level kernels only)."""
    totals = dict.fromkeys(CATEGORIES, 0.0)
    counted = set()
    for event in sorted(events, key=lambda e: e.time_range.start):
        parent, nested = event.cpu_parent, False
        while parent is not None:
            if id(parent) in counted:
                nested = True
                break
            parent = parent.cpu_parent
        if nested:
            continue
        name = event.name
        if name == "specserve::output_layer" or (name in LINEAR_OPS and _output_dim(event) == vocab_size):
            category = "output layer"
        elif name == "specserve::attention" or name in ATTENTION_OPS:
            category = "attention"
        elif name in LINEAR_OPS:
            category = "matmuls"
        else:
            continue
        counted.add(id(event))
        totals[category] += event.cpu_time_total
    totals["other"] = max(0.0, wall_us - sum(totals.values()))
    return totals


def profile_pass(run, vocab_size: int, repeats: int) -> dict:
    """Profile `run()` (one forward pass) `repeats` times; mean milliseconds per category."""
    from torch.profiler import ProfilerActivity, profile

    run()  # warm
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        wall_us = (time.perf_counter() - start) * 1e6
    totals = categorise(prof.events(), vocab_size, wall_us)
    return {"ms": round(wall_us / repeats / 1e3, 2),
            **{k: round(v / repeats / 1e3, 2) for k, v in totals.items()}}


def run_profile(target: str, *, context: int, prefill: int, batch: int, repeats: int, dtype: str) -> dict:
    import torch

    from specserve import models
    from specserve.engine.torch_worker import ForwardItem, TorchWorker
    from specserve.loading import set_torch_threads

    set_torch_threads()
    model = models.load_causal_lm(target, dtype=dtype)
    worker = TorchWorker(model)
    vocab = worker.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (context,), generator=gen).tolist() for _ in range(batch)]
    for i, ids in enumerate(prompts):  # cache every request's context
        worker.forward([ForwardItem(f"r{i}", ids)])
    step = [0]

    def decode(n: int):
        def run():
            step[0] += 1
            worker.forward([ForwardItem(f"r{i}", prompts[i] + [step[0] % vocab]) for i in range(n)])
        return run

    prefill_ids = torch.randint(0, vocab, (prefill,), generator=gen).tolist()

    def prefill_pass():
        worker.release("prefill")
        worker.forward([ForwardItem("prefill", prefill_ids)])

    rows = {"decode, batch 1": profile_pass(decode(1), vocab, repeats)}
    if batch > 1:
        rows[f"decode, batch {batch}"] = profile_pass(decode(batch), vocab, repeats)
    rows[f"prefill {prefill} tokens"] = profile_pass(prefill_pass, vocab, max(1, repeats // 4))
    return {"target": target, "dtype": models.resolve_dtype(dtype), "context": context, "threads": torch.get_num_threads(),
            "passes": rows}


def markdown(report: dict) -> str:
    head = "| pass | ms | " + " | ".join(CATEGORIES) + " |"
    lines = [head, "|" + "---|" * (len(CATEGORIES) + 2)]
    for name, row in report["passes"].items():
        cells = [f"{row[c]:.1f} ({100 * row[c] / row['ms']:.0f}%)" for c in CATEGORIES]
        lines.append(f"| {name} | {row['ms']:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


BEGIN, END = "<!-- profile: written by specserve.benchmarks.profile -->", "<!-- /profile -->"


def marked_section(page: str) -> str:
    """The profile section of a BENCHMARKS.md page, markers included ('' when absent)."""
    return next((section for section in kept_sections(page) if section.startswith(BEGIN)), "")


def docs_section(after: dict, before: dict | None, command: str) -> str:
    parts = [BEGIN, "", "## Where a pass goes (torch engine profile)", "",
             f"`{command}`: {after['target']}, {after['dtype']}, {after['threads']} threads, "
             f"{after['context']} cached tokens per request. Milliseconds per pass and share of the pass.", ""]
    if before is not None:
        parts += [f"Before ({before.get('label', 'earlier engine')}):", "", markdown(before), "",
                  f"After ({after.get('label', 'this engine')}):", ""]
    parts += [markdown(after), "", END]
    return "\n".join(parts)


def write_docs(docs: str, section: str) -> None:
    from pathlib import Path

    page = Path(docs) / "BENCHMARKS.md"
    text = page.read_text() if page.exists() else "# specserve benchmarks\n"
    old = marked_section(text)
    page.write_text(text.replace(old, section) if old else text.rstrip("\n") + "\n\n" + section + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--context", type=int, default=256, help="cached tokens per request before decoding")
    parser.add_argument("--prefill", type=int, default=256, help="prompt length of the prefill pass")
    parser.add_argument("--batch", type=int, default=8, help="batch size of the batched decode row")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json", help="also write the raw figures here")
    parser.add_argument("--label", help="what this run measures, e.g. a commit (shown in --docs)")
    parser.add_argument("--docs", help="write the profile section of DOCS/BENCHMARKS.md")
    parser.add_argument("--before", help="an earlier run's --json, shown before this one in --docs")
    args = parser.parse_args(argv)
    report = run_profile(args.target, context=args.context, prefill=args.prefill, batch=args.batch,
                         repeats=args.repeats, dtype=args.dtype)
    if args.label:
        report["label"] = args.label
    print(f"{report['target']} {report['dtype']}, {report['threads']} threads, context {report['context']}")
    print(markdown(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.docs:
        before = None
        if args.before:
            with open(args.before) as f:
                before = json.load(f)
        command = "python -m specserve.benchmarks.profile " + " ".join(argv if argv is not None else sys.argv[1:])
        write_docs(args.docs, docs_section(report, before, command))


if __name__ == "__main__":
    main()
