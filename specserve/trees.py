"""Draft tree shapes: how a proposer's token tree grows, level by level (pure, torch-free).

A proposer grows its draft in levels. Each level it asks the growth for its `frontier` (the
nodes whose children are wanted; -1 is the root), runs the draft model on them, hands
`allocate` every frontier node's candidate probabilities (the draft's, most probable first),
and adds the children `allocate` granted with `add` (`grow_level` does the last two). Three growths:

- `ChainGrowth`: one child per level, k levels, stopping once the draft is unsure
  (the `draft` method);
- `DynamicGrowth`: the best `width` children of the whole frontier per level, scored by the
  draft's probability of their whole path, within a node budget (EAGLE-2's expansion);
- `StaticGrowth`: a fixed shape given as paths of child ranks (Medusa's `medusa_choices`).

How many children a node gets depends only on probabilities known before its children are
drawn, never on which tokens the draws pick: lossless multi-draft verification of sampled
trees needs that (see specserve.sampling.accept_rejection_tree). A reranked dynamic tree
(`TreeSpec.rerank`) keeps its best nodes once grown, which looks at later draws, so
`growth_for` reranks only trees of chosen candidates. When the growth ends, `kept` says which
of its nodes the tree keeps and `finish` builds that tree.

`merge_beams` is the other way to a tree: ReDrafter's beams, merged on their shared prefixes.

`shape_from_acceptance` turns measured per-rank acceptance into the static shape that
spends a node budget where it pays.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import replace

from specserve.protocol import MAX_TREE_NODES, TokenTree, TreeSpec


class ChainGrowth:
    """k tokens in a row; stops after a token whose draft probability is below `min_confidence`
    (any stopping rule that looks only at the draft keeps the output exact)."""

    max_children = 1

    def __init__(self, k: int, min_confidence: float = 0.0):
        self.k = k
        self.min_confidence = min_confidence
        self.parents: list[int] = []
        self._last_prob = 1.0

    def frontier(self) -> list[int]:
        n = len(self.parents)
        if n >= self.k or self._last_prob < self.min_confidence:
            return []
        return [n - 1]

    def allocate(self, candidates: dict[int, Sequence[float]]) -> dict[int, int]:
        return {node: 1 for node, probs in candidates.items() if len(probs)}

    def add(self, parent: int, prob: float) -> int:
        self.parents.append(parent)
        self._last_prob = prob
        return len(self.parents) - 1

    def kept(self) -> list[int]:
        return list(range(len(self.parents)))


class DynamicGrowth:
    """Each level, the `width` children of the frontier with the highest path score join the
    tree (children scoring below `min_score` never do) and form the next frontier, until
    `depth` levels or `budget` nodes. Reranked (`spec.rerank`), the levels grow whatever the
    budget and `kept` is the `budget` best nodes by score (EAGLE-2's reranking).

    >>> g = DynamicGrowth(TreeSpec(budget=3, depth=2, width=2, min_score=0.1))
    >>> g.allocate({-1: [0.6, 0.3, 0.1]})  # the root's two best children
    {-1: 2}
    >>> a, b = g.add(-1, 0.6), g.add(-1, 0.3)
    >>> g.frontier(), g.allocate({a: [0.9, 0.05], b: [0.5]})  # 0.54 beats 0.15; 1 node left
    ([0, 1], {0: 1})
    >>> g = DynamicGrowth(TreeSpec(budget=3, depth=2, width=2, min_score=0.1, rerank=True))
    >>> a, b = g.add(-1, 0.6), g.add(-1, 0.3)
    >>> g.allocate({a: [0.9, 0.05], b: [0.5]})  # the level grows its width, past the budget
    {0: 1, 1: 1}
    >>> _, _ = g.add(a, 0.9), g.add(b, 0.5)
    >>> g.kept()  # 0.6, 0.3 and 0.54 (under the 0.6) beat 0.15
    [0, 1, 2]
    """

    def __init__(self, spec: TreeSpec):
        self.spec = spec
        self.max_children = spec.width
        self.parents: list[int] = []
        self.depths: list[int] = []
        self.scores: list[float] = []
        self._level = [-1]
        # the nodes the levels may grow: reranked, every level's width (as many as any tree may
        # hold at most), the budget applied after
        self._grown = min(spec.width * spec.depth, MAX_TREE_NODES) if spec.rerank else spec.budget

    def _score(self, node: int) -> float:
        return 1.0 if node < 0 else self.scores[node]

    def frontier(self) -> list[int]:
        if len(self.parents) >= self._grown:
            return []
        return [n for n in self._level
                if n < 0 or (self.depths[n] < self.spec.depth and self.scores[n] >= self.spec.min_score)]

    def allocate(self, candidates: dict[int, Sequence[float]]) -> dict[int, int]:
        room = min(self.spec.width, self._grown - len(self.parents))
        ranked = sorted((-self._score(node) * p, order, rank, node)
                        for order, (node, probs) in enumerate(candidates.items())
                        for rank, p in enumerate(probs[: self.spec.width]))
        counts: dict[int, int] = {}
        for neg_value, _, _, node in ranked[:room]:
            if -neg_value < self.spec.min_score:
                break
            counts[node] = counts.get(node, 0) + 1
        self._level = []
        return counts

    def add(self, parent: int, prob: float) -> int:
        node = len(self.parents)
        self.parents.append(parent)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.scores.append(self._score(parent) * prob)
        self._level.append(node)
        return node

    def kept(self) -> list[int]:
        """The nodes the tree keeps, in the order they joined (level order). Reranked: the
        `budget` best by score, a parent before its equal-scoring child (it joined first), so
        every kept node's parent is kept."""
        nodes = range(len(self.parents))
        if not self.spec.rerank or len(self.parents) <= self.spec.budget:
            return list(nodes)
        return sorted(heapq.nsmallest(self.spec.budget, nodes, key=lambda n: (-self.scores[n], n)))


class StaticGrowth:
    """The same shape every round: `spec.shape`, paths of child ranks."""

    def __init__(self, spec: TreeSpec):
        self.children_of: dict[tuple[int, ...], int] = {}
        for path in spec.shape:
            self.children_of[path[:-1]] = self.children_of.get(path[:-1], 0) + 1
        self.max_children = max(self.children_of.values())
        self.paths: list[tuple[int, ...]] = []
        self._level = [-1]

    def _path(self, node: int) -> tuple[int, ...]:
        return () if node < 0 else self.paths[node]

    def frontier(self) -> list[int]:
        return [n for n in self._level if self._path(n) in self.children_of]

    def allocate(self, candidates: dict[int, Sequence[float]]) -> dict[int, int]:
        self._level = []
        return {node: min(self.children_of[self._path(node)], len(probs)) for node, probs in candidates.items()}

    def add(self, parent: int, prob: float) -> int:
        base = self._path(parent)
        rank = sum(1 for p in self.paths if p[:-1] == base)
        self.paths.append(base + (rank,))
        self._level.append(len(self.paths) - 1)
        return len(self.paths) - 1

    def kept(self) -> list[int]:
        return list(range(len(self.paths)))


def growth_for(k: int, tree: TreeSpec | None, min_confidence: float, *, drawn: bool = False):
    """The growth of one request's draft: a chain of k, or the tree `tree` capped at depth k.
    `drawn`: the proposer draws the children (a draft model's, for a sampled request), so the
    tree does not rerank (see TreeSpec)."""
    if tree is None:
        return ChainGrowth(k, min_confidence)
    tree = tree.capped(k)
    if drawn and tree.rerank:
        tree = replace(tree, rerank=False)
    return DynamicGrowth(tree) if tree.shape is None else StaticGrowth(tree)


def finish(growth, tokens: Sequence[int], parents: Sequence[int]) -> tuple[TokenTree, list[int]]:
    """The tree of the nodes `growth` keeps (`kept`) out of the `tokens`/`parents` it grew,
    renumbered, and the grown index of each of its nodes (to carry what else the proposer
    keeps per node).

    >>> g = DynamicGrowth(TreeSpec(budget=2, depth=2, width=2, min_score=0, rerank=True))
    >>> for parent, p in [(-1, 0.5), (-1, 0.4), (0, 0.9), (1, 0.2)]:
    ...     _ = g.add(parent, p)
    >>> finish(g, [5, 6, 7, 8], [-1, -1, 0, 1])  # 0.5 and 0.45 (its child) beat 0.4
    (TokenTree(tokens=(5, 7), parents=(-1, 0)), [0, 2])
    """
    kept = growth.kept()
    if len(kept) == len(tokens):  # nothing dropped (every growth but a reranked one): no renumbering
        return TokenTree(tuple(int(t) for t in tokens), tuple(parents)), kept
    index = {old: new for new, old in enumerate(kept)}
    tree = TokenTree(tuple(int(tokens[n]) for n in kept),
                     tuple(-1 if parents[n] < 0 else index[parents[n]] for n in kept))
    return tree, kept


def grow_level(growth, frontier: Sequence[int], candidates: dict[int, tuple[Sequence[int], Sequence[float]]],
               tokens: list[int], parents: list[int]) -> list[int]:
    """One level of growth: `candidates[node]` is (token ids, probabilities), most probable
    first, for the children of each `frontier` node. The growth allocates children from the
    probabilities; the granted ones are appended to `tokens`/`parents` (node i of the tree is
    index i). Returns the new nodes (none: the tree is complete).

    >>> g, tokens, parents = ChainGrowth(2), [], []
    >>> grow_level(g, g.frontier(), {-1: ([5, 6], [0.9, 0.1])}, tokens, parents), tokens, parents
    ([0], [5], [-1])
    """
    counts = growth.allocate({n: list(candidates[n][1][: growth.max_children]) for n in frontier})
    added: list[int] = []
    for node in frontier:
        ids, probs = candidates[node]
        for rank in range(counts.get(node, 0)):
            added.append(growth.add(node, float(probs[rank])))
            tokens.append(int(ids[rank]))
            parents.append(node)
    return added


def grow_from_marginals(growth, candidates: Sequence[tuple[Sequence[int], Sequence[float]]]) -> TokenTree:
    """Grow a tree whose candidates depend only on depth: `candidates[d]` is (token ids,
    probabilities), most probable first, for every node at depth d + 1 (Medusa: head d's top
    tokens, whatever the path above). Nodes below the last depth get no children.

    >>> grow_from_marginals(ChainGrowth(3), [([5, 6], [0.9, 0.1]), ([7], [0.8])])
    TokenTree(tokens=(5, 7), parents=(-1, 0))
    """
    tokens: list[int] = []
    parents: list[int] = []
    depth_of = {-1: 0}
    while True:
        frontier = [n for n in growth.frontier() if depth_of[n] < len(candidates)]
        if not frontier:
            break
        added = grow_level(growth, frontier, {n: candidates[depth_of[n]] for n in frontier}, tokens, parents)
        if not added:
            break
        for child in added:
            depth_of[child] = depth_of[parents[child]] + 1
    return finish(growth, tokens, parents)[0]


def merge_beams(beams: Sequence[Sequence[int]], budget: int | None = None) -> TokenTree:
    """The prefix tree of `beams` (each a list of tokens under the root), best beam first: a
    prefix several beams share is stored once, and a node's children come in the order of the
    best beam through each, so the verifier tries siblings best first. At most `budget` nodes:
    beams are taken best first and the first one that does not fit is cut short. Nodes are in
    level order, like every proposer's (a proposal cut to a depth keeps its first nodes).

    >>> merge_beams([[5, 6, 7], [5, 6, 8], [9, 6]])
    TokenTree(tokens=(5, 9, 6, 6, 7, 8), parents=(-1, -1, 0, 1, 2, 2))
    """
    children: dict[tuple[int, ...], list[int]] = {(): []}  # path -> its children's tokens, best first
    size = 0
    for beam in beams:
        beam = tuple(int(t) for t in beam)
        for depth, token in enumerate(beam):
            if token in children[beam[:depth]]:
                continue
            if budget is not None and size >= budget:
                return _level_order(children)
            children[beam[:depth]].append(token)
            children[beam[: depth + 1]] = []
            size += 1
    return _level_order(children)


def _level_order(children: dict[tuple[int, ...], list[int]]) -> TokenTree:
    """The tree whose node paths are `children`'s keys, level by level."""
    tokens: list[int] = []
    parents: list[int] = []
    level: list[tuple[tuple[int, ...], int]] = [((), -1)]
    while level:
        below = []
        for path, node in level:
            for token in children[path]:
                tokens.append(token)
                parents.append(node)
                below.append((path + (token,), len(tokens) - 1))
        level = below
    return TokenTree(tuple(tokens), tuple(parents))


def shape_from_acceptance(rank_acceptance: Sequence[float], budget: int, depth: int) -> tuple[tuple[int, ...], ...]:
    """The static shape that maximises the expected accepted length for a node budget, when the
    draft's j-th ranked child is accepted with probability `rank_acceptance[j]` given that its
    parent was (Sequoia's positional model). A node's chance of being accepted is then the
    product of its path's rank probabilities; a best-first walk takes the `budget` most
    likely nodes, which always form a tree.

    >>> shape_from_acceptance([0.8, 0.1], budget=4, depth=3)  # 0.8, 0.64, 0.512 then 0.1
    ((0,), (1,), (0, 0), (0, 0, 0))
    """
    if not rank_acceptance or budget < 1 or depth < 1:
        return ()
    chosen: list[tuple[int, ...]] = []
    heap = [(-rank_acceptance[0], (0,), 1.0)]  # (-value, path, the parent's value)
    while heap and len(chosen) < budget:
        neg_value, path, parent_value = heapq.heappop(heap)
        if -neg_value <= 0:
            break
        chosen.append(path)
        rank = path[-1]
        if rank + 1 < len(rank_acceptance):  # the next sibling
            heapq.heappush(heap, (-parent_value * rank_acceptance[rank + 1], path[:-1] + (rank + 1,), parent_value))
        if len(path) < depth:  # the first child
            heapq.heappush(heap, (neg_value * rank_acceptance[0], path + (0,), -neg_value))
    return tuple(sorted(chosen, key=lambda p: (len(p), p)))


def rank_acceptance(accepted_per_rank: Sequence[int], reached_per_rank: Sequence[int]) -> list[float]:
    """Measured acceptance per sibling rank: of the rank-j drafts whose parent was accepted,
    the fraction accepted (from SpecStats.num_accepted_tokens_per_rank / num_reached_per_rank)."""
    return [a / r if r else 0.0 for a, r in zip(accepted_per_rank, reached_per_rank)]


def count_ranks(tree: TokenTree, accepted: Sequence[int]) -> tuple[list[int], list[int]]:
    """For one verified tree and its accepted nodes: (accepted, reached) counts per sibling
    rank. A node is reached when its parent (or the root) was accepted."""
    ranks = tree.ranks()
    children = tree.children()
    accepted_counts: list[int] = []
    reached_counts: list[int] = []
    for parent in [-1, *accepted]:
        for node in children.get(parent, ()):
            add_counts(reached_counts, [0] * ranks[node] + [1])
    for node in accepted:
        add_counts(accepted_counts, [0] * ranks[node] + [1])
    return accepted_counts, reached_counts


def add_counts(into: list[int], counts: Sequence[int]) -> None:
    """into += counts, elementwise, growing `into` as needed."""
    for i, n in enumerate(counts):
        if i == len(into):
            into.append(0)
        into[i] += n
