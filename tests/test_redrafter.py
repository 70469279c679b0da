"""ReDrafter, co-located: the recurrent drafter, beam search merged into a prefix tree, exactness
(greedy and sampled), one target pass per round, files and wiring. Tiny seeded random models."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_heads, tiny_model, tiny_redrafter
from specserve.protocol import DETERMINISTIC, ProposeRequest, SamplingParams, SpecserveError, TokenTree, TreeSpec
from specserve.trees import merge_beams
from test_medusa import SHAPES

# ---- the drafter --------------------------------------------------------------------------


def test_an_untrained_drafter_is_medusa_head_zero_at_every_step():
    """The head starts as "take h", so whatever the state, every step is an untrained Medusa head."""
    model = tiny_model("qwen2", seed=1)
    drafter, medusa = tiny_redrafter(model, num_heads=3), tiny_heads(model, num_heads=1)
    hidden, path = torch.randn(5, model.config.hidden_size), torch.randint(0, 97, (5, 3))
    logits = drafter(hidden, path)
    assert logits.shape == (3, 5, 97)
    for step in logits:
        torch.testing.assert_close(step, medusa(hidden)[0])


def test_step_i_reads_the_first_i_plus_one_path_tokens_and_serving_steps_match_training():
    model = tiny_model("llama", seed=2)
    drafter = tiny_redrafter(model, num_heads=3, noise=0.1)
    hidden = torch.randn(4, model.config.hidden_size)
    path = torch.randint(0, 97, (4, 3))
    other = path.clone()
    other[:, 2] = (other[:, 2] + 1) % 97  # only the last token differs
    a, b = drafter(hidden, path), drafter(hidden, other)
    torch.testing.assert_close(a[:2], b[:2])  # steps 0 and 1 never read path[:, 2]
    assert not torch.allclose(a[2], b[2])
    state = drafter.initial_state(4)
    for i in range(3):  # one recurrent step at a time, as the proposer runs it
        state = drafter.advance(state, path[:, i])
        torch.testing.assert_close(drafter.step_logits(hidden, state), a[i])


def test_a_drafter_for_another_model_is_refused():
    from specserve.heads.redrafter import ReDrafter, ReDrafterConfig

    model = tiny_model("qwen2", seed=1)
    with pytest.raises(SpecserveError, match="trained for another model"):
        ReDrafter(ReDrafterConfig(hidden_size=32, vocab_size=97), model.lm_head.weight,
                  model.get_input_embeddings().weight)
    with pytest.raises(SpecserveError, match=">= 1 head"):
        ReDrafterConfig(hidden_size=64, vocab_size=97, num_heads=0)


# ---- beams into a tree --------------------------------------------------------------------


def test_beams_merge_into_a_prefix_tree_storing_shared_prefixes_once():
    beams = [[5, 6, 7], [5, 6, 8], [5, 9, 7], [4, 6, 7]]  # best first
    tree = merge_beams(beams)
    assert tree == TokenTree((5, 4, 6, 9, 6, 7, 8, 7, 7), (-1, -1, 0, 0, 1, 2, 2, 3, 4))  # level order
    for beam in beams:  # every beam is a path, its nodes shared with the beams before it
        assert [tree.tokens[n] for n in tree.path_of(beam)] == beam
    assert tree.children()[-1] == [0, 1] and tree.children()[0] == [2, 3]  # siblings: best beam first
    assert merge_beams([[1, 2], [1, 2], [1]]) == TokenTree.chain([1, 2])  # duplicates add nothing
    assert merge_beams([]) == TokenTree()


def test_merging_stops_at_the_budget_best_beams_first():
    assert merge_beams([[5, 6, 7], [5, 6, 8], [9, 1]], budget=4) == TokenTree((5, 6, 7, 8), (-1, 0, 1, 1))
    assert merge_beams([[5, 6, 7], [9, 1, 2]], budget=4) == TokenTree((5, 9, 6, 7), (-1, -1, 0, 2))


def test_a_merged_tree_cut_to_a_depth_keeps_its_shallow_nodes():
    from specserve.protocol import Proposal

    tree = merge_beams([[5, 6, 7], [9, 6, 8]])
    assert Proposal("r", tree, DETERMINISTIC).truncated(1).tree == TokenTree((5, 9), (-1, -1))


def test_the_beam_plan_comes_from_the_speculation_shape():
    from specserve.proposers.redrafter import BeamPlan, beam_plan

    params = SamplingParams()
    chain = ProposeRequest("c", [1], 8, params, 0)
    assert beam_plan(chain, 4) == BeamPlan(1, 4, 4)  # k capped at the steps the drafter was trained for
    dynamic = ProposeRequest("d", [1], 2, params, 0, TreeSpec(budget=16, depth=4, width=3, min_score=0.1))
    assert beam_plan(dynamic, 4) == BeamPlan(3, 2, 6, 0.1)  # the policy's k caps the length (and the budget)
    static = ProposeRequest("s", [1], 4, params, 0, SHAPES["static"]["tree"])  # 7 nodes, 4 leaves, depth 3
    assert beam_plan(static, 4) == BeamPlan(4, 3, 7)
    assert beam_plan(ProposeRequest("off", [1], 0, params, 0), 4) is None
    assert BeamPlan(2, 3, 6, min_score=0.3).kept_length([0.9, 0.3, 0.9]) == 1  # path 0.27 < 0.3: cut there
    assert BeamPlan(1, 3, 3, min_confidence=0.5).kept_length([0.9, 0.4, 0.9]) == 2  # a chain stops after 0.4


class CountingDrafter:
    """Wraps a drafter, counting `step_logits` calls (one per depth, whatever the batch)."""

    def __init__(self, drafter):
        self.inner, self.calls = drafter, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def step_logits(self, hidden, state):
        self.calls.append(len(hidden))
        return self.inner.step_logits(hidden, state)


def reference_beam_search(drafter, hidden, root, width, length):
    """Beam search for one request, written plainly: [(tokens, log-probability)], best first."""
    beams = [((), 0.0, drafter.initial_state(1))]
    for _ in range(length):
        extended = []
        for tokens, score, state in beams:
            state = drafter.advance(state, torch.tensor([tokens[-1] if tokens else root]))
            log_probs = drafter.step_logits(hidden[None], state)[0].log_softmax(-1)
            extended += [(tokens + (t,), score + float(log_probs[t]), state) for t in range(len(log_probs))]
        beams = sorted(extended, key=lambda b: -b[1])[:width]
    return [(list(tokens), score) for tokens, score, _ in beams]


def test_a_round_is_a_beam_search_per_request_batched_one_drafter_step_per_depth():
    from specserve.proposers.redrafter import ReDrafterProposer

    model = tiny_model("qwen2", seed=1)
    drafter = tiny_redrafter(model, num_heads=3, noise=0.2)
    counting = CountingDrafter(drafter)
    params = SamplingParams()
    dynamic = TreeSpec(budget=12, depth=3, width=3, min_score=0.0)
    requests = [ProposeRequest("wide", [4, 1], 3, params, 0, dynamic),
                ProposeRequest("short", [2], 2, params, 0, TreeSpec(budget=8, depth=3, width=2, min_score=0.0)),
                ProposeRequest("chain", [7, 8, 9], 8, params, 0),  # capped at the drafter's 3 steps
                ProposeRequest("off", [1], 0, params, 0)]
    hidden = torch.randn(4, model.config.hidden_size)
    out = ReDrafterProposer(counting).propose_from_hidden(requests, hidden)
    assert all(p.law == DETERMINISTIC and p.dists is None for p in out)
    # depth 1: one beam per drafting request; then every live beam of every request in one call
    assert counting.calls == [3, 3 + 2 + 1, 3 + 1]
    for b, (width, length) in enumerate([(3, 3), (2, 2), (1, 3)]):
        beams = reference_beam_search(drafter, hidden[b], requests[b].token_ids[-1], width, length)
        assert out[b].tree == merge_beams([tokens for tokens, _ in beams]), requests[b].request_id
    assert out[2].tree.is_chain and len(out[2].tree) == 3
    assert len(out[3].tree) == 0
    beams = [tokens for tokens, _ in reference_beam_search(drafter, hidden[0], 1, 3, 3)]
    prefixes = {tuple(beam[:d]) for beam in beams for d in range(1, 4)}
    assert len(out[0].tree) == len(prefixes) < 9  # a prefix is one node, however many beams share it


def test_beams_below_min_score_are_cut_and_the_budget_holds():
    from specserve.proposers.redrafter import ReDrafterProposer

    model = tiny_model("llama", seed=4)
    drafter = tiny_redrafter(model, num_heads=3, noise=0.3)
    hidden = torch.randn(1, model.config.hidden_size)
    spec = TreeSpec(budget=5, depth=3, width=4, min_score=0.0)
    [tree] = [p.tree for p in ReDrafterProposer(drafter).propose_from_hidden(
        [ProposeRequest("r", [3], 3, SamplingParams(), 0, spec)], hidden)]
    beams = reference_beam_search(drafter, hidden[0], 3, 4, 3)
    assert tree == merge_beams([tokens for tokens, _ in beams], budget=5) and len(tree) == 5
    strict = TreeSpec(budget=12, depth=3, width=4, min_score=0.999)  # no path is that sure
    [empty] = ReDrafterProposer(drafter).propose_from_hidden(
        [ProposeRequest("r", [3], 3, SamplingParams(), 0, strict)], hidden)
    assert len(empty.tree) == 0


# ---- files and wiring ---------------------------------------------------------------------


@pytest.fixture
def saved_drafter(tmp_path):
    """A tiny target, a ReDrafter and Medusa heads for it saved to directories."""
    model = tiny_model("qwen2", seed=3)
    drafter = tiny_redrafter(model, num_heads=2, noise=0.1, head_vocab_size=60)
    drafter.save(tmp_path / "redrafter")
    tiny_heads(model, num_heads=2).save(tmp_path / "medusa")
    return model, drafter, tmp_path / "redrafter", tmp_path / "medusa"


def test_loading_builds_the_redrafter_proposer(saved_drafter):
    from specserve.engine.torch_worker import TorchWorker
    from specserve.heads.redrafter import load_heads
    from specserve.loading import load_heads_proposer
    from specserve.proposers.redrafter import ReDrafterProposer

    model, drafter, drafter_dir, medusa_dir = saved_drafter
    loaded = load_heads_proposer(drafter_dir, TorchWorker(model))
    assert isinstance(loaded, ReDrafterProposer) and loaded.method == "redrafter"
    assert json.loads((drafter_dir / "config.json").read_text())["method"] == "redrafter"
    requests = [ProposeRequest("r", [5, 9], 2, SamplingParams(), 0, TreeSpec(budget=6, depth=2, width=3))]
    hidden = torch.randn(1, model.config.hidden_size)
    assert (loaded.propose_from_hidden(requests, hidden)[0].tree
            == ReDrafterProposer(drafter).propose_from_hidden(requests, hidden)[0].tree)
    with pytest.raises(SpecserveError, match="proposer 'redrafter' needs redrafter heads; .* holds medusa heads"):
        load_heads_proposer(medusa_dir, TorchWorker(model), method="redrafter")
    with pytest.raises(SpecserveError, match="holds 'medusa' heads, not ReDrafter heads"):
        load_heads(medusa_dir, model.lm_head.weight, model.get_input_embeddings().weight)


def test_the_serve_builder_and_cli_know_the_redrafter(saved_drafter, tmp_path, monkeypatch, capsys):
    import argparse

    from specserve import cli
    from specserve.heads import require_heads
    from specserve.serve import check_heads
    from specserve.serve.config import AppArgs

    _, _, drafter_dir, medusa_dir = saved_drafter

    def args(heads, proposer="redrafter"):
        return AppArgs.model_validate({"target": {"model": "org/tiny", "heads": str(heads)},
                                       "speculation": {"proposer": proposer}})

    assert check_heads(args(drafter_dir)) == drafter_dir
    with pytest.raises(SpecserveError, match="holds medusa heads, not redrafter heads"):
        check_heads(args(medusa_dir))
    with pytest.raises(ValueError, match="needs heads on the target"):
        AppArgs.model_validate({"target": {"model": "org/tiny"}, "speculation": {"proposer": "redrafter"}})
    monkeypatch.setenv("SPECSERVE_HOME", str(tmp_path / "home"))
    with pytest.raises(SpecserveError, match=r"no Redrafter heads for m at .*m-redrafter; .*--method redrafter"):
        require_heads("m", "default", "redrafter")
    defaults = dict(target="t", draft=None)
    assert cli._default_proposer(argparse.Namespace(heads=str(drafter_dir), **defaults)) == "redrafter"
    argv = ["generate", "--target", "smollm2-135m-instruct", "--prompt", "x", "--proposer", "redrafter"]
    assert cli.main(argv + ["--heads", str(medusa_dir)]) == cli.EXIT_USAGE  # before any model is loaded
    assert "holds medusa heads, not redrafter heads" in capsys.readouterr().err
