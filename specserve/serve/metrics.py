"""The router's Prometheus metrics, through `ray.serve.metrics` (Ray exports them with a `ray_`
prefix on each node's metrics export port, with Serve's tags: application, deployment, replica).

Speculation counters reuse vLLM's spec-decode names with a `specserve_` prefix so vLLM's
dashboards and PromQL carry over; their sums over requests equal the sums of `usage.speculation`.
Every metric is declared once in METRICS; the Grafana dashboard (specserve.serve.dashboard) may
only query names declared here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal, NamedTuple

# Seconds: from a few ms (a round on a GPU) to minutes (a long request on a CPU).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384)
# Ray wants positive boundaries: le="0.5" counts the rounds with speculation off, le="k+0.5" depth <= k.
K_BUCKETS = tuple(k + 0.5 for k in range(16))


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: Literal["counter", "gauge", "histogram"]
    description: str
    tags: tuple[str, ...] = ()
    boundaries: tuple[float, ...] = ()


METRICS = (
    MetricSpec("specserve_num_drafts", "counter", "Rounds that verified at least one draft token.", ("proposer",)),
    MetricSpec("specserve_num_draft_tokens", "counter", "Draft tokens verified.", ("proposer",)),
    MetricSpec("specserve_num_accepted_tokens", "counter", "Draft tokens accepted.", ("proposer",)),
    MetricSpec("specserve_num_accepted_tokens_per_pos", "counter",
               "Draft tokens accepted at each draft position (0 = the first drafted token).", ("proposer", "position")),
    MetricSpec("specserve_prompt_tokens", "counter", "Prompt tokens of finished requests.", ()),
    MetricSpec("specserve_generation_tokens", "counter", "Tokens generated (usage.completion_tokens).", ()),
    MetricSpec("specserve_requests", "counter", "Finished requests, by finish reason.", ("finish_reason",)),
    MetricSpec("specserve_time_to_first_token_seconds", "histogram",
               "From the start of a request's rounds to its first token.", (), LATENCY_BUCKETS),
    MetricSpec("specserve_inter_token_latency_seconds", "histogram",
               "Per round: the round's time divided by the tokens it emitted.", (), LATENCY_BUCKETS),
    MetricSpec("specserve_e2e_request_latency_seconds", "histogram",
               "From the start of a request's rounds to its last token.", (), LATENCY_BUCKETS),
    MetricSpec("specserve_pool_batch_size", "histogram",
               "Calls in the pool pass that answered a round's call (seen once per call).", ("pool",), BATCH_BUCKETS),
    MetricSpec("specserve_pool_batch_tokens", "histogram",
               "Tokens per forward pass of the pool pass that answered a call.", ("pool",), TOKEN_BUCKETS),
    MetricSpec("specserve_pool_queue", "gauge", "Calls waiting in the pool when its last pass ended.", ("pool",)),
    MetricSpec("specserve_pool_step_seconds", "histogram", "Seconds per forward pass of a pool.", ("pool",),
               STEP_BUCKETS),
    MetricSpec("specserve_speculation_k", "histogram",
               "Draft depth per round as the load-aware policy (or a fixed k) chose it; 0 = speculation off.",
               ("proposer",), K_BUCKETS),
    MetricSpec("specserve_speculation_on", "gauge",
               "1 when this router's last round drafted, 0 when speculation was off.", ("proposer",)),
)
METRIC_NAMES = frozenset(m.name for m in METRICS)


def ray_metric(spec: MetricSpec):
    """The `ray.serve.metrics` object for `spec` (in a replica: Serve adds its tags)."""
    from ray.serve import metrics

    if spec.kind == "histogram":
        return metrics.Histogram(spec.name, spec.description, boundaries=list(spec.boundaries), tag_keys=spec.tags)
    cls = metrics.Counter if spec.kind == "counter" else metrics.Gauge
    return cls(spec.name, spec.description, tag_keys=spec.tags)


class SpecCounts(NamedTuple):
    """A request's SpecStats counters at one moment, to diff across a round (RequestState.commit
    keeps the one definition of what a round adds)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: tuple[int, ...]
    k_histogram: tuple[int, ...]

    @classmethod
    def of(cls, stats) -> SpecCounts:
        return cls(stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
                   tuple(stats.num_accepted_tokens_per_pos), tuple(stats.k_histogram))


