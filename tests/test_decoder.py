"""End-to-end exactness of speculative decoding on tiny random models (fp32)."""

from dataclasses import replace

import itertools

import pytest
import torch

from conftest import hf_greedy, make_decoder, perturbed, tiny_model
from specserve.protocol import SamplingParams, SpecserveError

PROMPTS = [[5, 17, 3], [40, 2, 2, 9, 61, 7, 13, 1, 88], [12], [30, 31, 32, 33, 34, 35]]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("k", [1, 3, 4, 8])
def test_greedy_output_equals_target_alone(arch, k):
    target = tiny_model(arch, seed=11)
    draft = perturbed(target, scale=0.1)
    decoder = make_decoder(target, draft, k=k)
    outs = decoder.generate(PROMPTS, SamplingParams(max_tokens=24))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(target, prompt, 24)
        assert out.finish_reason == "length"
    stats = decoder.last_report.stats
    # the draft is good but not perfect: both paths of acceptance are exercised
    assert 0.2 < stats.acceptance_rate < 0.95
    assert stats.mean_accepted_length > 1.2


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_an_int8_draft_keeps_the_greedy_output_exact(arch):
    """The draft's linears in int8 change what it proposes, never what is output."""
    from specserve.engine.torch_worker import Int8Linear

    target = tiny_model(arch, seed=11)
    decoder = make_decoder(target, perturbed(target, scale=0.1), k=4, draft_quantize="int8")
    assert all(isinstance(layer.gate_up, Int8Linear) for layer in decoder.proposer.worker.layers)
    outs = decoder.generate(PROMPTS, SamplingParams(max_tokens=24))
    assert [o.token_ids for o in outs] == [hf_greedy(target, p, 24) for p in PROMPTS]
    stats = decoder.last_report.stats
    assert stats.num_draft_tokens > 0 and stats.mean_accepted_length > 1.2


def test_target_only_method_equals_target_alone(qwen_pair):
    target, _ = qwen_pair
    outs = make_decoder(target).generate(PROMPTS, SamplingParams(max_tokens=16))
    assert [o.token_ids for o in outs] == [hf_greedy(target, p, 16) for p in PROMPTS]
    assert all(o.stats.target_steps == 16 for o in outs)


def test_per_request_method_and_k_override(qwen_pair):
    target, draft = qwen_pair
    decoder = make_decoder(target, draft, k=4)
    [spec] = decoder.generate([PROMPTS[1]], SamplingParams(max_tokens=20))
    [plain] = decoder.generate([PROMPTS[1]], SamplingParams(max_tokens=20), method="none")
    [k1] = decoder.generate([PROMPTS[1]], SamplingParams(max_tokens=20), k=1)
    assert spec.token_ids == plain.token_ids == k1.token_ids
    assert plain.stats.num_draft_tokens == 0 and spec.stats.num_draft_tokens > 0
    assert max(len(k1.stats.num_accepted_tokens_per_pos), 1) == 1


def test_eos_stops_generation_exactly_where_the_target_would(qwen_pair):
    target, draft = qwen_pair
    free_run = hf_greedy(target, PROMPTS[0], 30)
    eos = free_run[6]  # a token the target emits mid-stream: declare it EOS
    expected = hf_greedy(target, PROMPTS[0], 30, eos_token_id=eos)
    assert expected[-1] == eos and len(expected) <= 7
    for k in (2, 5):
        [out] = make_decoder(target, draft, k=k, eos_token_ids=[eos]).generate([PROMPTS[0]], SamplingParams(max_tokens=30))
        assert out.token_ids == expected and out.finish_reason == "stop"
    [ignored] = make_decoder(target, draft, eos_token_ids=[eos]).generate(
        [PROMPTS[0]], SamplingParams(max_tokens=30, ignore_eos=True))
    assert ignored.token_ids == free_run


