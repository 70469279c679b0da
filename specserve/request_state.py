"""Per-request bookkeeping of the round protocol, shared by the library decoder and the router.

Torch-free. A round for one request: make a ProposeRequest (if speculating), then a
VerifyRequest carrying the proposal, then `commit` the verified tokens, which applies EOS,
stop token ids and max_tokens and updates the speculation statistics.
"""

from __future__ import annotations

import random
import secrets
from dataclasses import dataclass, field

from specserve.protocol import (
    MAX_K, Proposal, ProposeRequest, SamplingParams, SpecserveError, TokenTree, VerifyRequest, VerifyResult,
)

METHODS = ("none", "draft")


@dataclass
class SpecStats:
    """Speculation counters, named after vLLM's spec-decode metrics."""

    target_steps: int = 0  # target forward passes that produced tokens for this request
    num_drafts: int = 0  # rounds that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    generated_tokens: int = 0
    # Serving only: wall time of pool calls minus the pools' compute time (transport, queueing).
    round_trip_overhead_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target step, bonus/recovered token included (1.0 = no gain)."""
        return self.generated_tokens / self.target_steps if self.target_steps else 0.0

    def merge(self, other: SpecStats) -> None:
        self.target_steps += other.target_steps
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.generated_tokens += other.generated_tokens
        self.round_trip_overhead_s += other.round_trip_overhead_s
        for pos, n in enumerate(other.num_accepted_tokens_per_pos):
            if pos == len(self.num_accepted_tokens_per_pos):
                self.num_accepted_tokens_per_pos.append(0)
            self.num_accepted_tokens_per_pos[pos] += n

    def as_dict(self) -> dict:
        return {
            "target_steps": self.target_steps,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "round_trip_overhead_ms_per_round": round(
                1000 * self.round_trip_overhead_s / self.target_steps if self.target_steps else 0.0, 3),
        }


def validate_speculation(method: str, k: int) -> None:
    if method not in METHODS:
        raise SpecserveError(f"unknown speculation method {method!r}; choose one of {', '.join(METHODS)}")
    if not 0 <= k <= MAX_K:
        raise SpecserveError(f"k (draft tokens per round) must be in [0, {MAX_K}], got {k}")


@dataclass
class RequestState:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    method: str = "draft"
    k: int = 4
    eos_token_ids: frozenset[int] = frozenset()
    max_context: int | None = None  # the models' context length: generation stops there
    # Serving: the first round drafts nothing, so the first token costs one target prefill
    # (time to first token); the draft catches up on the prompt in round two.
    prefill_without_draft: bool = False
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length"
    stop_text: str | None = None  # the output text cut before a matched stop sequence
    released: bool = False  # serving: the pools were told to free this request's caches
    stats: SpecStats = field(default_factory=SpecStats)
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise SpecserveError("the prompt is empty: give at least one token")
        validate_speculation(self.method, self.k)
        if self.max_context is not None and len(self.prompt_ids) >= self.max_context:
            raise SpecserveError(
                f"the prompt has {len(self.prompt_ids)} tokens; the model's context is "
                f"{self.max_context} tokens, leaving no room to generate"
            )
        seed = self.params.seed if self.params.seed is not None else secrets.randbits(63)
        self.rng = random.Random(seed)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def room(self) -> int:
        """Tokens this request may still emit."""
        room = self.params.max_tokens - len(self.output_ids)
        if self.max_context is not None:
            room = min(room, self.max_context - len(self.token_ids))
        return room

    def round_k(self) -> int:
        """Draft length this round: never draft tokens that could not be emitted (the round's
        recovered/bonus token takes one of the remaining places)."""
        if self.method == "none" or (self.prefill_without_draft and not self.output_ids):
            return 0
        return max(0, min(self.k, self.room() - 1))

    def propose_request(self) -> ProposeRequest:
        return ProposeRequest(self.request_id, self.token_ids, self.round_k(), self.params, self.rng.getrandbits(63))

    def verify_request(self, proposal: Proposal | None) -> VerifyRequest:
        seed = self.rng.getrandbits(63)
        if proposal is None or not proposal.tokens:
            return VerifyRequest(self.request_id, self.token_ids, self.params, seed)
        return VerifyRequest(
            self.request_id, self.token_ids, self.params, seed, TokenTree.chain(proposal.tokens), proposal.dists
        )

    def commit(self, result: VerifyResult, num_drafted: int) -> list[int]:
        """Append a round's verified tokens, cut at EOS / stop ids / max_tokens. Returns the
        tokens actually emitted."""
        s = self.stats
        s.target_steps += 1
        if num_drafted:
            s.num_drafts += 1
            s.num_draft_tokens += num_drafted
            s.num_accepted_tokens += result.num_accepted
            while len(s.num_accepted_tokens_per_pos) < num_drafted:
                s.num_accepted_tokens_per_pos.append(0)
            for pos in range(result.num_accepted):
                s.num_accepted_tokens_per_pos[pos] += 1
        emitted: list[int] = []
        for token in result.tokens:
            if self.room() <= 0:
                break
            emitted.append(token)
            self.output_ids.append(token)
            if (not self.params.ignore_eos and token in self.eos_token_ids) or token in self.params.stop_token_ids:
                self.finish_reason = "stop"
                break
        s.generated_tokens += len(emitted)
        if self.finish_reason is None and self.room() <= 0:
            self.finish_reason = "length"
        return emitted

    def finish_at_stop_string(self, decode) -> str | None:
        """If the decoded output contains a stop string, cut the output after the token that
        completes the earliest one and return the text before it (OpenAI semantics: the stop
        sequence itself is not returned). `decode(ids) -> str`."""
        if not self.params.stop:
            return None
        text = decode(self.output_ids)
        hits = [i for i in (text.find(s) for s in self.params.stop) if i >= 0]
        if not hits:
            return None
        cut = min(hits)
        keep = next(n for n in range(1, len(self.output_ids) + 1)
                    if any(s in decode(self.output_ids[:n]) for s in self.params.stop))
        self.stats.generated_tokens -= len(self.output_ids) - keep
        del self.output_ids[keep:]
        self.finish_reason = "stop"
        self.stop_text = text[:cut]
        return self.stop_text
