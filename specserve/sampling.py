"""Sampling and lossless acceptance: small pure functions of tensors.

Vocabulary (as in vLLM's rejection sampler), for one request whose draft proposed k tokens:
- accepted: draft tokens the target keeps, a prefix of the draft;
- recovered: on the first rejection, one token drawn from the residual norm(max(0, p - q));
- bonus: when all k drafts are accepted, one token drawn from the target's p at position k.
Each round therefore emits num_accepted + 1 tokens.

The guarantee (Leviathan et al. 2023, Chen et al. 2023): every emitted token is distributed
exactly as the target's p given the tokens before it, whatever the draft distribution q is,
as long as the draft tokens were drawn from q. Candidates that were chosen rather than drawn
(head top-k, n-grams, beams) are the case q = a point mass on each candidate.

`accept_typical_tree` (Medusa's typical acceptance) is the one exception: lossy by design,
used only when a request opts in.
"""

from __future__ import annotations

import torch

from specserve.protocol import SamplingParams, SparseDist, TokenTree, TypicalAcceptance


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution to sample from: temperature, then top-k, then top-p, in float32.

    logits: [n, V]. Returns [n, V] rows summing to 1. Greedy (temperature 0) returns the
    one-hot argmax so greedy is the limit of sampling.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        logits = logits.masked_fill(_outside_top_p(logits, params.top_p), float("-inf"))
    return logits.softmax(-1)


TOP_P_CANDIDATES = 1024  # top-p looks at this many tokens first; a full sort only if they fall short


def _outside_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """[n, V] bool: tokens top-p drops. A token is dropped when the tokens ranked above it
    already reach top_p; the top one stays. Sorting 150k logits per row is the slow part, so
    the ranking runs on the TOP_P_CANDIDATES most probable tokens, which hold the whole nucleus
    in practice (every token outside them is then dropped); rows whose candidates do not reach
    top_p are ranked in full. Same result either way."""
    probs = logits.softmax(-1)
    m = min(TOP_P_CANDIDATES, logits.shape[-1])
    top, order = probs.topk(m, dim=-1)  # sorted, descending
    if m < logits.shape[-1] and bool((top.sum(-1) < top_p).any()):
        top, order = probs.sort(dim=-1, descending=True)
    drop_sorted = (top.cumsum(-1) - top) >= top_p
    drop_sorted[..., 0] = False  # even when top_p underflows float32 to 0 (5e-324): never an empty row
    drop = torch.ones_like(probs, dtype=torch.bool)
    return drop.scatter_(-1, order, drop_sorted)


class LazyTargetProbs:
    """`target_probs` of a [n, V] block of logits, one row at a time on first use, on the
    CPU in float32: acceptance walks one path of the tree and touches only the rows on it.

    >>> rows = LazyTargetProbs(torch.tensor([[0., 1.], [2., 0.]]), SamplingParams(temperature=1.0))
    >>> rows.shape, round(float(rows[1][0]), 3)
    ((2, 2), 0.881)
    """

    def __init__(self, logits: torch.Tensor, params: SamplingParams):
        self.logits = logits
        self.params = params
        self.shape = tuple(logits.shape)
        self._rows: dict[int, torch.Tensor] = {}

    def __getitem__(self, row: int) -> torch.Tensor:
        if row not in self._rows:
            self._rows[row] = target_probs(self.logits[row:row + 1].float().cpu(), self.params)[0]
        return self._rows[row]

    def dense(self) -> torch.Tensor:
        return torch.stack([self[i] for i in range(self.shape[0])])


