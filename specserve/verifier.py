"""Target-side verification: score every request's draft in one forward pass, then accept."""

from __future__ import annotations

from specserve.engine.torch_worker import ForwardItem, TorchWorker
from specserve.protocol import SpecserveError, VerifyRequest, VerifyResult
from specserve.sampling import accept_greedy_tree, accept_rejection_tree, densify, generator_for, target_probs


class Verifier:
    def __init__(self, worker: TorchWorker):
        self.worker = worker

    def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        logits = self.worker.forward([ForwardItem(r.request_id, r.token_ids, r.draft) for r in requests])
        return [self._accept(r, rows) for r, rows in zip(requests, logits)]

    def _accept(self, request: VerifyRequest, logits) -> VerifyResult:
        draft = request.draft
        if request.params.greedy:
            out = accept_greedy_tree(draft, logits)  # chains are one-branch trees
        else:
            if len(draft) and (request.dists is None or request.dists.ids.shape[0] != len(draft)):
                raise SpecserveError(f"request {request.request_id}: sampled drafts need one draft "
                                     "distribution per node")
            p = target_probs(logits, request.params)
            q = densify(request.dists, p.shape[-1]) if len(draft) else p[:0]
            out = accept_rejection_tree(draft, q, p, generator_for(request.seed))
        return VerifyResult(request.request_id, len(out) - 1, out)

    def release(self, request_id: str) -> None:
        self.worker.release(request_id)
