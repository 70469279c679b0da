"""Prompt lookup (proposer `ngram`): the incremental index, the trees it builds, and exactness
(greedy and sampled, chains and trees with siblings) on tiny random models in fp32."""

import random

import pytest
import torch

from conftest import hf_greedy, make_decoder, tiny_model
from specserve.protocol import ProposeRequest, SamplingParams, Speculation, TokenTree, TreeSpec
from specserve.proposers.ngram import NgramIndex, NgramProposer, prefix_tree
from test_decoder import SMALL_VOCAB, assert_converges, empirical_two_token_distribution, exact_two_token_distribution

# Prompts that repeat themselves (as code does), so lookups find something.
PROMPTS = [[5, 17, 3, 9, 5, 17, 3, 9, 5, 17], [40, 2, 2, 9, 40, 2, 2], [12, 13, 12, 13, 12], [30, 31, 32, 33, 34, 35]]


def test_the_index_kept_incrementally_equals_one_built_from_scratch():
    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(200)]
    incremental = NgramIndex(max_n=3, min_n=1)
    for end in range(1, len(tokens) + 1, 7):  # rounds commit several tokens at a time
        incremental.sync(tokens[:end])
    incremental.sync(tokens)
    scratch = NgramIndex(max_n=3, min_n=1)
    scratch.sync(tokens)
    assert incremental.starts == scratch.starts and incremental.tokens == tokens
    other = tokens[:50] + [9, 9]  # not an extension of what was indexed: rebuilt
    incremental.sync(other)
    fresh = NgramIndex(max_n=3, min_n=1)
    fresh.sync(other)
    assert incremental.starts == fresh.starts


def test_lookups_prefer_the_longest_n_and_the_most_recent_occurrence():
    index = NgramIndex(max_n=2, min_n=1)
    index.sync([7, 1, 2, 8, 1, 3, 4, 1, 2, 5, 6, 2])
    # suffix (6, 2): never seen before; (2,): followed by 8 (pos 3) and 5 (pos 9); most recent first
    assert index.continuations(k=3, limit=4) == [[5, 6, 2], [8, 1, 3]]
    index.sync([7, 1, 2, 8, 1, 3, 4, 1, 2, 5, 6, 2, 1, 2])
    # (1, 2) occurred twice before (most recent first); then the 1-gram (2,) adds the one
    # continuation the 2-gram did not have (after position 11)
    assert index.continuations(k=2, limit=1) == [[5, 6]]
    assert index.continuations(k=2, limit=4) == [[5, 6], [8, 1], [1, 2]]
    assert NgramIndex().continuations(k=2, limit=4) == []


def test_continuations_merge_into_a_prefix_tree_within_the_budget():
    tree = prefix_tree([[1, 2, 3], [1, 2, 4], [1, 5], [6]], budget=16)
    assert tree == TokenTree((1, 2, 3, 4, 5, 6), (-1, 0, 1, 1, 0, -1))
    assert prefix_tree([[1, 2, 3], [4, 5, 6]], budget=4) == TokenTree((1, 2, 3, 4), (-1, 0, 1, -1))


def test_proposals_are_deterministic_chains_or_trees_and_released():
    proposer = NgramProposer(max_n=2, min_n=1)
    ids = [1, 2, 3, 1, 2, 4, 1, 2]
    chain = proposer.propose_one(ProposeRequest("a", ids, 3, SamplingParams(), 0))
    assert chain.law == "deterministic" and chain.tree == TokenTree.chain([4, 1, 2])
    tree = proposer.propose_one(ProposeRequest("a", ids, 2, SamplingParams(), 0, TreeSpec(width=3, min_score=0.0)))
    assert tree.tree == TokenTree((4, 1, 3, 1), (-1, 0, -1, 2))
    assert proposer.propose_one(ProposeRequest("b", [1, 2, 3], 4, SamplingParams(), 0)).tree == TokenTree()
    assert proposer.cached_requests == 2
    proposer.release("a")
    proposer.release("b")
    assert proposer.cached_requests == 0


def ngram_decoder(target, *, min_n: int | None = None, **speculation):
    decoder = make_decoder(target)
    decoder.speculation = Speculation(proposer="ngram", **speculation)
    if min_n is not None:
        decoder.ngram = NgramProposer(min_n=min_n, max_n=max(min_n, decoder.ngram.max_n))
    return decoder


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("speculation", [dict(k=4), dict(shape="tree", tree=TreeSpec(budget=12, depth=4, width=3))],
                         ids=["chain", "tree"])
def test_greedy_ngram_output_equals_target_alone(arch, speculation):
    target = tiny_model(arch, seed=11)
    decoder = ngram_decoder(target, **speculation)
    outs = decoder.generate(PROMPTS, SamplingParams(max_tokens=32))  # four requests share each pass
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(target, prompt, 32)
    stats = decoder.last_report.stats
    assert stats.num_accepted_tokens > 0  # lookups hit and were accepted: the exactness above means something
    assert decoder.ngram.cached_requests == 0  # released when they finished


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, max_tokens=2),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_tokens=2),
], ids=["t1", "t0.7-topk5-topp0.9"])
def test_sampled_ngram_trees_follow_the_target_distribution(params):
    """The prompt ends in 1, which was followed by 2, 4 and 6 before: the first token's draft
    has three siblings, each with a child, so rejections walk siblings and the residual."""
    target = tiny_model("qwen2", seed=5, vocab_size=SMALL_VOCAB)
    prompt = [1, 2, 3, 1, 4, 5, 1, 6, 7, 1]
    exact = exact_two_token_distribution(target, prompt, params)
    # single tokens are looked up too (the default starts at 2)
    decoder = ngram_decoder(target, min_n=1, shape="tree", tree=TreeSpec(budget=8, depth=2, width=3))
    assert_converges(lambda n: empirical_two_token_distribution(decoder, prompt, params, n, seed_base=n), exact)
    stats = decoder.last_report.stats
    assert stats.num_draft_tokens > 0 and sum(stats.num_accepted_tokens_per_rank[1:]) > 0


def test_ngram_needs_no_draft_model_and_the_policy_counts_it_free():
    target = tiny_model("qwen2", seed=3)
    decoder = make_decoder(target)  # no draft model, no heads
    out = decoder.generate([PROMPTS[0]], SamplingParams(max_tokens=8), proposer="ngram", policy="adaptive")[0]
    assert out.token_ids == hf_greedy(target, PROMPTS[0], 8)
    assert out.speculation["proposer"] == "ngram"
    assert Speculation(proposer="ngram").draft_cost == "free"
    assert torch.is_tensor(decoder.verifier.worker.model.lm_head.weight)
