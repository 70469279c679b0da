"""The application-level autoscaling policy (specserve.serve.autoscaling), on Serve-shaped
contexts built by hand: it is a pure function of the pools' reported metrics."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from specserve.serve.autoscaling import PoolAutoscaler, drafting_requests, target_demand


def context(name, *, replicas=1, metrics=None, requests=0.0, state=None, now=1000.0, up=10.0, down=60.0):
    return SimpleNamespace(deployment_name=name, target_num_replicas=replicas, aggregated_metrics=metrics or {},
                           total_num_requests=requests, policy_state=state or {}, current_time=now,
                           config=SimpleNamespace(upscale_delay_s=up, downscale_delay_s=down,
                                                  target_ongoing_requests=2.0))


def pool_metrics(**per_replica):
    """metric -> {replica: value}, one entry per replica index."""
    return {name: dict(enumerate(values)) for name, values in per_replica.items()}


def test_target_demand_counts_tokens_per_pass_and_the_calls_waiting():
    metrics = pool_metrics(batch_tokens=[40.0, 10.0], batch_size=[8.0, 2.0], queued=[8.0, 0.0])
    assert target_demand(metrics) == 40 * 2 + 10
    assert target_demand({}) is None  # nothing reported yet


def test_drafting_requests_follow_the_share_of_calls_with_drafts():
    metrics = pool_metrics(requests=[10.0, 6.0], draft_share=[0.5, 0.0])
    assert drafting_requests(metrics) == 5.0
    assert drafting_requests({}) is None


def test_pools_scale_on_tokens_and_speculating_requests():
    scaler = PoolAutoscaler(target_tokens_per_replica=64, draft_requests_per_replica=4)
    contexts = {
        "target": context("TargetPool", metrics=pool_metrics(batch_tokens=[100.0], batch_size=[20.0],
                                                             queued=[10.0], requests=[30.0], draft_share=[0.4])),
        "draft": context("DraftPool"),
        "router": context("Router", requests=5.0),
    }
    assert scaler.wanted(contexts) == {"target": 3, "draft": 3, "router": 3}  # 150/64, 12/4, 5/2


def test_the_draft_pool_shrinks_while_speculation_is_off_and_returns_for_waiting_calls():
    scaler = PoolAutoscaler(draft_requests_per_replica=4)
    off = pool_metrics(batch_tokens=[20.0], batch_size=[20.0], queued=[0.0], requests=[20.0], draft_share=[0.0])
    contexts = {"target": context("TargetPool", metrics=off), "draft": context("DraftPool", replicas=3)}
    assert scaler.wanted(contexts)["draft"] == 0  # Serve raises it to min_replicas
    contexts["draft"] = context("DraftPool", replicas=0, requests=2.0)  # speculation is back: calls wait
    assert scaler.wanted(contexts)["draft"] == 1


def test_a_pool_that_reported_nothing_keeps_its_size():
    scaler = PoolAutoscaler()
    contexts = {"target": context("TargetPool", replicas=2), "draft": context("DraftPool", replicas=1)}
    assert scaler.wanted(contexts) == {"target": 2, "draft": 1}


def test_the_policy_returns_what_each_deployment_wants_and_leaves_delays_to_serve():
    scaler = PoolAutoscaler(target_tokens_per_replica=4)
    busy = pool_metrics(batch_tokens=[6.0], batch_size=[6.0], queued=[2.0], requests=[8.0], draft_share=[0.0])
    decisions, state = scaler({"target": context("TargetPool", metrics=busy)})
    assert decisions == {"target": 2} and state == {}


def test_the_autoscaler_refuses_nonsense_arguments():
    with pytest.raises(ValueError, match="must be > 0"):
        PoolAutoscaler(target_tokens_per_replica=0)
