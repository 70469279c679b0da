"""Replay co-located head proposers (Medusa, Hydra, ReDrafter) on recorded greedy continuations:
accepted length offline.

    specserve replay-heads --workloads code --skip 16 --prompts 24 \\
        --trees 'budget=16,depth=4,width=4,min_score=0.05' 'budget=16,depth=4,width=4,min_score=0'

Under greedy decoding, the rounds of a head proposer depend only on the
target's greedy continuation and its hidden states along it: a round whose root is
continuation token c proposes from the hidden state of the row that produced it, and accepts
the longest path of the tree that follows the continuation. So one target pass over each
prompt + continuation gives every round's input, and a tree shape's accepted length comes out
of the heads alone, in seconds where `specserve bench` spends a target pass per round (~35 s
a call on a 2-core CPU). It measures accepted length only, never tokens/s: shapes found here
are confirmed with `specserve bench` (tokens/s and exactness).

Workloads: `code` (HumanEval), `chat` (MT-Bench first turns) and `chat2` (MT-Bench second
turns, as MT-Bench asks them: after the target's own greedy answer to the first turn, at most
FIRST_ANSWER_TOKENS of it, as `specserve train-heads --chat-turns 2` builds its training
conversations); with both chat and chat2, `mtbench` rows add the two up (MT-Bench's accepted
length over both turns of each question, as the papers report it). Continuations (and chat2's
first answers) are decoded once per (target, workload, prompt, max_tokens) and cached under
$SPECSERVE_HOME/replay. The rounds mirror the decoder's: the prefill yields the first token,
each round commits its accepted tokens and the target's next one, up to max_tokens or a stop
token; accepted length = tokens / target passes, as `specserve bench` reports it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from specserve.protocol import ProposeRequest, SamplingParams, SpecserveError, TokenTree, TreeSpec


@dataclass
class Trajectory:
    """One prompt's greedy continuation and the target's hidden state of each row that
    produced a continuation token (row c produced continuation[c])."""

    prompt: list[int]
    continuation: list[int]
    hidden: object = None  # torch.Tensor [len(continuation), H]


@dataclass
class ReplayResult:
    tokens: int = 0
    passes: int = 0  # target passes: the prefill and one per round
    nodes: int = 0  # tree nodes proposed
    rounds: int = 0
    accepted_at_depth: list[int] = field(default_factory=list)

    @property
    def accepted_length(self) -> float:
        return self.tokens / max(self.passes, 1)

    def add(self, accepted: int, committed: int, nodes: int) -> None:
        self.rounds += 1
        self.passes += 1
        self.tokens += committed
        self.nodes += nodes
        while len(self.accepted_at_depth) < accepted:
            self.accepted_at_depth.append(0)
        for d in range(accepted):
            self.accepted_at_depth[d] += 1

    def merged(self, other: ReplayResult) -> ReplayResult:
        """Both results' rounds as one replay (e.g. MT-Bench's two turns)."""
        depth = max(len(self.accepted_at_depth), len(other.accepted_at_depth))
        at_depth = [sum(r.accepted_at_depth[d] for r in (self, other) if d < len(r.accepted_at_depth))
                    for d in range(depth)]
        return ReplayResult(self.tokens + other.tokens, self.passes + other.passes, self.nodes + other.nodes,
                            self.rounds + other.rounds, at_depth)


def replay(proposer, spec: TreeSpec | None, k: int, trajectories: Sequence[Trajectory], max_tokens: int) -> ReplayResult:
    """Every trajectory decoded with `proposer`'s trees (`spec`; None: chains of k), rounds
    batched across trajectories as the pool batches them."""
    import torch

    result = ReplayResult()
    position = [0] * len(trajectories)  # the root's index in its continuation
    windowed = bool(getattr(proposer, "context_window", 0))  # Hydra++: heads read the committed tokens' states
    for i, t in enumerate(trajectories):  # the prefill's token; the pool has seen the prompt's last row
        result.passes += 1
        result.tokens += 1
        if windowed:
            proposer.observe(f"replay-{i}", len(t.prompt) - 1, t.hidden[:1])
    params = SamplingParams(max_tokens=max_tokens)
    while True:
        live = [i for i, t in enumerate(trajectories) if position[i] + 1 < min(len(t.continuation), max_tokens)]
        if not live:
            for i in range(len(trajectories)):
                proposer.release(f"replay-{i}")
            return result
        requests = [ProposeRequest(f"replay-{i}", trajectories[i].prompt + trajectories[i].continuation[:position[i] + 1],
                                   k, params, 0, spec) for i in live]
        hidden = torch.stack([trajectories[i].hidden[position[i]] for i in live])
        for i, proposal in zip(live, proposer.propose_from_hidden(requests, hidden)):
            t = trajectories[i]
            remaining = min(len(t.continuation), max_tokens) - position[i] - 1
            accepted = len(proposal.tree.path_of(t.continuation[position[i] + 1:]))  # greedy acceptance
            committed = min(accepted + 1, remaining)
            result.add(min(accepted, committed), committed, len(proposal.tree.tokens))
            if windowed:
                proposer.observe(proposal.request_id, len(t.prompt) + position[i],
                                 t.hidden[position[i] + 1:position[i] + committed + 1])
            position[i] += committed


def greedy_continuations(worker, prompts: Sequence[list[int]], max_tokens: int, stop_ids: set[int],
                         log=print) -> list[list[int]]:
    """The target's greedy continuations, all prompts decoded as one batch (the stop token
    kept, as the decoder returns it)."""
    from specserve.engine.torch_worker import ForwardItem

    outputs: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    started = time.monotonic()
    step = 0
    while live:
        rows = worker.run([ForwardItem(f"greedy-{i}", prompts[i] + outputs[i]) for i in live])
        for i, r in zip(live, rows):
            outputs[i].append(int(r.argmax()[0]))
        live = [i for i in live if len(outputs[i]) < max_tokens and outputs[i][-1] not in stop_ids]
        step += 1
        if step % 16 == 0 or not live:
            log(f"  greedy: {max(map(len, outputs))}/{max_tokens} tokens, {time.monotonic() - started:.0f} s")
    for i in range(len(prompts)):
        worker.release(f"greedy-{i}")
    return outputs


def hidden_along(worker, prompt: list[int], continuation: list[int]):
    """[len(continuation), H]: the hidden state of the row that produced each continuation
    token (the prompt's last token, then each continuation token but the last)."""
    from specserve.engine.torch_worker import ForwardItem

    rows = worker.run([ForwardItem("replay-hidden", list(prompt), TokenTree.chain(continuation[:-1]))])[0]
    worker.release("replay-hidden")
    return rows.hidden.float().cpu()


REPLAY_WORKLOADS = ("code", "chat", "chat2")
FIRST_ANSWER_TOKENS = 256  # chat2: the first answer the second turn follows (train-heads' generated_max_new)


def cached_continuations(worker, cache, ids: Sequence[str], prompts: Sequence[list[int]], max_tokens: int,
                         stop_ids: set[int], log=print, what: str = "greedy continuations") -> list[list[int]]:
    """`greedy_continuations` of `prompts`, kept in the JSON file `cache` by prompt id: only the
    prompts it does not hold yet are decoded."""
    known = json.loads(cache.read_text()) if cache.is_file() else {}
    missing = [i for i, pid in enumerate(ids) if pid not in known]
    if missing:
        log(f"{cache.stem}: decoding {len(missing)} {what} ({max_tokens} tokens)")
        decoded = greedy_continuations(worker, [prompts[i] for i in missing], max_tokens, stop_ids, log)
        known.update({ids[i]: out for i, out in zip(missing, decoded)})
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(known))
    return [known[pid] for pid in ids]


