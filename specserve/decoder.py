"""The library API: speculative decoding in one process, batched across requests.

    decoder = SpeculativeDecoder.from_pretrained("qwen2.5-coder-1.5b-instruct",
                                                 draft="qwen2.5-coder-0.5b-instruct")
    [out] = decoder.generate(["def fib(n):"], SamplingParams(max_tokens=64))
    print(out.text, out.stats.mean_accepted_length)

Each round, for all live requests at once: the proposer drafts (one batched forward per draft
step), the target verifies every request's draft in one batched forward, and acceptance turns
the target's distributions into tokens (see specserve.sampling).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from specserve.proposers import Proposer
from specserve.protocol import SamplingParams, SpecserveError, TreeSpec
from specserve.request_state import DRAFT_METHODS, RequestState, SpecStats, validate_speculation
from specserve.verifier import Verifier


@dataclass
class Generation:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    stats: SpecStats


@dataclass
class BatchReport:
    """What one `generate` call did, for CLI output and benchmarks."""

    seconds: float = 0.0
    stats: SpecStats = field(default_factory=SpecStats)

    @property
    def tokens_per_second(self) -> float:
        return self.stats.generated_tokens / self.seconds if self.seconds else 0.0


class SpeculativeDecoder:
    def __init__(
        self,
        verifier: Verifier,
        proposer: Proposer | None = None,
        *,
        tokenizer=None,
        eos_token_ids=(),
        method: str = "draft",
        k: int = 4,
        tree: TreeSpec | None = None,
        max_context: int | None = None,
    ):
        validate_speculation(method, k)
        self.verifier = verifier
        self.proposer = proposer
        self._check_proposer(method)
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.method = method
        self.k = k
        self.tree = tree or TreeSpec()
        self.max_context = max_context
        self.last_report = BatchReport()

    @classmethod
    def from_pretrained(cls, target: str, draft: str | None = None, *, dtype: str = "bfloat16",
                        device: str = "cpu", method: str | None = None, k: int = 4, tree: TreeSpec | None = None,
                        draft_top_m: int = 256, draft_min_confidence: float = 0.5) -> SpeculativeDecoder:
        """Load a target (and draft) by registry name, local directory or Hub id."""
        from specserve.loading import load_pair

        pair = load_pair(target, draft, dtype=dtype, device=device)
        return cls(
            pair.verifier(),
            pair.proposer(top_m=draft_top_m, min_confidence=draft_min_confidence),
            tokenizer=pair.tokenizer,
            eos_token_ids=pair.eos_token_ids,
            method=method or ("draft" if draft else "none"),
            k=k,
            tree=tree,
            max_context=pair.max_context,
        )

    def _check_proposer(self, method: str) -> None:
        if method in DRAFT_METHODS and self.proposer is None:
            raise SpecserveError(f"method {method!r} needs a draft model")

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise SpecserveError("text prompts need a tokenizer; pass token ids instead")
            return self.tokenizer.encode(prompt)  # with the model's BOS, if it has one
        return [int(t) for t in prompt]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] = SamplingParams(), *,
                 method: str | None = None, k: int | None = None, tree: TreeSpec | None = None) -> list[Generation]:
        """Generate for a batch of prompts (strings or token id lists) together. `method`, `k`
        and `tree` override the decoder's defaults for this call."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise SpecserveError("give one SamplingParams per prompt, or one for all")
        method = method or self.method
        self._check_proposer(method)
        states = [
            RequestState(uuid.uuid4().hex, self._encode(prompt), p, method, self.k if k is None else k,
                         self.eos_token_ids, self.max_context, tree=tree or self.tree)
            for prompt, p in zip(prompts, params)
        ]
        start = time.perf_counter()
        live = list(states)
        while live:
            self._round(live)
            if self.tokenizer is not None:
                for s in live:
                    s.finish_at_stop_string(self._decode)
            for s in [s for s in live if s.finished]:
                self.verifier.release(s.request_id)
                if self.proposer is not None:
                    self.proposer.release(s.request_id)
            live = [s for s in live if not s.finished]
        report = BatchReport(time.perf_counter() - start)
        for s in states:
            report.stats.merge(s.stats)
        self.last_report = report
        return [Generation(s.request_id, s.prompt_ids, s.output_ids, self._text(s), s.finish_reason, s.stats)
                for s in states]

    def _text(self, state: RequestState) -> str | None:
        if state.stop_text is not None:
            return state.stop_text
        return self._decode(state.output_ids) if self.tokenizer is not None else None

    def _round(self, live: list[RequestState]) -> None:
        propose = [s.propose_request() for s in live]
        drafting = [r for r in propose if r.k > 0]
        proposals = {p.request_id: p for p in self.proposer.propose(drafting)} if drafting else {}
        verify = [s.verify_request(proposals.get(s.request_id)) for s in live]
        for s, v, result in zip(live, verify, self.verifier.verify(verify)):
            s.commit(result, v.draft)
