"""What the co-located head proposers (Medusa, Hydra) share: growth plans per request, the
top candidates of head logits mapped back to token ids (padding rows never proposed), and,
for heads that read past hidden states (Hydra++'s prefix attention), each request's window of
them."""

from __future__ import annotations

import torch

from specserve.protocol import ProposeRequest
from specserve.trees import growth_for


class HeadProposer:
    method = ""  # the proposer name: medusa | hydra

    def __init__(self, heads, *, vocab_size: int | None = None, min_confidence: float = 0.0):
        self.heads = heads
        self.context_window = getattr(heads, "context_window", 0)
        self.contexts = HiddenContexts(self.context_window)
        self.num_heads = heads.config.num_heads
        self.min_confidence = min_confidence  # chains: stop after a head top-1 below this
        # lm_head rows past the tokenizer's vocabulary (padding) are never proposed.
        limit = vocab_size or heads.config.vocab_size
        self._padding = heads.token_map >= limit

    def growths(self, requests: list[ProposeRequest]) -> list:
        """Each request's tree growth (None: it drafts nothing this round)."""
        return [growth_for(min(r.k, self.num_heads), r.tree, self.min_confidence) if r.k > 0 else None
                for r in requests]

    def top_candidates(self, logits: torch.Tensor, growths: list, head: int | None = None) -> tuple[list, list]:
        """(token ids, probabilities) of the best candidates per row of `logits` (as wide as
        the widest growth needs), as nested lists shaped like logits without its last axis.
        `logits` are head `head`'s, or every head's along the first axis (None); the
        probabilities are at the heads' score temperatures (`scoring_logits`)."""
        width = min(max((g.max_children for g in growths if g is not None), default=1),
                    self.heads.config.head_vocab_size)
        logits = self.heads.scoring_logits(logits, head)
        probs, index = logits.masked_fill(self._padding, float("-inf")).float().softmax(-1).topk(width, dim=-1)
        return self.heads.token_map[index].cpu().tolist(), probs.cpu().tolist()

    def observe(self, request_id: str, position: int, states: torch.Tensor) -> None:
        """The target's hidden states of the tokens a verify pass committed for the request
        (states [n, H]; the first is token `position`'s). Kept only when the heads read them."""
        if self.context_window:
            self.contexts.observe(request_id, position, states)

    def context(self, requests: list[ProposeRequest]):
        """(states [B, W, H], valid [B, W]) for the heads, or None when they read h_t alone."""
        return self.contexts.batch([r.request_id for r in requests]) if self.context_window else None

    def release(self, request_id: str) -> None:
        self.contexts.release(request_id)


class HiddenContexts:
    """Per request, the hidden states of its last `window` committed tokens, and the position
    after them. A pass that does not continue where the last one ended (a round verified again
    after a failover, a request that came back from another replica) keeps only what is still
    true: the states before its first position."""

    def __init__(self, window: int):
        self.window = window
        self._states: dict[str, tuple[int, torch.Tensor]] = {}  # request id -> (next position, [n, H])

    def observe(self, request_id: str, position: int, states: torch.Tensor) -> None:
        end, kept = self._states.get(request_id, (position, states[:0]))
        keep = max(0, len(kept) - max(0, end - position)) if position <= end else 0
        joined = torch.cat([kept[:keep], states.detach()])[-self.window:]
        self._states[request_id] = (position + len(states), joined)

    def batch(self, request_ids: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """States right-aligned (the newest last) in [B, window, H], with a mask of the
        filled slots."""
        found = [self._states[r][1] for r in request_ids]
        sample = found[0]
        states = sample.new_zeros(len(found), self.window, sample.shape[-1])
        valid = torch.zeros(len(found), self.window, dtype=torch.bool, device=sample.device)
        for b, s in enumerate(found):
            if len(s):
                states[b, -len(s):] = s
                valid[b, -len(s):] = True
        return states, valid

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._states)
