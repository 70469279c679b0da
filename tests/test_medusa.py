"""Medusa heads, co-located: exactness (greedy and sampled), draw laws, typical acceptance (lossy),
one target pass per round. Tiny seeded random models; real weights are in test_real_models.py."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import empirical_pairs, make_medusa_decoder, tiny_heads, tiny_hydra_heads, tiny_model, tiny_redrafter
from specserve.protocol import (
    DETERMINISTIC, SAMPLED, Proposal, ProposeRequest, SamplingParams, Speculation, SparseDist, SpecserveError,
    TokenTree, TreeSpec, VerifyRequest,
)
from specserve.sampling import generator_for
from test_decoder import SMALL_VOCAB, tv

PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23, 24, 25, 26]]
SHAPES = {
    "chain": dict(shape="chain", k=3),
    "static": dict(shape="tree", tree=TreeSpec(shape=((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))),
    "dynamic": dict(shape="tree", tree=TreeSpec(budget=10, depth=3, width=3, min_score=0.0)),
    "reranked": dict(shape="tree", tree=TreeSpec(budget=6, depth=3, width=3, min_score=0.0, rerank=True)),
}


# ---- deterministic candidates: the verifier is lossless for point-mass proposals ------------

def _deterministic_round(p_root, p_next, root_candidates, next_candidates, gen):
    """Verify a fixed 2-level tree of chosen (not drawn) candidates; first two emitted tokens."""
    from specserve.sampling import accept_rejection_tree

    tokens, parents, p_rows = [], [], [p_root]
    for x in root_candidates:
        tokens.append(x), parents.append(-1), p_rows.append(p_next[x])
    for parent in range(len(root_candidates)):
        for x in next_candidates:
            tokens.append(x), parents.append(parent), p_rows.append(torch.full_like(p_root, 1 / len(p_root)))
    out = accept_rejection_tree(TokenTree(tuple(tokens), tuple(parents)), None, torch.stack(p_rows), gen)
    if len(out) == 1:  # every root candidate rejected: the second token comes from the next round
        out.append(int(torch.multinomial(p_next[out[0]], 1, generator=gen)))
    return out[:2]


def test_deterministic_sibling_candidates_emit_the_target_distribution():
    """Three chosen candidates at the root and two under each, tried in order with the
    residual updated after each rejection: the first two tokens follow the target's joint
    distribution, with an error that shrinks with samples."""
    torch.manual_seed(4)
    vocab = 5
    p_root = torch.softmax(torch.randn(vocab) * 1.5, -1)
    p_next = torch.softmax(torch.randn(vocab, vocab) * 1.5, -1)
    exact = (p_root[:, None] * p_next).flatten()
    root_candidates = p_root.argsort()[:3].tolist()  # the target's three LEAST likely: far off
    next_candidates = [0, 1]

    def draw(gen):
        return _deterministic_round(p_root, p_next, root_candidates, next_candidates, gen)

    errors = [tv(empirical_pairs(draw, vocab, n, seed=n), exact) for n in (300, 12000)]
    assert errors[1] < errors[0] and errors[1] < 0.03
    random_refs = [tv(torch.softmax(torch.randn(vocab * vocab) * 1.5, -1), exact) for _ in range(20)]
    assert errors[1] < min(random_refs) / 4


def test_a_top_k_tree_verified_as_if_sampled_would_be_inexact():
    """Why proposals state their law: the same top-2 candidates sent with their true q (as if
    drawn from q) shift the output distribution; sent as deterministic they are exact."""
    from specserve.sampling import accept_rejection_tree

    p = torch.tensor([0.4, 0.3, 0.3])
    q = torch.tensor([0.5, 0.45, 0.05])
    tree = TokenTree((0, 1), (-1, -1))  # q's top two, chosen, not drawn
    rows = torch.stack([p, p, p])

    def first_tokens(draft_probs, n=6000):
        gen = generator_for(1)
        counts = torch.zeros(3)
        for _ in range(n):
            counts[accept_rejection_tree(tree, draft_probs, rows, gen)[0]] += 1
        return counts / n

    assert tv(first_tokens(torch.stack([q, q])), p) > 0.1  # token 2 is almost never emitted
    assert tv(first_tokens(None), p) < 0.02


def test_a_proposal_must_state_its_law_consistently():
    tree = TokenTree.chain([1, 2])
    dist = SparseDist(np.array([[1], [2]]), np.array([[1.0], [1.0]], dtype=np.float32))
    with pytest.raises(SpecserveError, match="sampled drafts need"):
        Proposal("r", tree, SAMPLED)
    with pytest.raises(SpecserveError, match="deterministic drafts carry no draft distribution"):
        Proposal("r", tree, DETERMINISTIC, dist)
    with pytest.raises(SpecserveError, match="unknown draw law"):
        Proposal("r", tree, "top-k")
    with pytest.raises(SpecserveError, match="sampled drafts need"):
        VerifyRequest("r", [1], SamplingParams(temperature=1.0), 0, tree, SAMPLED)


def test_the_verifier_refuses_sampled_nodes_that_cannot_have_been_sampled():
    from specserve.engine.torch_worker import TorchWorker
    from specserve.verifier import Verifier

    verifier = Verifier(TorchWorker(tiny_model("qwen2", seed=2)))
    params = SamplingParams(temperature=1.0)
    q_without_token_2 = SparseDist(np.array([[1, 3]]), np.array([[0.5, 0.5]], dtype=np.float32))
    with pytest.raises(SpecserveError, match="probability 0 under the distribution it was sampled from"):
        verifier.verify([VerifyRequest("r", [1, 2], params, 0, TokenTree.chain([2]), SAMPLED, q_without_token_2)])
    twice = SparseDist(np.array([[4, 5], [4, 5]]), np.array([[0.5, 0.5], [0.5, 0.5]], dtype=np.float32))
    with pytest.raises(SpecserveError, match="distinct"):
        verifier.verify([VerifyRequest("s", [1, 2], params, 0, TokenTree((4, 4), (-1, -1)), SAMPLED, twice)])


# ---- the worker's hidden states ---------------------------------------------------------

def test_worker_returns_the_models_last_hidden_state_for_every_row():
    from specserve.engine.torch_worker import ForwardItem, TorchWorker

    model = tiny_model("llama", seed=3)
    worker = TorchWorker(model)
    prompt, tree = [4, 8, 15, 16], TokenTree((23, 42, 7), (-1, 0, -1))
    [rows] = worker.run([ForwardItem("r", prompt, tree)])
    with torch.no_grad():
        for row, branch in ((0, []), (1, [23]), (2, [23, 42]), (3, [7])):
            expected = model.model(torch.tensor([prompt + branch])).last_hidden_state[0, -1]
            torch.testing.assert_close(rows.hidden[row], expected, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(rows.logits[row], model.lm_head(expected), atol=1e-4, rtol=1e-4)


# ---- trees from heads -------------------------------------------------------------------

def test_heads_propose_static_dynamic_and_chain_shapes_from_one_batched_pass():
    from specserve.proposers.medusa import MedusaProposer

    model = tiny_model("qwen2", seed=1)
    heads = tiny_heads(model, num_heads=3, noise=0.05)
    proposer = MedusaProposer(heads)
    params = SamplingParams()
    static = SHAPES["static"]["tree"]
    requests = [ProposeRequest("static", [1], 3, params, 0, static),
                ProposeRequest("dynamic", [1], 3, params, 0, TreeSpec(budget=5, depth=3, width=2, min_score=0.0)),
                ProposeRequest("chain", [1], 8, params, 0),  # capped at the number of heads
                ProposeRequest("off", [1], 0, params, 0)]
    hidden = torch.randn(4, model.config.hidden_size)
    out = proposer.propose_from_hidden(requests, hidden)
    assert all(p.law == DETERMINISTIC and p.dists is None for p in out)
    assert len(out[0].tree) == len(static.shape) and out[0].tree.ranks()[:3] == [0, 1, 2]
    assert len(out[1].tree) == 5 and max(out[1].tree.depths) <= 3
    assert out[2].tree.is_chain and len(out[2].tree) == 3
    assert len(out[3].tree) == 0
    logits = heads(hidden)  # head d's top-1 is the chain's node d
    assert list(out[2].tree.tokens) == logits[:, 2].argmax(-1).tolist()
    siblings = [out[0].tree.tokens[i] for i in range(3)]  # the root's children: head 0's top 3
    assert siblings == logits[0, 0].topk(3).indices.tolist()


@pytest.mark.parametrize("make_heads", [tiny_heads, tiny_hydra_heads, tiny_redrafter])
def test_served_heads_project_every_head_and_row_in_one_product(make_heads):
    """Serving puts the heads' shared projection on the target's linear kernel (oneDNN-prepacked
    on CPU): one product for every head and row, with the logits of one product per head."""
    from specserve.engine.torch_worker import TorchWorker
    from specserve.loading import serving_heads

    model = tiny_model("qwen2", seed=1)
    worker = TorchWorker(model)
    heads = make_heads(model, noise=0.05, head_vocab_size=40)
    features = torch.randn(3, 4, model.config.hidden_size)
    per_head = torch.stack([f @ heads.shared_lm_head.T for f in features])
    assert heads.projection_kernel is None
    torch.testing.assert_close(heads.project(features), per_head, atol=1e-5, rtol=1e-4)
    served = serving_heads(heads, worker)
    assert served.projection_kernel is not None and served.projection_kernel.packed == worker.prepacked
    torch.testing.assert_close(served.project(features), per_head, atol=1e-5, rtol=1e-4)


def test_medusa_heads_with_their_own_projections_keep_one_product_per_head():
    from specserve.engine.torch_worker import TorchWorker
    from specserve.heads.medusa import MedusaConfig, MedusaHeads
    from specserve.loading import serving_heads

    model = tiny_model("qwen2", seed=1)
    config = MedusaConfig(model.config.hidden_size, model.config.vocab_size, num_heads=2, own_lm_head=True)
    heads = MedusaHeads(config, model.lm_head.weight).requires_grad_(False)
    with torch.no_grad():
        heads.lm_heads[1].mul_(2.0)  # the heads' projections differ
    hidden = torch.randn(3, model.config.hidden_size)
    assert serving_heads(heads, TorchWorker(model)).projection_kernel is None
    logits = heads(hidden)
    for h in range(2):
        torch.testing.assert_close(logits[h], heads.features(hidden)[h] @ heads.lm_heads[h].T)
    with pytest.raises(SpecserveError, match="own projections"):
        heads.use_projection_kernel(lambda x: x)


def test_a_held_proposal_is_cut_to_the_rounds_depth():
    tree = TokenTree((1, 2, 3, 4), (-1, 0, -1, 1))
    dist = SparseDist(np.arange(4)[:, None], np.ones((4, 1), dtype=np.float32))
    cut = Proposal("r", tree, SAMPLED, dist).truncated(2)
    assert cut.tree == TokenTree((1, 2, 3), (-1, 0, -1)) and cut.dists.ids.tolist() == [[0], [1], [2]]


# ---- exactness end to end (every head method: test_co_located.py) ------------------------


def exact_second_and_third_tokens(model, prompt, params) -> torch.Tensor:
    """p(t2, t3 | prompt), t1 summed out, by enumeration: [V * V]. Heads propose from the
    previous round's pass, so a request's first token is never drafted; its second and third
    are (a depth-2 tree in round two)."""
    from specserve.sampling import target_probs

    V = SMALL_VOCAB
    with torch.no_grad():
        p1 = target_probs(model(torch.tensor([prompt])).logits[0, -1:], params)[0]
        p2 = target_probs(model(torch.tensor([prompt + [a] for a in range(V)])).logits[:, -1], params)
        rows = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])
        p3 = target_probs(model(rows).logits[:, -1], params).view(V, V, V)
    return (p1[:, None, None] * p2[:, :, None] * p3).sum(0).flatten()


def empirical_second_and_third_tokens(decoder, prompt, params, n, seed_base) -> torch.Tensor:
    outs = decoder.generate([prompt] * n, [replace(params, seed=seed_base + i) for i in range(n)])
    counts = torch.zeros(SMALL_VOCAB * SMALL_VOCAB)
    for o in outs:
        counts[o.token_ids[1] * SMALL_VOCAB + o.token_ids[2]] += 1
    return counts / n


def test_typical_acceptance_is_lossy_and_labelled():
    """Opt-in typical acceptance accepts plausible candidates outright, so the output drifts
    from the target's distribution; exact acceptance on the same heads does not. Responses
    say which one produced them."""
    target = tiny_model("qwen2", seed=5, vocab_size=SMALL_VOCAB)
    prompt = [1, 2, 3]
    params = SamplingParams(temperature=1.0, max_tokens=4)
    exact = exact_second_and_third_tokens(target, prompt, params)
    decoder = make_medusa_decoder(target, tiny_heads(target, num_heads=2), shape="chain", k=2)
    typical = empirical_second_and_third_tokens(_with(decoder, acceptance="typical"), prompt, params, 4000, 1)
    lossless = empirical_second_and_third_tokens(_with(decoder, acceptance="exact"), prompt, params, 4000, 1)
    assert tv(typical, exact) > 0.1 > 0.05 > tv(lossless, exact)
    [out] = decoder.generate([prompt], params, acceptance="typical")
    assert out.speculation["acceptance"] == "typical (lossy)" and out.speculation["lossy"] is True
    [out] = decoder.generate([prompt], params)
    assert out.speculation["acceptance"] == "exact" and out.speculation["lossy"] is False
    assert Speculation(acceptance="typical").describe().endswith("typical acceptance (LOSSY)")


def _with(decoder, **changes):
    decoder.speculation = replace(decoder.speculation, **changes)
    return decoder


def test_medusa_needs_heads_and_bad_settings_get_clear_errors():
    from specserve.decoder import SpeculativeDecoder
    from specserve.engine.torch_worker import TorchWorker
    from specserve.verifier import Verifier

    target = tiny_model("qwen2", seed=1)
    with pytest.raises(SpecserveError, match="needs heads on the target"):
        SpeculativeDecoder(Verifier(TorchWorker(target)), speculation=Speculation(proposer="medusa"))
    decoder = make_medusa_decoder(target)
    with pytest.raises(SpecserveError, match="needs a draft model"):
        decoder.generate([[1]], proposer="draft")
    with pytest.raises(SpecserveError, match="unknown speculation shape"):
        decoder.generate([[1]], shape="star")
    with pytest.raises(SpecserveError, match="unknown acceptance"):
        decoder.generate([[1]], acceptance="fast")
    with pytest.raises(SpecserveError, match="not both"):
        decoder.generate([[1]], method="tree", proposer="medusa")


def test_older_method_names_map_to_proposer_and_shape():
    assert Speculation().overridden(method="tree") == Speculation(proposer="draft", shape="tree")
    assert Speculation().overridden(method="none").proposer == "none"
    assert Speculation().overridden(method="medusa").proposer == "medusa"
    assert Speculation().overridden(method="hydra").proposer == "hydra"
    with pytest.raises(SpecserveError, match="write `proposer`"):
        Speculation().overridden(method="eagle")
