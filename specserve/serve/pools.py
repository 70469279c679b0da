"""Model pool deployments: DraftPool, TargetPool and CoLocatedPool, each an autoscaled pool of
replicas that each hold one engine worker and the KV caches of the requests routed to it.
CoLocatedPool is a TargetPool whose replicas also hold heads (Medusa or Hydra): its verify pass
returns the next round's proposal too.

Thin Ray Serve glue: the engine is built by `build_engine` (injectable for tests), and all
model work happens in the worker, in a thread, one batch at a time. Calls that arrive while a
forward pass runs are batched into the next one (ContinuousBatcher), so concurrent requests share
forward passes: continuous batching at round granularity.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from typing import Any, Callable

from ray import serve

from specserve.protocol import PoolLoad, Proposal, ProposeRequest, VerifyRequest, VerifyResult
from specserve.serve.batching import RUN_AGAIN, ContinuousBatcher

logger = logging.getLogger("ray.serve")
PROBE_ID = "__specserve_health_probe__"
RELEASE_MEMORY_S = 300.0  # how long a released request id is remembered
IDLE_AFTER_S = 2.0  # a replica without a forward pass for this long reports no load to the autoscaler
DRAFT_SHARE_EMA = 0.1  # weight of a pass in the share of calls that carry drafts
ALWAYS_READY_TOKENS = 32  # a call with this few uncached tokens (a decode round) never waits for prefill


def plan_prefill_chunks(uncached: list[int], budget: int) -> list[int | None]:
    """Which calls of a pass run now and which only advance their prompt.

    uncached: per call, the tokens the worker has not cached. A call runs now (None) when its
    uncached tokens fit what is left of this pass's `budget`, or are few (a decode round).
    Otherwise it gets n: cache n more prompt tokens now (what is left of the budget, maybe 0)
    and come back in the next pass. A long prompt thus never stalls the others' rounds.

    >>> plan_prefill_chunks([1, 1000, 3, 600, 100], budget=256)
    [None, 256, None, 0, 0]
    """
    plan: list[int | None] = []
    for tokens in uncached:
        if tokens <= ALWAYS_READY_TOKENS or tokens <= budget:
            plan.append(None)
            budget -= tokens if tokens > ALWAYS_READY_TOKENS else 0
        else:
            plan.append(budget)
            budget = 0
    return plan


def default_engine(pool_args: dict[str, Any]):
    """Load the model of a pool into a torch worker. Imports torch: only pool replicas call it."""
    if pool_args["engine"] != "torch":
        raise RuntimeError(f"engine {pool_args['engine']!r} is not implemented yet; use engine: torch")
    from specserve import models
    from specserve.engine.torch_worker import TorchWorker
    from specserve.loading import set_torch_threads

    set_torch_threads(pool_args.get("torch_threads") or _cpus_of_this_replica())
    model = models.load_causal_lm(pool_args["model"], dtype=pool_args["dtype"], device=pool_args["device"])
    # The replica owns the model: the projections' own copies go once they are prepacked.
    return TorchWorker(model, kv_cache_bytes=int(pool_args["kv_cache_memory"]), release_model_weights=True,
                       cuda_graphs=pool_args.get("cuda_graphs"))


def _cpus_of_this_replica() -> int:
    try:
        import ray

        if not ray.is_initialized():  # get_runtime_context() would start a Ray instance
            raise RuntimeError("not inside Ray")
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
    except Exception:  # not inside Ray
        cpus = os.cpu_count() or 1
    return max(1, int(round(cpus)))


def vocabulary_signature(model_ref: str) -> str:
    """A hash of the token -> id mapping and EOS ids, to compare pools without moving vocabularies."""
    from specserve.text import TextCodec

    codec = TextCodec.for_model(model_ref)
    vocab = sorted(codec.tokenizer.get_vocab(with_added_tokens=True).items())
    return hashlib.sha256(json.dumps([vocab, codec.config.get("eos_token")]).encode()).hexdigest()


class _Pool:
    def __init__(self, pool_args: dict[str, Any], build_engine: Callable | None = None):
        self.args = pool_args
        started = time.monotonic()
        self.worker = (build_engine or default_engine)(pool_args)
        self._lock = threading.Lock()  # the worker is single-threaded; releases wait for the batch
        self._last_forward = time.monotonic()
        self._batches = 0
        self._batched_calls = 0
        self._busy_s = 0.0
        self._load = PoolLoad(0, 0.0, 0, 0.0, 0)  # the last pass's load signal
        self._draft_share = 0.0  # EMA: share of calls that carried draft tokens
        # request id -> release time. A call still queued or in flight when its request was
        # released must not leave a cache behind: batches drop these entries after running.
        self._released: OrderedDict[str, float] = OrderedDict()
        self.batcher = ContinuousBatcher(lambda requests: self._run(self._batch_fn(), requests),
                                         max_batch_size=pool_args["max_batch_size"],
                                         wait_s=pool_args["batch_wait_timeout_s"],
                                         key=lambda request: request.request_id,
                                         join_fraction=pool_args["batch_join_fraction"])
        logger.info("%s ready: %s in %.1f s", type(self).__name__, pool_args["model"], time.monotonic() - started)

    def _batch_fn(self):
        """The worker call a batch of this pool's requests goes through."""
        raise NotImplementedError

    def _run(self, fn, requests):
        with self._lock:
            started = time.perf_counter()
            passes_before = getattr(self.worker, "forward_passes", 0)
            uncached, chunks = self._queue_prefill_chunks(requests)
            ready = [r for r, chunk in zip(requests, chunks) if chunk is None]
            out = iter(fn(ready) if ready else self.worker.run([]))  # run([]): the chunks alone
            out = [next(out) if chunk is None else RUN_AGAIN for chunk in chunks]
            seconds = time.perf_counter() - started
            self._last_forward = time.monotonic()
            self._batches += 1
            self._batched_calls += len(requests)
            self._busy_s += seconds
            passes = getattr(self.worker, "forward_passes", 1) - passes_before
            drafts = [r.draft_nodes for r in requests]
            tokens = sum(n + d if chunk is None else chunk for n, d, chunk in zip(uncached, drafts, chunks))
            self._load = load = PoolLoad.measured(len(requests), tokens, passes, seconds, self.batcher.queued)
            drafted = sum(1 for d in drafts if d) / len(requests)
            self._draft_share += DRAFT_SHARE_EMA * (drafted - self._draft_share)
            for result in out:
                if result is not RUN_AGAIN:
                    result.compute_s = seconds
                    result.load = load
            for request in requests:
                if request.request_id in self._released:
                    self.worker.release(request.request_id)
            return out

    def _queue_prefill_chunks(self, requests) -> tuple[list[int], list[int | None]]:
        """Queue this pass's prompt chunks with the worker (see plan_prefill_chunks). Returns
        each call's uncached tokens and its plan."""
        worker = self.worker
        uncached = [worker.uncached_tokens(r.request_id, r.token_ids) for r in requests]
        chunks = plan_prefill_chunks(uncached, self.args["prefill_chunk_tokens"])
        for r, left, chunk in zip(requests, uncached, chunks):
            if chunk:
                worker.queue_prefill(r.request_id, r.token_ids[: len(r.token_ids) - left + chunk])
        return uncached, chunks

    async def release(self, request_id: str) -> bool:
        self.batcher.forget(request_id)
        return await asyncio.to_thread(self._locked_release, request_id)

    def _locked_release(self, request_id: str) -> bool:
        with self._lock:
            now = time.monotonic()
            while self._released and now - next(iter(self._released.values())) > RELEASE_MEMORY_S:
                self._released.popitem(last=False)  # oldest first
            self._released[request_id] = now
            self._released.move_to_end(request_id)
            return self.worker.release(request_id)

    async def stats(self) -> dict:
        stats = await asyncio.to_thread(self._locked_cache_stats)  # never hold the event loop for a pass
        return {**stats, "batches": self._batches, "batched_calls": self._batched_calls,
                "busy_s": round(self._busy_s, 3), "pid": os.getpid(), "load": dataclasses.asdict(self._load),
                "replica": serve.get_replica_context().replica_id.unique_id}

    def _locked_cache_stats(self) -> dict:
        with self._lock:
            return self.worker.cache_stats()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Custom metrics for Serve's autoscaler (specserve.serve.autoscaling reads them in
        `ctx.aggregated_metrics`): the last pass's load, the calls waiting now, the requests
        holding a cache here and the share of calls that carry drafts."""
        load = self._load
        if time.monotonic() - self._last_forward > IDLE_AFTER_S:  # no pass lately: nothing in flight
            load = PoolLoad(0, 0.0, 0, load.step_s, 0)
        return {"batch_tokens": float(load.batch_tokens), "batch_size": float(load.batch_size),
                "queued": float(self.batcher.queued), "step_s": float(load.step_s),
                "requests": float(self.worker.cached_requests), "draft_share": float(self._draft_share)}

    async def vocabulary_signature(self) -> str:
        return await asyncio.to_thread(vocabulary_signature, self.args["model"])

    async def check_health(self) -> None:
        """Healthy means the model still runs: when idle, push one token through it."""
        if time.monotonic() - self._last_forward < self.args["health_check_period_s"]:
            return
        await asyncio.to_thread(self._probe)

    def _probe(self) -> None:
        from specserve.engine.torch_worker import ForwardItem

        with self._lock:
            [logits] = self.worker.forward([ForwardItem(PROBE_ID, [0])])
            self.worker.release(PROBE_ID)
            if not bool(logits.isfinite().all()):
                raise RuntimeError("the model produced non-finite logits")
            self._last_forward = time.monotonic()


@serve.deployment
class DraftPool(_Pool):
    def __init__(self, pool_args: dict[str, Any], speculation: dict[str, Any], build_engine: Callable | None = None):
        super().__init__(pool_args, build_engine)
        from specserve.proposers.draft_model import DraftModelProposer

        self.proposer = DraftModelProposer(self.worker, top_m=speculation["draft_top_m"],
                                           min_confidence=speculation["draft_min_confidence"])

    def _batch_fn(self):
        return self.proposer.propose

    async def propose(self, request: ProposeRequest) -> Proposal:
        return await self.batcher.submit(request)


class _Verifying(_Pool):
    """A replica that holds the target and verifies (TargetPool, CoLocatedPool)."""

    def __init__(self, pool_args: dict[str, Any], build_engine: Callable | None = None):
        super().__init__(pool_args, build_engine)
        from specserve.verifier import Verifier

        self.verifier = Verifier(self.worker, self._heads())

    def _heads(self):
        """Heads that propose from the verify pass (CoLocatedPool); none here."""
        return None

    def _batch_fn(self):
        return self.verifier.verify

    async def verify(self, request: VerifyRequest) -> VerifyResult:
        return await self.batcher.submit(request)

    async def model_info(self) -> dict:
        return {"max_context": self.worker.config.max_position_embeddings,
                "eos_token_ids": sorted(self._eos_ids()),
                # the head proposer this pool serves (medusa, hydra), None without heads
                "heads_method": getattr(self.verifier.heads, "method", None)}

    def _eos_ids(self) -> set[int]:
        from specserve.loading import eos_ids

        return eos_ids(self.worker.model, None)


@serve.deployment
class TargetPool(_Verifying):
    """The target alone: verifies drafts proposed elsewhere (a draft pool), or decodes alone."""


@serve.deployment
class CoLocatedPool(_Verifying):
    """The target and its heads in one replica: one batched forward pass per round verifies
    every request's tree and, from the same pass's hidden states, proposes each request's next
    tree (`VerifyRequest.propose_next` -> `VerifyResult.next_proposal`)."""

    def _heads(self):
        from specserve.heads import require_heads
        from specserve.loading import load_heads_proposer

        # build_app resolved `heads: default` to the directory of the speculation's method
        heads = load_heads_proposer(require_heads(self.args["model"], self.args["heads"]), self.worker)
        logger.info("CoLocatedPool: %d %s heads over %d tokens", heads.num_heads, heads.method,
                    heads.heads.config.head_vocab_size)
        return heads