def test_caches_are_released_when_requests_finish(qwen_pair):
    target, draft = qwen_pair
    decoder = make_decoder(target, draft)
    decoder.generate(PROMPTS, SamplingParams(max_tokens=5))
    assert decoder.verifier.worker.cache_stats()["requests"] == 0
    assert decoder.proposer.worker.cache_stats()["requests"] == 0


# ---- sampling: the output distribution is the target's ----------------------------------

SMALL_VOCAB = 8


def exact_two_token_distribution(model, prompt, params) -> torch.Tensor:
    """p(t1, t2 | prompt) under the processed target distribution, by enumeration: [V * V]."""
    from specserve.sampling import target_probs

    with torch.no_grad():
        p1 = target_probs(model(torch.tensor([prompt])).logits[0, -1:], params)[0]
        rows = torch.tensor([prompt + [t] for t in range(SMALL_VOCAB)])
        p2 = target_probs(model(rows).logits[:, -1], params)
    return (p1[:, None] * p2).flatten()


def empirical_two_token_distribution(decoder, prompt, params, n, seed_base) -> torch.Tensor:
    outs = decoder.generate([prompt] * n, [SamplingParams(**{**params.__dict__, "seed": seed_base + i}) for i in range(n)])
    counts = torch.zeros(SMALL_VOCAB * SMALL_VOCAB)
    for o in outs:
        counts[o.token_ids[0] * SMALL_VOCAB + o.token_ids[1]] += 1
    return counts / n


def tv(a, b) -> float:
    return 0.5 * float((a - b).abs().sum())


def assert_converges(empirical, exact, sizes=(500, 8000), tolerance: float = 0.05) -> list[float]:
    """`empirical(n)` (n samples) gets closer to `exact` as n grows, and ends within `tolerance`
    total variation. Returns the errors."""
    errors = [tv(empirical(n), exact) for n in sizes]
    assert errors[1] < errors[0] and errors[1] < tolerance, errors
    return errors


@pytest.mark.parametrize("params,top_m,draft_quantize", [
    (SamplingParams(temperature=1.0, max_tokens=2), 64, None),
    (SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_tokens=2), 64, None),
    (SamplingParams(temperature=1.0, max_tokens=2), 3, None),  # drafts from a top-3 truncation: still exact
    (SamplingParams(temperature=1.0, max_tokens=2), 64, "int8"),  # the draft's own int8 distribution
], ids=["t1", "t0.7-topk5-topp0.9", "t1-draft-top3", "t1-int8-draft"])
def test_sampled_output_follows_the_target_distribution(params, top_m, draft_quantize):
    target = tiny_model("qwen2", seed=5, vocab_size=SMALL_VOCAB)
    draft = perturbed(target, scale=0.5, seed=9)
    prompt = [1, 2, 3]
    exact = exact_two_token_distribution(target, prompt, params)
    assert tv(exact, exact_two_token_distribution(draft, prompt, params)) > 0.05  # a real gap to close
    decoder = make_decoder(target, draft, k=2, top_m=top_m, draft_quantize=draft_quantize)
    errors = assert_converges(lambda n: empirical_two_token_distribution(decoder, prompt, params, n, seed_base=n), exact)
    torch.manual_seed(0)
    random_refs = [tv(torch.distributions.Dirichlet(torch.ones(len(exact))).sample(), exact) for _ in range(10)]
    assert errors[1] < min(random_refs) / 4
    assert decoder.last_report.stats.num_draft_tokens > 0


def test_identical_draft_is_accepted_almost_always():
    target = tiny_model("qwen2", seed=6)
    decoder = make_decoder(target, target, k=4, top_m=97)  # no truncation of the draft
    decoder.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=40, seed=0))
    assert decoder.last_report.stats.acceptance_rate > 0.99


def test_same_seed_same_output(qwen_pair):
    target, draft = qwen_pair
    decoder = make_decoder(target, draft)
    runs = [decoder.generate(PROMPTS, SamplingParams(temperature=1.0, top_p=0.95, max_tokens=20, seed=s))
            for s in (7, 7, 8)]
    ids = [[o.token_ids for o in run] for run in runs]
    assert ids[0] == ids[1]
    assert ids[0] != ids[2]


