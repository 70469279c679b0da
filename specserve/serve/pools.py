"""Model pool deployments: DraftPool, TargetPool and CoLocatedPool, each an autoscaled pool of
replicas that each hold one engine (specserve.engine) and the KV caches of the requests routed
to it. CoLocatedPool is a TargetPool whose replicas also hold heads (Medusa or Hydra): its
verify pass returns the next round's proposal too.

Thin Ray Serve glue: the engine is built by `build_engine(pool_args)` (injectable for tests; a
bare TorchWorker is wrapped in a TorchEngine) and does all model work, batching concurrent
calls into shared forward passes itself.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any, Callable

from ray import serve

from specserve.engine import vocabulary_fingerprint
from specserve.engine.torch_engine import ALWAYS_READY_TOKENS, PROBE_ID, plan_prefill_chunks  # noqa: F401
from specserve.models import resolve_dtype
from specserve.protocol import Proposal, ProposeRequest, VerifyRequest, VerifyResult

logger = logging.getLogger("ray.serve")


def default_engine(pool_args: dict[str, Any], role: str = "target", speculation: dict[str, Any] | None = None):
    """The engine the pool's args name. Imports torch or vLLM: only pool replicas call it."""
    from specserve.engine import build_engine

    return build_engine(pool_args, role, **({"speculation": speculation} if speculation is not None else {}))


def vocabulary_signature(model_ref: str) -> str:
    return vocabulary_fingerprint(model_ref)


class _Pool:
    ROLE = "target"

    def __init__(self, pool_args: dict[str, Any], build_engine: Callable | None = None,
                 speculation: dict[str, Any] | None = None):
        self.args = pool_args
        self._last_call: dict[str, float] = {}  # request id -> when a call for it last came or went
        started = time.monotonic()
        if build_engine is None:
            self.engine = default_engine(pool_args, self.ROLE, speculation)
        else:
            self.engine = _as_engine(build_engine(pool_args), pool_args, self.ROLE, speculation)
        logger.info("%s ready: %s in %s on engine %s in %.1f s", type(self).__name__, pool_args["model"],
                    resolve_dtype(pool_args.get("dtype", "auto"), pool_args.get("device", "cpu")),
                    pool_args["engine"], time.monotonic() - started)

    @property
    def worker(self):
        """The torch engine's worker (tests and the CLI look inside)."""
        return self.engine.worker

    async def release(self, request_id: str) -> bool:
        self._last_call.pop(request_id, None)
        return await self.engine.release(request_id)

    async def _call(self, request_id: str, call):
        """Run an engine call for a request, noting when its cache was last touched."""
        self._last_call[request_id] = time.monotonic()
        try:
            return await call
        finally:
            self._last_call[request_id] = time.monotonic()

    async def _streamed(self, request_id: str, items: AsyncIterator) -> AsyncIterator:
        """A streaming engine call for a request, noting each item as a touch of its cache;
        closed (the engine stops) however the stream ends."""
        self._last_call[request_id] = time.monotonic()
        try:
            async for item in items:
                self._last_call[request_id] = time.monotonic()
                yield item
        finally:
            self._last_call[request_id] = time.monotonic()
            await items.aclose()

    async def release_abandoned(self) -> int:
        """Release the caches of requests no call has touched for `abandoned_cache_s`: their
        router died mid-request (its release will never come). Returns how many."""
        cutoff = time.monotonic() - self.args.get("abandoned_cache_s", 300)
        abandoned = [rid for rid, t in self._last_call.items() if t < cutoff]
        for request_id in abandoned:
            await self.release(request_id)
        if abandoned:
            logger.info("released the caches of %d abandoned requests", len(abandoned))
        return len(abandoned)

    async def info(self):
        """The engine's EngineInfo: context, EOS ids, vocabulary fingerprint, capabilities."""
        return self.engine.info()

    async def stats(self) -> dict:
        return {**await self.engine.stats(), "pid": os.getpid(), "load": dataclasses.asdict(self.engine.load()),
                "replica": serve.get_replica_context().replica_id.unique_id}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Custom metrics for Serve's autoscaler (specserve.serve.autoscaling reads them in
        `ctx.aggregated_metrics`): the last pass's load, the calls waiting now, the requests
        holding a cache here and the share of calls that carry drafts."""
        engine, load = self.engine, self.engine.load()
        return {"batch_tokens": float(load.batch_tokens), "batch_size": float(load.batch_size),
                "queued": float(load.queued), "step_s": float(load.step_s),
                "requests": float(getattr(engine, "cached_requests", 0)),
                "draft_share": float(getattr(engine, "draft_share", 0.0))}

    async def vocabulary_signature(self) -> str:
        return self.engine.info().vocabulary

    async def check_health(self) -> None:
        await self.engine.check_health()
        await self.release_abandoned()


def _as_engine(built, pool_args: dict[str, Any], role: str, speculation: dict[str, Any] | None):
    """An injected engine, or a bare TorchWorker wrapped in the torch engine."""
    if hasattr(built, "info"):  # engines answer info(); workers do not
        return built
    from specserve.engine.torch_engine import TorchEngine

    return TorchEngine(built, pool_args, role, speculation=speculation)


@serve.deployment
class DraftPool(_Pool):
    ROLE = "draft"

    def __init__(self, pool_args: dict[str, Any], speculation: dict[str, Any], build_engine: Callable | None = None):
        super().__init__(pool_args, build_engine, speculation)

    async def propose(self, request: ProposeRequest) -> Proposal:
        return await self._call(request.request_id, self.engine.propose(request))

    async def propose_stream(self, request: ProposeRequest) -> AsyncIterator[Proposal]:
        """speculation.pipeline: the draft's greedy continuation as it is made (a Serve
        streaming call: `handle.options(stream=True)`); the router closing it stops the draft."""
        async for proposal in self._streamed(request.request_id, self.engine.propose_stream(request)):
            yield proposal


class _Verifying(_Pool):
    """A replica that holds the target and verifies (TargetPool, CoLocatedPool)."""

    async def verify(self, request: VerifyRequest) -> VerifyResult:
        return await self._call(request.request_id, self.engine.verify(request))

    async def verify_stream(self, request: VerifyRequest) -> AsyncIterator[VerifyResult]:
        """Native mode: the rest of the request's generation as the engine makes it (a Serve
        streaming call: `handle.options(stream=True)`)."""
        async for result in self._streamed(request.request_id, self.engine.verify_stream(request)):
            yield result

    async def model_info(self) -> dict:
        info = self.engine.info()
        return {"max_context": info.max_context, "eos_token_ids": list(info.eos_token_ids),
                "heads_method": info.heads_method, "engine": info}


@serve.deployment
class TargetPool(_Verifying):
    """The target alone: verifies drafts proposed elsewhere (a draft pool), or decodes alone."""


@serve.deployment
class CoLocatedPool(_Verifying):
    """The target and its heads in one replica: one batched forward pass per round verifies
    every request's tree and, from the same pass's hidden states, proposes each request's next
    tree (`VerifyRequest.propose_next` -> `VerifyResult.next_proposal`). The torch engine loads
    the heads named by `pool_args["heads"]`."""
