"""Messages exchanged between the router and the model workers.

Plain Python and numpy only: the router (and anything that speaks to workers over Ray) must not
import torch. Every message carries what a fresh worker needs to rebuild its KV cache (the request's
full token ids), so worker caches are caches, never the source of truth.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MAX_K = 64  # longest draft chain / deepest tree accepted anywhere


class SpecserveError(ValueError):
    """A request or configuration that specserve refuses, with a message meant for the user."""


@dataclass(frozen=True)
class SamplingParams:
    """How to turn the target's logits into tokens. temperature == 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k truncation
    max_tokens: int = 128
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not self.temperature >= 0:  # also rejects NaN
            raise SpecserveError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SpecserveError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SpecserveError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens < 1:
            raise SpecserveError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise SpecserveError("stop sequences must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class TokenTree:
    """Draft tokens hanging under a request's last committed token (the root, not stored here).

    `parents[i]` is the index of node i's parent, -1 for a child of the root; nodes are in
    topological order (parent index < node index). A chain of k tokens is the one-branch case:
    parents == [-1, 0, 1, ..., k-2].

    Example: root -> a -> b and root -> c is TokenTree(tokens=(a, b, c), parents=(-1, 0, -1)).
    """

    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise SpecserveError("a token tree needs one parent per token")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise SpecserveError(f"tree node {i} has parent {p}: parents must precede children")

    @classmethod
    def chain(cls, tokens) -> TokenTree:
        tokens = tuple(int(t) for t in tokens)
        return cls(tokens, tuple(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depths(self) -> list[int]:
        """Depth of each node; children of the root have depth 1."""
        depths: list[int] = []
        for p in self.parents:
            depths.append(1 if p < 0 else depths[p] + 1)
        return depths

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def ancestor_mask(self) -> np.ndarray:
        """[n, n] bool: mask[i, j] is True when node j is node i or one of its ancestors."""
        n = len(self.tokens)
        mask = np.zeros((n, n), dtype=bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                mask[i] = mask[p]
            mask[i, i] = True
        return mask


@dataclass
class SparseDist:
    """A distribution over the vocabulary that is zero outside `ids`. [k, m] per request.

    Drafts sample from a top-m truncation of the draft distribution and send exactly that
    truncated distribution: rejection sampling is exact for any proposal distribution, so the
    truncation costs a little acceptance, never correctness, and keeps messages small.
    """

    ids: np.ndarray  # [k, m] int64
    probs: np.ndarray  # [k, m] float32, rows sum to 1


@dataclass
class ProposeRequest:
    request_id: str
    token_ids: list[int]  # committed ids: prompt + generated so far
    k: int
    params: SamplingParams
    seed: int  # randomness of this round's draft sampling


@dataclass
class Proposal:
    request_id: str
    tokens: list[int]
    dists: SparseDist | None = None  # None for greedy requests
    compute_s: float = 0.0  # the pool's time in the batch that produced it


@dataclass
class VerifyRequest:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    seed: int  # randomness of this round's acceptance
    draft: TokenTree = field(default_factory=TokenTree)
    dists: SparseDist | None = None  # draft distribution per node, for sampled requests


@dataclass
class VerifyResult:
    request_id: str
    num_accepted: int  # draft tokens accepted
    tokens: list[int]  # accepted draft tokens + one recovered or bonus token from the target
    compute_s: float = 0.0  # the pool's time in the batch that produced it