# ---- bad input ----------------------------------------------------------------------------

def test_bad_requests_get_clear_errors(qwen_pair):
    target, draft = qwen_pair
    decoder = make_decoder(target, draft)
    with pytest.raises(SpecserveError, match="empty"):
        decoder.generate([[]])
    with pytest.raises(SpecserveError, match="k .* must be in"):
        decoder.generate([[1]], k=-1)
    with pytest.raises(SpecserveError, match="unknown speculation method"):
        decoder.generate([[1]], method="medusa-typo")
    with pytest.raises(SpecserveError, match="context"):
        decoder.generate([[1] * 512])
    with pytest.raises(SpecserveError, match="needs a draft model"):
        make_decoder(target).generate([[1]], method="draft")
    with pytest.raises(SpecserveError, match="temperature"):
        SamplingParams(temperature=-1)


def test_generation_stops_at_the_context_length(qwen_pair):
    target, draft = qwen_pair
    [out] = make_decoder(target, draft).generate([[3] * 500], SamplingParams(max_tokens=100))
    assert len(out.token_ids) == 12 and out.finish_reason == "length"


def test_greedy_tree_rounds_equal_the_target_alone(qwen_pair):
    """Rounds with a 2x2 draft tree (the draft's top-2 tokens, each extended by its argmax),
    verified in one target pass with tree attention: output equals the target alone, and the
    compaction of non-chain accepted paths keeps both caches right across rounds."""
    from specserve.engine.torch_worker import ForwardItem, TorchWorker
    from specserve.protocol import TokenTree, VerifyRequest
    from specserve.verifier import Verifier

    target, draft = qwen_pair
    draft_worker, verifier = TorchWorker(draft), Verifier(TorchWorker(target))
    ids = list(PROMPTS[1])
    accepted_second_branch = 0
    while len(ids) - len(PROMPTS[1]) < 30:
        [root] = draft_worker.forward([ForwardItem("r", ids)])
        first = torch.topk(root[-1], 2).indices.tolist()
        [rows] = draft_worker.forward([ForwardItem("r", ids, TokenTree(tuple(first), (-1, -1)))])
        tree = TokenTree(tuple(first) + (int(rows[1].argmax()), int(rows[2].argmax())), (-1, -1, 0, 1))
        [result] = verifier.verify([VerifyRequest("r", ids, SamplingParams(), 0, tree)])
        accepted_second_branch += result.num_accepted > 0 and result.tokens[0] == first[1]
        ids += result.tokens
    out = ids[len(PROMPTS[1]):][:30]
    assert out == hf_greedy(target, PROMPTS[1], 30)
    assert accepted_second_branch > 0  # the non-chain path (compaction moves KV) was exercised


# ---- tree speculation through the decoder ---------------------------------------------------

