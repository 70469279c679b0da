"""Hydra heads, co-located: path-conditioned heads, level-by-level trees, exactness (greedy and
sampled), files, and the wiring that picks the right heads. Tiny seeded random models."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import hf_greedy, make_hydra_decoder, tiny_heads, tiny_hydra_heads, tiny_model
from specserve.protocol import DETERMINISTIC, ProposeRequest, SamplingParams, SpecserveError, TreeSpec
from test_medusa import PROMPTS, SHAPES

# ---- the heads ----------------------------------------------------------------------------


def test_an_untrained_hydra_head_is_an_untrained_medusa_head():
    model = tiny_model("qwen2", seed=1)
    hydra, medusa = tiny_hydra_heads(model, num_heads=3), tiny_heads(model, num_heads=3)
    hidden, path = torch.randn(5, model.config.hidden_size), torch.randint(0, 97, (5, 3))
    torch.testing.assert_close(hydra(hidden, path), medusa(hidden))


def test_head_i_reads_the_first_i_plus_one_path_tokens():
    model = tiny_model("llama", seed=2)
    heads = tiny_hydra_heads(model, num_heads=3, noise=0.1)
    hidden = torch.randn(4, model.config.hidden_size)
    path = torch.randint(0, 97, (4, 3))
    other = path.clone()
    other[:, 2] = (other[:, 2] + 1) % 97  # only the last token differs
    a, b = heads(hidden, path), heads(hidden, other)
    torch.testing.assert_close(a[:2], b[:2])  # heads 0 and 1 never read path[:, 2]
    assert not torch.allclose(a[2], b[2])
    for i in range(3):  # the teacher-forced pass is the serving one, head by head
        torch.testing.assert_close(heads.head_logits(i, hidden, path[:, : i + 1]), a[i])
    with pytest.raises(SpecserveError, match="reads a path of 2 tokens"):
        heads.head_logits(1, hidden, path)


def test_heads_for_another_model_are_refused():
    from specserve.heads.hydra import HydraConfig, HydraHeads

    model = tiny_model("qwen2", seed=1)
    config = HydraConfig(hidden_size=32, vocab_size=97)
    with pytest.raises(SpecserveError, match="trained for another model"):
        HydraHeads(config, model.lm_head.weight, model.get_input_embeddings().weight)
    with pytest.raises(SpecserveError, match=">= 1 head"):
        HydraConfig(hidden_size=64, vocab_size=97, num_heads=0)


# ---- trees, level by level ------------------------------------------------------------------


class CountingHeads:
    """Wraps heads, counting `head_logits` calls (one per tree level, whatever the batch)."""

    def __init__(self, heads):
        self.inner, self.calls = heads, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def head_logits(self, index, hidden, path):
        self.calls.append((index, len(path)))
        return self.inner.head_logits(index, hidden, path)


def test_candidates_depend_on_their_path_and_each_level_is_one_batched_call():
    from specserve.proposers.hydra import HydraProposer

    model = tiny_model("qwen2", seed=1)
    heads = tiny_hydra_heads(model, num_heads=3, noise=0.2)
    counting = CountingHeads(heads)
    proposer = HydraProposer(counting)
    params = SamplingParams()
    static = SHAPES["static"]["tree"]  # (0,) (1,) (2,) (0, 0) (0, 1) (1, 0) (0, 0, 0)
    requests = [ProposeRequest("static", [4, 1], 3, params, 0, static),
                ProposeRequest("dynamic", [2], 3, params, 0, TreeSpec(budget=6, depth=3, width=2, min_score=0.0)),
                ProposeRequest("chain", [7, 8, 9], 8, params, 0),  # capped at the number of heads
                ProposeRequest("off", [1], 0, params, 0)]
    hidden = torch.randn(4, model.config.hidden_size)
    out = proposer.propose_from_hidden(requests, hidden)
    assert all(p.law == DETERMINISTIC and p.dists is None for p in out)
    assert [c[0] for c in counting.calls] == [0, 1, 2]  # one call per level, every request in it
    assert counting.calls[0][1] == 3  # the three roots (the request with k=0 drafts nothing)

    def top(index, b, path, n):
        logits = heads.head_logits(index, hidden[b: b + 1], torch.tensor([path]))[0]
        return logits.topk(n).indices.tolist()

    chain = out[2].tree
    assert chain.is_chain and len(chain) == 3
    a = top(0, 2, [9], 1)[0]
    b = top(1, 2, [9, a], 1)[0]
    assert list(chain.tokens) == [a, b, top(2, 2, [9, a, b], 1)[0]]

    tree = out[0].tree
    assert len(tree) == len(static.shape) and tree.parents == (-1, -1, -1, 0, 0, 1, 3)
    first = top(0, 0, [1], 3)
    assert list(tree.tokens[:3]) == first  # the root's children: head 0's top 3 after the root token
    assert list(tree.tokens[3:5]) == top(1, 0, [1, first[0]], 2)  # each node's children read its own path
    assert [tree.tokens[5]] == top(1, 0, [1, first[1]], 1)
    assert [tree.tokens[6]] == top(2, 0, [1, first[0], tree.tokens[3]], 1)

    assert len(out[1].tree) == 6 and max(out[1].tree.depths) <= 3
    assert len(out[3].tree) == 0


def test_dynamic_trees_score_paths_by_the_product_of_conditional_probabilities():
    """With a budget of two nodes and width 2, the second node is the root's second child
    exactly when p0(second) beats p0(first) * p1(best child of first | first)."""
    from specserve.proposers.hydra import HydraProposer

    model = tiny_model("llama", seed=4)
    heads = tiny_hydra_heads(model, num_heads=2, noise=0.3)
    hidden = torch.randn(1, model.config.hidden_size)
    spec = TreeSpec(budget=2, depth=2, width=2, min_score=0.0)
    [proposal] = HydraProposer(heads).propose_from_hidden([ProposeRequest("r", [3], 2, SamplingParams(), 0, spec)],
                                                          hidden)
    p0 = heads.head_logits(0, hidden, torch.tensor([[3]]))[0].softmax(-1)
    first, second = p0.topk(2).indices.tolist()
    p1 = heads.head_logits(1, hidden, torch.tensor([[3, first]]))[0].softmax(-1)
    deeper = float(p0[first] * p1.max())
    expected_parents = (-1, 0) if deeper > float(p0[second]) else (-1, -1)
    assert proposal.tree.parents == expected_parents


@pytest.mark.parametrize("temperatures", [[1.0, 0.01], [1.0, 100.0]])
def test_dynamic_trees_score_paths_at_the_heads_score_temperatures(temperatures):
    """A reranked tree of two nodes (from two levels of width 2) keeps the root's best child
    and the better of its second child and the first one's best child, scored with each
    head's logits divided by its score temperature: under a sharp second head the second
    node is the first one's child, under a flat one its sibling."""
    from specserve.proposers.hydra import HydraProposer

    model = tiny_model("llama", seed=4)
    heads = tiny_hydra_heads(model, num_heads=2, noise=0.3)
    heads.config.score_temperatures = temperatures
    hidden = torch.randn(1, model.config.hidden_size)
    spec = TreeSpec(budget=2, depth=2, width=2, min_score=0.0, rerank=True)
    [proposal] = HydraProposer(heads).propose_from_hidden([ProposeRequest("r", [3], 2, SamplingParams(), 0, spec)],
                                                          hidden)
    p0 = (heads.head_logits(0, hidden, torch.tensor([[3]]))[0] / temperatures[0]).softmax(-1)
    first, second = p0.topk(2).indices.tolist()
    p1 = (heads.head_logits(1, hidden, torch.tensor([[3, first]]))[0] / temperatures[1]).softmax(-1)
    deeper = float(p0[first] * p1.max())
    assert proposal.tree.parents == ((-1, 0) if deeper > float(p0[second]) else (-1, -1))
    assert proposal.tree.parents == ((-1, 0) if temperatures[1] < 1 else (-1, -1))


