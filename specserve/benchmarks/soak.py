"""Soak: hold N streams for a long time and watch memory and the pools' caches.

    python -m specserve.benchmarks.soak --minutes 30 --streams 8                  # the default CPU app
    python -m specserve.benchmarks.soak --minutes 3 --streams 8 --preset smol     # quick, SmolLM2
    python -m specserve.benchmarks.soak --address HOST:6379 --url http://HOST:8000 --app specserve

Starts its own local Ray cluster (HTTP on --port, never the default) and deploys the app of
manifests/local.yaml (`--preset default`: Qwen2.5-Coder 1.5B target, 0.5B draft) or a SmolLM2
pair (`--preset smol`); or drives an app already running on a cluster it connects to. Each of
--streams clients sends greedy streaming completions back to back until the time is up. Every
--sample-s seconds it records each replica's resident memory (measured inside the replica's
process) and the requests holding a cache in each pool. At the end it waits for the pools to
drop every cache and reports what is left (goal: 0).

Writes soak.json, soak.md and soak.png (memory over time) into --out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specserve.benchmarks import reliability as rel

PROMPTS = ["Write a Python function that checks whether a number is prime.",
           "Explain what a hash map is in two sentences.", "def fibonacci(n):",
           "List five uses of a binary search tree.", "Write a haiku about autumn.",
           "class Stack:\n    def __init__(self):", "What is the difference between a list and a tuple?",
           "Translate 'good morning' into French, Spanish and German."]


@dataclass
class Load:
    completed: int = 0
    failed: int = 0
    tokens: int = 0
    errors: list[str] = field(default_factory=list)


@dataclass
class Sample:
    t_s: float
    rss_mb: dict[str, float]  # "Deployment replica-id" -> resident memory
    cached: dict[str, int]  # pool -> requests holding a cache, all replicas


def sample(app: str, started: float) -> Sample:
    rss, cached = {}, {}
    for deployment, replicas in rel.replicas(app).items():
        for replica in replicas:
            with contextlib.suppress(Exception):  # a replica that just died
                rss[f"{deployment} {replica.replica_id}"] = round(rel.replica_rss(replica)[1] / 2 ** 20, 1)
        if deployment in rel.POOLS:
            with contextlib.suppress(Exception):
                cached[deployment] = sum(rel.cached_requests(app, deployment).values())
    return Sample(round(time.monotonic() - started, 1), rss, cached)


def sampler(app: str, started: float, every_s: float, stop: threading.Event, out: list[Sample]) -> None:
    while not stop.is_set():
        out.append(sample(app, started))
        stop.wait(every_s)


async def hold_streams(url: str, model: str, streams: int, max_tokens: int, until: float) -> Load:
    import httpx

    load = Load()

    async def client(i: int):
        n = i
        while time.monotonic() < until:
            body = {"model": model, "prompt": PROMPTS[n % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0,
                    "stream_options": {"include_usage": True}}
            outcome = await rel.stream_completion(http, url, body, timeout_s=600)
            if outcome.completed:
                load.completed += 1
                load.tokens += outcome.tokens
            else:
                load.failed += 1
                load.errors.append(outcome.error or "ended without [DONE]")
            n += streams

    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=30),
                                 limits=httpx.Limits(max_connections=streams * 2)) as http:
        await asyncio.gather(*[client(i) for i in range(streams)])
    return load


def slope_mb_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MB) in MB per minute."""
    if len(points) < 3:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mm = sum(m for _, m in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return None
    return round(60 * sum((t - mt) * (m - mm) for t, m in points) / var, 3)


def memory_summary(samples: list[Sample], warmup_s: float) -> dict[str, dict]:
    """Per replica: memory at the first and last sample, and its slope after the warm-up
    (model loading and the first passes' allocations are not a leak)."""
    series: dict[str, list[tuple[float, float]]] = {}
    for s in samples:
        for name, mb in s.rss_mb.items():
            series.setdefault(name, []).append((s.t_s, mb))
    out = {}
    for name, points in series.items():
        steady = [p for p in points if p[0] >= warmup_s] or points
        out[name] = {"start_mb": points[0][1], "end_mb": points[-1][1], "steady_start_mb": steady[0][1],
                     "slope_mb_per_min": slope_mb_per_min(steady), "samples": len(points)}
    return out


def plot(samples: list[Sample], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, caches) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, height_ratios=[3, 1])
    names = sorted({name for s in samples for name in s.rss_mb})
    for name in names:
        points = [(s.t_s / 60, s.rss_mb[name]) for s in samples if name in s.rss_mb]
        mem.plot([p[0] for p in points], [p[1] for p in points], label=name.split(" ")[0] + " " + name.split(" ")[1][:6])
    mem.set_ylabel("resident memory (MB)")
    mem.set_title(title)
    mem.legend(fontsize=7, loc="upper left")
    mem.grid(alpha=0.3)
    for pool in sorted({p for s in samples for p in s.cached}):
        caches.plot([s.t_s / 60 for s in samples], [s.cached.get(pool, 0) for s in samples], label=pool)
    caches.set_ylabel("cached requests")
    caches.set_xlabel("minutes")
    caches.legend(fontsize=7)
    caches.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(report: dict) -> str:
    load, config = report["load"], report["config"]
    lines = ["# Soak", "", f"`{config['command']}`: {config['streams']} streams held for {config['minutes']} min "
             f"({config['preset']}), greedy completions of up to {config['max_tokens']} tokens, memory sampled every "
             f"{config['sample_s']} s.", "",
             f"- requests completed: {load['completed']}, failed: {load['failed']}",
             f"- tokens generated: {load['tokens']} ({report['tokens_per_s']:.1f} tok/s)",
             f"- cached requests left in the pools at the end: {report['leaked_caches']} (goal 0)", "",
             "| replica | memory at start (MB) | after warm-up (MB) | at end (MB) | slope after warm-up (MB/min) |",
             "|---|---|---|---|---|"]
    for name, m in sorted(report["memory"].items()):
        lines.append(f"| {name} | {m['start_mb']} | {m['steady_start_mb']} | {m['end_mb']} | {m['slope_mb_per_min']} |")
    if load["errors"]:
        lines += ["", "Errors:", ""] + [f"- `{e[:160]}`" for e in sorted(set(load["errors"]))[:10]]
    lines += ["", "![memory over time](soak.png)"]
    return "\n".join(lines) + "\n"


