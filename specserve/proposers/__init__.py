"""Proposers: one module each.

- Proposers with their own model (`draft_model.py`) run in a draft pool behind
  `Proposer.propose(requests) -> proposals`.
- Head proposers (`medusa.py`) run co-located with the target behind
  `HiddenStateProposer.propose_from_hidden(requests, hidden) -> proposals`: the verify pass
  hands them the target's last hidden state, so one target pass verifies and proposes.

Every proposal states how its nodes were drawn (`Proposal.law`): sampled from a distribution
sent along, or deterministic (a point mass on each candidate).
"""

from typing import Protocol

from specserve.protocol import Proposal, ProposeRequest


class Proposer(Protocol):
    def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        """Draft tokens for each request (at most request.k of them), with the distributions
        they were drawn from for sampled requests."""
        ...

    def release(self, request_id: str) -> None:
        """Forget whatever is cached for the request."""
        ...


class HiddenStateProposer(Protocol):
    context_window: int  # how many past hidden states the heads read (0: h_t alone)

    def observe(self, request_id: str, position: int, states) -> None:
        """The hidden states [n, hidden] of the tokens a verify pass committed for the request,
        the first being token `position`'s (every pass, proposing or not; used when
        context_window > 0)."""
        ...

    def release(self, request_id: str) -> None:
        """Forget whatever is kept for the request."""
        ...

    def propose_from_hidden(self, requests: list[ProposeRequest], hidden) -> list[Proposal]:
        """Draft tokens for each request from the target's last hidden state after its last
        committed token (hidden: [len(requests), hidden_size])."""
        ...
