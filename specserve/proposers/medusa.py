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

from specserve.heads.medusa import MedusaHeads
from specserve.protocol import DETERMINISTIC, Proposal, ProposeRequest, TokenTree
from specserve.trees import grow_from_marginals, growth_for


class MedusaProposer:
    method = "medusa"

    def __init__(self, heads: MedusaHeads, *, vocab_size: int | None = None, min_confidence: float = 0.0):
        self.heads = heads
        self.num_heads = heads.config.num_heads
        self.min_confidence = min_confidence  # chains: stop after a head top-1 below this
        # lm_head rows past the tokenizer's vocabulary (padding) are never proposed.
        limit = vocab_size or heads.config.vocab_size
        self._padding = heads.token_map >= limit

    @torch.inference_mode()
    def propose_from_hidden(self, requests: list[ProposeRequest], hidden: torch.Tensor) -> list[Proposal]:
        """hidden: [len(requests), hidden], the target's last hidden state after each request's
        last committed token. One batched heads pass for every request."""
        if not requests:
            return []
        growths = [growth_for(min(r.k, self.num_heads), r.tree, self.min_confidence) if r.k > 0 else None
                   for r in requests]
        width = min(max((g.max_children for g in growths if g is not None), default=1),
                    self.heads.config.head_vocab_size)
        logits = self.heads(hidden.to(self.heads.token_map.device))  # [heads, B, head_vocab]
        logits = logits.masked_fill(self._padding, float("-inf"))
        probs, index = logits.float().softmax(-1).topk(width, dim=-1)
        ids = self.heads.token_map[index].cpu().tolist()
        probs = probs.cpu().tolist()
        proposals = []
        for b, (request, growth) in enumerate(zip(requests, growths)):
            candidates = [(ids[d][b], probs[d][b]) for d in range(self.num_heads)]
            tree = grow_from_marginals(growth, candidates) if growth is not None else TokenTree()
            proposals.append(Proposal(request.request_id, tree, DETERMINISTIC))
        return proposals

    def release(self, request_id: str) -> None:
        """Heads keep no per-request state."""
