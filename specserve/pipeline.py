"""Pipelined verification of a streamed draft (`speculation.pipeline`): the bookkeeping, pure.

A round that takes turns (draft k tokens, then verify them) pays both pools' per-call latency
every round; on vLLM pools a new request costs several decode steps' time (~11 ms against a
2.3 ms decode step on an H200, docs/bench/gpu-h200-vllm-3). Pipelined, the draft pool instead
runs one greedy request that streams its continuation at decode speed, and the router verifies
it in k-token chunks as they arrive, up to `max_in_flight` verifies at once: chunk j is verified
after the context plus chunks 0..j-1, on the guess that they are accepted. Results are settled
oldest first:

- a chunk accepted whole, with more draft after it, commits its k tokens; its bonus token is
  the next chunk's first position, which the next chunk's verify checks;
- a chunk accepted whole at the end of the stream commits its bonus token too;
- a rejected token commits the accepted tokens and the target's own token there, and ends the
  stream: everything drafted or verified after it followed a token the target did not make.

Exact for greedy requests: each committed token is the target's argmax after the tokens
committed before it (a chunk is settled only once every chunk before it was accepted whole, so
its guessed context is the real one).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

from specserve.protocol import TokenTree, VerifyResult


@dataclass
class StreamedDraft:
    """One draft stream's chunks: drafted, sent to verify, settled.

    >>> pipe = StreamedDraft([1, 2], k=2, max_in_flight=2)
    >>> pipe.add([5, 6, 7])
    >>> [(context, chunk.tokens) for context, chunk in pipe.chunks_to_verify()]
    [([1, 2], (5, 6))]
    >>> pipe.add([8])
    >>> [(context, chunk.tokens) for context, chunk in pipe.chunks_to_verify()]
    [([1, 2, 5, 6], (7, 8))]
    >>> pipe.settle(VerifyResult("r", 2, [5, 6, 7]))  # accepted whole: the bonus is chunk 2's to check
    (VerifyResult(request_id='r', num_accepted=2, tokens=[5, 6], compute_s=0.0, next_proposal=None, load=None), True)
    >>> pipe.settle(VerifyResult("r", 0, [9]))  # rejected: the stream ends
    (VerifyResult(request_id='r', num_accepted=0, tokens=[9], compute_s=0.0, next_proposal=None, load=None), False)
    """

    base: list[int]  # the token ids the stream drafts after
    k: int  # draft tokens per verify
    max_in_flight: int  # verifies at once
    drafted: list[int] = field(default_factory=list)
    sent: int = 0  # drafted tokens sent to verify
    ended: bool = False  # the stream has said all it will
    in_flight: deque[int] = field(default_factory=deque)  # each verify's chunk length, oldest first

    def add(self, tokens) -> None:
        self.drafted.extend(int(t) for t in tokens)

    def chunks_to_verify(self) -> list[tuple[list[int], TokenTree]]:
        """The verifies to send now, as (context, chunk): whole k-token chunks, and the rest once
        the stream has ended, while fewer than max_in_flight run."""
        out = []
        while len(self.in_flight) < self.max_in_flight:
            pending = len(self.drafted) - self.sent
            if pending < self.k and not (self.ended and pending > 0):
                break
            n = min(self.k, pending)
            out.append((self.base + self.drafted[: self.sent], TokenTree.chain(self.drafted[self.sent: self.sent + n])))
            self.in_flight.append(n)
            self.sent += n
        return out

    def settle(self, result: VerifyResult) -> tuple[VerifyResult, bool]:
        """The oldest verify's result: (what to commit, whether the stream goes on)."""
        n = self.in_flight.popleft()
        if result.num_accepted < n:
            return result, False
        if self.in_flight or not self.ended or len(self.drafted) > self.sent:
            return replace(result, tokens=result.tokens[:n]), True
        return result, False

    @property
    def done(self) -> bool:
        """The stream ended and everything it drafted was settled."""
        return self.ended and not self.in_flight and self.sent == len(self.drafted)
