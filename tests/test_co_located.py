"""Exactness of every co-located head method (Medusa, Hydra, ReDrafter), one parametrised set:
greedy output equal to the target alone (fp32, batched, every shape), one target pass per round
for the whole batch, and sampled output distributed as the target's with trees that have
siblings. Tiny seeded random models; what differs per method is how its heads are built."""

from __future__ import annotations

import pytest

from conftest import (
    hf_greedy, make_hydra_decoder, make_medusa_decoder, make_redrafter_decoder, tiny_heads, tiny_hydra_heads,
    tiny_model, tiny_redrafter,
)
from specserve.protocol import SamplingParams, TreeSpec
from test_decoder import SMALL_VOCAB, assert_converges
from test_medusa import PROMPTS, SHAPES, empirical_second_and_third_tokens, exact_second_and_third_tokens

# method -> (decoder factory, untrained heads factory)
METHODS = {
    "medusa": (make_medusa_decoder, tiny_heads),
    "hydra": (make_hydra_decoder, tiny_hydra_heads),
    "redrafter": (make_redrafter_decoder, tiny_redrafter),
}
SIBLINGS = TreeSpec(shape=((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (1, 1)))  # siblings at both levels
# ReDrafter reads a tree as beams: 4 beams of 2 tokens also give siblings at both levels
SAMPLED_TREES = {"medusa": SIBLINGS, "hydra": SIBLINGS,
                 "redrafter": TreeSpec(budget=8, depth=2, width=4, min_score=0.0)}


def decoder_for(method: str, target, *, noise: float | None = None, num_heads: int = 3, **speculation):
    make_decoder, make_heads = METHODS[method]
    heads = make_heads(target, num_heads=num_heads, noise=noise) if noise is not None else None
    return make_decoder(target, heads, **speculation)


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_greedy_output_equals_target_alone(method, arch, shape):
    target = tiny_model(arch, seed=11)
    decoder = decoder_for(method, target, noise=0.02, **SHAPES[shape])
    outs = decoder.generate(PROMPTS, SamplingParams(max_tokens=24))  # four requests share each pass
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(target, prompt, 24)
    stats = decoder.last_report.stats
    assert stats.num_accepted_tokens > 0  # drafts were accepted, so tree paths and compaction ran
    if shape != "chain":
        assert sum(stats.num_accepted_tokens_per_rank[1:]) > 0  # and so were second-ranked candidates
    assert outs[0].speculation["proposer"] == method


@pytest.mark.parametrize("method", sorted(METHODS))
def test_a_round_is_one_target_pass_for_the_whole_batch(method):
    target = tiny_model("qwen2", seed=11)
    decoder = decoder_for(method, target, **SHAPES["static" if method != "redrafter" else "dynamic"])
    worker = decoder.verifier.worker
    before = worker.forward_passes
    outs = decoder.generate(PROMPTS, SamplingParams(max_tokens=20, ignore_eos=True))
    rounds = max(o.stats.target_steps for o in outs)  # all requests step together; all stop at 20
    assert worker.forward_passes - before == rounds
    assert decoder.last_report.stats.mean_accepted_length > 1.0


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, max_tokens=4),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_tokens=4),
], ids=["t1", "t0.7-topk5-topp0.9"])
def test_sampled_trees_follow_the_target_distribution(method, params):
    """Candidates are chosen (top-k, beams), not drawn: verified as point masses, the output is
    the target's."""
    target = tiny_model("qwen2", seed=5, vocab_size=SMALL_VOCAB)
    prompt = [1, 2, 3]
    exact = exact_second_and_third_tokens(target, prompt, params)
    decoder = decoder_for(method, target, noise=0.3, num_heads=2, shape="tree", tree=SAMPLED_TREES[method])
    assert_converges(lambda n: empirical_second_and_third_tokens(decoder, prompt, params, n, seed_base=n), exact)
    stats = decoder.last_report.stats
    assert stats.num_draft_tokens > 0 and sum(stats.num_accepted_tokens_per_rank[1:]) > 0


@pytest.mark.parametrize("method", ["medusa", "hydra"])
def test_sampled_reranked_trees_follow_the_target_distribution(method):
    """A reranked tree keeps its best nodes once grown; chosen candidates are point masses
    whichever stay, so the output is still the target's."""
    params = SamplingParams(temperature=1.0, max_tokens=4)
    target = tiny_model("qwen2", seed=5, vocab_size=SMALL_VOCAB)
    prompt = [1, 2, 3]
    exact = exact_second_and_third_tokens(target, prompt, params)
    tree = TreeSpec(budget=4, depth=2, width=3, min_score=0.0, rerank=True)
    decoder = decoder_for(method, target, noise=0.3, num_heads=2, shape="tree", tree=tree)
    assert_converges(lambda n: empirical_second_and_third_tokens(decoder, prompt, params, n, seed_base=n), exact)
    stats = decoder.last_report.stats
    assert stats.num_draft_tokens > 0 and sum(stats.num_accepted_tokens_per_rank[1:]) > 0


@pytest.mark.parametrize("method", sorted(METHODS))
def test_score_temperatures_reshape_trees_and_keep_greedy_output_exact(method):
    """Heads with `score_temperatures` (a sharp first head, flat deeper ones) draft other
    trees from the same logits, and the output is still the target's own. A static shape
    takes each head's r-th candidate, which no temperature reorders: the same trees."""
    import torch

    from specserve.protocol import ProposeRequest

    target = tiny_model("qwen2", seed=11)
    make_decoder, make_heads = METHODS[method]
    heads = make_heads(target, num_heads=3, noise=0.3)
    spec = SHAPES["reranked"] if method != "redrafter" else dict(shape="tree", tree=SAMPLED_TREES["redrafter"])
    plain = make_decoder(target, heads, **spec)
    hidden = torch.randn(len(PROMPTS), target.config.hidden_size)
    requests = [ProposeRequest(f"r{i}", p, 3, SamplingParams(), 0, spec["tree"]) for i, p in enumerate(PROMPTS)]
    static = [ProposeRequest(f"s{i}", p, 3, SamplingParams(), 0, SHAPES["static"]["tree"])
              for i, p in enumerate(PROMPTS)]

    def trees(batch):
        return [x.tree for x in plain.verifier.heads.propose_from_hidden(batch, hidden)]

    before, static_before = trees(requests), trees(static)
    heads.config.score_temperatures = [0.2, 8.0, 8.0]
    assert trees(requests) != before
    if method != "redrafter":  # ReDrafter reads a static shape as beams, which scores do rank
        assert trees(static) == static_before
    outs = make_decoder(target, heads, **spec).generate(PROMPTS, SamplingParams(max_tokens=24))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(target, prompt, 24)
