"""What the co-located head proposers (Medusa, Hydra) share: growth plans per request, and the
top candidates of head logits mapped back to token ids, padding rows never proposed."""

from __future__ import annotations

import torch

from specserve.protocol import ProposeRequest
from specserve.trees import growth_for


class HeadProposer:
    method = ""  # the proposer name: medusa | hydra

    def __init__(self, heads, *, vocab_size: int | None = None, min_confidence: float = 0.0):
        self.heads = heads
        self.num_heads = heads.config.num_heads
        self.min_confidence = min_confidence  # chains: stop after a head top-1 below this
        # lm_head rows past the tokenizer's vocabulary (padding) are never proposed.
        limit = vocab_size or heads.config.vocab_size
        self._padding = heads.token_map >= limit

    def growths(self, requests: list[ProposeRequest]) -> list:
        """Each request's tree growth (None: it drafts nothing this round)."""
        return [growth_for(min(r.k, self.num_heads), r.tree, self.min_confidence) if r.k > 0 else None
                for r in requests]

    def top_candidates(self, logits: torch.Tensor, growths: list) -> tuple[list, list]:
        """(token ids, probabilities) of the best candidates per row of `logits` (as wide as
        the widest growth needs), as nested lists shaped like logits without its last axis."""
        width = min(max((g.max_children for g in growths if g is not None), default=1),
                    self.heads.config.head_vocab_size)
        probs, index = logits.masked_fill(self._padding, float("-inf")).float().softmax(-1).topk(width, dim=-1)
        return self.heads.token_map[index].cpu().tolist(), probs.cpu().tolist()

    def release(self, request_id: str) -> None:
        """Heads keep no per-request state."""
