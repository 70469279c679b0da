"""Medusa benchmark: co-located heads against target-only and the draft model, same run.

    python -m specserve.benchmarks.medusa --prompts 8 --max-tokens 128 --repeats 2

Loads the target, the 0.5B draft and the target's Medusa heads (`make heads`; `--heads DIR`
for others) in one process and runs, batch 1, greedy, on HumanEval prompts the heads were not
trained on (the first N problems; `specserve.heads.data.held_out`): target-only, the draft
chain (k=4) and draft tree, then Medusa as a chain of the heads' top-1s, as dynamic trees of
each node budget, and as static trees (of each `--static-budgets`) derived from the per-rank
acceptance the largest dynamic tree measured; those run later, with a baseline of their own. With `--repeats 2` every system runs twice, in alternating order
(A B .. B A), and the figures sum both runs, so drift on a noisy machine hits every system
alike. Prints tokens/s, the speedup over target-only, the mean accepted length (tokens per
target step, bonus included), draft nodes per round, and how many outputs equal target-only's.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass, field


@dataclass
class System:
    name: str
    speculation: object  # specserve.protocol.Speculation
    seconds: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)
    stats: object = None  # SpecStats, merged over prompts and repeats


def run_once(decoder, system: System, prompt_ids, max_tokens: int) -> None:
    from specserve.protocol import SamplingParams
    from specserve.request_state import SpecStats

    system.stats = system.stats or SpecStats()
    outputs = []
    for ids in prompt_ids:
        start = time.perf_counter()
        [out] = decoder.generate([ids], SamplingParams(max_tokens=max_tokens), speculation=system.speculation)
        system.seconds += time.perf_counter() - start
        system.stats.merge(out.stats)
        outputs.append(out.token_ids)
    system.outputs = system.outputs or outputs


def main(argv=None) -> int:
    from specserve.benchmarks.engine import DEFAULT_DRAFT, DEFAULT_TARGET, humaneval_prompts

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_DRAFT, help="'' to skip the draft-model systems")
    parser.add_argument("--heads", default="default", help="Medusa heads directory (default: the target's, "
                                                           "from `make heads`)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=8, help="first N HumanEval problems (held out of training)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 16], help="Medusa dynamic tree budgets")
    parser.add_argument("--min-score", type=float, default=0.05, help="Medusa dynamic trees' min_score")
    parser.add_argument("--static-budgets", type=int, nargs="+", default=[8, 16],
                        help="node budgets of the static trees derived from the measured per-rank acceptance")
    parser.add_argument("--repeats", type=int, default=2, help="runs per system, in alternating order")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)

    import torch

    from specserve.decoder import SpeculativeDecoder
    from specserve.heads.data import held_out
    from specserve.loading import load_pair, set_torch_threads
    from specserve.protocol import Speculation, TreeSpec
    from specserve.trees import rank_acceptance, shape_from_acceptance

    set_torch_threads()
    pair = load_pair(args.target, args.draft or None, heads=args.heads, dtype=args.dtype)
    decoder = SpeculativeDecoder(pair.verifier(), pair.proposer(), tokenizer=pair.tokenizer,
                                 eos_token_ids=pair.eos_token_ids, max_context=pair.max_context)
    prompts = humaneval_prompts(args.prompts)
    trained_on = [p for p in range(args.prompts) if f"HumanEval/{p}" not in held_out().humaneval]
    if trained_on:
        print(f"# warning: HumanEval/{trained_on} are not held out of the heads' training text", flush=True)
    prompt_ids = [pair.tokenizer.encode(p) for p in prompts]
    depth = pair.heads.num_heads
    print(f"# {len(prompt_ids)} held-out HumanEval prompts, {args.max_tokens} new tokens, greedy, batch 1, "
          f"{args.dtype}, torch threads {torch.get_num_threads()}, {depth} Medusa heads over "
          f"{pair.heads.heads.config.head_vocab_size} tokens, {args.repeats} runs per system", flush=True)

    systems = [System("specserve none (target only)", Speculation(proposer="none"))]
    if pair.draft is not None:
        systems += [System("specserve draft, chain k=4", Speculation(proposer="draft", k=4)),
                    System("specserve draft, tree (default)", Speculation(proposer="draft", shape="tree"))]
    systems.append(System(f"specserve medusa, chain k={depth}", Speculation(proposer="medusa", k=depth)))
    for budget in args.budgets:
        tree = TreeSpec(budget=budget, depth=depth, width=4, min_score=args.min_score)
        systems.append(System(f"specserve medusa, tree budget {budget}", Speculation(proposer="medusa", shape="tree",
                                                                                    tree=tree)))
    for system in systems:  # warm-up: allocator growth, kernel selection, tree masks
        decoder.generate([prompt_ids[0][:16]], speculation=system.speculation)

    def run_all(batch: list[System]) -> None:
        for rep in range(args.repeats):
            for system in (batch if rep % 2 == 0 else batch[::-1]):
                run_once(decoder, system, prompt_ids, args.max_tokens)
                print(f"#   run {rep + 1}/{args.repeats}: {system.name} done", file=sys.stderr, flush=True)

    run_all(systems)
    largest = systems[-1].stats
    rates = rank_acceptance(largest.num_accepted_tokens_per_rank, largest.num_reached_tokens_per_rank)
    print(f"# Medusa per-rank acceptance {[round(r, 3) for r in rates]}", flush=True)
    static = []
    for budget in args.static_budgets:
        shape = shape_from_acceptance(rates, budget=budget, depth=depth)
        print(f"#   static shape for {budget} nodes: {[list(p) for p in shape]}", flush=True)
        if shape:
            static.append(System(f"specserve medusa, static from acceptance ({len(shape)})",
                                 Speculation(proposer="medusa", shape="tree", tree=TreeSpec(shape=shape))))
    if static:
        baseline_again = System("specserve none (target only), again", Speculation(proposer="none"))
        run_all([baseline_again, *static])  # with their own baseline: these ran later than the rest
        systems += [*static, baseline_again]

    header = f"{'system':48} {'tok/s':>6} {'speedup':>8} {'acc.len':>8} {'nodes/rnd':>10} {'same output':>12}"
    print(header + "\n" + "-" * len(header), flush=True)
    rows = []
    for system in systems:
        baseline = systems[-1] if any(system is s for s in static) else systems[0]
        tps = system.stats.generated_tokens / system.seconds
        row = {"name": system.name, "speculation": system.speculation.describe(), "tokens_per_second": tps,
               "speedup": tps / (baseline.stats.generated_tokens / baseline.seconds),
               "accepted_length": system.stats.mean_accepted_length,
               "nodes_per_round": system.stats.num_draft_tokens / system.stats.target_steps,
               "matches": sum(a == b for a, b in zip(system.outputs, systems[0].outputs)),
               "seconds": system.seconds, "stats": system.stats.as_dict(), "outputs": system.outputs}
        rows.append(row)
        print(f"{row['name']:48} {tps:6.2f} {row['speedup']:7.2f}x {row['accepted_length']:8.2f} "
              f"{row['nodes_per_round']:10.1f} {row['matches']:>6}/{len(prompt_ids)}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            machine = {"platform": platform.platform(), "python": sys.version.split()[0],
                       "torch": torch.__version__, "threads": torch.get_num_threads()}
            json.dump({"machine": machine, "args": vars(args), "heads": asdict(pair.heads.heads.config),
                       "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
