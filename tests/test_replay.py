"""The tree replay (specserve.benchmarks.replay): accepted length of head proposers computed
from greedy continuations must be the decoder's own, round for round. Tiny seeded models."""

from __future__ import annotations

import pytest

from conftest import hf_greedy, make_co_located_decoder, tiny_heads, tiny_hydra_heads, tiny_model, tiny_redrafter
from specserve.benchmarks.replay import Trajectory, greedy_continuations, hidden_along, parse_tree, replay
from specserve.protocol import NAMED_TREE_SHAPES, SamplingParams, SpecserveError, TokenTree, TreeSpec
from test_medusa import PROMPTS

TREES = {"chain": None, "dynamic": TreeSpec(budget=10, depth=3, width=3, min_score=0.0),
         "static": TreeSpec(shape=((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0))),
         "mc_sim_7b_63": TreeSpec(shape="mc_sim_7b_63")}  # the papers' 63-node tree, 4 levels: deeper than 3 heads


def test_greedy_acceptance_walks_the_path_the_continuation_takes():
    tree = TokenTree((5, 6, 7, 8, 7), (-1, -1, 1, 1, 3))  # what replay counts: len(tree.path_of(continuation))
    assert len(tree.path_of([6, 8, 7, 1])) == 3
    assert len(tree.path_of([6, 7])) == 2
    assert len(tree.path_of([9])) == 0
    assert len(TokenTree().path_of([5])) == 0


def test_tree_specs_parse_and_bad_ones_are_refused():
    assert parse_tree("chain") is None
    assert parse_tree("budget=16,depth=4,width=4,min_score=0.05") == TreeSpec(budget=16, depth=4, width=4,
                                                                             min_score=0.05)
    with pytest.raises(SpecserveError, match="budget"):
        parse_tree("budget=0")
    papers = parse_tree("shape=mc_sim_7b_63")
    assert set(papers.shape) == set(NAMED_TREE_SHAPES["mc_sim_7b_63"]) and (papers.budget, papers.depth) == (63, 4)
    with pytest.raises(SpecserveError, match="unknown tree shape"):
        parse_tree("shape=mc_sim")
    assert parse_tree("budget=16,depth=4,width=8,min_score=0,rerank=1").rerank
    assert not parse_tree("budget=16,rerank=0").rerank
    for bad in ("breadth=4", "budget", "width=four", "rerank=yes", "shape=mc_sim_7b_63,rerank=1"):
        with pytest.raises(SpecserveError, match="tree"):
            parse_tree(bad)


def test_the_cli_refuses_a_bad_tree_before_loading_anything(capsys):
    from specserve.cli import main

    assert main(["replay-heads", "--trees", "depth=0"]) == 2
    assert "tree depth" in capsys.readouterr().err


def head_proposer(method: str, target):
    from specserve.proposers.hydra import HydraProposer
    from specserve.proposers.medusa import MedusaProposer
    from specserve.proposers.redrafter import ReDrafterProposer

    if method == "medusa":
        return MedusaProposer(tiny_heads(target, noise=0.02))
    if method == "redrafter":
        return ReDrafterProposer(tiny_redrafter(target, noise=0.02))
    return HydraProposer(tiny_hydra_heads(target, noise=0.02, prefix_window=6 if method == "hydra++" else 0))


@pytest.mark.parametrize(("method", "shape"), [(m, s) for m in ("medusa", "hydra", "hydra++") for s in sorted(TREES)]
                         + [("redrafter", "chain"), ("redrafter", "dynamic")])
def test_replayed_accepted_length_is_the_decoders(method, shape):
    from specserve.engine.torch_worker import TorchWorker

    target = tiny_model("qwen2", seed=11)
    proposer = head_proposer(method, target)
    tree, k, max_tokens = TREES[shape], 3, 24
    decoder = make_co_located_decoder(target, proposer, **({"shape": "chain", "k": k} if tree is None
                                                           else {"shape": "tree", "tree": tree}))
    outs = decoder.generate(PROMPTS, SamplingParams(max_tokens=max_tokens))
    tokens = sum(o.stats.generated_tokens for o in outs)
    passes = sum(o.stats.target_steps for o in outs)

    worker = TorchWorker(target)
    continuations = greedy_continuations(worker, PROMPTS, max_tokens, set(), log=lambda _: None)
    assert continuations == [hf_greedy(target, p, max_tokens) for p in PROMPTS] == [o.token_ids for o in outs]
    trajectories = [Trajectory(p, c, hidden_along(worker, p, c)) for p, c in zip(PROMPTS, continuations)]
    result = replay(proposer, tree, k, trajectories, max_tokens)
    assert sum(result.accepted_at_depth) > 0  # the heads do accept: the comparison means something
    assert (result.tokens, result.passes) == (tokens, passes)
    assert len(getattr(proposer, "contexts", ())) == 0  # the replay leaves no window behind


