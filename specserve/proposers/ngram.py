"""Prompt lookup (n-gram) proposer: drafts copied from earlier in the request, no model.

Code, edits and grounded answers repeat what the prompt (or the output so far) already says.
The proposer looks up the request's last n tokens (longest n first, `max_n` down to `min_n`)
among its earlier tokens and proposes what followed them. Several earlier occurrences with
different continuations become a tree (shape `tree`): their continuations merged into a prefix
tree, most recent match first among siblings. A chain takes the most recent match of the
longest n.

The per-request index is kept incrementally: committed tokens are only ever appended, so each
round adds the n-grams that end at the new tokens instead of rescanning the sequence.

The candidates are chosen, not drawn: proposals are `deterministic` (q = a point mass on each
candidate), which the verifier accepts losslessly for greedy and sampled requests alike. It
runs wherever the token ids are (the router, the library decoder): no pool, no RPC.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from specserve.protocol import DETERMINISTIC, Proposal, ProposeRequest, SpecserveError, TokenTree, TreeSpec

MAX_INDEXED_REQUESTS = 4096  # least recently used indexes beyond this are dropped (rebuilt if needed)
# n-grams of 2 to 5 tokens (vLLM's prompt_lookup_min/max in its benchmarks): replayed on recorded
# greedy outputs (16 HumanEval and 16 MT-Bench prompts), matching single tokens (min_n 1) drafted
# in about twice as many rounds for few more accepted tokens, and a round that drafts costs a
# verify of k+1 rows (~1.6 decode steps for 5 rows in float32 on a 2-core CPU).
DEFAULT_MIN_N, DEFAULT_MAX_N = 2, 5


@dataclass
class NgramIndex:
    """Where every n-gram (min_n <= n <= max_n) of a token sequence occurred: n-gram -> the
    positions right after each occurrence (where its continuation starts), oldest first."""

    max_n: int = DEFAULT_MAX_N
    min_n: int = DEFAULT_MIN_N
    tokens: list[int] = field(default_factory=list)
    starts: dict[tuple[int, ...], list[int]] = field(default_factory=dict)

    def sync(self, token_ids: list[int]) -> None:
        """Catch up with a request's committed ids: append the new ones (rebuild only if the
        sequence is not an extension of what was indexed, e.g. after an eviction elsewhere)."""
        seen = len(self.tokens)
        if len(token_ids) < seen or (seen and token_ids[seen - 1] != self.tokens[-1]):
            self.tokens, self.starts, seen = [], {}, 0
        for token in token_ids[seen:]:
            self.append(token)

    def append(self, token: int) -> None:
        self.tokens.append(token)
        end = len(self.tokens)
        for n in range(self.min_n, min(self.max_n, end) + 1):
            self.starts.setdefault(tuple(self.tokens[end - n:]), []).append(end)

    def continuations(self, k: int, limit: int) -> list[list[int]]:
        """Up to `limit` distinct continuations (at most k tokens each) of the sequence's last
        n tokens, longest n first and, within an n, the most recent occurrence first."""
        end = len(self.tokens)
        found: list[list[int]] = []
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            for start in reversed(self.starts.get(tuple(self.tokens[end - n:]), ())):
                if start == end:  # the suffix itself: nothing follows yet
                    continue
                continuation = self.tokens[start:start + k]
                if continuation not in found:
                    found.append(continuation)
                    if len(found) == limit:
                        return found
        return found


def prefix_tree(sequences: list[list[int]], budget: int) -> TokenTree:
    """The sequences merged into a token tree (shared prefixes stored once), in order: the
    first sequence's nodes are each parent's first child. At most `budget` nodes."""
    tokens: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for sequence in sequences:
        parent = -1
        for token in sequence:
            node = children.get((parent, token))
            if node is None:
                if len(tokens) == budget:
                    break
                node = len(tokens)
                tokens.append(token)
                parents.append(parent)
                children[(parent, token)] = node
            parent = node
    return TokenTree(tuple(tokens), tuple(parents))


class NgramProposer:
    """`Proposer` for proposer `ngram`: one incremental index per request."""

    def __init__(self, *, max_n: int = DEFAULT_MAX_N, min_n: int = DEFAULT_MIN_N):
        if not 1 <= min_n <= max_n:
            raise SpecserveError(f"ngram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n
        self._indexes: OrderedDict[str, NgramIndex] = OrderedDict()

    def index(self, request_id: str) -> NgramIndex:
        index = self._indexes.get(request_id)
        if index is None:
            index = self._indexes[request_id] = NgramIndex(self.max_n, self.min_n)
            while len(self._indexes) > MAX_INDEXED_REQUESTS:
                self._indexes.popitem(last=False)
        self._indexes.move_to_end(request_id)
        return index

    def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        return [self.propose_one(r) for r in requests]

    def propose_one(self, request: ProposeRequest) -> Proposal:
        index = self.index(request.request_id)
        index.sync(request.token_ids)
        if request.k <= 0:
            return Proposal(request.request_id, TokenTree(), DETERMINISTIC)
        tree: TreeSpec | None = request.tree
        if tree is None:
            found = index.continuations(request.k, 1)
            draft = TokenTree.chain(found[0]) if found else TokenTree()
        else:
            draft = prefix_tree(index.continuations(min(request.k, tree.depth), tree.width), tree.budget)
        return Proposal(request.request_id, draft, DETERMINISTIC)

    def release(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

    @property
    def cached_requests(self) -> int:
        return len(self._indexes)