def second_turn_prompts(worker, tokenizer, questions, first_turns: Sequence[list[int]], cache_stem: str, cache_dir,
                        stop_ids: set[int], log=print) -> list[list[int]]:
    """MT-Bench's second turns (`Prompt.follow_up`), each asked after the target's own greedy
    answer to its question's first turn (`first_turns`, encoded), cut at FIRST_ANSWER_TOKENS."""
    from specserve.heads.data import answer_text, second_turn_prompt

    unpaired = [q.id for q in questions if q.follow_up is None]
    if unpaired:
        raise SpecserveError(f"chat2: these questions have no second turn: {', '.join(unpaired)}")
    answers = cached_continuations(worker, cache_dir / f"{cache_stem}-answers-{FIRST_ANSWER_TOKENS}.json",
                                   [q.id for q in questions], first_turns, FIRST_ANSWER_TOKENS, stop_ids, log,
                                   what="first answers")
    return [second_turn_prompt(tokenizer, (q.text, q.follow_up), answer_text(tokenizer, a))
            for q, a in zip(questions, answers)]


def load_trajectories(worker, tokenizer, target: str, workload: str, prompts: int, skip: int, max_tokens: int,
                      stop_ids: set[int], log=print, cache_dir=None) -> list[Trajectory]:
    """The workload's prompts (the benchmark's seeded order, the first `skip` left out), the
    target's greedy continuations of them (cached in `cache_dir`, default
    $SPECSERVE_HOME/replay) and its hidden states along them."""
    from specserve.benchmarks import workloads
    from specserve.models import specserve_home

    if workload not in REPLAY_WORKLOADS:
        raise SpecserveError(f"unknown workload {workload!r}; choose from {', '.join(REPLAY_WORKLOADS)}")
    cache_dir = specserve_home() / "replay" if cache_dir is None else cache_dir
    chosen = workloads.load(["chat" if workload == "chat2" else workload], skip + prompts)[0]
    questions = chosen.prompts[skip:]
    ids = [p.id for p in questions]
    encoded = chosen.encode(tokenizer)[skip:]
    stem, name = target.replace('/', '--'), workload
    if workload == "chat2":  # its continuations follow first answers of this length: named by it
        encoded = second_turn_prompts(worker, tokenizer, questions, encoded, f"{stem}-chat", cache_dir, stop_ids, log)
        name = f"chat2-after-{FIRST_ANSWER_TOKENS}"
    continuations = cached_continuations(worker, cache_dir / f"{stem}-{name}-{max_tokens}.json", ids, encoded,
                                         max_tokens, stop_ids, log)
    trajectories = [Trajectory(p, c) for p, c in zip(encoded, continuations)]
    started = time.monotonic()
    for n, t in enumerate(trajectories, 1):
        t.hidden = hidden_along(worker, t.prompt, t.continuation)
        if n % 8 == 0 or n == len(trajectories):
            log(f"  hidden states: {n}/{len(trajectories)} prompts, {time.monotonic() - started:.0f} s")
    return trajectories


