"""Calls between replicas: Ray Serve's throughput-optimized mode (`fast_replica_calls`) on and off.

`python -m specserve.benchmarks.replica_calls [--passes 4] [--out DIR]`
`python -m specserve.benchmarks.replica_calls --bare [--calls 300]`

Every round makes one or two pool calls (propose, verify), so their cost is paid per round. One
`serve run` per pass, the setting alternating (on off off on ...): SmolLM2-135M as target and
draft pool, k = 4 fixed, one stream, 8 prompts x 64 tokens, greedy, EOS ignored. Per pass:
tokens/s and the median of the router's own measure of a round's time outside the pools'
compute (`usage.speculation.round_trip_overhead_ms_per_round`); the greedy texts of every pass
must agree. A small model keeps the pools' compute short, so the calls' share of a round is as
large as it gets on this machine.

Writes results.json and results.md into --out.

`--bare` times the call alone: one caller replica awaiting an echo replica's answer (300 ints
in, the same out), in one Ray session, three apps taking turns (A B C C B A): Serve's defaults;
the throughput-optimized mode as the builder sets it but the handle as it came (by reference);
and the mode with the handle the router uses (`pool_handle`: over gRPC). A plain Ray actor call
from the same caller is the floor. Prints the median and p90 milliseconds of each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import yaml

from specserve.benchmarks.http import run_level, start_server, stop_server, wait_healthy
from specserve.serve import FAST_REPLICA_CALLS_ENV

PORT = 8013
MODEL = "smollm2-135m-instruct"
PROMPTS = ("def fibonacci(n):", "import numpy as np\n", "class LRUCache:", "SELECT name, COUNT(*) FROM orders",
           "def merge_sorted(a, b):", "The quick brown fox", "for i in range(10):", "async def main():")


def config(fast: bool, port: int = PORT) -> dict:
    """The Serve config of one pass."""
    def pool() -> dict:
        return {"model": MODEL, "dtype": "float32", "torch_threads": 1, "num_replicas": 1,
                "ray_actor_options": {"num_cpus": 0.5}}

    args = {"model_name": "bench", "target": pool(), "draft": pool(), "fast_replica_calls": fast,
            "speculation": {"proposer": "draft", "shape": "chain", "k": 4, "policy": "fixed"}}
    return {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": port},
            "applications": [{"name": "replica-calls", "route_prefix": "/", "import_path": "specserve.serve:build_app",
                              "args": args}]}


def wait_port_free(port: int, timeout_s: float = 120.0) -> None:
    """Until nothing answers on `port`: a stopped `serve run`'s proxy can outlive it for a while,
    and the next pass's health check would find it (and its requests fail as it goes)."""
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) != 0:
                return
        time.sleep(1)
    raise RuntimeError(f"port {port} still answers {timeout_s:.0f} s after the server stopped")


def one_pass(fast: bool, work: Path, max_tokens: int) -> dict:
    manifest = work / f"replica-calls-{'on' if fast else 'off'}.yaml"
    manifest.write_text(yaml.safe_dump(config(fast), sort_keys=False))
    server = start_server(str(manifest), str(work / "serve.log"))
    url = f"http://127.0.0.1:{PORT}"
    try:
        wait_healthy(url, 600, server)
        asyncio.run(run_level(url, "bench", ["warm up"], 8, 1, None, extra={"ignore_eos": True}))
        wall, results = asyncio.run(run_level(url, "bench", list(PROMPTS), max_tokens, 1, None,
                                              extra={"ignore_eos": True}))
    finally:
        stop_server(server)
        wait_port_free(PORT)
    tokens = sum(r.tokens for r in results)
    return {"fast_replica_calls": fast, "tok_s": tokens / wall,
            "overhead_ms_per_round": statistics.median(r.speculation["round_trip_overhead_ms_per_round"]
                                                       for r in results),
            "texts": [r.text for r in results]}


