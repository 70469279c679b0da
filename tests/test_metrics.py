"""The router's metrics at the node's metrics export port (Prometheus text), on the shared
cluster's app: the documented names and labels appear, and the spec-decode counters add up to
the requests' `usage`."""

import time
from collections import defaultdict

import httpx
import pytest

from conftest import BASE, METRICS_PORT

pytestmark = [pytest.mark.serve, pytest.mark.slow]

APP = "specserve"


def scrape() -> dict[str, list[tuple[dict, float]]]:
    """Samples of the specserve metrics of the app: {exported sample name: [(labels, value)]}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).text
    samples = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("ray_specserve_") and sample.labels.get("application") == APP:
                samples[sample.name].append((sample.labels, sample.value))
    return samples


def totals(samples) -> dict[str, float]:
    """Counter totals (Ray exports counters with or without `_total`: both spellings read)."""
    out = defaultdict(float)
    for name, values in samples.items():
        base = name.removeprefix("ray_").removesuffix("_total")
        if name.endswith("_per_pos") or name.endswith("_per_pos_total"):
            for labels, value in values:
                out[f"{base}[{labels['position']}]"] += value
        else:
            out[base] += sum(v for _, v in values)
    return out


def settled(timeout: float = 120) -> dict[str, float]:
    """Totals once two scrapes more than a report interval apart agree (Ray pushes a worker's
    metrics every 10 s: earlier tests' rounds are exported by then)."""
    deadline = time.monotonic() + timeout
    last = totals(scrape())
    while time.monotonic() < deadline:
        time.sleep(11)
        now = totals(scrape())
        if now == last:
            return now
        last = now
    raise AssertionError("the metrics never settled")


def test_metrics_are_exported_and_counters_add_up_to_usage(app):
    from specserve.serve.metrics import METRIC_NAMES

    before = settled()
    usages = [httpx.post(f"{BASE}/v1/completions", timeout=300, json={
        "model": "smol", "prompt": prompt, "max_tokens": 16, "temperature": 0}).json()["usage"]
        for prompt in ("The capital of France is", "def add(a, b):")]
    expected = defaultdict(float)
    for u in usages:
        spec = u["speculation"]
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            expected[f"specserve_{name}"] += spec[name]
        for position, n in enumerate(spec["num_accepted_tokens_per_pos"]):
            expected[f"specserve_num_accepted_tokens_per_pos[{position}]"] += n
        expected["specserve_generation_tokens"] += u["completion_tokens"]
        expected["specserve_prompt_tokens"] += u["prompt_tokens"]
    assert expected["specserve_num_draft_tokens"] > 0

    def added() -> dict[str, float]:
        now = totals(scrape())
        return {name: now.get(name, 0) - before.get(name, 0) for name in expected}

    deadline = time.monotonic() + 90
    while added() != expected and time.monotonic() < deadline:
        time.sleep(2)
    assert added() == expected

    samples = scrape()
    exported = {name.removeprefix("ray_").removesuffix("_total") for name in samples}
    for suffix in ("_bucket", "_sum", "_count"):
        exported |= {name.removesuffix(suffix) for name in exported if name.endswith(suffix)}
    assert METRIC_NAMES <= exported, sorted(METRIC_NAMES - exported)
    pools = {labels["pool"] for labels, _ in samples["ray_specserve_pool_step_seconds_count"]}
    assert pools == {"target", "draft"}
    labels = samples["ray_specserve_time_to_first_token_seconds_count"][0][0]
    assert {"deployment", "replica", "application"} <= set(labels) and labels["deployment"] == "Router"