def _flag(value: str) -> bool:
    if value.lower() not in ("0", "1", "true", "false"):
        raise ValueError(value)
    return value.lower() in ("1", "true")


TREE_FIELDS = {"budget": int, "depth": int, "width": int, "min_score": float, "shape": str, "rerank": _flag}


def parse_tree(text: str) -> TreeSpec | None:
    """'chain', 'budget=16,depth=4,width=4,min_score=0.05' (a dynamic TreeSpec's fields; those
    left out keep TreeSpec's defaults; 'rerank=1' reranks) or 'shape=mc_sim_7b_63' (a static
    shape by name)."""
    if text == "chain":
        return None
    fields = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key.strip() not in TREE_FIELDS or not value:
            raise SpecserveError(f"tree {text!r}: give 'chain' or comma-separated {', '.join(TREE_FIELDS)} "
                                 f"as key=value, e.g. 'budget=16,depth=4,width=4,min_score=0.05' or "
                                 f"'shape=mc_sim_7b_63'")
        try:
            fields[key.strip()] = TREE_FIELDS[key.strip()](value)
        except ValueError:
            kind = "0 or 1" if TREE_FIELDS[key.strip()] is _flag else "a number"
            raise SpecserveError(f"tree {text!r}: {key} must be {kind}, got {value!r}") from None
    return TreeSpec(**fields)