def markdown(rows: list[dict]) -> str:
    lines = ["| pass | fast_replica_calls | tok/s | router's ms per round outside pool compute (median) |",
             "|---|---|---|---|"]
    lines += [f"| {i} | {'on' if r['fast_replica_calls'] else 'off'} | {r['tok_s']:.2f} | {r['overhead_ms_per_round']:.1f} |"
              for i, r in enumerate(rows)]
    for fast in (True, False):
        mine = [r for r in rows if r["fast_replica_calls"] == fast]
        if mine:
            lines.append(f"\n{'on' if fast else 'off'}: mean {statistics.mean(r['tok_s'] for r in mine):.2f} tok/s, "
                         f"{statistics.mean(r['overhead_ms_per_round'] for r in mine):.1f} ms per round outside "
                         "pool compute")
    return "\n".join(lines) + "\n"


BARE_SETTINGS = {  # name -> (the replicas' env, the router's handle over gRPC)
    "Serve defaults": ({}, False),
    "throughput mode, handle by reference": (FAST_REPLICA_CALLS_ENV, False),
    "throughput mode, handle over gRPC (as built)": (FAST_REPLICA_CALLS_ENV, True),
}


def bare_calls(calls: int) -> dict[str, dict[str, float]]:
    """Median and p90 ms of one call between two replicas per BARE_SETTINGS, and of a plain Ray
    actor call (see the module's doc)."""
    import ray
    from ray import serve

    from specserve.serve.router import pool_handle

    @ray.remote(num_cpus=0)
    class PlainEcho:
        async def echo(self, x):
            return x

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Echo:
        async def echo(self, x):
            return x

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class CallTimer:
        def __init__(self, pool, over_grpc: bool):
            self.pool = pool_handle(pool, over_grpc)
            self.plain = PlainEcho.remote()

        async def time(self, n: int, plain: bool) -> list[float]:
            payload, seconds = list(range(300)), []
            for _ in range(n):
                started = time.perf_counter()
                await (self.plain.echo.remote(payload) if plain else self.pool.echo.remote(payload))
                seconds.append(time.perf_counter() - started)
            return seconds

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        timers = {}
        for i, (name, (env, over_grpc)) in enumerate(BARE_SETTINGS.items()):
            options = {"ray_actor_options": {"num_cpus": 0, "runtime_env": {"env_vars": env}}}
            timers[name] = serve.run(CallTimer.options(**options).bind(Echo.options(**options).bind(), over_grpc),
                                     name=f"calls-{i}", route_prefix=None)
        for timer in timers.values():
            timer.time.remote(30, False).result()  # warm up
        order = [*timers, *reversed(timers)]  # A B C C B A
        seconds: dict[str, list[float]] = {name: [] for name in [*timers, "plain Ray actor call"]}
        for name in order:
            print(f"{name}: {calls} calls", flush=True)
            seconds[name] += timers[name].time.remote(calls, False).result()
        seconds["plain Ray actor call"] = timers[order[0]].time.remote(2 * calls, True).result()
    finally:
        serve.shutdown()
        ray.shutdown()
    return {name: {"median_ms": round(1000 * statistics.median(v), 2),
                   "p90_ms": round(1000 * statistics.quantiles(v, n=10)[-1], 2)} for name, v in seconds.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--passes", type=int, default=4, help="serve runs, alternating on off off on ...")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default="bench-results/replica-calls")
    parser.add_argument("--bare", action="store_true", help="time bare calls between replicas instead")
    parser.add_argument("--calls", type=int, default=300, help="with --bare: calls per setting per turn")
    args = parser.parse_args(argv)
    if args.bare:
        rows = bare_calls(args.calls)
        print("| setting | median ms | p90 ms |\n|---|---|---|")
        for name, row in rows.items():
            print(f"| {name} | {row['median_ms']:.2f} | {row['p90_ms']:.2f} |")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    order = [p % 4 in (0, 3) for p in range(args.passes)]  # on off off on on off off on ...
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for p, fast in enumerate(order):
            row = one_pass(fast, Path(work), args.max_tokens)
            rows.append(row)
            print(f"pass {p} fast_replica_calls={'on' if fast else 'off'}: {row['tok_s']:.2f} tok/s, "
                  f"{row['overhead_ms_per_round']:.1f} ms per round outside pool compute", flush=True)
    if any(r["texts"] != rows[0]["texts"] for r in rows):
        raise RuntimeError("the passes returned different greedy texts")
    (out / "results.json").write_text(json.dumps([{k: v for k, v in r.items() if k != "texts"} for r in rows],
                                                 indent=1))
    (out / "results.md").write_text(markdown(rows))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
