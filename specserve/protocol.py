"""Messages exchanged between the router and the model workers.

Plain Python and numpy only: the router (and anything that speaks to workers over Ray) must not
import torch. Every message carries what a fresh worker needs to rebuild its KV cache (the request's
full token ids), so worker caches are caches, never the source of truth.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

MAX_K = 64  # longest draft chain / deepest tree accepted anywhere
MAX_TREE_NODES = 256  # largest draft tree accepted anywhere
MAX_PIPELINE = 16  # most verifies at once on one streamed draft (speculation.pipeline)

# Speculation = proposer x shape. Proposers: where draft tokens come from.
PROPOSERS = ("none", "draft", "medusa", "hydra", "redrafter", "ngram", "native")
DRAFT_POOL_PROPOSERS = ("draft",)  # need a separate draft model (a draft pool)
HEAD_PROPOSERS = ("medusa", "hydra", "redrafter")  # heads on the target: co-located, proposed by the verify pass
LOCAL_PROPOSERS = ("ngram",)  # no model: proposed where the token ids are (router, library decoder)
# No draft reaches the router: the target decodes alone (none), or speculates inside its own engine
# (native: vLLM's speculative decoding in a vLLM target pool; each round returns several tokens).
TARGET_ONLY_PROPOSERS = ("none", "native")
# Shapes: a chain of k tokens, or a token tree (static when TreeSpec.shape is set, else dynamic).
SHAPES = ("chain", "tree")
# The method names before proposer and shape were separate, and what each one means now.
LEGACY_METHODS = {"none": ("none", "chain"), "draft": ("draft", "chain"), "tree": ("draft", "tree")}
ACCEPTANCES = ("exact", "typical")
# fixed: draft `depth` every round; adaptive: specserve.policy picks 0..depth per round from load
POLICIES = ("fixed", "adaptive")

# How the nodes of a proposal were drawn; the verifier's acceptance depends on it.
SAMPLED = "sampled"  # siblings drawn without replacement from a distribution q sent along
DETERMINISTIC = "deterministic"  # chosen, not drawn (top-k, heads, n-grams, beams): q = point mass
DRAW_LAWS = (SAMPLED, DETERMINISTIC)


class SpecserveError(ValueError):
    """A request or configuration that specserve refuses, with a message meant for the user."""


@dataclass(frozen=True)
class SamplingParams:
    """How to turn the target's logits into tokens. temperature 0 (below 1e-5) means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k truncation
    max_tokens: int = 128
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not self.temperature >= 0:  # also rejects NaN
            raise SpecserveError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SpecserveError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SpecserveError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens < 1:
            raise SpecserveError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise SpecserveError("stop sequences must be non-empty strings")

    @property
    def greedy(self) -> bool:
        # below vLLM's sampling epsilon, logits / temperature overflows float32 (NaN rows):
        # such a temperature is greedy, its limit
        return self.temperature < GREEDY_BELOW_TEMPERATURE


GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class TokenTree:
    """Draft tokens hanging under a request's last committed token (the root, not stored here).

    `parents[i]` is the index of node i's parent, -1 for a child of the root; nodes are in
    topological order (parent index < node index). A chain of k tokens is the one-branch case:
    parents == [-1, 0, 1, ..., k-2].

    Example: root -> a -> b and root -> c is TokenTree(tokens=(a, b, c), parents=(-1, 0, -1)).
    """

    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise SpecserveError("a token tree needs one parent per token")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise SpecserveError(f"tree node {i} has parent {p}: parents must precede children")

    @classmethod
    def chain(cls, tokens) -> TokenTree:
        tokens = tuple(int(t) for t in tokens)
        return cls(tokens, tuple(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depths(self) -> list[int]:
        """Depth of each node; children of the root have depth 1."""
        depths: list[int] = []
        for p in self.parents:
            depths.append(1 if p < 0 else depths[p] + 1)
        return depths

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def children(self) -> dict[int, list[int]]:
        """Node -> its children in order (-1 is the root). Siblings are in rank order: the
        proposer lists a node's children from most to least preferred."""
        out: dict[int, list[int]] = {}
        for i, p in enumerate(self.parents):
            out.setdefault(p, []).append(i)
        return out

    def path_of(self, continuation) -> list[int]:
        """Indices of the nodes that spell out a prefix of `continuation`, root downwards.

        >>> TokenTree((5, 6, 7), (-1, 0, -1)).path_of([7, 1])
        [2]
        """
        children = self.children()
        path: list[int] = []
        parent = -1
        for token in continuation:
            child = next((c for c in children.get(parent, ()) if self.tokens[c] == token), None)
            if child is None:
                break
            path.append(child)
            parent = child
        return path

    def ranks(self) -> list[int]:
        """Each node's position among its siblings (0 = its parent's first child)."""
        ranks = [0] * len(self.tokens)
        for siblings in self.children().values():
            for rank, node in enumerate(siblings):
                ranks[node] = rank
        return ranks

    def extends(self, prefix: TokenTree) -> bool:
        """Whether this tree is `prefix` with more nodes appended."""
        n = len(prefix)
        return self.tokens[:n] == prefix.tokens and self.parents[:n] == prefix.parents

    def ancestor_mask(self) -> np.ndarray:
        """[n, n] bool: mask[i, j] is True when node j is node i or one of its ancestors."""
        n = len(self.tokens)
        mask = np.zeros((n, n), dtype=bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                mask[i] = mask[p]
            mask[i, i] = True
        return mask


# Static tree shapes known by name (TreeSpec(shape="mc_sim_7b_63")). mc_sim_7b_63 is Medusa's
# default tree (FasterDecoding/Medusa, medusa/model/medusa_choices.py): 63 nodes, 4 levels, up to
# 10 children at the root. Hydra's evaluation (zankner/Hydra, --hydra-choices) uses it too, so it
# is the tree under the papers' accepted lengths.
NAMED_TREE_SHAPES: dict[str, tuple[tuple[int, ...], ...]] = {
    "mc_sim_7b_63": (
        (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4), (2, 0), (0, 5),
        (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8), (0, 0, 2), (3, 0), (0, 9), (8,),
        (9,), (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0), (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0),
        (0, 1, 1), (0, 0, 6), (0, 3, 0), (5, 0), (1, 3), (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0),
        (1, 4), (7, 0), (0, 1, 2), (2, 0, 0), (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1),
        (9, 0), (0, 6, 0), (0, 0, 0, 1), (1, 6), (0, 7, 0),
    ),
}


@dataclass(frozen=True)
class TreeSpec:
    """How a draft model grows its token tree each round (method `tree`).

    Dynamic (no `shape`): level by level, like EAGLE-2's expansion. A node's score is the
    draft's probability of its whole path. At each level the `width` best new children of the
    current frontier (by score) join the tree and become the next frontier, skipping children
    whose score is below `min_score`, until `depth` levels or `budget` nodes. The tree is deep
    and thin where the draft is sure and bushy where it hesitates.

    Static (`shape` given): the same tree every round, as a list of paths of child ranks, like
    Medusa's `medusa_choices`: (0,) is the draft's first choice after the root, (0, 1) its
    second choice after that, (1,) its second choice at the root. Every prefix of a path must
    be listed, and a node's ranks must be 0..n-1. `budget` and `depth` follow from the shape.
    A name from NAMED_TREE_SHAPES stands for its paths ("mc_sim_7b_63": Medusa's and Hydra's
    63-node default).

    Sampled requests draw a node's children without replacement from the draft's distribution
    (the shape decides only how many), which lossless multi-draft verification needs.

    Reranked (`rerank`, dynamic only; EAGLE-2's reranking): the levels grow `width` children
    each to `depth` levels whatever the budget (at most MAX_TREE_NODES in all, the most any
    tree holds, so a request cannot ask for width x depth drafted nodes unbounded), then the
    tree keeps the `budget` nodes of highest score. A node never scores above its parent, so
    they always form a tree, and the budget goes where the draft is sure at any depth rather
    than to each level in turn. Which
    nodes stay then depends on the probabilities of tokens drawn after them, so a tree whose
    children are drawn (a draft model's, for a sampled request) grows under the budget as
    without it; trees of chosen candidates (greedy drafts, Medusa's and Hydra's heads) rerank.
    ReDrafter's beams and prompt lookup's matches come ranked already and do not use it.
    """

    budget: int = 16
    depth: int = 12
    width: int = 4
    min_score: float = 0.2
    shape: tuple[tuple[int, ...], ...] | str | None = None  # a name from NAMED_TREE_SHAPES becomes its paths
    rerank: bool = False  # dynamic: grow width x depth, keep the budget best (see above)

    def __post_init__(self) -> None:
        if isinstance(self.shape, str):
            if self.shape not in NAMED_TREE_SHAPES:
                raise SpecserveError(f"unknown tree shape {self.shape!r}: give paths of child ranks or one of "
                                     f"{', '.join(NAMED_TREE_SHAPES)}")
            object.__setattr__(self, "shape", NAMED_TREE_SHAPES[self.shape])
        if self.shape is not None and self.rerank:
            raise SpecserveError("tree rerank applies to dynamic trees: a static shape is the same every round")
        if self.shape is not None:
            shape = tuple(sorted({tuple(int(r) for r in path) for path in self.shape}, key=lambda p: (len(p), p)))
            check_shape(shape)
            object.__setattr__(self, "shape", shape)
            object.__setattr__(self, "budget", len(shape))
            object.__setattr__(self, "depth", max(len(p) for p in shape))
        if not 1 <= self.budget <= MAX_TREE_NODES:
            raise SpecserveError(f"tree budget must be in [1, {MAX_TREE_NODES}] nodes, got {self.budget}")
        if not 1 <= self.depth <= MAX_K:
            raise SpecserveError(f"tree depth must be in [1, {MAX_K}], got {self.depth}")
        if not 1 <= self.width <= MAX_TREE_NODES:
            raise SpecserveError(f"tree width must be in [1, {MAX_TREE_NODES}], got {self.width}")
        if not 0 <= self.min_score < 1:
            raise SpecserveError(f"tree min_score must be in [0, 1), got {self.min_score}")

    def capped(self, depth: int) -> TreeSpec:
        """This spec limited to `depth` levels (a request near max_tokens drafts less)."""
        if depth >= self.depth:
            return self
        if self.shape is None:
            return replace(self, depth=depth, budget=min(self.budget, self.width * depth))
        return replace(self, shape=tuple(p for p in self.shape if len(p) <= depth))


def check_shape(paths: tuple[tuple[int, ...], ...]) -> None:
    """A static tree shape: non-empty, prefix-closed, ranks 0..n-1 under every node."""
    if not paths:
        raise SpecserveError("a static tree shape needs at least one path")
    if len(paths) > MAX_TREE_NODES:
        raise SpecserveError(f"a static tree shape may have at most {MAX_TREE_NODES} nodes, got {len(paths)}")
    known = set(paths)
    for path in paths:
        if not path or any(r < 0 for r in path):
            raise SpecserveError(f"tree shape path {list(path)}: give non-empty lists of ranks >= 0")
        if len(path) > MAX_K:
            raise SpecserveError(f"tree shape path {list(path)} is deeper than {MAX_K}")
        if len(path) > 1 and path[:-1] not in known:
            raise SpecserveError(f"tree shape path {list(path)} needs its parent {list(path[:-1])} in the shape")
        if path[-1] > 0 and path[:-1] + (path[-1] - 1,) not in known:
            raise SpecserveError(f"tree shape path {list(path)} needs its elder sibling "
                                 f"{list(path[:-1] + (path[-1] - 1,))} in the shape")


@dataclass(frozen=True)
class TypicalAcceptance:
    """Medusa's typical acceptance: LOSSY, opt-in. A sampled request accepts a draft token x
    when p(x) > min(posterior_threshold, posterior_alpha * exp(-H(p))), where p is the target's
    processed distribution and H its entropy. The output is then *not* distributed as the
    target's; it trades that for longer accepted runs. Greedy requests are unaffected."""

    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3

    def __post_init__(self) -> None:
        if not 0 < self.posterior_threshold <= 1:
            raise SpecserveError(f"posterior_threshold must be in (0, 1], got {self.posterior_threshold}")
        if not 0 < self.posterior_alpha <= 1:
            raise SpecserveError(f"posterior_alpha must be in (0, 1], got {self.posterior_alpha}")


@dataclass(frozen=True)
class Speculation:
    """What a request speculates with: a proposer and a shape.

    - proposer: `none` (target only), `draft` (a draft model in its own pool), `medusa`, `hydra`
      or `redrafter` (heads on the target, co-located: the verify pass also proposes the next round),
      `ngram` (prompt lookup: no model, proposed by the router itself);
    - shape: `chain` (k tokens in a row) or `tree` (`tree`: dynamic, or static when
      `tree.shape` lists paths of child ranks);
    - acceptance: `exact` (lossless, the default) or `typical` (Medusa's typical acceptance,
      lossy by design, opt-in).

    >>> Speculation(proposer="medusa", shape="tree").depth
    12
    """

    proposer: str = "draft"
    shape: str = "chain"
    k: int = 4
    tree: TreeSpec = field(default_factory=TreeSpec)
    acceptance: str = "exact"
    typical: TypicalAcceptance = field(default_factory=TypicalAcceptance)
    policy: str = "fixed"
    # Greedy draft-pool chains: verifies at once on one streamed draft (specserve.pipeline); 0: off
    pipeline: int = 0
    # Adaptive chains: the longest chain the policy may draft for a request alone in the rounds
    # (0: k). Alone, a deep draft costs only its own round; sharing the target's passes, every
    # request's round waits for it (see `cap`).
    solo_k: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.pipeline <= MAX_PIPELINE:
            raise SpecserveError(f"pipeline (verifies at once on a streamed draft) must be in [0, {MAX_PIPELINE}], "
                                 f"got {self.pipeline}")
        if self.policy not in POLICIES:
            raise SpecserveError(f"unknown speculation policy {self.policy!r}; choose fixed (draft k / the "
                                 "tree's depth every round) or adaptive (load-aware, 0..k per round)")
        if self.proposer not in PROPOSERS:
            raise SpecserveError(f"unknown proposer {self.proposer!r}; choose one of {', '.join(PROPOSERS)}")
        if self.shape not in SHAPES:
            raise SpecserveError(f"unknown speculation shape {self.shape!r}; choose one of {', '.join(SHAPES)}")
        if not 0 <= self.k <= MAX_K:
            raise SpecserveError(f"k (draft tokens per round) must be in [0, {MAX_K}], got {self.k}")
        if self.solo_k and self.policy != "adaptive":
            raise SpecserveError("solo_k (the longest chain for a request alone) is the adaptive policy's: with "
                                 "policy fixed every round drafts k; set policy adaptive or drop solo_k")
        if self.solo_k and not self.k <= self.solo_k <= MAX_K:
            raise SpecserveError(f"solo_k (the longest adaptive chain for a request alone) must be 0 (= k) or "
                                 f"in [k, {MAX_K}] = [{self.k}, {MAX_K}], got {self.solo_k}")
        if self.acceptance not in ACCEPTANCES:
            raise SpecserveError(f"unknown acceptance {self.acceptance!r}; choose exact (lossless) or "
                                 "typical (lossy, Medusa's typical acceptance)")

    @property
    def depth(self) -> int:
        """The most draft tokens one round can accept: k for a chain, the tree's depth."""
        return 0 if self.proposer in TARGET_ONLY_PROPOSERS else self.k if self.shape == "chain" else self.tree.depth

    def cap(self, alone: bool) -> int:
        """The deepest round the load-aware policy may choose: the depth, or for a chain whose
        request is alone in the rounds, `solo_k` where that is deeper. Why not solo_k always: a
        request sharing the target's passes makes every other one wait for its draft and verify,
        which its own goodput does not count (a cap of 8 everywhere: 1.06x always on's k = 4 at
        1 stream on code, 0.70x at 8 streams; docs/bench/adaptive-cap8-avx2)."""
        if alone and self.shape == "chain" and self.depth:
            return max(self.depth, self.solo_k)
        return self.depth

    @property
    def co_located(self) -> bool:
        return self.proposer in HEAD_PROPOSERS

    @property
    def draft_cost(self) -> str:
        """What drafting costs a round (specserve.policy.DRAFT_COSTS): a draft pool's steps,
        heads riding on the target pass, or nothing."""
        return "pool" if self.proposer in DRAFT_POOL_PROPOSERS else "co_located" if self.co_located else "free"

    @property
    def lossy(self) -> bool:
        return self.acceptance == "typical"

    def draft_tree(self) -> TreeSpec | None:
        """The tree a proposer grows (None: a chain)."""
        return self.tree if self.shape == "tree" else None

    @property
    def adaptive(self) -> bool:
        return self.policy == "adaptive" and self.proposer not in TARGET_ONLY_PROPOSERS

    def describe(self) -> str:
        if self.proposer in TARGET_ONLY_PROPOSERS:
            return {"none": "none", "native": "native (the target engine's own speculative decoding)"}[self.proposer]
        shape = f"chain k={self.k}" if self.shape == "chain" else f"tree {self.tree}"
        solo = f", up to {self.solo_k} alone" if self.adaptive and self.cap(alone=True) > self.depth else ""
        policy = f", adaptive (load-aware{solo})" if self.adaptive else ""
        return f"{self.proposer}, {shape}{policy}, {'typical acceptance (LOSSY)' if self.lossy else 'exact'}"

    def overridden(self, *, method: str | None = None, proposer: str | None = None, shape: str | None = None,
                   k: int | None = None, tree: TreeSpec | None = None, acceptance: str | None = None,
                   typical: dict | None = None, policy: str | None = None,
                   pipeline: int | None = None, solo_k: int | None = None) -> Speculation:
        """This speculation with some settings replaced (a request's override, a CLI flag).
        `method` is the older spelling of proposer + shape (see `from_method`). `typical` is
        partial: unset fields keep these ones. An explicit proposer, shape, k or tree wins over
        the load-aware policy: it makes the policy `fixed` unless `policy` is given too; so does a
        pipeline (its chunks are k tokens each). Without its own `solo_k`, a request that sets k
        (its longest chain) or ends up fixed drops the deployment's."""
        if method is not None:
            proposer, shape = from_method(method, proposer, shape)
        if policy is None and (any(v is not None for v in (proposer, shape, k, tree)) or pipeline):
            policy = "fixed"
        if solo_k is None and self.solo_k and (k is not None or (policy or self.policy) == "fixed"):
            solo_k = 0
        changes = {name: value for name, value in (("proposer", proposer), ("shape", shape), ("k", k),
                                                   ("solo_k", solo_k),
                                                   ("tree", tree), ("acceptance", acceptance),
                                                   ("policy", policy), ("pipeline", pipeline)) if value is not None}
        if typical:
            changes["typical"] = replace(self.typical, **typical)
        return replace(self, **changes) if changes else self


def from_method(method: str, proposer: str | None, shape: str | None) -> tuple[str | None, str | None]:
    """(proposer, shape) for the older `method` spelling: none | draft | tree (LEGACY_METHODS),
    which may not be combined with proposer or shape, or a proposer's name (method: medusa).

    >>> from_method("tree", None, None)
    ('draft', 'tree')
    """
    if method in LEGACY_METHODS:
        if proposer is not None or shape is not None:
            raise SpecserveError("give `proposer` and `shape`, or the older `method`, not both "
                                 "(method tree = proposer draft + shape tree)")
        return LEGACY_METHODS[method]
    if method in PROPOSERS and proposer is None:
        return method, shape
    raise SpecserveError(f"unknown speculation method {method!r}; write `proposer` ({', '.join(PROPOSERS)}) "
                         f"and `shape` ({', '.join(SHAPES)}) instead")


@dataclass
class SparseDist:
    """A distribution over the vocabulary that is zero outside `ids`. [k, m] per request.

    Drafts sample from a top-m truncation of the draft distribution and send exactly that
    truncated distribution: rejection sampling is exact for any proposal distribution, so the
    truncation costs a little acceptance, never correctness, and keeps messages small.
    """

    ids: np.ndarray  # [k, m] int64
    probs: np.ndarray  # [k, m] float32, rows sum to 1


def check_draw_law(tree: TokenTree, law: str, dists: SparseDist | None, who: str) -> None:
    """A proposal must say how its nodes were drawn, consistently with what it sends:
    `sampled` nodes come with the distribution q each was drawn from (one row per node);
    `deterministic` nodes come with none (q is a point mass on each candidate). Verifying a
    top-k tree as if it had been sampled from its q would be inexact, so the law is never
    guessed from what happens to be attached."""
    if law not in DRAW_LAWS:
        raise SpecserveError(f"{who}: unknown draw law {law!r}; use {SAMPLED!r} or {DETERMINISTIC!r}")
    if law == SAMPLED and len(tree) and (dists is None or dists.ids.shape[0] != len(tree)):
        raise SpecserveError(f"{who}: sampled drafts need the distribution each node was drawn from, "
                             "one row per node")
    if law == DETERMINISTIC and dists is not None:
        raise SpecserveError(f"{who}: deterministic drafts carry no draft distribution (q is a point mass "
                             "on each candidate); a proposer that sampled its nodes must say law='sampled'")


@dataclass(frozen=True)
class PoolLoad:
    """A pool's state at the pass that answered a call: the load signal every reply carries."""

    batch_size: int  # calls in the pass
    batch_tokens: float  # tokens per forward pass (new tokens + draft nodes)
    queued: int  # calls still waiting when the pass ended
    step_s: float  # seconds per forward pass
    passes: int = 1  # forward passes the call took (a draft's k steps)

    @classmethod
    def measured(cls, batch_size: int, tokens: int, passes: int, seconds: float, queued: int = 0) -> PoolLoad:
        """The signal of a batch that ran `tokens` tokens (uncached ones + draft nodes) through
        `passes` forward passes in `seconds`: per-pass means, which fit a step time that is
        linear in tokens (a draft's prefill and its k steps average out correctly)."""
        passes = max(1, passes)
        return cls(batch_size, tokens / passes, queued, seconds / passes, passes)


@dataclass(frozen=True)
class DraftShape:
    """How much to draft for a request's next round: a chain of k tokens (tree None), or a tree
    capped at depth k. `seed` is the randomness of that round's draft sampling."""

    k: int
    tree: TreeSpec | None = None
    seed: int = 0


@dataclass
class ProposeRequest:
    request_id: str
    token_ids: list[int]  # committed ids: prompt + generated so far
    k: int  # chain length, or the deepest level of a tree
    params: SamplingParams
    seed: int  # randomness of this round's draft sampling
    tree: TreeSpec | None = None  # None: a chain of k tokens

    @classmethod
    def after(cls, request_id: str, token_ids: list[int], params: SamplingParams, shape: DraftShape) -> ProposeRequest:
        return cls(request_id, token_ids, shape.k, params, shape.seed, shape.tree)

    @property
    def draft_nodes(self) -> int:
        """Tokens the draft adds to its passes beyond the uncached ones: k steps of `width`."""
        return self.k * (self.tree.width if self.tree is not None else 1)


@dataclass
class Proposal:
    """A draft for one request: a token tree (a chain is the one-branch tree) and how its
    nodes were drawn (`law`, see check_draw_law)."""

    request_id: str
    tree: TokenTree
    law: str
    # law == SAMPLED: row i is the distribution node i was drawn from (its parent's, before
    # drawing without replacement). None for deterministic proposals.
    dists: SparseDist | None = None
    compute_s: float = 0.0  # the pool's time in the batch that produced it
    load: PoolLoad | None = None  # the draft pool's state at that batch

    def __post_init__(self) -> None:
        check_draw_law(self.tree, self.law, self.dists, f"proposal for {self.request_id}")

    def truncated(self, depth: int) -> Proposal:
        """Only the nodes at depth <= `depth` (a request near max_tokens verifies less). Whole
        levels go, so the kept siblings keep their law."""
        depths = self.tree.depths
        if not depths or max(depths) <= depth:
            return self
        keep = [i for i, d in enumerate(depths) if d <= depth]  # parents precede children: same indices
        tree = TokenTree(tuple(self.tree.tokens[i] for i in keep), tuple(self.tree.parents[i] for i in keep))
        dists = None if self.dists is None else SparseDist(self.dists.ids[keep], self.dists.probs[keep])
        return replace(self, tree=tree, dists=dists)


@dataclass
class VerifyRequest:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    seed: int  # randomness of this round's acceptance
    draft: TokenTree = field(default_factory=TokenTree)
    law: str = DETERMINISTIC  # how the draft's nodes were drawn (an empty draft: either)
    dists: SparseDist | None = None  # law == SAMPLED: the draft distribution per node
    typical: TypicalAcceptance | None = None  # None: exact acceptance; set: LOSSY typical acceptance
    # Co-located heads: the shape of the next round's proposal, made from this pass's hidden state.
    propose_next: DraftShape | None = None

    def __post_init__(self) -> None:
        check_draw_law(self.draft, self.law, self.dists, f"request {self.request_id}")

    @property
    def draft_nodes(self) -> int:
        """Tokens verification adds to the pass beyond the uncached ones."""
        return len(self.draft)


@dataclass
class VerifyResult:
    request_id: str
    num_accepted: int  # draft tokens accepted
    tokens: list[int]  # accepted draft tokens + one recovered or bonus token from the target
    compute_s: float = 0.0  # the pool's time in the batch that produced it
    next_proposal: Proposal | None = None  # co-located heads: the next round's draft
    load: PoolLoad | None = None  # the target pool's state at that batch
