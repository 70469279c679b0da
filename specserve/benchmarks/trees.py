"""Tree speculation benchmark: draft chains against draft trees, in one process, same run.

    python -m specserve.benchmarks.trees --prompts 8 --max-tokens 128 --budgets 8 16 32

Runs target-only decoding, the `draft` chain (k=4, the default early stop) and dynamic trees
of each node budget on the same HumanEval prompts, batch 1, greedy. Then it derives a static
tree from the per-rank acceptance the largest dynamic tree measured
(specserve.trees.shape_from_acceptance) and runs that too. For each system it prints
tokens/s, the speedup over target-only, the mean accepted length (tokens per target step,
bonus included) and its ratio to the chain's, the draft nodes verified and the draft forward
passes per round, and how many outputs equal target-only's token for token.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import asdict

from specserve.benchmarks.engine import add_pair_arguments, load_for_benchmark


def run(decoder, prompt_ids, max_tokens: int, method: str, k: int, tree) -> dict:
    """Each prompt alone (batch 1): seconds, outputs and the merged speculation statistics."""
    import time

    from specserve.protocol import SamplingParams
    from specserve.request_state import SpecStats

    stats, outputs, seconds = SpecStats(), [], 0.0
    for ids in prompt_ids:
        start = time.perf_counter()
        [out] = decoder.generate([ids], SamplingParams(max_tokens=max_tokens), method=method, k=k, tree=tree)
        seconds += time.perf_counter() - start
        stats.merge(out.stats)
        outputs.append(out.token_ids)
    return {"seconds": seconds, "outputs": outputs, "stats": stats}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_arguments(parser)
    parser.add_argument("-k", "--k", type=int, default=4, help="the chain's draft length")
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32], help="tree node budgets")
    parser.add_argument("--depth", type=int, default=None, help="tree depth (default: TreeSpec's)")
    parser.add_argument("--width", type=int, default=None, help="tree width (default: TreeSpec's)")
    parser.add_argument("--min-score", type=float, default=None, help="tree min_score (default: TreeSpec's)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)

    import torch

    from specserve.protocol import TreeSpec
    from specserve.request_state import SpecStats
    from specserve.trees import rank_acceptance, shape_from_acceptance

    pair, decoder, prompt_ids = load_for_benchmark(args)
    tuning = {name: value for name, value in (("depth", args.depth), ("width", args.width),
                                              ("min_score", args.min_score)) if value is not None}

    header = (f"{'system':44} {'tok/s':>6} {'speedup':>8} {'acc.len':>8} {'vs chain':>9} "
              f"{'nodes/rnd':>10} {'draft fwd/rnd':>14} {'same output':>12}")
    print(header + "\n" + "-" * len(header), flush=True)
    rows: list[dict] = []

    def measure(name: str, method: str, tree: TreeSpec | None = None) -> SpecStats:
        draft_passes = pair.draft.forward_passes
        result = run(decoder, prompt_ids, args.max_tokens, method, args.k, tree)
        stats: SpecStats = result["stats"]
        baseline = rows[0] if rows else None
        chain = rows[1] if len(rows) > 1 else None
        row = {"name": name, "method": method, "tree": None if tree is None else asdict(tree),
               "seconds": result["seconds"], "outputs": result["outputs"],
               "tokens_per_second": stats.generated_tokens / result["seconds"],
               "accepted_length": stats.mean_accepted_length,
               "nodes_per_round": stats.num_draft_tokens / stats.target_steps,
               "draft_forwards_per_round": (pair.draft.forward_passes - draft_passes) / stats.target_steps,
               "stats": stats.as_dict()}
        row["speedup"] = row["tokens_per_second"] / (baseline or row)["tokens_per_second"]
        row["accepted_length_vs_chain"] = row["accepted_length"] / chain["accepted_length"] if chain else None
        row["matches"] = sum(a == b for a, b in zip(row["outputs"], (baseline or row)["outputs"]))
        rows.append(row)
        vs_chain = f"{row['accepted_length_vs_chain']:.2f}x" if chain else "-"
        print(f"{name:44} {row['tokens_per_second']:6.2f} {row['speedup']:7.2f}x {row['accepted_length']:8.2f} "
              f"{vs_chain:>9} {row['nodes_per_round']:10.1f} {row['draft_forwards_per_round']:14.1f} "
              f"{row['matches']:>6}/{len(prompt_ids)}", flush=True)
        return stats

    measure("specserve none (target only)", "none")
    measure(f"specserve draft, chain k={args.k}", "draft")
    largest = None
    for budget in args.budgets:
        spec = TreeSpec(budget=budget, **tuning)
        largest = measure(f"specserve tree, dynamic budget {budget}", "tree", spec)
    if largest is not None:
        rates = rank_acceptance(largest.num_accepted_tokens_per_rank, largest.num_reached_tokens_per_rank)
        budget = sorted(args.budgets)[len(args.budgets) // 2]
        shape = shape_from_acceptance(rates, budget=budget, depth=(args.depth or TreeSpec.depth))
        print(f"# measured per-rank acceptance {[round(r, 3) for r in rates]} -> static shape {[list(p) for p in shape]}",
              flush=True)
        if shape:
            measure(f"specserve tree, static from acceptance ({len(shape)})", "tree", TreeSpec(shape=shape))
    if args.json:
        with open(args.json, "w") as f:
            machine = {"platform": platform.platform(), "python": sys.version.split()[0],
                       "torch": torch.__version__, "threads": torch.get_num_threads()}
            json.dump({"machine": machine, "args": vars(args), "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