def app_args(preset: str, manifest: str) -> tuple[dict, str]:
    """The app's build args and the model name it serves."""
    if preset == "smol":
        return rel.smol_app_args("smol", target_replicas=1, router_replicas=1, pool_cpus=1), "smol"
    import yaml

    from specserve.serve.config import AppArgs

    with open(manifest) as f:
        args = yaml.safe_load(f)["applications"][0]["args"]
    return args, AppArgs.model_validate(args).served_name


def run(args) -> dict:
    if args.address:
        cluster, url, app, model = rel.connected(args.address), args.url, args.app, args.served_name
        args_for_app = None
    else:
        args_for_app, model = app_args(args.preset, args.manifest)
        cluster, url, app = rel.local_cluster(args.port, args.port + 1000, num_cpus=4), f"http://127.0.0.1:{args.port}", "soak"
    samples: list[Sample] = []
    with cluster:
        if args_for_app is not None:
            rel.deploy(args_for_app, app, "/")
        started = time.monotonic()
        stop = threading.Event()
        watcher = threading.Thread(target=sampler, args=(app, started, args.sample_s, stop, samples), daemon=True)
        watcher.start()
        load = asyncio.run(hold_streams(url, model, args.streams, args.max_tokens, started + args.minutes * 60))
        seconds = time.monotonic() - started
        stop.set()
        watcher.join(timeout=120)
        rel.wait_until(lambda: rel.total_cached_requests(app) == 0, 60, 1.0)
        final = sample(app, started)
        samples.append(final)
    command = " ".join(sys.argv[1:])
    return {"config": {"command": f"python -m specserve.benchmarks.soak {command}".strip(), "streams": args.streams,
                       "minutes": args.minutes, "preset": "connected" if args.address else args.preset,
                       "max_tokens": args.max_tokens, "sample_s": args.sample_s},
            "load": asdict(load), "seconds": round(seconds, 1), "tokens_per_s": load.tokens / seconds,
            "leaked_caches": sum(final.cached.values()),
            "memory": memory_summary(samples, warmup_s=min(120.0, args.minutes * 60 / 4)),
            "samples": [asdict(s) for s in samples]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--preset", choices=["default", "smol"], default="default",
                        help="default: manifests/local.yaml's app (Qwen pair); smol: SmolLM2 target and draft")
    parser.add_argument("--manifest", default="manifests/local.yaml")
    parser.add_argument("--sample-s", type=float, default=10)
    parser.add_argument("--port", type=int, default=8995, help="HTTP port of the local cluster (gRPC: +1000)")
    parser.add_argument("--address", help="drive an app on this running cluster instead of starting one")
    parser.add_argument("--url", help="the app's HTTP base URL (with --address)")
    parser.add_argument("--app", default="specserve", help="the app's name (with --address)")
    parser.add_argument("--served-name", help="the model name it serves (with --address)")
    parser.add_argument("--out", default="bench-results/soak")
    args = parser.parse_args(argv)
    if args.address and not (args.url and args.served_name):
        parser.error("--address needs --url and --served-name")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = run(args)
    (out / "soak.json").write_text(json.dumps(report, indent=1))
    plot([Sample(**s) for s in report["samples"]], out / "soak.png",
         f"{report['config']['streams']} streams, {report['config']['minutes']} min ({report['config']['preset']})")
    (out / "soak.md").write_text(markdown(report))
    print((out / "soak.md").read_text())
    return 1 if report["leaked_caches"] or report["load"]["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
