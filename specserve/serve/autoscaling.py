"""Application-level autoscaling for specserve's pools (Ray Serve's `autoscaling_policy`).

Serve's default policy scales each deployment on its own ongoing calls. For speculative pools
that is the wrong signal twice over: a target pass of 8 requests drafting 4 tokens each costs
like 40 requests decoding alone, and the draft pool has work only while requests speculate. So
the application's policy scales

- the target pool (TargetPool / CoLocatedPool) on tokens in flight: the tokens per forward
  pass each replica reports (new tokens and draft nodes), plus the calls waiting for a pass,
  over `target_tokens_per_replica`;
- the draft pool on the requests that speculate: the target replicas' requests in flight times
  the share of their verify calls that carried a draft (or the calls waiting for a draft
  replica, if more), over `draft_requests_per_replica`. When the load-aware policy turns
  speculation off, the share falls to 0 and the draft pool shrinks to its minimum;
- any other deployment (the router) like Serve's default, on ongoing requests over its
  `target_ongoing_requests`.

The numbers come from the pools' `record_autoscaling_stats` (pushed every ~10 s). Each
deployment's own `autoscaling_config` still bounds it (min/max replicas) and sets the delays:
Serve applies a new size once it has been wanted for `upscale_delay_s` / `downscale_delay_s`.

    applications:
    - name: specserve
      autoscaling_policy:
        policy_function: specserve.serve.autoscaling:PoolAutoscaler
        policy_kwargs: {target_tokens_per_replica: 64, draft_requests_per_replica: 16}
"""

from __future__ import annotations

import logging
import math
from typing import Any

logger = logging.getLogger("ray.serve")

TARGET_POOLS = ("TargetPool", "CoLocatedPool")
DRAFT_POOLS = ("DraftPool",)
POLICY_FUNCTION = "specserve.serve.autoscaling:PoolAutoscaler"


def target_demand(metrics: dict[str, dict[Any, float]] | None) -> float | None:
    """Tokens in flight on the target pool: each replica's tokens per pass, scaled up by the
    calls waiting behind that pass. None when no replica reported yet."""
    metrics = metrics or {}
    tokens = metrics.get("batch_tokens", {})
    if not tokens:
        return None
    sizes, queued = metrics.get("batch_size", {}), metrics.get("queued", {})
    return float(sum(t * (1 + queued.get(r, 0.0) / max(1.0, sizes.get(r, 1.0))) for r, t in tokens.items()))


def drafting_requests(metrics: dict[str, dict[Any, float]] | None) -> float | None:
    """Requests in flight on the target pool that speculate with a draft pool."""
    metrics = metrics or {}
    requests = metrics.get("requests", {})
    if not requests:
        return None
    share = metrics.get("draft_share", {})
    return float(sum(n * share.get(r, 0.0) for r, n in requests.items()))


class PoolAutoscaler:
    """Serve instantiates it once per application (`policy_kwargs` are its arguments) and calls
    it every autoscaling tick with every autoscaled deployment's context."""

    def __init__(self, target_tokens_per_replica: float = 64.0, draft_requests_per_replica: float = 16.0):
        if target_tokens_per_replica <= 0 or draft_requests_per_replica <= 0:
            raise ValueError("target_tokens_per_replica and draft_requests_per_replica must be > 0")
        self.target_tokens_per_replica = float(target_tokens_per_replica)
        self.draft_requests_per_replica = float(draft_requests_per_replica)

    def wanted(self, contexts: dict) -> dict:
        """Replicas each deployment should have now (before delays and bounds)."""
        drafting = None
        for ctx in contexts.values():
            if ctx.deployment_name in TARGET_POOLS:
                n = drafting_requests(ctx.aggregated_metrics)
                drafting = n if drafting is None else drafting + (n or 0.0)
        wanted = {}
        for dep, ctx in contexts.items():
            if ctx.deployment_name in TARGET_POOLS:
                demand = target_demand(ctx.aggregated_metrics)
                n = None if demand is None else math.ceil(demand / self.target_tokens_per_replica)
            elif ctx.deployment_name in DRAFT_POOLS:
                # calls already waiting for a draft replica count too: a pool scaled to zero
                # while speculation was off comes back when the policy turns it on again
                waiting = math.ceil(ctx.total_num_requests / self.draft_requests_per_replica)
                if drafting is not None:
                    n = max(waiting, math.ceil(drafting / self.draft_requests_per_replica))
                else:
                    n = waiting or None  # no target replica reported yet: keep the size
            else:
                per_replica = getattr(ctx.config, "target_ongoing_requests", None) or 2.0
                n = math.ceil(ctx.total_num_requests / per_replica)
            wanted[dep] = ctx.target_num_replicas if n is None else n  # Serve applies min/max_replicas
        return wanted

    def __call__(self, contexts: dict) -> tuple[dict, dict]:
        """Desired replicas per deployment; Serve's wrapper applies each deployment's delays
        (upscale_delay_s, downscale_delay_s) and bounds (min/max_replicas) to them."""
        wanted = self.wanted(contexts)
        for dep, n in wanted.items():
            ctx = contexts[dep]
            if n != ctx.target_num_replicas:
                logger.debug("PoolAutoscaler: %s wants %d replicas (has %d; metrics %s)", ctx.deployment_name, n,
                             ctx.target_num_replicas, _summary(ctx.aggregated_metrics))
        return wanted, {}


def _summary(metrics: dict[str, dict[Any, float]] | None) -> dict[str, float]:
    return {name: round(sum(values.values()), 3) for name, values in (metrics or {}).items()}
