"""Presets of `specserve bench`: named sets of defaults (systems, modes, sizes).

    specserve bench --preset vllm       # batch 1: specserve none / draft k=4 against vLLM's best
    specserve bench --preset batch      # library throughput at batch 1, 4, 8 and 16

A flag given on the command line wins over the preset, and --quick's sizes win over the
preset's, so ``--preset batch --quick`` is a smoke run of the batch sweep. ``variants`` replaces
systems.SPECSERVE_VARIANTS; ``derive`` runs static trees derived from a measured tree's per-rank
acceptance after the main passes, with a baseline of their own (``suite._derived_phase``).
"""

from __future__ import annotations

from typing import Any

from specserve.benchmarks.systems import K, SERVED, SOLO_K

VS_VLLM = ["specserve none", f"specserve draft k={K}", "vllm none", f"vllm draft_model k={K}"]

MEDUSA_TREE = {"budget": 16, "depth": 4, "width": 4, "min_score": 0.05}  # as deep as `make heads`' 4 heads
PAPERS_TREE = {"shape": "mc_sim_7b_63"}  # Medusa's and Hydra's own evaluations: 63 nodes, 4 levels
# reranked (EAGLE-2): the budget's best nodes of width x depth grown, scored at the heads' score
# temperatures; the 63-node one is both methods' best tree in replay (docs/bench/replay-calibrated-epyc)
RERANKED_TREES = [{"budget": 16, "depth": 4, "width": 16, "min_score": 0.0, "rerank": True},
                  {"budget": 63, "depth": 4, "width": 32, "min_score": 0.0, "rerank": True}]
REDRAFTER_BEAMS = {"width": 4, "depth": 4, "budget": 16, "min_score": 0.05}  # manifests/local-redrafter.yaml
NGRAM_TREE = {"budget": 16, "depth": 8, "width": 4}  # up to 4 earlier matches, 8 tokens each, merged

