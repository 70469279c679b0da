"""The Grafana dashboard for specserve's metrics, generated from code so that it queries only
what specserve.serve.metrics declares: `python -m specserve.serve.dashboard` writes
deploy/grafana/specserve.json (tests/test_dashboard.py fails when the committed file is stale).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from specserve.serve.metrics import METRICS, MetricSpec

OUTPUT = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "specserve.json"
SELECTOR = 'application=~"$application"'
WINDOW = "[$__rate_interval]"
_SPECS = {m.name: m for m in METRICS}


def exported(name: str, suffix: str = "") -> str:
    """The name Ray exports: `ray_` prefix, counters with `_total`, histograms per `suffix`
    (_bucket, _sum, _count). Refuses a name METRICS does not declare."""
    spec: MetricSpec = _SPECS[name]
    return "ray_" + name + ("_total" if spec.kind == "counter" else suffix)


def rate(name: str, by: str = "", suffix: str = "", match: str = "") -> str:
    group = f" by ({by})" if by else ""
    labels = ",".join(filter(None, (SELECTOR, match)))
    return f"sum{group}(rate({exported(name, suffix)}{{{labels}}}{WINDOW}))"


def quantile(q: float, name: str, by: str = "") -> str:
    return f"histogram_quantile({q}, {rate(name, ', '.join(filter(None, ('le', by))), '_bucket')})"


def mean(name: str, by: str = "") -> str:
    return f"{rate(name, by, '_sum')} / {rate(name, by, '_count')}"


def _quantiles(name: str, by: str = "") -> list[tuple[str, str]]:
    tag = f"{{{{{by}}}}} " if by else ""
    return [(quantile(q, name, by), f"{tag}p{round(q * 100)}") for q in (0.5, 0.9, 0.99)]


# (title, unit, [(PromQL, legend)])
PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Draft acceptance rate", "percentunit", [
        (f"{rate('specserve_num_accepted_tokens', 'proposer')} / {rate('specserve_num_draft_tokens', 'proposer')}",
         "{{proposer}}")]),
    ("Mean accepted length (tokens per drafted round)", "none", [
        (f"1 + {rate('specserve_num_accepted_tokens', 'proposer')} / {rate('specserve_num_drafts', 'proposer')}",
         "{{proposer}}")]),
    ("Acceptance per draft position", "percentunit", [
        (f"{rate('specserve_num_accepted_tokens_per_pos', 'position')} / ignoring(position) group_left "
         f"{rate('specserve_num_drafts')}", "position {{position}}")]),
    ("Draft and accepted tokens / s", "short", [
        (rate("specserve_num_draft_tokens", "proposer"), "drafted {{proposer}}"),
        (rate("specserve_num_accepted_tokens", "proposer"), "accepted {{proposer}}")]),
    ("Generated tokens / s", "short", [(rate("specserve_generation_tokens"), "generated"),
                                       (rate("specserve_prompt_tokens"), "prompt")]),
    ("Requests / s", "reqps", [(rate("specserve_requests", "finish_reason"), "{{finish_reason}}")]),
    ("Time to first token", "s", _quantiles("specserve_time_to_first_token_seconds")),
    ("Inter-token latency", "s", _quantiles("specserve_inter_token_latency_seconds")),
    ("End-to-end latency", "s", _quantiles("specserve_e2e_request_latency_seconds")),
    ("Speculation depth k (load-aware policy)", "none", [
        (mean("specserve_speculation_k", "proposer"), "mean k {{proposer}}"),
        # the le="0.5" bucket holds the rounds that drafted nothing
        (rate("specserve_speculation_k", "proposer", "_bucket", 'le="0.5"') + " / "
         + rate("specserve_speculation_k", "proposer", "_count"), "share off {{proposer}}")]),
    ("Speculation on (router replicas' last round)", "none", [
        (f"avg by (proposer) ({exported('specserve_speculation_on')}{{{SELECTOR}}})", "{{proposer}}")]),
    ("Pool batch size", "none", _quantiles("specserve_pool_batch_size", "pool")),
    ("Pool tokens per forward pass", "none", _quantiles("specserve_pool_batch_tokens", "pool")),
    ("Pool queue", "none", [(f"max by (pool) ({exported('specserve_pool_queue')}{{{SELECTOR}}})", "{{pool}}")]),
    ("Pool step time", "s", _quantiles("specserve_pool_step_seconds", "pool")),
]


def _panel(index: int, title: str, unit: str, queries: list[tuple[str, str]]) -> dict:
    return {
        "id": index + 1, "type": "timeseries", "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [{"expr": expr, "legendFormat": legend, "refId": chr(ord("A") + i)}
                    for i, (expr, legend) in enumerate(queries)],
    }


def dashboard() -> dict:
    return {
        "title": "specserve", "uid": "specserve", "schemaVersion": 39, "version": 1,
        "tags": ["specserve", "ray-serve", "speculative-decoding"],
        "time": {"from": "now-1h", "to": "now"}, "refresh": "10s",
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source"},
            {"name": "application", "type": "query", "label": "Serve application", "includeAll": True,
             "multi": True, "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": f"label_values({exported('specserve_requests')}, application)", "refresh": 2},
        ]},
        "panels": [_panel(i, *panel) for i, panel in enumerate(PANELS)],
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main() -> None:
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