# ---- Hydra++ prefix attention ------------------------------------------------------------


def test_an_untrained_prefix_layer_changes_nothing():
    model = tiny_model("qwen2", seed=1)
    plain, prefixed = tiny_hydra_heads(model), tiny_hydra_heads(model, prefix_window=4)
    hidden, path = torch.randn(3, model.config.hidden_size), torch.randint(0, model.config.vocab_size, (3, 3))
    context = (torch.randn(3, 4, model.config.hidden_size), torch.tensor([[False, True, True, True]] * 3))
    torch.testing.assert_close(prefixed(hidden, path, context), plain(hidden, path))
    with pytest.raises(SpecserveError, match="attend over the prefix"):
        prefixed(hidden, path)


def test_the_prefix_layer_reads_only_the_valid_past_states():
    model = tiny_model("qwen2", seed=1)
    heads = tiny_hydra_heads(model, prefix_window=4, noise=0.2)
    hidden, path = torch.randn(2, model.config.hidden_size), torch.randint(0, model.config.vocab_size, (2, 3))
    states = torch.randn(2, 4, model.config.hidden_size)
    valid = torch.tensor([[False, False, True, True]] * 2)
    other = states.clone()
    other[:, :2] = torch.randn(2, 2, model.config.hidden_size)  # masked slots: free to differ
    torch.testing.assert_close(heads(hidden, path, (states, valid)), heads(hidden, path, (other, valid)))
    other[:, 2] += 1.0  # a valid one: not
    assert not torch.allclose(heads(hidden, path, (states, valid)), heads(hidden, path, (other, valid)))


