"""Proposers: one module each, all behind `Proposer.propose(requests) -> proposals`."""

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