def _added(before: tuple[int, ...], after: tuple[int, ...]) -> list[int]:
    return [n - (before[i] if i < len(before) else 0) for i, n in enumerate(after)]


def round_increments(before: SpecCounts, after: SpecCounts) -> tuple[dict[str, int], list[int], int]:
    """What one round added: the scalar counters, the accepted tokens per position, and the
    depth it drafted (0 = speculation off).

    >>> before = SpecCounts(1, 3, 2, (1, 1, 0), (0, 0, 0, 1))
    >>> round_increments(before, SpecCounts(2, 6, 3, (2, 1, 0), (0, 0, 0, 2)))
    ({'specserve_num_drafts': 1, 'specserve_num_draft_tokens': 3, 'specserve_num_accepted_tokens': 1}, [1, 0, 0], 3)
    """
    scalars = {f"specserve_{name}": getattr(after, name) - getattr(before, name)
               for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    rounds = _added(before.k_histogram, after.k_histogram)
    depth = rounds.index(1) if 1 in rounds else 0
    return scalars, _added(before.num_accepted_tokens_per_pos, after.num_accepted_tokens_per_pos), depth


class RouterMetrics:
    """Records a request's rounds. `make(spec)` builds each metric (ray_metric in a replica;
    tests pass fakes)."""

    def __init__(self, make=ray_metric):
        self.m = {spec.name: make(spec) for spec in METRICS}

    def round(self, proposer: str, before: SpecCounts, after: SpecCounts) -> None:
        tags = {"proposer": proposer}
        scalars, per_pos, depth = round_increments(before, after)
        for name, n in scalars.items():
            if n:
                self.m[name].inc(n, tags=tags)
        for position, accepted in enumerate(per_pos):
            if accepted:
                self.m["specserve_num_accepted_tokens_per_pos"].inc(accepted, tags={**tags, "position": str(position)})
        self.m["specserve_speculation_k"].observe(depth, tags=tags)
        self.m["specserve_speculation_on"].set(1 if depth else 0, tags=tags)

    def pool_load(self, pool: str, load) -> None:
        """A PoolLoad that came back with a call."""
        tags = {"pool": pool}
        self.m["specserve_pool_batch_size"].observe(load.batch_size, tags=tags)
        self.m["specserve_pool_batch_tokens"].observe(load.batch_tokens, tags=tags)
        self.m["specserve_pool_queue"].set(load.queued, tags=tags)
        self.m["specserve_pool_step_seconds"].observe(load.step_s, tags=tags)

    def timer(self) -> RequestTimer:
        return RequestTimer(self)

    def finished(self, prompt_tokens: int, completion_tokens: int, finish_reason: str) -> None:
        self.m["specserve_prompt_tokens"].inc(prompt_tokens)
        if completion_tokens:
            self.m["specserve_generation_tokens"].inc(completion_tokens)
        self.m["specserve_requests"].inc(tags={"finish_reason": finish_reason})


class RequestTimer:
    """TTFT, inter-token and end-to-end latency of one request, from its deltas."""

    def __init__(self, metrics: RouterMetrics):
        self.m = metrics.m
        self.started = self.last = time.perf_counter()
        self.first = True

    def emitted(self, tokens: int, final: bool) -> None:
        now = time.perf_counter()
        if tokens:
            if self.first:
                self.m["specserve_time_to_first_token_seconds"].observe(now - self.started)
                self.first = False
            else:
                self.m["specserve_inter_token_latency_seconds"].observe((now - self.last) / tokens)
            self.last = now
        if final:
            self.m["specserve_e2e_request_latency_seconds"].observe(now - self.started)