def test_hidden_contexts_keep_the_last_window_and_survive_a_replayed_round():
    from specserve.proposers.heads import HiddenContexts

    contexts = HiddenContexts(window=4)
    rows = torch.arange(10.0)[:, None]  # the hidden state of token p is [p]
    contexts.observe("a", 2, rows[2:3])  # the prompt's last token
    contexts.observe("a", 3, rows[3:6])  # a round that committed tokens 3, 4, 5
    states, valid = contexts.batch(["a"])
    assert states[0, :, 0].tolist() == [2, 3, 4, 5] and valid.all()
    contexts.observe("a", 4, rows[4:5] + 100)  # the same request verified again from token 4
    states, valid = contexts.batch(["a"])
    assert states[0, valid[0], 0].tolist() == [2, 3, 104]
    contexts.observe("b", 7, rows[7:8])
    states, valid = contexts.batch(["b", "a"])
    assert valid.tolist() == [[False, False, False, True], [False, True, True, True]]
    contexts.observe("a", 9, rows[9:10])  # a gap (the request came back from another replica)
    assert contexts.batch(["a"])[1].sum() == 1
    contexts.release("a")
    contexts.release("b")
    assert len(contexts) == 0


@pytest.mark.parametrize("shape", ["chain", "dynamic"])
def test_greedy_hydra_with_prefix_attention_equals_target_alone(shape):
    target = tiny_model("qwen2", seed=11)
    heads = tiny_hydra_heads(target, noise=0.02, prefix_window=6)
    decoder = make_hydra_decoder(target, heads, **SHAPES[shape])
    outs = decoder.generate(PROMPTS, SamplingParams(max_tokens=24))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(target, prompt, 24)
    assert decoder.last_report.stats.num_accepted_tokens > 0
    assert len(decoder.verifier.heads.contexts) == 0  # finished requests leave no window behind


# ---- files and wiring ---------------------------------------------------------------------


@pytest.fixture
def saved_heads(tmp_path):
    """A tiny target, and Hydra and Medusa heads for it saved to directories."""
    model = tiny_model("qwen2", seed=3)
    hydra = tiny_hydra_heads(model, num_heads=2, noise=0.1, head_vocab_size=60)
    hydra.save(tmp_path / "hydra")
    tiny_heads(model, num_heads=2).save(tmp_path / "medusa")
    return model, hydra, tmp_path / "hydra", tmp_path / "medusa"