TREE_SPECS = {
    "dynamic-16": dict(budget=16, depth=6, width=4, min_score=0.0),
    "dynamic-8-narrow": dict(budget=8, depth=8, width=2, min_score=0.0),
    "reranked-8": dict(budget=8, depth=6, width=3, min_score=0.0, rerank=True),
    "static": dict(shape=[[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]),
}


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("spec", sorted(TREE_SPECS))
def test_greedy_tree_output_equals_target_alone(arch, spec):
    from specserve.protocol import TreeSpec

    target = tiny_model(arch, seed=11)
    draft = perturbed(target, scale=0.15)
    decoder = make_decoder(target, draft, method="tree")
    decoder.speculation = replace(decoder.speculation, tree=TreeSpec(**TREE_SPECS[spec]))
    outs = decoder.generate(PROMPTS, SamplingParams(max_tokens=24))  # a batch of four trees per round
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(target, prompt, 24)
    stats = decoder.last_report.stats
    assert stats.mean_accepted_length > 1.2
    # a second-ranked child was accepted: the branches are real, and so is the compaction
    assert len(stats.num_accepted_tokens_per_rank) > 1 and stats.num_accepted_tokens_per_rank[1] > 0


def test_a_tree_accepts_more_per_round_than_a_chain_of_its_depth(qwen_pair):
    from specserve.protocol import TreeSpec

    target, _ = qwen_pair
    draft = perturbed(target, scale=0.3)
    decoder = make_decoder(target, draft, k=4)
    decoder.proposer.min_confidence = 0.0  # a full chain of 4 every round
    [chain] = decoder.generate([PROMPTS[1]], SamplingParams(max_tokens=40))
    [tree] = decoder.generate([PROMPTS[1]], SamplingParams(max_tokens=40), method="tree",
                              tree=TreeSpec(budget=32, depth=4, width=8, min_score=0.0))
    assert tree.token_ids == chain.token_ids
    assert tree.stats.mean_accepted_length > chain.stats.mean_accepted_length


@pytest.mark.parametrize("spec", [
    dict(shape=[[0], [1], [2], [0, 0], [0, 1], [1, 0]]),  # three siblings at the root, two below
    dict(budget=6, depth=2, width=3, min_score=0.0),
    dict(budget=4, depth=2, width=3, min_score=0.0, rerank=True),  # drawn children: grown under the budget
], ids=["static", "dynamic", "reranked"])
def test_sampled_tree_output_follows_the_target_distribution(spec):
    from specserve.protocol import TreeSpec

    params = SamplingParams(temperature=1.0, max_tokens=2)
    target = tiny_model("qwen2", seed=5, vocab_size=SMALL_VOCAB)
    draft = perturbed(target, scale=0.5, seed=9)
    prompt = [1, 2, 3]
    exact = exact_two_token_distribution(target, prompt, params)
    decoder = make_decoder(target, draft, method="tree", top_m=64)
    decoder.speculation = replace(decoder.speculation, tree=TreeSpec(**spec))
    assert_converges(lambda n: empirical_two_token_distribution(decoder, prompt, params, n, seed_base=n), exact)
    stats = decoder.last_report.stats
    assert stats.num_reached_tokens_per_rank[2] > 0 and stats.num_accepted_tokens_per_rank[1] > 0


def test_identical_draft_tree_accepts_its_first_children():
    from specserve.protocol import TreeSpec

    target = tiny_model("qwen2", seed=6)
    decoder = make_decoder(target, target, method="tree", top_m=97)
    decoder.speculation = replace(decoder.speculation, tree=TreeSpec(budget=12, depth=4, width=3, min_score=0.0))
    decoder.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=40, seed=0))
    stats = decoder.last_report.stats
    assert stats.num_accepted_tokens_per_rank[0] / stats.num_reached_tokens_per_rank[0] > 0.99


def test_same_seed_same_tree_output(qwen_pair):
    from specserve.protocol import TreeSpec

    target, draft = qwen_pair
    decoder = make_decoder(target, draft, method="tree")
    decoder.speculation = replace(decoder.speculation, tree=TreeSpec(budget=12, depth=4, min_score=0.0))  # tiny random models are unsure of everything
    runs = [decoder.generate(PROMPTS, SamplingParams(temperature=0.8, max_tokens=20, seed=s)) for s in (3, 3, 4)]
    ids = [[o.token_ids for o in run] for run in runs]
    assert ids[0] == ids[1] and ids[0] != ids[2]


# ---- the load-aware policy: k varies from round to round --------------------------------


class RandomDepthPolicy:
    """A policy that drafts a random depth (0..k) every round: exactness must not depend on it."""

    def __init__(self, seed: int):
        import random

        from specserve.policy import SpeculationPolicy

        self._base = SpeculationPolicy()
        self.config = self._base.config
        self.rng = random.Random(seed)
        self.chosen: list[int] = []

    def tracker(self, kind, positions):
        return self._base.tracker(kind, positions)

    def choose(self, acceptance, load, *, current, max_k, batch=None, draft_cost="pool", catch_up=0, room=None,
               probe_from_off=True):
        from specserve.policy import Decision

        self.chosen.append(self.rng.randint(0, max_k))
        return Decision(self.chosen[-1], {}, "random")


