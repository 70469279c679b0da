"""Service throughput at concurrency with and without joining due calls into a pass.

`python -m specserve.benchmarks.join [--streams 4] [--rounds 2] [--out DIR]`

Two copies of the benchmark app run side by side in one `serve run` (same models, same
machine, so the comparison is in one run): one with the pools' `batch_join_fraction` at its
default, one with it at 0 (every pass takes only what is queued). They take turns (A B A B),
each serving the same prompts over the same number of streams, target-only and with the draft
chain. Prints tok/s and calls per forward pass of each; writes results.json into --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import yaml

from specserve import models
from specserve.benchmarks.http import run_level, start_server, stop_server, wait_healthy
from specserve.benchmarks.service import serve_config
from specserve.benchmarks.workloads import humaneval
from specserve.serve.config import PoolArgs

PORT = 8011
SETTINGS = {"join": PoolArgs.model_fields["batch_join_fraction"].default, "split": 0.0}
METHODS = {"none": {"proposer": "none"}, "draft k=4": {"proposer": "draft", "k": 4, "policy": "fixed"}}


def two_apps_config(target: str, draft: str, dtype: str) -> dict:
    """Both settings as apps of one Serve instance; fractional CPUs so both fit on 2 cores
    (only one app is busy at a time)."""
    config = serve_config(target, draft, dtype, PORT)
    base = config["applications"][0]
    apps = []
    for name, fraction in SETTINGS.items():
        args = json.loads(json.dumps(base["args"]))
        for pool in ("target", "draft"):
            args[pool]["batch_join_fraction"] = fraction
            args[pool]["ray_actor_options"] = {"num_cpus": 0.3}
        args["router"]["ray_actor_options"] = {"num_cpus": 0.05}
        apps.append({**base, "name": f"join-{name}", "route_prefix": f"/{name}", "args": args})
    config["applications"] = apps
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="passes of A B over every method")
    parser.add_argument("--out", default="bench-results/join")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = out / "serve-config.yaml"
    manifest.write_text(yaml.safe_dump(two_apps_config(args.target, args.draft, args.dtype)))

    tokenizer = models.load_tokenizer(args.target)
    prompts = humaneval(args.requests).encode(tokenizer)
    server = start_server(str(manifest), str(out / "serve.log"))
    results = []
    try:
        urls = {name: f"http://127.0.0.1:{PORT}/{name}" for name in SETTINGS}
        for url in urls.values():
            wait_healthy(url, 900, server)
        for url in urls.values():  # warm-up
            asyncio.run(run_level(url, "bench", prompts[:1], 4, 1, None, speculation=METHODS["none"]))
        for round_ in range(args.rounds):
            for method, spec in METHODS.items():
                order = list(urls.items()) if round_ % 2 == 0 else list(urls.items())[::-1]
                for name, url in order:
                    seconds, streams = asyncio.run(run_level(url, "bench", prompts, args.max_tokens, args.streams,
                                                             None, speculation=spec))
                    tokens = sum(s.tokens for s in streams)
                    row = {"setting": name, "method": method, "round": round_, "tokens": tokens,
                           "seconds": round(seconds, 3), "tok_s": round(tokens / seconds, 2)}
                    results.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        stop_server(server)
    summary = {}
    for method in METHODS:
        for name in SETTINGS:
            rows = [r for r in results if r["method"] == method and r["setting"] == name]
            summary[f"{method} / {name}"] = round(sum(r["tokens"] for r in rows) / sum(r["seconds"] for r in rows), 2)
    for method in METHODS:
        ratio = summary[f"{method} / join"] / summary[f"{method} / split"]
        print(f"{method:>10}: join {summary[f'{method} / join']:.2f} tok/s, split {summary[f'{method} / split']:.2f} "
              f"tok/s -> {ratio:.2f}x ({args.streams} streams)")
    (out / "results.json").write_text(json.dumps({"command": "python -m specserve.benchmarks.join",
                                                  "args": vars(args), "runs": results, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