BOTH_TURNS = "mtbench"  # chat and chat2 together: MT-Bench's accepted length over both turns


def result_row(results: dict[tuple[str, str, str], ReplayResult], workload: str, tree: str, method: str) -> dict:
    """One replay's row, against the first method replayed on the same workload and tree
    (`vs_first`), with its totals (so workloads can be added up later) and its printed line."""
    r = results[workload, tree, method]
    first_method, first = next((m, x) for (w, t, m), x in results.items() if w == workload and t == tree)
    row = {"workload": workload, "tree": tree, "method": method, "accepted_length": r.accepted_length,
           "nodes_per_round": r.nodes / max(r.rounds, 1),
           "accepted_at_depth": [a / max(r.rounds, 1) for a in r.accepted_at_depth],
           "tokens": r.tokens, "passes": r.passes, "rounds": r.rounds,
           "vs_first": r.accepted_length / first.accepted_length if first.accepted_length else 0.0}
    row["line"] = (f"{workload:7} {method:9} {tree:45} accepted length {r.accepted_length:.3f}  "
                   f"({row['vs_first']:.3f}x {first_method})  nodes/round {row['nodes_per_round']:.1f}  reached "
                   + " ".join(f"{a:.2f}" for a in row["accepted_at_depth"]))
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve replay-heads", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--heads", nargs="+", default=None,
                        help="methods (their default heads directories, from `specserve train-heads`) or heads "
                             "directories (default: every method whose default heads are there)")
    parser.add_argument("--workloads", nargs="+", default=["code"], choices=REPLAY_WORKLOADS,
                        help="code (HumanEval), chat (MT-Bench first turns), chat2 (MT-Bench second turns, after "
                             f"the target's own greedy first answer, at most {FIRST_ANSWER_TOKENS} tokens)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per workload, the benchmark's seeded order")
    parser.add_argument("--skip", type=int, default=0, help="skip the workload's first N prompts (tune on others "
                        "than the benchmark's)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--trees", nargs="+", default=["budget=16,depth=4,width=4,min_score=0.05"],
                        help="'chain' (one node per head), dynamic trees as 'budget=16,depth=4,width=4,min_score=0' "
                             "(',rerank=1': reranked) or static shapes by name, 'shape=mc_sim_7b_63' (Medusa's and Hydra's 63-node default)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    trees = [(text, parse_tree(text)) for text in args.trees]  # bad shapes are refused before any loading

    from pathlib import Path

    from specserve.heads import HEAD_METHODS, find_heads, require_heads
    from specserve.loading import load_pair

    heads = args.heads or [m for m in HEAD_METHODS if find_heads(args.target, "default", m)]
    if not heads:
        raise SpecserveError(f"no heads for {args.target}: train some with `specserve train-heads`, or give --heads")
    pair = load_pair(args.target, dtype="float32", release_model_weights=True)
    pair.add_heads([require_heads(args.target, "default", h) if h in HEAD_METHODS else Path(h) for h in heads])
    stop_ids = set(pair.eos_token_ids)
    results: dict[tuple[str, str, str], ReplayResult] = {}
    rows = []

    def record(key: tuple[str, str, str], result: ReplayResult) -> None:
        results[key] = result
        row = result_row(results, *key)
        print(row.pop("line"), flush=True)
        rows.append(row)

    for workload in args.workloads:
        trajectories = load_trajectories(pair.target, pair.tokenizer, args.target, workload, args.prompts, args.skip,
                                         args.max_tokens, stop_ids)
        for tree_text, spec in trees:
            for method, proposer in pair.heads_by_method.items():
                k = proposer.num_heads if spec is None else min(spec.depth, proposer.num_heads)
                record((workload, tree_text, method), replay(proposer, spec, k, trajectories, args.max_tokens))
    if {"chat", "chat2"} <= set(args.workloads):  # MT-Bench as it is run: both turns of each question
        for tree_text, _ in trees:
            for method in pair.heads_by_method:
                record((BOTH_TURNS, tree_text, method),
                       results["chat", tree_text, method].merged(results["chat2", tree_text, method]))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
