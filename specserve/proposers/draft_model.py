"""Draft-model proposer: a small model drafts a chain (method `draft`) or a token tree (method
`tree`) for every request, all requests batched level by level."""

from __future__ import annotations

import numpy as np
import torch

from specserve.engine.torch_worker import ForwardItem, TorchWorker
from specserve.protocol import DETERMINISTIC, SAMPLED, Proposal, ProposeRequest, SparseDist, TokenTree
from specserve.sampling import generator_for, target_probs, truncate_top_m
from specserve.trees import finish, growth_for


class DraftModelProposer:
    """Level j of every request's draft is one batched forward pass over the nodes whose
    children are wanted next (the growth's frontier, see specserve.trees). A tree extends the
    one fed at the previous level, so the draft computes each node once.

    Greedy requests take the draft's most probable tokens. Sampled requests draw a node's
    children without replacement from the draft's distribution, processed like the target's
    (temperature, top-k, top-p) and truncated to its `top_m` most probable tokens; that exact
    truncated distribution travels with the proposal (see SparseDist).

    A chain stops early once the draft's probability of its own token falls below
    `min_confidence`: later tokens would likely be rejected, and drafting them costs draft
    steps. Any stopping rule that looks only at the draft keeps the output exact.
    """

    def __init__(self, worker: TorchWorker, *, top_m: int = 256, min_confidence: float = 0.5):
        self.worker = worker
        self.top_m = top_m
        self.min_confidence = min_confidence

    def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        drafts = {r.request_id: _Draft(r, growth_for(r.k, r.tree, self.min_confidence, drawn=not r.params.greedy))
                  for r in requests}
        while True:
            stepping = [d for d in drafts.values() if d.frontier()]
            if not stepping:
                break
            logits = self.worker.forward([d.forward_item() for d in stepping])
            for d, rows in zip(stepping, logits):
                d.expand(rows, self.top_m)
        return [drafts[r.request_id].proposal() for r in requests]

    def release(self, request_id: str) -> None:
        self.worker.release(request_id)


class _Draft:
    """One request's growing draft: its tree, the nodes fed to the draft model so far, and
    for sampled requests the distribution each node was drawn from."""

    def __init__(self, request: ProposeRequest, growth):
        self.request = request
        self.growth = growth
        self.generator = None if request.params.greedy else generator_for(request.seed)
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.dists: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.fed: dict[int, int] = {}  # draft node -> its index in the tree fed to the worker
        self.fed_tree = TokenTree()
        self._frontier: list[int] = []

    def frontier(self) -> list[int]:
        self._frontier = self.growth.frontier() if self.request.k > 0 else []
        return self._frontier

    def forward_item(self) -> ForwardItem:
        """The root's logits, or the frontier nodes appended to the tree fed so far."""
        if self._frontier == [-1]:
            return ForwardItem(self.request.request_id, self.request.token_ids)
        start = len(self.fed_tree)
        tokens, parents = list(self.fed_tree.tokens), list(self.fed_tree.parents)
        for node in self._frontier:
            self.fed[node] = len(tokens)
            tokens.append(self.tokens[node])
            parents.append(self.fed.get(self.parents[node], -1))
        self.fed_tree = TokenTree(tuple(tokens), tuple(parents))
        return ForwardItem(self.request.request_id, self.request.token_ids, self.fed_tree, logits_from=start)

    def expand(self, rows: torch.Tensor, top_m: int) -> None:
        """rows: [len(frontier), V] draft logits after each frontier node."""
        params = self.request.params
        options = {}  # node -> (candidate ids, their probabilities), most probable first
        for node, row in zip(self._frontier, rows):
            if params.greedy:
                probs, ids = row.float().softmax(-1).topk(self.growth.max_children)
                options[node] = (ids.cpu(), probs.cpu(), None)
            else:  # the truncated distribution comes to the CPU, where the generator is
                ids, probs = (t[0].cpu() for t in truncate_top_m(target_probs(row[None], params), top_m))
                options[node] = (ids, probs, (ids, probs))
        counts = self.growth.allocate({node: probs[: self.growth.max_children].tolist()
                                       for node, (_, probs, _) in options.items()})
        for node, (ids, probs, dist) in options.items():
            count = counts.get(node, 0)
            if not count:
                continue
            if dist is None:
                picks = torch.arange(count)
            else:  # without replacement, in draw order: what multi-draft verification expects
                count = min(count, int((probs > 0).sum()))
                picks = torch.multinomial(probs, count, replacement=False, generator=self.generator)
            for pick in picks.tolist():
                self.growth.add(node, float(probs[pick]))
                self.tokens.append(int(ids[pick]))
                self.parents.append(node)
                if dist is not None:
                    self.dists.append(dist)

    def proposal(self) -> Proposal:
        """Greedy requests take the draft's top choices (deterministic); sampled requests drew
        their nodes and send the distributions they drew them from."""
        tree, kept = finish(self.growth, self.tokens, self.parents)
        if self.generator is None:
            return Proposal(self.request.request_id, tree, DETERMINISTIC)
        return Proposal(self.request.request_id, tree, SAMPLED, _stack([self.dists[n] for n in kept]))


def _stack(rows: list[tuple[torch.Tensor, torch.Tensor]]) -> SparseDist:
    if not rows:
        return SparseDist(np.zeros((0, 1), dtype=np.int64), np.zeros((0, 1), dtype=np.float32))
    return SparseDist(
        torch.stack([ids for ids, _ in rows]).numpy(),
        torch.stack([p for _, p in rows]).numpy().astype(np.float32),
    )
