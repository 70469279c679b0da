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

from specserve.policy import LoadModel, SpeculationPolicy
from specserve.proposers import Proposer
from specserve.proposers.ngram import NgramProposer
from specserve.protocol import DRAFT_POOL_PROPOSERS, LOCAL_PROPOSERS, PoolLoad, SamplingParams, Speculation, SpecserveError, TreeSpec
from specserve.request_state import RequestState, SpecStats
from specserve.verifier import Verifier


@dataclass
class Generation:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    stats: SpecStats
    # What produced the stats: proposer, shape, acceptance ("typical (lossy)" when opted in).
    speculation: dict = field(default_factory=dict)


@dataclass
class BatchReport:
    """What one `generate` call did, for CLI output and benchmarks."""

    seconds: float = 0.0
    stats: SpecStats = field(default_factory=SpecStats)

    @property
    def tokens_per_second(self) -> float:
        return self.stats.generated_tokens / self.seconds if self.seconds else 0.0


def measured_pass(worker, calls, run) -> tuple[list, PoolLoad]:
    """`run(calls)` on `worker`, and its load signal as a pool would report it (the same
    token count: uncached tokens + draft nodes), for the load-aware policy."""
    tokens = sum(worker.uncached_tokens(c.request_id, c.token_ids) + c.draft_nodes for c in calls)
    passes, started = worker.forward_passes, time.perf_counter()
    out = run(calls)
    return out, PoolLoad.measured(len(calls), tokens, worker.forward_passes - passes, time.perf_counter() - started)


