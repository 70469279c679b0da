"""The torch engine behind the `Engine` protocol: one TorchWorker, its verifier (target pools,
with heads for co-located pools) or its draft proposer (draft pools), and the continuous
batching that turns concurrent calls into shared forward passes.

All model work happens in a thread, one batch at a time. Calls that arrive while a forward pass
runs join the next one (ContinuousBatcher); long prompts are cached chunk by chunk alongside
other requests' rounds (plan_prefill_chunks). Ray-free: pools wrap it, tests drive it directly.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from specserve.engine import EngineInfo, chunked_propose_stream, vocabulary_fingerprint
from specserve.protocol import PoolLoad, Proposal, ProposeRequest, SpecserveError, VerifyRequest, VerifyResult
from specserve.serve.batching import RUN_AGAIN, ContinuousBatcher

logger = logging.getLogger("ray.serve")

PROBE_ID = "__specserve_health_probe__"
RELEASE_MEMORY_S = 300.0  # how long a released request id is remembered
IDLE_AFTER_S = 2.0  # a replica without a forward pass for this long reports no load to the autoscaler
DRAFT_SHARE_EMA = 0.1  # weight of a pass in the share of calls that carry drafts
ALWAYS_READY_TOKENS = 32  # a call with this few uncached tokens (a decode round) never waits for prefill
TIMING_ID = "__specserve_pass_timing_{}__"
# cached tokens of each timed call: short, so timing takes seconds; at 300 a pass of 8 or 16 calls
# of the 1.5B target took 12-15% longer, which the router's drift takes up (DecodeCurve)
TIMING_CONTEXT = 4
TIMING_MAX_CALLS = 64


def timed_call_counts(max_batch_size: int) -> list[int]:
    """Calls per decode pass timed at startup: powers of two up to the pool's largest pass
    (at most TIMING_MAX_CALLS), and that pass itself.

    >>> timed_call_counts(16), timed_call_counts(12), timed_call_counts(1)
    ([1, 2, 4, 8, 16], [1, 2, 4, 8, 12], [1])
    """
    largest = min(max_batch_size, TIMING_MAX_CALLS)
    counts = [1 << i for i in range(largest.bit_length()) if 1 << i < largest]
    return counts + [largest]


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


def cpus_of_this_replica() -> int:
    try:
        import ray

        if not ray.is_initialized():  # get_runtime_context() would start a Ray instance
            raise RuntimeError("not inside Ray")
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
    except Exception:  # not inside Ray
        cpus = os.cpu_count() or 1
    return max(1, int(round(cpus)))


def load_worker(pool_args: dict[str, Any], role: str = "target"):
    """Load the model of a pool into a torch worker (a draft's has no greedy screen: its
    proposals read its logits as probabilities)."""
    from specserve import models
    from specserve.engine.torch_worker import TorchWorker
    from specserve.loading import set_torch_threads

    set_torch_threads(pool_args.get("torch_threads") or cpus_of_this_replica())
    model = models.load_causal_lm(pool_args["model"], dtype=pool_args["dtype"], device=pool_args["device"])
    # The replica owns the model: the projections' own copies go once they are prepacked.
    return TorchWorker(model, kv_cache_bytes=int(pool_args["kv_cache_memory"]), release_model_weights=True,
                       cuda_graphs=pool_args.get("cuda_graphs"), linear_layout=pool_args.get("linear_layout"),
                       quantize=pool_args.get("quantize"), greedy_screen=pool_args.get("greedy_screen") if role == "target" else False)


def build(pool_args: dict[str, Any], role: str, *, speculation: dict[str, Any] | None = None) -> TorchEngine:
    """A torch engine for a pool of `role` ("target", or "draft" with the speculation's settings)."""
    return TorchEngine(load_worker(pool_args, role), pool_args, role, speculation=speculation)


class TorchEngine:
    """See the module docstring. `worker` may be any loaded TorchWorker (tests pass tiny ones)."""

    def __init__(self, worker, pool_args: dict[str, Any], role: str, *, speculation: dict[str, Any] | None = None):
        self.worker = worker
        self.args = pool_args
        self.role = role
        self.verifier = self.proposer = None
        if role == "draft":
            from specserve.proposers.draft_model import DraftModelProposer

            speculation = speculation or {}
            self.proposer = DraftModelProposer(worker, top_m=speculation.get("draft_top_m", 256),
                                               min_confidence=speculation.get("draft_min_confidence", 0.5))
            self._batch_fn = self.proposer.propose
        else:
            from specserve.verifier import Verifier

            self.verifier = Verifier(worker, self._heads())
            self._batch_fn = self.verifier.verify
        self._info: EngineInfo | None = None
        self._lock = threading.Lock()  # the worker is single-threaded; releases wait for the batch
        self._last_forward = time.monotonic()
        self.batches = 0
        self.batched_calls = 0
        self.busy_s = 0.0
        self._load = PoolLoad(0, 0.0, 0, 0.0, 0)  # the last pass's load signal
        self.draft_share = 0.0  # EMA: share of calls that carried draft tokens
        # request id -> release time. A call still queued or in flight when its request was
        # released must not leave a cache behind: batches drop these entries after running.
        self._released: OrderedDict[str, float] = OrderedDict()
        self._decode_pass_s: tuple[tuple[int, float], ...] = ()
        if self.verifier is not None and pool_args.get("time_decode_passes"):
            self._decode_pass_s = self._time_decode_passes(timed_call_counts(pool_args["max_batch_size"]))
        self.batcher = ContinuousBatcher(lambda requests: self._run(requests),
                                         max_batch_size=pool_args["max_batch_size"],
                                         wait_s=pool_args["batch_wait_timeout_s"],
                                         key=lambda request: request.request_id,
                                         join_fraction=pool_args["batch_join_fraction"])

    def _heads(self):
        """Co-located heads (Medusa, Hydra) when the pool names a directory of them."""
        if self.args.get("heads") is None:
            return None
        from specserve.heads import require_heads
        from specserve.loading import load_heads_proposer

        # build_app resolved `heads: default` to the directory of the speculation's method
        return load_heads_proposer(require_heads(self.args["model"], self.args["heads"]), self.worker)

    # ---- the Engine protocol -----------------------------------------------------------

    def info(self) -> EngineInfo:
        if self._info is None:
            from specserve.loading import eos_ids

            heads = self.verifier.heads if self.verifier is not None else None
            self._info = EngineInfo(
                engine="torch", max_context=self.worker.config.max_position_embeddings,
                eos_token_ids=tuple(sorted(eos_ids(self.worker.model, None))),
                vocabulary=self._vocabulary(), trees=True, hidden_states=True, proposes=True,
                sampled_top_k_max=None, heads_method=getattr(heads, "method", None),
                decode_pass_s=self._decode_pass_s)
        return self._info

    def _time_decode_passes(self, counts: list[int], repeats: int = 2) -> tuple[tuple[int, float], ...]:
        """Seconds of a greedy decode pass of n calls through the verifier, for each n of
        `counts`: the fastest of `repeats` rounds over the counts, after a round that warms each
        shape, made non-decreasing in n (more calls never make a pass shorter: a dip is noise).
        Timed before the pool takes calls, so the passes run alone; ~5 s for the float32 1.5B
        target on a 2-core CPU. A speculating router sees only its verify passes (several rows a
        call, the draft pool sharing the cores), and a line fitted on those put a 16-call decode
        pass at 1.0-1.4 s where it took 0.75-0.8 s (code, 16 streams)."""
        from specserve.protocol import SamplingParams

        vocab, params = self.worker.vocab_size, SamplingParams()
        ids = [[(31 * i + j) % vocab for j in range(TIMING_CONTEXT)] for i in range(max(counts))]
        seconds: dict[int, list[float]] = {n: [] for n in counts}
        with self._lock:
            try:
                self._batch_fn([VerifyRequest(TIMING_ID.format(i), ids[i], params, 0) for i in range(len(ids))])
                for repeat in range(repeats + 1):
                    for n in counts:
                        for i in range(n):
                            ids[i].append((ids[i][-1] * 7 + 1) % vocab)
                        started = time.perf_counter()
                        self._batch_fn([VerifyRequest(TIMING_ID.format(i), ids[i], params, 0) for i in range(n)])
                        if repeat:
                            seconds[n].append(time.perf_counter() - started)
            finally:
                for i in range(len(ids)):
                    self._forget(TIMING_ID.format(i))
        timed, floor = [], 0.0
        for n in counts:
            floor = max(floor, min(seconds[n]))
            timed.append((n, floor))
        logger.info("decode passes timed: %s", ", ".join(f"{n} calls {1e3 * s:.0f} ms" for n, s in timed))
        return tuple(timed)

    def _vocabulary(self) -> str:
        try:
            return vocabulary_fingerprint(self.args["model"])
        except Exception:  # a model built in a test has no tokenizer
            return f"vocab:{self.worker.vocab_size}"

    async def verify(self, request: VerifyRequest) -> VerifyResult:
        if self.verifier is None:
            raise SpecserveError("this pool proposes; it does not verify")
        return await self.batcher.submit(request)

    def verify_stream(self, request: VerifyRequest):
        raise SpecserveError("engine torch does not speculate itself (native mode is vLLM's): it verifies drafts")

    async def propose(self, request: ProposeRequest) -> Proposal:
        if self.proposer is None:
            raise SpecserveError("this pool verifies; it does not propose")
        return await self.batcher.submit(request)

    def propose_stream(self, request: ProposeRequest) -> AsyncIterator[Proposal]:
        return chunked_propose_stream(self, request)

    async def release(self, request_id: str) -> bool:
        self.batcher.forget(request_id)
        return await asyncio.to_thread(self._locked_release, request_id)

    async def stats(self) -> dict:
        stats = await asyncio.to_thread(self._locked_cache_stats)  # never hold the event loop for a pass
        return {**stats, "batches": self.batches, "batched_calls": self.batched_calls,
                "busy_s": round(self.busy_s, 3)}

    def load(self) -> PoolLoad:
        """The last pass's load; none once no pass ran for IDLE_AFTER_S."""
        if time.monotonic() - self._last_forward > IDLE_AFTER_S:
            return PoolLoad(0, 0.0, 0, self._load.step_s, 0)
        return self._load

    @property
    def cached_requests(self) -> int:
        return self.worker.cached_requests

    async def check_health(self) -> None:
        """Healthy means the model still runs: when idle, push one token through it."""
        if time.monotonic() - self._last_forward < self.args["health_check_period_s"]:
            return
        await asyncio.to_thread(self._probe)

    # ---- batches -----------------------------------------------------------------------

    def _run(self, requests):
        with self._lock:
            started = time.perf_counter()
            passes_before = getattr(self.worker, "forward_passes", 0)
            uncached, chunks = self._queue_prefill_chunks(requests)
            ready = [r for r, chunk in zip(requests, chunks) if chunk is None]
            out = iter(self._batch_fn(ready) if ready else self.worker.run([]))  # run([]): the chunks alone
            out = [next(out) if chunk is None else RUN_AGAIN for chunk in chunks]
            seconds = time.perf_counter() - started
            self._last_forward = time.monotonic()
            self.batches += 1
            self.batched_calls += len(requests)
            self.busy_s += seconds
            passes = getattr(self.worker, "forward_passes", 1) - passes_before
            drafts = [r.draft_nodes for r in requests]
            tokens = sum(n + d if chunk is None else chunk for n, d, chunk in zip(uncached, drafts, chunks))
            self._load = load = PoolLoad.measured(len(requests), tokens, passes, seconds, self.batcher.queued)
            drafted = sum(1 for d in drafts if d) / len(requests)
            self.draft_share += DRAFT_SHARE_EMA * (drafted - self.draft_share)
            for result in out:
                if result is not RUN_AGAIN:
                    result.compute_s = seconds
                    result.load = load
            for request in requests:
                if request.request_id in self._released:
                    self._forget(request.request_id)
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

    def _locked_release(self, request_id: str) -> bool:
        with self._lock:
            now = time.monotonic()
            while self._released and now - next(iter(self._released.values())) > RELEASE_MEMORY_S:
                self._released.popitem(last=False)  # oldest first
            self._released[request_id] = now
            self._released.move_to_end(request_id)
            return self._forget(request_id)

    def _forget(self, request_id: str) -> bool:
        """Drop the request's cache, and whatever co-located heads keep for it."""
        heads = self.verifier.heads if self.verifier is not None else None
        if heads is not None and hasattr(heads, "release"):
            heads.release(request_id)
        return self.worker.release(request_id)

    def _locked_cache_stats(self) -> dict:
        with self._lock:
            return self.worker.cache_stats()

    def _probe(self) -> None:
        from specserve.engine.torch_worker import ForwardItem

        with self._lock:
            [logits] = self.worker.forward([ForwardItem(PROBE_ID, [0])])
            self.worker.release(PROBE_ID)
            if not bool(logits.isfinite().all()):
                raise RuntimeError("the model produced non-finite logits")
            self._last_forward = time.monotonic()
