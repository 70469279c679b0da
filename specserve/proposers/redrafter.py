"""ReDrafter proposer: a beam search with the recurrent drafter, its beams merged into a tree.

Co-located with the target, like Medusa and Hydra: the verify pass yields the hidden state h_t of
the row that produced the round's root x_{t+1}. Each round, per request, a beam search of width W
and length L runs the drafter from the root (state s_0 = 0); every depth is **one** drafter step
over every live beam of every request. The W final beams are merged into a prefix tree
(`specserve.trees.merge_beams`: shared prefixes stored once, siblings in the order of their best
beam) that the target verifies in one pass with tree attention.

W and L come from the request's speculation shape (`beam_plan`), so ReDrafter needs no settings
of its own:

- `shape: chain`: W = 1, L = k: the drafter's greedy chain;
- `shape: tree`: W = `tree.width` beams of L = `tree.depth` tokens, at most `tree.budget` nodes
  after merging, nodes whose path probability under the drafter is below `tree.min_score` left
  out; a static `tree.shape` gives W = its number of leaves, L = its depth, its size as budget
  (and, as for the other proposers, no min_score).

L is capped by the request's k (the policy's depth for the round) and by the steps the drafter
was trained for (`config.num_heads`).

The law is deterministic: beam search *chooses* its candidates (the best-scoring continuations),
it never draws them, so the proposal is a set of point masses and the verifier tries siblings in
order with the residual renormalised after each rejection. That is exact for greedy and sampled
requests alike. Verifying the beams as if they had been sampled from the drafter's softmax would
not be: beams are the drafter's most likely tokens, not draws from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specserve.protocol import DETERMINISTIC, Proposal, ProposeRequest, TokenTree
from specserve.proposers.heads import HeadProposer
from specserve.trees import merge_beams


@dataclass(frozen=True)
class BeamPlan:
    """One request's beam search: `width` beams of `length` tokens merged into at most `budget`
    nodes. A beam is cut before the first token whose path probability is below `min_score`
    (trees) and after the first token whose own probability is below `min_confidence` (chains)."""

    width: int
    length: int
    budget: int
    min_score: float = 0.0
    min_confidence: float = 0.0

    def kept_length(self, probs: list[float]) -> int:
        """How many leading tokens of a beam whose step probabilities are `probs` to keep."""
        score = 1.0
        for i, p in enumerate(probs):
            score *= p
            if score < self.min_score:
                return i
            if p < self.min_confidence:
                return i + 1
        return len(probs)


def beam_plan(request: ProposeRequest, max_length: int, min_confidence: float = 0.0) -> BeamPlan | None:
    """The beam search a request's shape asks for (None: it drafts nothing this round).

    >>> from specserve.protocol import SamplingParams, TreeSpec
    >>> beam_plan(ProposeRequest("r", [1], 8, SamplingParams(), 0, TreeSpec(budget=12, width=3)), 4)
    BeamPlan(width=3, length=4, budget=12, min_score=0.2, min_confidence=0.0)
    """
    length = min(request.k, max_length)
    if length < 1:
        return None
    if request.tree is None:
        return BeamPlan(1, length, length, min_confidence=min_confidence)
    tree = request.tree.capped(length)
    if tree.shape is None:
        return BeamPlan(tree.width, tree.depth, tree.budget, tree.min_score)
    return BeamPlan(leaves(tree.shape), tree.depth, tree.budget)  # a static shape has no min_score


def leaves(shape: tuple[tuple[int, ...], ...]) -> int:
    """How many paths of a static shape end in a leaf (no other path extends them)."""
    parents = {path[:-1] for path in shape}
    return sum(1 for path in shape if path not in parents)


@dataclass(frozen=True)
class _Beam:
    tokens: tuple[int, ...] = ()
    probs: tuple[float, ...] = ()  # the drafter's probability of each token, given the ones before
    score: float = 0.0  # log-probability of the whole beam


class ReDrafterProposer(HeadProposer):
    method = "redrafter"

    @torch.inference_mode()
    def propose_from_hidden(self, requests: list[ProposeRequest], hidden: torch.Tensor) -> list[Proposal]:
        """hidden: [len(requests), hidden], the target's last hidden state after each request's
        last committed token (request.token_ids[-1], the root). One batched drafter step per
        depth for every beam of every request."""
        if not requests:
            return []
        plans = [beam_plan(r, self.num_heads, self.min_confidence) for r in requests]
        finished: dict[int, list[_Beam]] = {}
        # One row per live beam: (request, beam); rows of a request are contiguous, best first.
        rows = [(b, _Beam()) for b, plan in enumerate(plans) if plan is not None]
        device = self.heads.token_map.device
        hidden = hidden.to(device)
        state = self.heads.initial_state(len(rows))
        last = torch.tensor([requests[b].token_ids[-1] for b, _ in rows], device=device)
        width = max((p.width for p in plans if p is not None), default=1)
        depth = 0
        while rows:
            state = self.heads.advance(state, last)
            logits = self.heads.step_logits(hidden[torch.tensor([b for b, _ in rows], device=device)], state)
            log_probs, ids = self.top_log_probs(logits, width, depth)
            depth += 1
            chosen = []  # (row, rank) of each next beam, grouped by request
            for b, members in _by_request(rows).items():
                best = _best_extensions(rows, members, log_probs, plans[b].width)
                extended = [(r, j, _extend(rows[r][1], ids[r][j], log_probs[r][j])) for r, j in best]
                if depth >= plans[b].length:
                    finished[b] = [beam for _, _, beam in extended]
                else:
                    chosen += [(r, b, beam) for r, _, beam in extended]
            if not chosen:
                break
            parents = torch.tensor([r for r, _, _ in chosen], device=device)
            state = state[parents]
            last = torch.tensor([beam.tokens[-1] for _, _, beam in chosen], device=device)
            rows = [(b, beam) for _, b, beam in chosen]
        return [Proposal(r.request_id, self._tree(plans[b], finished.get(b, [])), DETERMINISTIC)
                for b, r in enumerate(requests)]

    def top_log_probs(self, logits: torch.Tensor, width: int, step: int) -> tuple[list, list]:
        """(log-probabilities, token ids) of each row's `width` best tokens at drafting step
        `step`'s score temperature (`scoring_logits`), padding never among them."""
        width = min(width, self.heads.config.head_vocab_size)
        logits = self.heads.scoring_logits(logits, step)
        values, index = logits.masked_fill(self._padding, float("-inf")).float().log_softmax(-1).topk(width, dim=-1)
        return values.cpu().tolist(), self.heads.token_map[index].cpu().tolist()

    @staticmethod
    def _tree(plan: BeamPlan | None, beams: list[_Beam]) -> TokenTree:
        if plan is None:
            return TokenTree()
        return merge_beams([beam.tokens[: plan.kept_length(list(beam.probs))] for beam in beams], plan.budget)


def _by_request(rows: list[tuple[int, _Beam]]) -> dict[int, list[int]]:
    """Request -> the indices of its rows."""
    out: dict[int, list[int]] = {}
    for r, (b, _) in enumerate(rows):
        out.setdefault(b, []).append(r)
    return out


def _best_extensions(rows, members: list[int], log_probs: list, width: int) -> list[tuple[int, int]]:
    """The `width` best (row, rank) extensions of a request's beams by total log-probability,
    best first (ties: the better beam, then the better token); impossible tokens never."""
    scored = [(rows[r][1].score + lp, -r, -j) for r in members for j, lp in enumerate(log_probs[r])
              if lp != float("-inf")]
    return [(-r, -j) for _, r, j in sorted(scored, reverse=True)[:width]]


def _extend(beam: _Beam, token: int, log_prob: float) -> _Beam:
    return _Beam(beam.tokens + (int(token),), beam.probs + (math.exp(log_prob),),
                 beam.score + log_prob)