def truncate_top_m(probs: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the m most probable tokens of each row, renormalised: (ids [n, m], probs [n, m])."""
    m = min(m, probs.shape[-1])
    top_probs, top_ids = torch.topk(probs, m, dim=-1)
    return top_ids, top_probs / top_probs.sum(-1, keepdim=True)


def densify(dist: SparseDist, vocab_size: int) -> torch.Tensor:
    """SparseDist [k, m] -> dense [k, V] float32."""
    ids = torch.as_tensor(dist.ids, dtype=torch.long)
    probs = torch.as_tensor(dist.probs, dtype=torch.float32)
    return torch.zeros(ids.shape[0], vocab_size).scatter_(-1, ids, probs)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from a [V] distribution."""
    return int(torch.multinomial(probs, 1, generator=generator))


def accept_greedy(draft_tokens: list[int], target_logits: torch.Tensor) -> list[int]:
    """Greedy verification of a chain. target_logits: [k+1, V].

    Keeps the longest draft prefix equal to the target's argmax, then adds the target's own
    argmax at the first mismatch (recovered) or after the last draft (bonus).

    >>> logits = torch.tensor([[0., 9.], [9., 0.], [0., 9.]])  # argmax 1, 0, 1
    >>> accept_greedy([1, 1], logits)  # 1 accepted, recovered 0
    [1, 0]
    """
    argmax = target_logits.argmax(-1).tolist()
    n = 0
    while n < len(draft_tokens) and draft_tokens[n] == argmax[n]:
        n += 1
    return list(draft_tokens[:n]) + [argmax[n]]


def accept_greedy_tree(tree: TokenTree, target_logits: torch.Tensor) -> list[int]:
    """Greedy verification of a token tree. target_logits: [1 + n, V]; row 0 follows the
    root (the last committed token), row i + 1 follows node i.

    Walks down from the root: while the target's argmax is a child of the current node, that
    child is accepted; the first argmax with no matching child is the recovered token (or the
    bonus token below an accepted leaf). A chain gives exactly `accept_greedy`.

    >>> tree = TokenTree((5, 6, 7), (-1, -1, 1))  # root -> 5, root -> 6 -> 7
    >>> logits = torch.nn.functional.one_hot(torch.tensor([6, 0, 7, 9]), 10).float()
    >>> accept_greedy_tree(tree, logits)  # 6 and 7 accepted, then the target's 9
    [6, 7, 9]
    """
    return walk_greedy_tree(tree, target_logits.argmax(-1).tolist())


def walk_greedy_tree(tree: TokenTree, argmax: list[int]) -> list[int]:
    """accept_greedy_tree on the target's argmax per row (an engine that returns the top
    tokens rather than logits needs no [n, V] tensor).

    >>> walk_greedy_tree(TokenTree((5, 6, 7), (-1, -1, 1)), [6, 0, 7, 9])
    [6, 7, 9]
    """
    children = tree.children()
    out: list[int] = []
    node = -1
    while True:
        token = argmax[node + 1]
        out.append(token)
        child = next((c for c in children.get(node, ()) if tree.tokens[c] == token), None)
        if child is None:
            return out
        node = child


def accept_rejection_tree(
    tree: TokenTree,
    draft_probs: torch.Tensor | None,
    target_probs_: torch.Tensor,
    generator: torch.Generator | None,
) -> list[int]:
    """Lossless multi-draft speculative sampling of a token tree (recursive rejection sampling,
    SpecInfer / Jeon et al. 2024).

    target_probs_: [1 + n, V], the target's processed distribution after the root (row 0) and
    after each node (row i + 1). draft_probs says how the nodes were drawn:
    - [n, V] (sampled): row i is the distribution node i was drawn from, its parent's draft
      distribution q; a node's children were drawn from q *without replacement*, in sibling
      order. Sibling j is then proposed from q_j = q without the siblings before it;
    - None (deterministic): the candidates were chosen, not drawn (head top-k, n-grams,
      beams); each sibling's proposal q_j is a point mass on its own token.

    At the current node with target distribution p: accept child x_j with probability
    min(1, p(x_j) / q_j(x_j)) and descend into it; on rejection, p becomes the residual
    norm(max(0, p - q_j)) and the next sibling is tried. When every child is rejected, a
    recovered token is drawn from the last residual; below an accepted leaf, a bonus token is
    drawn from p. Each step is an exact speculative-sampling step against the current
    residual, so every emitted token follows the target's distribution. A chain is ordinary
    speculative sampling.

    Deterministic example: p = (0.5, 0.3, 0.2) and candidates 1 then 0 under the root. Token 1
    is accepted with probability 0.3; otherwise p becomes (5/7, 0, 2/7) and token 0 is accepted
    with probability 5/7; otherwise token 2 is emitted. P(1) = 0.3, P(0) = 0.7 * 5/7 = 0.5,
    P(2) = 0.7 * 2/7 = 0.2: exactly p.
    """
    children = tree.children()
    out: list[int] = []
    node = -1
    while True:
        p = target_probs_[node + 1]
        kids = children.get(node, [])
        q = draft_probs[kids[0]].clone() if kids and draft_probs is not None else None
        accepted = None
        for child in kids:
            x = tree.tokens[child]
            q_x = 1.0 if q is None else q[x]  # q(x) > 0: x was drawn from q
            if torch.rand((), generator=generator) * q_x < p[x]:  # u < p(x) / q(x)
                accepted = child
                break
            if q is None:
                p = _residual(p, torch.nn.functional.one_hot(torch.tensor(x), p.shape[-1]).to(p.dtype))
                continue
            p = _residual(p, q)
            q[x] = 0
            if q.sum() <= 0:  # the draft had no tokens left, so no later sibling can exist
                break
            q = q / q.sum()
        if accepted is None:  # bonus below a leaf, or recovered after every child was rejected
            out.append(sample(p, generator))
            return out
        out.append(tree.tokens[accepted])
        node = accepted


def accept_typical_tree(
    tree: TokenTree,
    target_probs_: torch.Tensor,
    typical: TypicalAcceptance,
    generator: torch.Generator | None,
) -> list[int]:
    """Medusa's typical acceptance, LOSSY: the emitted tokens are not distributed as p.

    A node x (under a parent whose target distribution is p) is acceptable when
    p(x) > min(posterior_threshold, posterior_alpha * exp(-H(p))). The longest path of
    acceptable nodes from the root is accepted (the first such path in node order on ties),
    then one token is sampled from the target's p after its last node.

    >>> tree = TokenTree((1,), (-1,))  # one candidate, p(1) = 0.3 > min(0.09, 0.3 e^-H)
    >>> accept_typical_tree(tree, torch.tensor([[0.5, 0.3, 0.2], [0., 0., 1.]]), TypicalAcceptance(), None)
    [1, 2]
    """
    entropy = -(target_probs_ * target_probs_.clamp_min(1e-30).log()).sum(-1)
    threshold = torch.minimum(torch.full_like(entropy, typical.posterior_threshold),
                              typical.posterior_alpha * torch.exp(-entropy))
    parents = tree.parents
    acceptable_depth = [0] * len(tree)  # length of the acceptable path ending at each node (0: not)
    for i, x in enumerate(tree.tokens):
        p_row = parents[i] + 1
        if target_probs_[p_row, x] > threshold[p_row] and (parents[i] < 0 or acceptable_depth[parents[i]]):
            acceptable_depth[i] = 1 + (acceptable_depth[parents[i]] if parents[i] >= 0 else 0)
    best = max(range(len(tree)), key=lambda i: (acceptable_depth[i], -i), default=None)
    path: list[int] = []
    node = best if best is not None and acceptable_depth[best] else -1
    while node >= 0:
        path.append(node)
        node = parents[node]
    path.reverse()
    last = path[-1] if path else -1
    return [tree.tokens[i] for i in path] + [sample(target_probs_[last + 1], generator)]


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)). It has mass TV(p, q) > 0 whenever a rejection is possible; p is
    kept only against float underflow."""
    residual = (p - q).clamp_(min=0)
    total = residual.sum()
    return residual / total if total > 0 else p


def accept_rejection(
    draft_tokens: list[int],
    draft_probs: torch.Tensor,
    target_probs_: torch.Tensor,
    generator: torch.Generator | None,
) -> list[int]:
    """Lossless speculative sampling of a chain: `accept_rejection_tree` on the one-branch tree.

    draft_probs: [k, V], the distributions the draft tokens were drawn from.
    target_probs_: [k+1, V], the target's (processed) distributions at each draft position and
    one more. Accept draft x with probability min(1, p(x) / q(x)); on the first rejection emit
    a recovered token from norm(max(0, p - q)) and stop; if all are accepted emit a bonus
    token from p at position k.
    """
    return accept_rejection_tree(TokenTree.chain(draft_tokens), draft_probs, target_probs_, generator)


def generator_for(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
