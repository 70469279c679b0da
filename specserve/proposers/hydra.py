"""Hydra proposer: token trees from path-conditioned heads on the target's last hidden state.

Co-located with the target, like Medusa: the verify pass yields the hidden state h_t of the row
that produced the round's last token x_{t+1} (the recovered or bonus one, the tree's root).
Unlike Medusa's, Hydra's candidates at depth d + 1 depend on the path above them, so the tree
grows level by level: each level runs head d once, batched over every frontier node of every
request (row = the request's h_t and the node's path x_{t+1} .. its own token), and the growth
(`specserve.trees`: a chain of top-1s, a static `medusa_choices`-style shape, or a dynamic tree
under a node budget) takes each node's top candidates. A node's score is the product of the
heads' conditional probabilities along its path: the heads' probability of the whole branch.

Candidates are chosen, not drawn: proposals are `deterministic` (q = a point mass on each
candidate), which the verifier accepts losslessly for greedy and sampled requests alike.
"""

from __future__ import annotations

import torch

from specserve.protocol import DETERMINISTIC, Proposal, ProposeRequest, TokenTree
from specserve.proposers.heads import HeadProposer
from specserve.trees import finish, grow_level


class HydraProposer(HeadProposer):
    method = "hydra"

    @torch.inference_mode()
    def propose_from_hidden(self, requests: list[ProposeRequest], hidden: torch.Tensor) -> list[Proposal]:
        """hidden: [len(requests), hidden], the target's last hidden state after each request's
        last committed token (request.token_ids[-1], the root). One batched heads call per
        level for every request. With prefix attention, h_t first looks back over the
        request's window (`observe`)."""
        if not requests:
            return []
        growths = self.growths(requests)
        drafts = [_Draft(r.token_ids[-1]) for r in requests]
        base = self.heads.base(hidden.to(self.heads.token_map.device), self.context(requests))
        for depth in range(self.num_heads):
            frontier = [(b, node) for b, g in enumerate(growths) if g is not None for node in g.frontier()]
            if not frontier:
                break
            rows = torch.tensor([b for b, _ in frontier], device=base.device)
            paths = torch.tensor([drafts[b].path(node) for b, node in frontier], device=base.device)
            logits = self.heads.head_logits(depth, base[rows], paths)  # [N, head_vocab]
            ids, probs = self.top_candidates(logits, growths, depth)
            by_request: dict[int, dict[int, tuple[list[int], list[float]]]] = {}
            for i, (b, node) in enumerate(frontier):
                by_request.setdefault(b, {})[node] = (ids[i], probs[i])
            for b, candidates in by_request.items():
                drafts[b].grow(growths[b], candidates)
        return [Proposal(r.request_id, d.tree(g), DETERMINISTIC) for r, d, g in zip(requests, drafts, growths)]


class _Draft:
    """One request's tree while it grows, with each node's path from the root token."""

    def __init__(self, root: int):
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self._paths: list[list[int]] = []
        self._root = [int(root)]

    def path(self, node: int) -> list[int]:
        """The root token, then the tokens down to `node` (-1: the root alone)."""
        return self._root if node < 0 else self._paths[node]

    def grow(self, growth, candidates: dict[int, tuple[list[int], list[float]]]) -> None:
        for child in grow_level(growth, list(candidates), candidates, self.tokens, self.parents):
            self._paths.append(self.path(self.parents[child]) + [self.tokens[child]])

    def tree(self, growth) -> TokenTree:
        """The tree the growth keeps (None: the request drafted nothing)."""
        return TokenTree() if growth is None else finish(growth, self.tokens, self.parents)[0]
