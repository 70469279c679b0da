"""Target-side verification: score every request's draft in one forward pass, then accept."""

from __future__ import annotations

from specserve.engine.torch_worker import ForwardItem, TorchWorker
from specserve.protocol import SpecserveError, VerifyRequest, VerifyResult
from specserve.sampling import accept_greedy_tree, accept_rejection, densify, generator_for, target_probs


class Verifier:
    def __init__(self, worker: TorchWorker):
        self.worker = worker

    def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        logits = self.worker.forward([ForwardItem(r.request_id, r.token_ids, r.draft) for r in requests])
        return [self._accept(r, rows) for r, rows in zip(requests, logits)]

    def _accept(self, request: VerifyRequest, logits) -> VerifyResult:
        draft = request.draft
        tokens = list(draft.tokens)
        if request.params.greedy:
            out = accept_greedy_tree(draft, logits)  # chains are one-branch trees
        else:
            if not draft.is_chain:
                raise SpecserveError("sampled verification of token trees is not available yet; "
                                     "use temperature 0 or a chain draft")
            if tokens and (request.dists is None or request.dists.ids.shape[0] != len(tokens)):
                raise SpecserveError(f"request {request.request_id}: sampled drafts need their distributions")
            p = target_probs(logits, request.params)
            q = densify(request.dists, p.shape[-1]) if tokens else p[:0]
            out = accept_rejection(tokens, q, p, generator_for(request.seed))
        return VerifyResult(request.request_id, len(out) - 1, out)

    def release(self, request_id: str) -> None:
        self.worker.release(request_id)
