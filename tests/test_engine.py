"""The torch worker: batched forward, tree attention, rollback, compaction, cache misses."""

import pytest
import torch

from conftest import tiny_model
from specserve.engine.torch_worker import ForwardItem, TorchWorker
from specserve.protocol import SpecserveError, TokenTree

ATOL = 1e-5


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    """Plain causal forward of the whole sequence with transformers: [len(ids), V]."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def fresh_kv(model, ids: list[int]) -> torch.Tensor:
    worker = TorchWorker(model)
    worker.forward([ForwardItem("r", ids)])
    return worker.cached_kv("r")


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model(request):
    return tiny_model(request.param, seed=3)


def test_batched_prefill_and_chain_match_causal_forward(model):
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (3, 11, 7)]
    worker = TorchWorker(model)
    first = worker.forward([ForwardItem(f"r{i}", s[:-2]) for i, s in enumerate(seqs)])
    for s, out in zip(seqs, first):
        assert torch.allclose(out[0], reference_logits(model, s[:-2])[-1], atol=ATOL)
    # second call: requests extend by a chain of 2 draft tokens, one request is new
    items = [ForwardItem(f"r{i}", s[:-2], TokenTree.chain(s[-2:])) for i, s in enumerate(seqs)]
    items.append(ForwardItem("new", seqs[1]))
    second = worker.forward(items)
    for s, out in zip(seqs, second):
        assert torch.allclose(out, reference_logits(model, s)[-3:], atol=ATOL)
    assert torch.allclose(second[3][0], reference_logits(model, seqs[1])[-1], atol=ATOL)


TREES = {
    "chain": TokenTree((11, 12, 13), (-1, 0, 1)),
    "2x2": TokenTree((11, 12, 13, 14, 15, 16), (-1, -1, 0, 0, 1, 1)),
    "unbalanced": TokenTree((11, 12, 13, 14, 15), (-1, 0, 1, -1, 0)),
}


def branch(tree: TokenTree, node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(tree.tokens[node])
        node = tree.parents[node]
    return path[::-1]


@pytest.mark.parametrize("shape", sorted(TREES))
def test_tree_attention_equals_causal_decoding_of_each_branch(model, shape):
    tree = TREES[shape]
    prefix = [5, 9, 2, 7, 1]
    worker = TorchWorker(model)
    worker.forward([ForwardItem("warm", prefix[:3])])  # a cached part and an uncached part
    for rid, start in (("cold", prefix), ("warm", prefix)):
        [logits] = worker.forward([ForwardItem(rid, start, tree)])
        assert torch.allclose(logits[0], reference_logits(model, prefix)[-1], atol=ATOL)
        for node in range(len(tree)):
            expected = reference_logits(model, prefix + branch(tree, node))[-1]
            assert torch.allclose(logits[node + 1], expected, atol=ATOL), (shape, node)


def test_trees_of_different_shapes_batch_together(model):
    worker = TorchWorker(model)
    items = [ForwardItem(name, [3 + i] * (2 + 3 * i), tree) for i, (name, tree) in enumerate(sorted(TREES.items()))]
    for item, logits in zip(items, worker.forward(items)):
        for node in range(len(item.tree)):
            expected = reference_logits(model, item.token_ids + branch(item.tree, node))[-1]
            assert torch.allclose(logits[node + 1], expected, atol=ATOL)


def test_rollback_after_rejection_equals_cache_of_accepted_tokens(model):
    worker = TorchWorker(model)
    prompt = [4, 8, 15, 16]
    worker.forward([ForwardItem("r", prompt, TokenTree.chain([23, 42, 7, 7]))])
    # the target accepted 23 and 42 then emitted its own token 9: the next call says so
    accepted = prompt + [23, 42, 9]
    [logits] = worker.forward([ForwardItem("r", accepted)])
    assert worker.cached_tokens("r") == accepted
    assert torch.allclose(worker.cached_kv("r"), fresh_kv(model, accepted), atol=ATOL)
    assert torch.allclose(logits[0], reference_logits(model, accepted)[-1], atol=ATOL)


def test_tree_compaction_keeps_only_the_accepted_path(model):
    tree = TREES["2x2"]  # paths 11->13, 11->14, 12->15, 12->16
    worker = TorchWorker(model)
    prompt = [1, 2, 3]
    worker.forward([ForwardItem("r", prompt, tree)])
    accepted = prompt + [12, 16, 30]  # nodes 1 and 5 accepted, 30 from the target
    assert tree.path_of(accepted[3:]) == [1, 5]
    [logits] = worker.forward([ForwardItem("r", accepted)])
    assert worker.forward_passes == 2
    assert torch.allclose(worker.cached_kv("r"), fresh_kv(model, accepted), atol=ATOL)
    assert torch.allclose(logits[0], reference_logits(model, accepted)[-1], atol=ATOL)


def test_cache_miss_and_stale_cache_give_the_same_logits(model):
    ids = [7, 3, 9, 1, 1, 4]
    tree = TREES["unbalanced"]
    [expected] = TorchWorker(model).forward([ForwardItem("r", ids, tree)])
    stale = TorchWorker(model)
    stale.forward([ForwardItem("r", [7, 3, 50, 60, 70, 80, 90])])  # diverges after two tokens
    [got] = stale.forward([ForwardItem("r", ids, tree)])
    assert torch.allclose(got, expected, atol=ATOL)
    assert stale.release("r") and not stale.release("r")
    [again] = stale.forward([ForwardItem("r", ids, tree)])  # after release: recompute
    assert torch.allclose(again, expected, atol=ATOL)
    # the same call twice: the last token is fed again, not served from nowhere
    [twice] = stale.forward([ForwardItem("r", ids)])
    assert torch.allclose(twice[0], expected[0], atol=ATOL)


def test_least_recently_used_caches_are_evicted_under_budget(model):
    worker = TorchWorker(model, max_cached_tokens=150)
    for rid in ("a", "b", "c"):
        worker.forward([ForwardItem(rid, [1, 2, 3])])  # each reserves 64 slots
    assert worker.cache_stats()["requests"] == 2
    assert worker.cached_tokens("a") == []


def test_bad_calls_are_refused(model):
    worker = TorchWorker(model)
    with pytest.raises(SpecserveError, match="no tokens"):
        worker.forward([ForwardItem("r", [])])
    with pytest.raises(SpecserveError, match="only once"):
        worker.forward([ForwardItem("r", [1]), ForwardItem("r", [2])])
    with pytest.raises(SpecserveError, match="parents must precede"):
        TokenTree((1, 2), (1, -1))


def test_unsupported_architecture_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(SpecserveError, match="not 'gpt2'"):
        TorchWorker(gpt2)


def test_growing_a_tree_level_by_level_computes_only_the_new_nodes(model):
    """A draft extends the tree of its previous call: the cached nodes keep their keys and
    values, the new ones see only their own ancestors, and the rows equal a one-shot pass."""
    full = TokenTree((11, 12, 13, 14, 15, 16, 17), (-1, -1, 0, 0, 1, 2, 4))
    prefix = [5, 9, 2, 7, 1]
    [expected] = TorchWorker(model).forward([ForwardItem("r", prefix, full)])
    worker = TorchWorker(model)
    [root] = worker.forward([ForwardItem("r", prefix)])
    assert torch.allclose(root[0], expected[0], atol=ATOL)
    for start, end in ((0, 2), (2, 5), (5, 7)):
        level = TokenTree(full.tokens[:end], full.parents[:end])
        before = worker.forward_passes
        [rows] = worker.forward([ForwardItem("r", prefix, level, logits_from=start)])
        assert rows.shape[0] == end - start
        assert torch.allclose(rows, expected[1 + start : 1 + end], atol=ATOL), (start, end)
        assert worker.forward_passes == before + 1
    # the next round compacts the accepted path (12 -> 15 -> 17) as usual
    accepted = prefix + [12, 15, 17, 40]
    [logits] = worker.forward([ForwardItem("r", accepted)])
    assert torch.allclose(worker.cached_kv("r"), fresh_kv(model, accepted), atol=ATOL)
    assert torch.allclose(logits[0], reference_logits(model, accepted)[-1], atol=ATOL)


def test_tree_extension_falls_back_to_recompute_when_the_cache_does_not_match(model):
    tree = TREES["2x2"]
    prefix = [3, 1, 4]
    [expected] = TorchWorker(model).forward([ForwardItem("r", prefix, tree)])
    worker = TorchWorker(model)
    worker.forward([ForwardItem("r", prefix, TokenTree((50,), (-1,)))])  # a different first node
    [rows] = worker.forward([ForwardItem("r", prefix, tree, logits_from=2)])
    assert torch.allclose(rows, expected[3:], atol=ATOL)
    fresh = TorchWorker(model)  # nothing cached at all
    [rows] = fresh.forward([ForwardItem("r", prefix, tree, logits_from=4)])
    assert torch.allclose(rows, expected[5:], atol=ATOL)
    with pytest.raises(SpecserveError, match="logits_from"):
        fresh.forward([ForwardItem("r", prefix, tree, logits_from=6)])
