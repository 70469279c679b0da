"""Tree shapes and tree bookkeeping: pure functions, no model."""

import pytest

from specserve.protocol import MAX_K, MAX_TREE_NODES, SpecserveError, TokenTree, TreeSpec
from specserve.trees import (
    ChainGrowth, DynamicGrowth, StaticGrowth, count_ranks, finish, growth_for, rank_acceptance, shape_from_acceptance,
)


def grow(growth, candidates_of):
    """Run a growth to the end; candidates_of(node) gives the candidate probabilities after a
    node. Returns the parents of the grown tree."""
    parents = []
    while frontier := growth.frontier():
        candidates = {node: candidates_of(node) for node in frontier}
        for node, count in growth.allocate(candidates).items():
            for rank in range(count):
                parents.append(node)
                assert growth.add(node, candidates[node][rank]) == len(parents) - 1
    return parents


def test_token_tree_helpers():
    tree = TokenTree((5, 6, 7, 8), (-1, -1, 1, 1))
    assert tree.children() == {-1: [0, 1], 1: [2, 3]}
    assert tree.ranks() == [0, 1, 0, 1]
    assert tree.path_of([6, 8, 9]) == [1, 3] and tree.path_of([9]) == []
    assert tree.extends(TokenTree((5, 6), (-1, -1))) and not tree.extends(TokenTree((6,), (-1,)))


def test_static_shapes_are_validated_and_normalised():
    spec = TreeSpec(shape=[[0, 0], [1], [0]])
    assert spec.shape == ((0,), (1,), (0, 0)) and spec.budget == 3 and spec.depth == 2
    for bad, message in (([[0, 0]], "parent"), ([[1]], "elder sibling"), ([], "at least one"),
                         ([[]], "non-empty"), ([[0, -1], [0]], ">= 0")):
        with pytest.raises(SpecserveError, match=message):
            TreeSpec(shape=bad)
    for bad in (dict(budget=0), dict(depth=0), dict(depth=65), dict(width=0), dict(min_score=1.0)):
        with pytest.raises(SpecserveError):
            TreeSpec(**bad)


def test_capping_a_spec_keeps_it_within_the_depth():
    assert TreeSpec(shape=[[0], [0, 0], [0, 0, 0], [1]]).capped(2).shape == ((0,), (1,), (0, 0))
    assert TreeSpec(budget=32, depth=8, width=4).capped(2) == TreeSpec(budget=8, depth=2, width=4)
    spec = TreeSpec()
    assert spec.capped(20) is spec


def test_static_growth_builds_exactly_the_shape():
    shape = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    parents = grow(StaticGrowth(TreeSpec(shape=shape)), lambda node: [0.5, 0.3, 0.2])
    tree = TokenTree(tuple(range(len(parents))), tuple(parents))
    paths = {tuple(tree.ranks()[n] for n in _path(tree, i)) for i, n in enumerate(range(len(parents)))}
    assert paths == {tuple(p) for p in shape}


def _path(tree, node):
    path = []
    while node >= 0:
        path.append(node)
        node = tree.parents[node]
    return path[::-1]


def test_dynamic_growth_is_a_deep_chain_where_the_draft_is_sure_and_bushy_where_it_hesitates():
    sure = grow(DynamicGrowth(TreeSpec(budget=16, depth=6, width=4, min_score=0.05)), lambda n: [0.97, 0.02, 0.01])
    assert sure == [-1, 0, 1, 2, 3, 4]  # a chain of depth 6
    unsure = grow(DynamicGrowth(TreeSpec(budget=16, depth=6, width=4, min_score=0.05)), lambda n: [0.4, 0.3, 0.2, 0.1])
    tree = TokenTree(tuple(range(len(unsure))), tuple(unsure))
    assert len(tree.children()[-1]) == 4 and max(tree.depths) <= 3  # unsure paths fall below min_score


def test_dynamic_growth_respects_budget_width_and_depth():
    spec = TreeSpec(budget=10, depth=3, width=3, min_score=0.0)
    parents = grow(DynamicGrowth(spec), lambda n: [0.5, 0.3, 0.2])
    tree = TokenTree(tuple(range(len(parents))), tuple(parents))
    assert len(parents) <= 10 and max(tree.depths) <= 3
    assert all(sum(1 for d in tree.depths if d == level) <= 3 for level in (1, 2, 3))


