"""The Grafana dashboard is current and queries only declared metrics; the router's metric
recording, with fake metric objects (no Ray), adds up to the requests' SpecStats."""

import json
import re
from collections import Counter

from specserve.serve.dashboard import OUTPUT, dashboard, render
from specserve.serve.metrics import METRICS, RouterMetrics, SpecCounts

KINDS = {m.name: m.kind for m in METRICS}
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def test_the_committed_dashboard_is_current_and_valid():
    assert OUTPUT.read_text() == render(), "stale: run python -m specserve.serve.dashboard"
    board = json.loads(OUTPUT.read_text())
    assert board["panels"] and all(p["targets"] for p in board["panels"])
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])


def test_every_queried_metric_is_declared_with_its_kinds_suffix():
    exprs = [t["expr"] for p in dashboard()["panels"] for t in p["targets"]]
    queried = {name for expr in exprs for name in re.findall(r"ray_(specserve_\w+)", expr)}
    assert queried
    for exported in queried:
        declared = [m for m in KINDS if any(exported == m + s for s in SUFFIXES[KINDS[m]])]
        assert declared, f"{exported} is not a declared metric (specserve.serve.metrics.METRICS)"
    used = {m for m in KINDS for e in queried if any(e == m + s for s in SUFFIXES[KINDS[m]])}
    assert used == set(KINDS), f"declared but not on the dashboard: {sorted(set(KINDS) - used)}"


class FakeMetric:
    def __init__(self, spec):
        self.values = Counter()
        self.observed = []

    def inc(self, value=1, tags=None):
        self.values[tuple(sorted((tags or {}).items()))] += value

    def set(self, value, tags=None):
        self.values[tuple(sorted((tags or {}).items()))] = value

    def observe(self, value, tags=None):
        self.observed.append(value)


def test_recorded_rounds_add_up_to_the_request_stats():
    from specserve.request_state import SpecStats

    metrics = RouterMetrics(make=FakeMetric)
    stats = SpecStats()
    # rounds as RequestState.commit counts them: (drafted depth, accepted)
    for depth, accepted in [(3, 2), (0, 0), (3, 3), (2, 0)]:
        before = SpecCounts.of(stats)
        stats.k_histogram += [0] * (depth + 1 - len(stats.k_histogram))
        stats.k_histogram[depth] += 1
        if depth:
            stats.num_drafts += 1
            stats.num_draft_tokens += depth
            stats.num_accepted_tokens += accepted
            per_pos = stats.num_accepted_tokens_per_pos
            per_pos += [0] * (depth - len(per_pos))
            for i in range(accepted):
                per_pos[i] += 1
        metrics.round("draft", before, SpecCounts.of(stats))
    m = metrics.m
    assert sum(m["specserve_num_drafts"].values.values()) == stats.num_drafts == 3
    assert sum(m["specserve_num_draft_tokens"].values.values()) == stats.num_draft_tokens == 8
    assert sum(m["specserve_num_accepted_tokens"].values.values()) == stats.num_accepted_tokens == 5
    per_pos = {dict(k)["position"]: v for k, v in m["specserve_num_accepted_tokens_per_pos"].values.items()}
    assert per_pos == {"0": 2, "1": 2, "2": 1} and list(stats.num_accepted_tokens_per_pos) == [2, 2, 1]
    assert m["specserve_speculation_k"].observed == [3, 0, 3, 2]
    assert m["specserve_speculation_on"].values[(("proposer", "draft"),)] == 1
