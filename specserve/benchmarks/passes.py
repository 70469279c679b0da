"""Forward-pass time by row count, for torch-worker settings side by side.

    python -m specserve.benchmarks.passes --model qwen2.5-coder-1.5b-instruct --rows 1 2 5 9 \\
        --settings linear_layout=one_row linear_layout=both
    python -m specserve.benchmarks.passes --model qwen2.5-coder-0.5b-instruct --rows 1 5 \\
        --settings quantize=none quantize=int8
    python -m specserve.benchmarks.passes --rows 1 5 --settings greedy_screen=false greedy_screen=true

A pass of n rows is what a greedy verify of n-1 drafted tokens costs (a chain under the
request's last token, every row's greedy token read), over `--context` cached tokens of
HumanEval prompts (the draft: the text's next tokens); n=1 is a lone decode step. Each setting gets its own worker on a freshly loaded model, and the settings take turns,
A B .. A B, for `--passes` passes (one worker at a time: a float32 1.5B target with both
layouts holds 12 GB), so drift on a noisy machine lands on every setting alike. Prints the
median milliseconds per pass and the range over passes, per setting and row count.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time


BOOLEAN_SETTINGS = {"prepack", "greedy_screen"}


def parse_setting(text: str) -> dict[str, str]:
    """'linear_layout=both,quantize=int8' -> {'linear_layout': 'both', 'quantize': 'int8'}."""
    setting = {}
    for part in filter(None, text.split(",")):
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"a setting is key=value[,key=value], not {text!r}")
        setting[key] = value
    return setting


def pass_times(worker, rows: list[int], *, context: int, repeats: int, text: list[int] | None = None,
               seed: int = 0) -> dict[int, list[float]]:
    """Seconds of each of `repeats` passes of each row count, after one warm pass each. `text`:
    token ids to read the context and the drafts from (real text: hidden states of random ids
    are unlike a model's, which matters to the greedy screen); default random ids."""
    import torch

    from specserve.engine.torch_worker import ForwardItem
    from specserve.protocol import TokenTree

    vocab = worker.vocab_size
    need = context + repeats + max(rows) + 1
    if text is None or len(text) < need:
        gen = torch.Generator().manual_seed(seed)
        text = torch.randint(0, vocab, (need,), generator=gen).tolist()
    prompt = text[:context]
    worker.forward([ForwardItem("r", prompt)])
    times: dict[int, list[float]] = {}
    for n in rows:
        times[n] = []
        for i in range(repeats + 1):
            # a new last token each pass: the cached context is reused, the n rows are computed
            tail = text[context + i: context + i + n]
            start = time.perf_counter()
            [out] = worker.run([ForwardItem("r", prompt + tail[:1], TokenTree.chain(tail[1:]))])
            out.argmax()  # what a greedy verify reads
            if i:  # the first pass of each count warms it
                times[n].append(time.perf_counter() - start)
    return times


def code_text(model_ref: str, tokens: int) -> list[int]:
    """HumanEval prompts, one after another, as `model_ref`'s token ids (at least `tokens`)."""
    from specserve import models
    from specserve.benchmarks import workloads

    tokenizer = models.load_tokenizer(model_ref)
    ids: list[int] = []
    count = 16
    while len(ids) < tokens and count <= 164:
        ids = [t for prompt in workloads.load(["code"], count)[0].encode(tokenizer) for t in prompt]
        count *= 2
    return ids


def measure(model_ref: str, settings: list[dict[str, str]], rows: list[int], *, context: int, repeats: int,
            passes: int, dtype: str, progress=print) -> dict:
    from specserve import models
    from specserve.engine.torch_worker import TorchWorker
    from specserve.loading import set_torch_threads

    set_torch_threads()
    text = code_text(model_ref, context + repeats + max(rows) + 1)
    seconds = [{n: [] for n in rows} for _ in settings]
    for p in range(passes):
        for s, setting in enumerate(settings):
            model = models.load_causal_lm(model_ref, dtype=dtype)
            worker = TorchWorker(model, release_model_weights=True, **setting)
            for n, ts in pass_times(worker, rows, context=context, repeats=repeats, text=text).items():
                seconds[s][n] += ts
            progress(f"pass {p + 1}/{passes} {label(setting)}: "
                     + ", ".join(f"{n} rows {1e3 * statistics.median(seconds[s][n]):.0f} ms" for n in rows))
            del worker, model
            gc.collect()
    return {"model": model_ref, "dtype": models.resolve_dtype(dtype), "context": context, "rows": rows,
            "results": [{"setting": setting, "ms": {str(n): [round(1e3 * t, 2) for t in seconds[s][n]] for n in rows}}
                        for s, setting in enumerate(settings)]}


def label(setting: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in setting.items()) or "defaults"


def markdown(report: dict) -> str:
    rows = report["rows"]
    lines = ["| setting | " + " | ".join(f"{n} row{'s' if n > 1 else ''} (ms)" for n in rows) + " |",
             "|---|" + "---|" * len(rows)]
    for result in report["results"]:
        cells = []
        for n in rows:
            ms = result["ms"][str(n)]
            cells.append(f"{statistics.median(ms):.0f} ({min(ms):.0f}-{max(ms):.0f})")
        lines.append(f"| {label(result['setting'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--settings", nargs="+", type=parse_setting, default=[{}],
                        help="TorchWorker settings to compare, each key=value[,key=value] "
                             "(linear_layout=one_row|many_rows|both, quantize=none|int8, greedy_screen=true|false, "
                             "prepack=true|false)")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 5, 9])
    parser.add_argument("--context", type=int, default=300, help="cached tokens before the pass")
    parser.add_argument("--repeats", type=int, default=5, help="passes of each row count per turn")
    parser.add_argument("--passes", type=int, default=2, help="turns of every setting (A B .. A B)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json", help="also write the raw figures here")
    args = parser.parse_args(argv)
    if any(n < 1 for n in args.rows):
        parser.error("--rows must be positive")
    for setting in args.settings:
        for key in BOOLEAN_SETTINGS & setting.keys():
            setting[key] = setting[key].lower() in ("1", "true", "yes", "on")
    report = measure(args.model, args.settings, args.rows, context=args.context, repeats=args.repeats,
                     passes=args.passes, dtype=args.dtype)
    print(f"{report['model']} {report['dtype']}, context {report['context']}: median ms per pass (range)")
    print(markdown(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