def test_two_workloads_merged_are_one_replay_of_both():
    """`mtbench` rows (chat and chat2 together) add two replays up: the same totals, per-depth
    counts and accepted length as one replay of both sets of trajectories."""
    from specserve.benchmarks.replay import BOTH_TURNS, result_row
    from specserve.engine.torch_worker import TorchWorker

    target = tiny_model("qwen2", seed=11)
    proposer = head_proposer("hydra", target)
    worker = TorchWorker(target)
    continuations = greedy_continuations(worker, PROMPTS, 16, set(), log=lambda _: None)
    trajectories = [Trajectory(p, c, hidden_along(worker, p, c)) for p, c in zip(PROMPTS, continuations)]
    tree = TREES["dynamic"]
    first, second = replay(proposer, tree, 3, trajectories[:2], 16), replay(proposer, tree, 3, trajectories[2:], 16)
    both = replay(proposer, tree, 3, trajectories, 16)
    merged = first.merged(second)
    assert merged == both and sum(merged.accepted_at_depth) > 0
    results = {("chat", "t", "medusa"): second, ("chat", "t", "hydra"): first, (BOTH_TURNS, "t", "hydra"): merged}
    row = result_row(results, "chat", "t", "hydra")
    assert row["vs_first"] == first.accepted_length / second.accepted_length  # against the first one replayed
    assert (row["tokens"], row["passes"], row["rounds"]) == (first.tokens, first.passes, first.rounds)
    assert row["line"].startswith("chat    hydra") and result_row(results, BOTH_TURNS, "t", "hydra")["vs_first"] == 1.0


def test_the_cli_takes_a_static_shape_as_paths_or_by_name():
    import argparse

    from specserve.cli import _tree_spec

    def spec(shape):
        return _tree_spec(argparse.Namespace(tree_budget=16, tree_depth=12, tree_width=4, tree_min_score=0.2,
                                             tree_shape=shape, tree_rerank=False))

    assert spec("[[0], [1], [0, 0]]").shape == ((0,), (1,), (0, 0))
    assert spec("mc_sim_7b_63") == TreeSpec(shape="mc_sim_7b_63")
    assert spec(None).shape is None
    for bad in ("[[0], [x]]", "papers"):
        with pytest.raises(SpecserveError, match="tree-shape|unknown tree shape"):
            spec(bad)


def test_an_unknown_workload_is_refused_before_anything_loads(capsys):
    from specserve.benchmarks.replay import load_trajectories
    from specserve.cli import main

    with pytest.raises(SpecserveError, match="chat2"):
        load_trajectories(None, None, "target", "poetry", 2, 0, 8, set())
    with pytest.raises(SystemExit):
        main(["replay-heads", "--workloads", "poetry"])
    assert "chat2" in capsys.readouterr().err


@pytest.mark.slow
def test_chat2_asks_mt_bench_second_turns_after_the_targets_own_first_answers(tmp_path, monkeypatch):
    """MT-Bench as MT-Bench runs: each question's second turn follows the target's own greedy
    answer to its first (cut at FIRST_ANSWER_TOKENS), and the replay continues that
    conversation. Answers and continuations are cached: a second load decodes nothing."""
    from specserve import models
    from specserve.benchmarks import replay
    from specserve.benchmarks.workloads import encode_prompt, mtbench
    from specserve.heads.data import second_turn_prompt
    from specserve.loading import load_pair

    smol = "smollm2-135m-instruct"
    if not models.is_cached(smol):
        pytest.skip(f"run `specserve models pull {smol}` first (make test does)")
    monkeypatch.setattr(replay, "FIRST_ANSWER_TOKENS", 12)
    pair = load_pair(smol, dtype="float32")
    tokenizer, stop, quiet = pair.tokenizer, set(pair.eos_token_ids), (lambda _: None)

    def load():
        return replay.load_trajectories(pair.target, tokenizer, smol, "chat2", 2, 1, 6, stop, quiet, cache_dir=tmp_path)

    trajectories = load()
    questions = mtbench(3).prompts[1:]  # --skip 1 --prompts 2
    firsts = [encode_prompt(tokenizer, q.text, chat=True) for q in questions]
    answers = replay.greedy_continuations(pair.target, firsts, 12, stop, quiet)
    assert all(len(a) == 12 for a in answers)  # the cut, not the answers' own end
    texts = [tokenizer.decode(a, skip_special_tokens=True).strip() for a in answers]  # the trainer's answer_text
    expected = [second_turn_prompt(tokenizer, (q.text, q.follow_up), text) for q, text in zip(questions, texts)]
    assert [t.prompt for t in trajectories] == expected
    for t, q, text in zip(trajectories, questions, texts):
        conversation = tokenizer.decode(t.prompt)
        assert 0 <= conversation.index(q.text) < conversation.index(text) < conversation.index(q.follow_up)
    assert [t.continuation for t in trajectories] == replay.greedy_continuations(pair.target, expected, 6, stop, quiet)
    assert all(t.hidden.shape[0] == len(t.continuation) for t in trajectories)
    cached = sorted(p.name for p in tmp_path.iterdir())
    assert cached == [f"{smol}-chat-answers-12.json", f"{smol}-chat2-after-12-6.json"]

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoded again instead of reading the cache")

    monkeypatch.setattr(replay, "greedy_continuations", no_decoding)
    again = load()
    assert [(t.prompt, t.continuation) for t in again] == [(t.prompt, t.continuation) for t in trajectories]
