"""Classic draft-model proposer: a small model decodes a chain of k tokens autoregressively."""

from __future__ import annotations

import numpy as np
import torch

from specserve.engine.torch_worker import ForwardItem, TorchWorker
from specserve.protocol import Proposal, ProposeRequest, SparseDist
from specserve.sampling import generator_for, sample, target_probs, truncate_top_m


class DraftModelProposer:
    """Runs all requests' draft steps batched: step j is one forward pass over every request
    that still wants a j-th token.

    Sampled requests draw from the draft's distribution processed like the target's
    (temperature, top-k, top-p) and truncated to its `top_m` most probable tokens; that exact
    truncated distribution travels with the proposal (see SparseDist).

    A request's chain stops early once the draft's probability of its own token falls below
    `min_confidence`: later tokens would likely be rejected, and drafting them costs draft
    steps. Any stopping rule that looks only at the draft keeps the output exact.
    """

    def __init__(self, worker: TorchWorker, *, top_m: int = 256, min_confidence: float = 0.5):
        self.worker = worker
        self.top_m = top_m
        self.min_confidence = min_confidence

    def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        drafts: dict[str, list[int]] = {r.request_id: [] for r in requests}
        dists: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {r.request_id: [] for r in requests}
        generators = {r.request_id: generator_for(r.seed) for r in requests if not r.params.greedy}
        confident = {r.request_id for r in requests}
        for step in range(max((r.k for r in requests), default=0)):
            stepping = [r for r in requests if r.k > step and r.request_id in confident]
            if not stepping:
                break
            logits = self.worker.forward(
                [ForwardItem(r.request_id, r.token_ids + drafts[r.request_id]) for r in stepping]
            )
            for r, rows in zip(stepping, logits):
                last = rows[-1:]
                if r.params.greedy:
                    token = int(last.argmax())
                    confidence = float(last.softmax(-1)[0, token]) if self.min_confidence else 1.0
                else:
                    ids, probs = truncate_top_m(target_probs(last, r.params), self.top_m)
                    choice = sample(probs[0], generators[r.request_id])
                    token, confidence = int(ids[0, choice]), float(probs[0, choice])
                    dists[r.request_id].append((ids[0], probs[0]))
                drafts[r.request_id].append(token)
                if confidence < self.min_confidence:
                    confident.discard(r.request_id)
        return [
            Proposal(r.request_id, drafts[r.request_id], _stack(dists[r.request_id]) if r.request_id in generators else None)
            for r in requests
        ]

    def release(self, request_id: str) -> None:
        self.worker.release(request_id)


def _stack(rows: list[tuple[torch.Tensor, torch.Tensor]]) -> SparseDist:
    if not rows:
        return SparseDist(np.zeros((0, 1), dtype=np.int64), np.zeros((0, 1), dtype=np.float32))
    return SparseDist(
        torch.stack([ids for ids, _ in rows]).numpy(),
        torch.stack([p for _, p in rows]).numpy().astype(np.float32),
    )