def test_loading_builds_the_proposer_the_directory_holds(saved_heads):
    from specserve.engine.torch_worker import TorchWorker
    from specserve.loading import load_heads_proposer
    from specserve.proposers.hydra import HydraProposer
    from specserve.proposers.medusa import MedusaProposer

    model, hydra, hydra_dir, medusa_dir = saved_heads
    worker = TorchWorker(model)
    loaded = load_heads_proposer(hydra_dir, worker)
    assert isinstance(loaded, HydraProposer) and loaded.method == "hydra"
    assert isinstance(load_heads_proposer(medusa_dir, worker), MedusaProposer)
    assert json.loads((hydra_dir / "config.json").read_text())["method"] == "hydra"
    spec = TreeSpec(shape=((0,), (1,), (0, 0), (1, 0)))
    requests = [ProposeRequest("r", [5, 9], 2, SamplingParams(), 0, spec)]
    hidden = torch.randn(1, model.config.hidden_size)
    assert (loaded.propose_from_hidden(requests, hidden)[0].tree
            == HydraProposer(hydra).propose_from_hidden(requests, hidden)[0].tree)
    with pytest.raises(SpecserveError, match="proposer 'hydra' needs hydra heads; .* holds medusa heads"):
        load_heads_proposer(medusa_dir, worker, method="hydra")
    with pytest.raises(SpecserveError, match="holds 'hydra' heads, not Medusa heads"):
        from specserve.heads.medusa import load_heads

        load_heads(hydra_dir, model.lm_head.weight)


def test_heads_of_another_method_or_missing_heads_are_refused(saved_heads, tmp_path, monkeypatch):
    from specserve.heads import require_heads

    _, _, hydra_dir, medusa_dir = saved_heads
    assert require_heads("m", str(hydra_dir), "hydra") == hydra_dir
    assert require_heads("m", str(hydra_dir)) == hydra_dir  # no method asked: whatever is there
    with pytest.raises(SpecserveError, match="holds medusa heads, not hydra heads: use proposer 'medusa'"):
        require_heads("m", str(medusa_dir), "hydra")
    monkeypatch.setenv("SPECSERVE_HOME", str(tmp_path / "home"))
    with pytest.raises(SpecserveError, match=r"no Hydra heads for m at .*m-hydra; .*train-heads --method hydra"):
        require_heads("m", "default", "hydra")


def test_the_serve_builder_checks_the_heads_method_and_resolves_default(saved_heads, tmp_path, monkeypatch):
    from specserve.serve import check_heads
    from specserve.serve.config import AppArgs

    _, _, hydra_dir, medusa_dir = saved_heads
    hub = "org/tiny"  # a Hub id: the builder leaves the shape check to the replicas

    def args(heads, proposer="hydra"):
        return AppArgs.model_validate({"target": {"model": hub, "heads": str(heads)},
                                       "speculation": {"proposer": proposer}})

    assert check_heads(args(hydra_dir)) == hydra_dir
    with pytest.raises(SpecserveError, match="holds medusa heads, not hydra heads"):
        check_heads(args(medusa_dir))
    with pytest.raises(SpecserveError, match="holds hydra heads, not medusa heads"):
        check_heads(args(hydra_dir, "medusa"))
    assert check_heads(args(medusa_dir, "none")) == medusa_dir  # per-request proposers only
    home = tmp_path / "home"
    monkeypatch.setenv("SPECSERVE_HOME", str(home))
    hydra_default = home / "heads" / "org--tiny-hydra"
    tiny_hydra_heads(tiny_model("qwen2", seed=3), num_heads=2).save(hydra_default)
    assert check_heads(args("default")) == hydra_default


def test_cli_generate_picks_and_checks_the_heads_method(saved_heads, capsys):
    import argparse

    from specserve import cli

    _, _, hydra_dir, medusa_dir = saved_heads
    argv = ["generate", "--target", "smollm2-135m-instruct", "--prompt", "x", "--proposer", "hydra"]
    assert cli.main(argv + ["--heads", str(medusa_dir)]) == cli.EXIT_USAGE  # before any model is loaded
    assert "holds medusa heads, not hydra heads" in capsys.readouterr().err
    defaults = dict(target="t", draft=None)
    assert cli._default_proposer(argparse.Namespace(heads=str(hydra_dir), **defaults)) == "hydra"
    assert cli._default_proposer(argparse.Namespace(heads=str(medusa_dir), **defaults)) == "medusa"
    assert cli._default_proposer(argparse.Namespace(heads=None, **defaults)) == "none"
