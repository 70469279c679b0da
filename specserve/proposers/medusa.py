"""Medusa proposer: token trees from heads on the target's last hidden state.

Co-located with the target: the verify pass that accepts this round's tokens also yields the
hidden state of the row that produced the round's last token (the recovered or bonus one), and
the heads turn it into the next round's tree. Head d's top tokens are the candidates at depth
d + 1 whatever the path above them, so the tree is a `grow_from_marginals` growth: a chain of
head top-1s, a static `medusa_choices`-style shape, or a dynamic tree under a node budget
scored by the product of the heads' probabilities along a path.

The candidates are chosen, not drawn: proposals are `deterministic` (q = a point mass on each
candidate), which the verifier accepts losslessly for greedy and sampled requests alike.
"""

from __future__ import annotations

import torch

from specserve.protocol import DETERMINISTIC, Proposal, ProposeRequest, TokenTree
from specserve.proposers.heads import HeadProposer
from specserve.trees import grow_from_marginals


class MedusaProposer(HeadProposer):
    method = "medusa"

    @torch.inference_mode()
    def propose_from_hidden(self, requests: list[ProposeRequest], hidden: torch.Tensor) -> list[Proposal]:
        """hidden: [len(requests), hidden], the target's last hidden state after each request's
        last committed token. One batched heads pass for every request."""
        if not requests:
            return []
        growths = self.growths(requests)
        logits = self.heads(hidden.to(self.heads.token_map.device))  # [heads, B, head_vocab]
        ids, probs = self.top_candidates(logits, growths)
        proposals = []
        for b, (request, growth) in enumerate(zip(requests, growths)):
            candidates = [(ids[d][b], probs[d][b]) for d in range(self.num_heads)]
            tree = grow_from_marginals(growth, candidates) if growth is not None else TokenTree()
            proposals.append(Proposal(request.request_id, tree, DETERMINISTIC))
        return proposals