def test_a_reranked_tree_spends_its_budget_where_the_draft_is_sure_at_any_depth():
    """Node 0's line is sure (0.95 a step), the rest is not (0.5/0.3). Level by level, a budget
    of 6 with width 2 goes two nodes to each of three levels; reranked, the tree grows every
    level's width to depth 5 and keeps the 6 best paths: node 0's line down to depth 5 and
    the root's second child."""
    sure = {0}

    def candidates_of(node):
        return [0.95, 0.03] if node in sure else [0.5, 0.3]

    def grown(spec):
        growth = DynamicGrowth(spec)
        parents = []
        while frontier := growth.frontier():
            candidates = {node: candidates_of(node) for node in frontier}
            for node, count in growth.allocate(candidates).items():
                for rank in range(count):
                    child = growth.add(node, candidates[node][rank])
                    parents.append(node)
                    if node in sure and rank == 0:
                        sure.add(child)
        tree, kept = finish(growth, list(range(len(parents))), parents)
        return tree, [growth.scores[n] for n in kept]

    level_by_level, _ = grown(TreeSpec(budget=6, depth=5, width=2, min_score=0.0))
    assert sorted(level_by_level.depths) == [1, 1, 2, 2, 3, 3]
    reranked, scores = grown(TreeSpec(budget=6, depth=5, width=2, min_score=0.0, rerank=True))
    assert sorted(reranked.depths) == [1, 1, 2, 3, 4, 5]
    assert sorted(scores)[0] == pytest.approx(0.3) and sorted(scores)[1] > 0.4  # depth 5's 0.5 x 0.95^4
    assert all(p < i for i, p in enumerate(reranked.parents))  # a tree, in level order


def test_a_reranked_tree_is_always_a_tree_of_the_budget_best_nodes():
    import random

    rng = random.Random(0)
    for trial in range(200):
        spec = TreeSpec(budget=rng.randint(1, 20), depth=rng.randint(1, 5), width=rng.randint(1, 4),
                        min_score=rng.choice([0.0, 0.01]), rerank=True)
        growth = DynamicGrowth(spec)
        # probabilities repeat (and hit 1.0), so equal scores are common
        parents = grow(growth, lambda node: sorted((rng.choice([1.0, 0.5, 0.25, 0.1]) for _ in range(4)),
                                                   reverse=True))
        assert len(parents) <= spec.width * spec.depth
        kept = growth.kept()
        assert len(kept) == min(spec.budget, len(parents)) and kept == sorted(kept)
        assert all(parents[n] < 0 or parents[n] in kept for n in kept)
        dropped = set(range(len(parents))) - set(kept)
        assert all(growth.scores[d] <= growth.scores[k] for d in dropped for k in kept)
        tree, index = finish(growth, [10 + n for n in range(len(parents))], parents)
        assert index == kept and list(tree.tokens) == [10 + n for n in kept]


def test_rerank_is_for_dynamic_trees_of_chosen_candidates():
    with pytest.raises(SpecserveError, match="rerank applies to dynamic trees"):
        TreeSpec(shape=[[0]], rerank=True)
    spec = TreeSpec(budget=8, depth=4, width=4, rerank=True)
    assert growth_for(4, spec, 0.5).spec.rerank
    # children drawn (a draft model's, sampled): keeping the best afterwards would look at later draws
    assert not growth_for(4, spec, 0.5, drawn=True).spec.rerank
    assert growth_for(2, spec, 0.5).spec == TreeSpec(budget=8, depth=2, width=4, rerank=True)
    # a request's widest, deepest reranked tree grows no more nodes than any tree may hold
    widest = DynamicGrowth(TreeSpec(budget=16, depth=MAX_K, width=MAX_TREE_NODES, min_score=0.0, rerank=True))
    assert len(grow(widest, lambda node: [0.9] * MAX_TREE_NODES)) == MAX_TREE_NODES
    assert len(widest.kept()) == 16


def test_chain_growth_stops_when_unsure():
    assert grow(ChainGrowth(5), lambda n: [0.1]) == [-1, 0, 1, 2, 3]
    assert grow(ChainGrowth(5, min_confidence=0.5), lambda n: [0.9] if n < 1 else [0.3]) == [-1, 0, 1]
    assert isinstance(growth_for(4, None, 0.5), ChainGrowth)
    assert isinstance(growth_for(4, TreeSpec(), 0.5), DynamicGrowth)
    assert isinstance(growth_for(4, TreeSpec(shape=[[0]]), 0.5), StaticGrowth)


def test_shape_from_acceptance_spends_the_budget_where_it_pays():
    # a draft whose first choice is usually right: a deep spine with side branches near the root
    shape = shape_from_acceptance([0.8, 0.15, 0.05], budget=8, depth=6)
    assert len(shape) == 8 and TreeSpec(shape=shape).shape == shape  # a valid shape
    assert (0, 0, 0, 0, 0) in shape and (1,) in shape and (2,) not in shape
    # a poor draft: wide, shallow
    wide = shape_from_acceptance([0.3, 0.25, 0.2, 0.15], budget=8, depth=6)
    assert {(0,), (1,), (2,), (3,)} <= set(wide) and max(len(p) for p in wide) <= 3
    assert shape_from_acceptance([], 8, 4) == ()


def test_rank_counts_measure_per_rank_acceptance():
    tree = TokenTree((5, 6, 7, 8), (-1, -1, 1, 1))  # root -> {5, 6}, 6 -> {7, 8}
    accepted, reached = count_ranks(tree, [1, 3])  # 6 then 8 accepted
    assert accepted == [0, 2] and reached == [2, 2]
    assert count_ranks(tree, []) == ([], [1, 1])
    assert rank_acceptance([3, 1], [4, 2]) == [0.75, 0.5]
