"""Target-side verification: score every request's draft in one forward pass, then accept.

With co-located heads (`heads`), the same pass also proposes: for each request that asks
(`VerifyRequest.propose_next`), the hidden state of the row that produced its last token goes
through the heads, and the next round's draft rides back on the result. One RPC, one target
pass per round.
"""

from __future__ import annotations

import torch

from specserve.engine.torch_worker import ForwardItem, Rows, TorchWorker
from specserve.proposers import HiddenStateProposer
from specserve.protocol import SAMPLED, ProposeRequest, SpecserveError, TokenTree, VerifyRequest, VerifyResult
from specserve.sampling import (
    LazyTargetProbs, accept_rejection_tree, accept_typical_tree, densify, generator_for, walk_greedy_tree,
)


class Verifier:
    def __init__(self, worker: TorchWorker, heads: HiddenStateProposer | None = None):
        self.worker = worker
        self.heads = heads

    def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        if self.heads is None and any(r.propose_next is not None for r in requests):
            raise SpecserveError("this target pool has no heads, so it cannot propose the next round")
        rows = self.worker.run([ForwardItem(r.request_id, r.token_ids, r.draft) for r in requests])
        results = [self._accept(r, out) for r, out in zip(requests, rows)]
        if self.heads is not None and self.heads.context_window:
            for r, out, result in zip(requests, rows, results):
                self.heads.observe(r.request_id, len(r.token_ids) - 1, out.hidden[_committed_rows(r.draft, result)])
        proposing = [i for i, r in enumerate(requests) if r.propose_next is not None]
        if proposing:
            hidden = torch.stack([rows[i].hidden[_last_row(requests[i].draft, results[i])] for i in proposing])
            asks = [ProposeRequest.after(requests[i].request_id, requests[i].token_ids + results[i].tokens,
                                         requests[i].params, requests[i].propose_next) for i in proposing]
            for i, proposal in zip(proposing, self.heads.propose_from_hidden(asks, hidden)):
                results[i].next_proposal = proposal
        return results

    def _accept(self, request: VerifyRequest, rows: Rows) -> VerifyResult:
        draft = request.draft
        if request.params.greedy:
            out = walk_greedy_tree(draft, rows.argmax())  # chains are one-branch trees
        else:
            p = LazyTargetProbs(rows.logits, request.params)  # only the rows acceptance visits
            generator = generator_for(request.seed)
            if request.typical is not None:  # opt-in, LOSSY
                out = accept_typical_tree(draft, p.dense(), request.typical, generator)
            else:
                q = None
                if request.law == SAMPLED and len(draft):
                    q = densify(request.dists, p.shape[-1])
                    check_sampled(draft, q, request.request_id)
                out = accept_rejection_tree(draft, q, p, generator)
        return VerifyResult(request.request_id, len(out) - 1, out)

    def release(self, request_id: str) -> bool:
        if self.heads is not None:
            self.heads.release(request_id)
        return self.worker.release(request_id)


def _committed_rows(draft: TokenTree, result: VerifyResult) -> list[int]:
    """The rows of the tokens this round committed that the pass computed: the root's (row 0),
    then each accepted node's (row node + 1); the round's last token is next round's root."""
    return [0] + [n + 1 for n in draft.path_of(result.tokens[: result.num_accepted])]


def _last_row(draft: TokenTree, result: VerifyResult) -> int:
    """The row whose logits produced the round's last token: the last accepted node's (row
    node + 1), or the root's (row 0) when nothing was accepted."""
    path = draft.path_of(result.tokens[: result.num_accepted])
    return path[-1] + 1 if path else 0


def check_sampled(tree: TokenTree, q: torch.Tensor, request_id: str) -> None:
    """A sampled node must be possible under the distribution it claims it was drawn from, and
    siblings drawn without replacement are distinct: catches a proposer that chose its nodes
    (top-k) but sent them as sampled."""
    for parent, kids in tree.children().items():
        tokens = [tree.tokens[c] for c in kids]
        if len(set(tokens)) != len(tokens):
            raise SpecserveError(f"request {request_id}: sampled siblings must be distinct tokens "
                                 "(drawn without replacement)")
        for c in kids:
            if not q[c, tree.tokens[c]] > 0:
                raise SpecserveError(f"request {request_id}: draft node {c} has probability 0 under the "
                                     "distribution it was sampled from; was it chosen rather than sampled? "
                                     "Send it with law='deterministic'")