@pytest.mark.parametrize("method", ["draft", "tree"])
def test_greedy_output_is_exact_when_k_varies_every_round(qwen_pair, method):
    target, draft = qwen_pair
    from specserve.protocol import TreeSpec

    decoder = make_decoder(target, draft, k=4, method=method)
    # min_score 0: a tiny random draft is never confident enough for the default tree's 0.2
    decoder.speculation = replace(decoder.speculation, tree=TreeSpec(budget=8, depth=4, width=2, min_score=0.0))
    decoder.policy = RandomDepthPolicy(seed=1)
    outs = decoder.generate(PROMPTS, SamplingParams(max_tokens=40), policy="adaptive")
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(target, prompt, 40)
    assert set(decoder.policy.chosen) == {0, 1, 2, 3, 4}
    histogram = decoder.last_report.stats.k_histogram  # depths drafted (a draft may stop short)
    assert histogram[0] > 0 and sum(histogram[1:]) > 0, histogram
    assert outs[0].speculation["policy"] == "adaptive"


def test_a_request_decoded_alone_drafts_up_to_solo_k_and_stays_exact(qwen_pair):
    """`speculation.solo_k`: a request alone in the rounds may draft deeper than k (the policy's
    cap), a batch of them at most k; the output is the target's own either way."""
    target, draft = qwen_pair
    decoder = make_decoder(target, draft, k=4)
    decoder.policy = RandomDepthPolicy(seed=3)
    out = decoder.generate(PROMPTS[:1], SamplingParams(max_tokens=40), policy="adaptive", solo_k=8)[0]
    assert out.token_ids == hf_greedy(target, PROMPTS[0], 40)
    assert max(decoder.policy.chosen) > 4
    decoder.policy = RandomDepthPolicy(seed=3)
    outs = decoder.generate(PROMPTS[:2], SamplingParams(max_tokens=12), policy="adaptive", solo_k=8)
    assert [o.token_ids for o in outs] == [hf_greedy(target, p, 12) for p in PROMPTS[:2]]
    assert max(decoder.policy.chosen[:2]) <= 4  # two requests share the rounds


def test_sampled_output_follows_the_target_distribution_when_k_varies(monkeypatch):
    from specserve.request_state import RequestState

    # Seeded sampled requests keep their depth (for reproducibility); this test is about
    # exactness, so let the policy vary k for them too.
    monkeypatch.setattr(RequestState, "pinned_depth", property(lambda self: False))
    params = SamplingParams(temperature=1.0, max_tokens=2)
    target = tiny_model("qwen2", seed=5, vocab_size=SMALL_VOCAB)
    draft = perturbed(target, scale=0.5, seed=9)
    prompt = [1, 2, 3]
    exact = exact_two_token_distribution(target, prompt, params)
    decoder = make_decoder(target, draft, k=2, top_m=64)
    decoder.policy = RandomDepthPolicy(seed=2)
    decoder.speculation = replace(decoder.speculation, policy="adaptive")
    assert_converges(lambda n: empirical_two_token_distribution(decoder, prompt, params, n, seed_base=n), exact)
    assert set(decoder.policy.chosen) == {0, 1, 2}  # first rounds: 0, 1 or 2 (cut to 1 by the room left)
    histogram = decoder.last_report.stats.k_histogram
    assert histogram[0] > 0 and histogram[1] > 0  # rounds with and without a draft


def test_adaptive_library_decoding_measures_the_passes_and_stays_exact(qwen_pair):
    """The real policy in the library: it sees the decoder's own passes and chooses."""
    target, draft = qwen_pair
    decoder = make_decoder(target, draft, k=4)
    outs = decoder.generate(PROMPTS, SamplingParams(max_tokens=32), policy="adaptive")
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(target, prompt, 32)
    assert decoder.load.target.observed and decoder.load.draft.observed
    assert sum(decoder.last_report.stats.k_histogram) == decoder.last_report.stats.target_steps