class SpeculativeDecoder:
    """Speculative decoding in one process. `proposer` is a draft model's (proposer `draft`);
    a verifier built with heads proposes itself (proposer `medusa`, co-located); prompt
    lookup (proposer `ngram`) needs neither."""

    def __init__(
        self,
        verifier: Verifier,
        proposer: Proposer | None = None,
        *,
        tokenizer=None,
        eos_token_ids=(),
        speculation: Speculation | None = None,
        method: str | None = None,
        k: int | None = None,
        tree: TreeSpec | None = None,
        max_context: int | None = None,
    ):
        self.verifier = verifier
        self.proposer = proposer
        self.ngram = NgramProposer()
        default = Speculation(proposer="draft" if proposer is not None
                              else getattr(verifier.heads, "method", "medusa") if verifier.heads is not None else "none")
        self.speculation = (speculation or default).overridden(method=method, k=k, tree=tree)
        self._check_proposer(self.speculation)
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_context = max_context
        self.last_report = BatchReport()
        # adaptive speculation: the policy and what it has measured of this decoder's passes
        self.policy = SpeculationPolicy()
        self.load = LoadModel()

    @classmethod
    def from_pretrained(cls, target: str, draft: str | None = None, *, heads: str | None = None,
                        dtype: str = "auto", device: str = "cpu", speculation: Speculation | None = None,
                        method: str | None = None, k: int | None = None, tree: TreeSpec | None = None,
                        draft_top_m: int = 256, draft_min_confidence: float = 0.5,
                        draft_quantize: str | None = None) -> SpeculativeDecoder:
        """Load a target (and a draft, or heads trained by `specserve train-heads`: a directory,
        or "default" for $SPECSERVE_HOME/heads/<target>-medusa) by registry name, local
        directory or Hub id."""
        from specserve.loading import load_pair

        pair = load_pair(target, draft, heads=heads, dtype=dtype, device=device, draft_quantize=draft_quantize,
                         release_model_weights=True)
        return cls(
            pair.verifier(),
            pair.proposer(top_m=draft_top_m, min_confidence=draft_min_confidence),
            tokenizer=pair.tokenizer,
            eos_token_ids=pair.eos_token_ids,
            speculation=speculation, method=method, k=k, tree=tree,
            max_context=pair.max_context,
        )

    def _check_proposer(self, spec: Speculation) -> None:
        if spec.proposer == "native":
            raise SpecserveError("proposer 'native' is vLLM's own speculative decoding inside a vLLM target pool "
                                 "(serve with engine: vllm); the library decoder runs the torch engine")
        if spec.proposer in DRAFT_POOL_PROPOSERS and self.proposer is None:
            raise SpecserveError(f"proposer {spec.proposer!r} needs a draft model")
        if spec.co_located and self.verifier.heads is None:
            raise SpecserveError(f"proposer {spec.proposer!r} needs heads on the target (train them with "
                                 "`specserve train-heads`)")
        held = getattr(self.verifier.heads, "method", spec.proposer)
        if spec.co_located and self.verifier.heads is not None and spec.proposer != held:
            raise SpecserveError(f"proposer {spec.proposer!r} needs {spec.proposer} heads; this target holds "
                                 f"{held} heads (use proposer {held!r})")

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise SpecserveError("text prompts need a tokenizer; pass token ids instead")
            return self.tokenizer.encode(prompt)  # with the model's BOS, if it has one
        return [int(t) for t in prompt]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] = SamplingParams(), *,
                 speculation: Speculation | None = None, method: str | None = None, proposer: str | None = None,
                 shape: str | None = None, k: int | None = None, tree: TreeSpec | None = None,
                 acceptance: str | None = None, policy: str | None = None,
                 solo_k: int | None = None) -> list[Generation]:
        """Generate for a batch of prompts (strings or token id lists) together. `speculation`
        (or `proposer`, `shape`, `k`, `tree`, `acceptance`, `policy`, or the older `method`)
        override the decoder's defaults for this call. `policy="adaptive"` lets the load-aware
        policy pick each round's depth (0..k, or 0..`solo_k` for a chain decoded alone); an
        explicit k, shape, tree or proposer alone means fixed."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise SpecserveError("give one SamplingParams per prompt, or one for all")
        spec = (speculation or self.speculation).overridden(method=method, proposer=proposer, shape=shape, k=k,
                                                            tree=tree, acceptance=acceptance, policy=policy,
                                                            solo_k=solo_k)
        self._check_proposer(spec)
        states = [RequestState(uuid.uuid4().hex, self._encode(prompt), p, spec, self.eos_token_ids, self.max_context)
                  for prompt, p in zip(prompts, params)]
        start = time.perf_counter()
        live = list(states)
        while live:
            self._round(live)
            if self.tokenizer is not None:
                for s in live:
                    s.finish_at_stop_string(self._decode)
            for s in [s for s in live if s.finished]:
                self.verifier.release(s.request_id)
                self.ngram.release(s.request_id)
                if self.proposer is not None:
                    self.proposer.release(s.request_id)
            live = [s for s in live if not s.finished]
        report = BatchReport(time.perf_counter() - start)
        for s in states:
            report.stats.merge(s.stats)
        self.last_report = report
        return [Generation(s.request_id, s.prompt_ids, s.output_ids, self._text(s), s.finish_reason, s.stats,
                           s.usage_stats()) for s in states]

    def _text(self, state: RequestState) -> str | None:
        if state.stop_text is not None:
            return state.stop_text
        return self._decode(state.output_ids) if self.tokenizer is not None else None

    def _round(self, live: list[RequestState]) -> None:
        for s in live:
            s.plan_round(self.policy, self.load, batch=len(live), alone=len(live) == 1)
        drafting = [(s.propose_request(), s.speculation.proposer) for s in live if s.needs_proposer]
        pooled = [r for r, proposer in drafting if proposer in DRAFT_POOL_PROPOSERS]
        proposals = {p.request_id: p for p in self.ngram.propose([r for r, proposer in drafting
                                                                  if proposer in LOCAL_PROPOSERS])}
        if pooled:
            proposed, load = measured_pass(self.proposer.worker, pooled, self.proposer.propose)
            proposals.update((p.request_id, p) for p in proposed)
            self.load.observe_draft(load.batch_tokens, load.step_s)
        verify = [s.verify_request(proposals.get(s.request_id) or s.proposal_in_hand()) for s in live]
        results, load = measured_pass(self.verifier.worker, verify, self.verifier.verify)
        self.load.observe_target(load.batch_size, load.batch_tokens, load.step_s)
        for s, v, result in zip(live, verify, results):
            s.commit(result, v.draft)