PRESETS: dict[str, dict[str, Any]] = {
    "engine": {
        "help": "make bench: batch 1, HumanEval; specserve none / draft k=4 against transformers and vLLM",
        "modes": ["library"], "workloads": ["code"], "prompts": 8, "max_tokens": 128, "batch_sizes": [1],
        "repeats": 2, "systems": [*VS_VLLM, "transformers *"],
    },
    "vllm": {
        "help": "batch 1, HumanEval: specserve none and draft k=4 against vLLM none and draft_model k=4 (its best "
                "engine settings)",
        "modes": ["library"], "workloads": ["code"], "prompts": 8, "max_tokens": 128, "batch_sizes": [1],
        "repeats": 2, "systems": VS_VLLM,
    },
    "speculative": {
        "help": "make bench-speculative: batch 1, HumanEval, each engine's speculative methods at their best: "
                "specserve's draft chain k=4 and up to 8 with the load-aware policy picking each round's depth, "
                "prompt lookup k=4 and Medusa and Hydra 4-node trees against vLLM's draft_model at k=4, 6 and 8, "
                "ngram k=4 and Medusa k=4 (the same Medusa heads, exported to vLLM's layout), and both "
                "target-only; each specserve method is compared with vLLM's fastest (make heads heads-hydra first)",
        "modes": ["library"], "workloads": ["code"], "prompts": 8, "max_tokens": 128, "batch_sizes": [1],
        "repeats": 2, "systems": ["specserve *", "vllm none", "vllm draft_model *", f"vllm ngram k={K}", "vllm medusa *"],
        "vllm_ks": [K, 6, 8],
        "variants": [("none", {}), ("draft", {"k": K}), ("draft", {"k": 8, "policy": "adaptive"}), ("ngram", {"k": K}),
                     *[(method, {"shape": "tree", "tree": {**MEDUSA_TREE, "budget": 4}}) for method in ("medusa", "hydra")]],
    },
    "batch": {
        "help": "library throughput at batch 1, 4, 8 and 16, HumanEval: specserve against vLLM",
        "modes": ["library"], "workloads": ["code"], "prompts": 8, "max_tokens": 128, "batch_sizes": [1, 4, 8, 16],
        "repeats": 2, "systems": VS_VLLM,
    },
    "trees": {
        "help": "draft chains against dynamic draft trees of 8, 16 and 32 nodes, and a static tree derived from "
                "the 32-node tree's per-rank acceptance",
        "modes": ["library"], "workloads": ["code"], "prompts": 8, "max_tokens": 128, "batch_sizes": [1],
        "repeats": 2, "systems": ["specserve *"],
        "variants": [("none", {}), ("draft", {"k": K}),
                     *[("tree", {"tree": {"budget": budget}}) for budget in (8, 16, 32)]],
        "derive": {"from": "specserve tree budget=32", "budgets": [16]},
    },
    "medusa": {
        "help": "make bench-medusa: Medusa heads (make heads) as a chain, dynamic trees and static trees derived "
                "from their acceptance, against target-only and the draft model",
        "modes": ["library"], "workloads": ["code"], "prompts": 8, "max_tokens": 128, "batch_sizes": [1],
        "repeats": 2, "systems": ["specserve *"],
        # chains of 1-4 and trees of 4 and 8 nodes: on a CPU a verify pass of n rows costs more
        # than one of 1 row as soon as n passes ~3, so the best proposal is small there
        "variants": [("none", {}), ("draft", {"k": K}), ("tree", {}),
                     *[("medusa", {"k": k}) for k in (1, 2, 3, 4)],
                     *[("medusa", {"shape": "tree", "tree": {**MEDUSA_TREE, "budget": budget}}) for budget in (4, 8)],
                     ("medusa", {"shape": "tree", "tree": MEDUSA_TREE}),
                     ("medusa", {"shape": "tree", "tree": MEDUSA_TREE, "policy": "adaptive"})],
        "derive": {"from": "specserve medusa shape=tree budget=16 depth=4 width=4 min_score=0.05",
                   "budgets": [8, 16]},
    },
    "ngram": {
        "help": "make bench-ngram: prompt lookup (chains of 4 and 8, a tree of up to 4 matches) against transformers' "
                "prompt lookup (prompt_lookup_num_tokens=10) and both engines' target-only decoding, HumanEval",
        "modes": ["library"], "workloads": ["code"], "prompts": 8, "max_tokens": 128, "batch_sizes": [1],
        "repeats": 2, "systems": ["specserve *", "transformers target only", "transformers prompt lookup"],
        "variants": [("none", {}), ("ngram", {"k": 4}), ("ngram", {"k": 8}),
                     ("ngram", {"shape": "tree", "tree": NGRAM_TREE})],
    },
    "methods": {
        "help": "make bench-methods: every proposer at batch 1 in one run, held-out HumanEval and MT-Bench: target-only, "
                "draft chain k=4 and tree, prompt lookup k=4, Medusa, Hydra and ReDrafter heads (trained with the same "
                "budget) as 4-node trees (on a 2-core CPU a verify pass of more than ~5 rows costs clearly more "
                "than one of 1) and as 16-node trees (closer to the papers' trees: accepted length, at a price "
                "in tokens/s here), and ReDrafter's 4 beams of 4 tokens (16 nodes)",
        "modes": ["library"], "workloads": ["code", "chat"], "prompts": 6, "max_tokens": 96, "batch_sizes": [1],
        "repeats": 2, "systems": ["specserve *"],
        "variants": [("none", {}), ("draft", {"k": K}), ("tree", {}), ("ngram", {"k": K}),
                     *[(method, {"shape": "tree", "tree": {**MEDUSA_TREE, "budget": 4}})
                       for method in ("medusa", "hydra", "redrafter")],
                     *[(method, {"shape": "tree", "tree": MEDUSA_TREE}) for method in ("medusa", "hydra")],
                     ("redrafter", {"shape": "tree", "tree": REDRAFTER_BEAMS})],
    },
    "hydra": {
        "help": "make bench-hydra: Hydra against Medusa heads (make heads, make heads-hydra), accepted length with the "
                "same 16-node trees, pruned where a node's path score falls below 0.05 (as in the methods preset and "
                "the manifests) and full (min_score 0: all 16 nodes), with the papers' own static tree "
                "(mc_sim_7b_63: 63 nodes, the default of both Medusa's and Hydra's evaluations), and reranked "
                "trees of 16 and 63 nodes, 16 held-out prompts per workload, one pass",
        "modes": ["library"], "workloads": ["code", "chat"], "prompts": 16, "max_tokens": 96, "batch_sizes": [1],
        "repeats": 1, "systems": ["specserve *"],
        "variants": [("none", {}),
                     *[(method, {"shape": "tree", "tree": tree})
                       for tree in (MEDUSA_TREE, {**MEDUSA_TREE, "min_score": 0.0}, PAPERS_TREE, *RERANKED_TREES)
                       for method in ("medusa", "hydra")]],
    },
    "adaptive": {
        "help": "make bench-adaptive: service mode through manifests/local.yaml at 1, 2, 4, 8 and 16 streams on code "
                "and chat: speculation always off, always on (draft chain k=4) and adaptive (the load-aware policy, "
                "0..4 draft tokens per round, 0..8 for a request alone, as manifests/local.yaml); 2 passes A B C C B A at each level, wave by wave (a wave: as many prompts as "
                "streams), rotated from wave to wave (about "
                "45-60 minutes on a 2-core AMD EPYC)",
        "modes": ["service"], "workloads": ["code", "chat"], "prompts": 8, "max_tokens": 96, "service_requests": 8,
        "service_max_tokens": 64, "service_repeats": 2, "concurrency": [1, 2, 4, 8, 16],
        "manifest": "manifests/local.yaml",
        "variants": [("none", {}), ("draft", {"k": K}), ("draft", {"k": K, "solo_k": SOLO_K, "policy": "adaptive"})],
    },
    "http": {
        "help": "make bench-http: service mode through `serve run manifests/local.yaml` (or --manifest, --url) and "
                "HTTP at 1 and 4 streams, speculation off and the deployment's own",
        "modes": ["service"], "workloads": ["code"], "prompts": 4, "max_tokens": 128, "service_requests": 4,
        "service_max_tokens": 128, "concurrency": [1, 4], "manifest": "manifests/local.yaml",
        "variants": [("none", {}), (SERVED, {})],  # served: no override, what the manifest configures
    },
}


def describe() -> str:
    return "; ".join(f"{name}: {preset['help']}" for name, preset in PRESETS.items())
