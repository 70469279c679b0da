"""gRPC against HTTP: the transports' overhead per token, and the metrics' cost per round.

`python -m specserve.benchmarks.transport [--streams 1 8] [--rounds 2] [--out DIR]`

One `serve run` serves one app on both proxies (HTTP SSE on --port, gRPC on 9000). The same
greedy requests go through HTTP streaming completions and gRPC `GenerateStream`, taking turns
(A B, then B A) at each concurrency level, so both see the same machine state. Per stream,
inter-token time = (end - first token) / (tokens - 1); the overhead per token is gRPC's minus
HTTP's. The default app is SmolLM2-135M target-only: every token is its own round, so the
transport's share of a token is as large as it gets on this machine.

The metrics' cost per round is measured apart, in a Ray task with the real `ray.serve.metrics`
objects: the router's per-round calls (`round`, two `pool_load`s, one `emitted`) timed over many
rounds, against the same calls on no-op metrics.

Writes results.json and results.md into --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

from specserve import models
from specserve.benchmarks.http import StreamResult, run_level, start_server, stop_server, wait_healthy
from specserve.benchmarks.service import serve_config
from specserve.benchmarks.workloads import humaneval

PORT = 8012
APPLICATION = "specserve-bench"


async def grpc_stream(client, prompt: str, max_tokens: int) -> StreamResult:
    """One greedy GenerateStream, timed like the HTTP client's `stream_completion`."""
    result = StreamResult()
    started = time.perf_counter()
    async for delta in client.generate_stream("bench", prompt, max_tokens=max_tokens, temperature=0,
                                              speculation={"proposer": "none"}):
        if delta.text:
            result.chunk_times.append(time.perf_counter() - started)
            if not result.text:
                result.ttft_s = result.chunk_times[0]
            result.text += delta.text
        if delta.HasField("usage"):
            result.tokens = delta.usage.completion_tokens
    result.seconds = time.perf_counter() - started
    return result


async def grpc_level(target: str, prompts: list[str], max_tokens: int, streams: int) -> tuple[float, list[StreamResult]]:
    from specserve.client import AsyncClient

    queue = list(enumerate(prompts))
    results: list[StreamResult] = [None] * len(prompts)  # type: ignore[list-item]
    async with AsyncClient(target, application=APPLICATION) as client:
        async def worker():
            while queue:
                index, prompt = queue.pop(0)
                results[index] = await grpc_stream(client, prompt, max_tokens)

        started = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(streams)])
        return time.perf_counter() - started, results


def inter_token_s(results: list[StreamResult]) -> float:
    """Mean seconds between a stream's tokens after its first."""
    per_stream = [(r.seconds - r.ttft_s) / (r.tokens - 1) for r in results if r.tokens > 1]
    return statistics.mean(per_stream)


def summarize(wall_s: float, results: list[StreamResult]) -> dict:
    tokens = sum(r.tokens for r in results)
    return {"wall_s": wall_s, "tokens": tokens, "tok_s": tokens / wall_s, "inter_token_ms": 1e3 * inter_token_s(results),
            "ttft_ms": 1e3 * statistics.mean(r.ttft_s for r in results)}


def transports_run(prompts: list[str], *, http_url: str, grpc_target: str, streams: list[int], rounds: int,
                   max_tokens: int) -> list[dict]:
    """Every level, each transport `rounds` times in A B / B A order; the texts must agree."""
    run = {
        "http": lambda n: asyncio.run(run_level(http_url, "bench", prompts, max_tokens, n, None,
                                                speculation={"proposer": "none"})),
        "grpc": lambda n: asyncio.run(grpc_level(grpc_target, prompts, max_tokens, n)),
    }
    rows = []
    for n in streams:
        texts = {}
        for r in range(rounds):
            for transport in (("http", "grpc") if r % 2 == 0 else ("grpc", "http")):
                wall_s, results = run[transport](n)
                texts.setdefault(transport, [res.text for res in results])
                row = {"streams": n, "round": r, "transport": transport, **summarize(wall_s, results)}
                rows.append(row)
                print(f"{n:>2} streams  {transport:<4}  {row['tok_s']:7.2f} tok/s  inter-token "
                      f"{row['inter_token_ms']:7.2f} ms  TTFT {row['ttft_ms']:7.1f} ms", flush=True)
        if texts["http"] != texts["grpc"]:
            raise RuntimeError(f"{n} streams: gRPC and HTTP returned different greedy texts")
    return rows


def overhead(rows: list[dict]) -> list[dict]:
    """Per level: mean inter-token ms and tok/s per transport, gRPC minus HTTP, and the ratio."""
    out = []
    for n in sorted({r["streams"] for r in rows}):
        mean = {t: {key: statistics.mean(r[key] for r in rows if r["streams"] == n and r["transport"] == t)
                    for key in ("inter_token_ms", "tok_s", "ttft_ms")} for t in ("http", "grpc")}
        out.append({"streams": n, "http": mean["http"], "grpc": mean["grpc"],
                    "grpc_minus_http_ms_per_token": mean["grpc"]["inter_token_ms"] - mean["http"]["inter_token_ms"],
                    "grpc_over_http_tok_s": mean["grpc"]["tok_s"] / mean["http"]["tok_s"]})
    return out


def _time_rounds(rounds: int) -> dict:
    """Seconds per round of the router's metric calls, real ray.serve.metrics against no-ops."""
    from types import SimpleNamespace

    from specserve.serve.metrics import RouterMetrics, SpecCounts

    class NoOp:
        def __init__(self, *a, **kw):
            pass

        def inc(self, *a, **kw):
            pass

        observe = set = inc

    load = SimpleNamespace(batch_size=4, batch_tokens=20, queued=1, step_s=0.02)
    # A round of depth 4 with 3 accepted: the busiest kind of round (every counter moves).
    before = SpecCounts(10, 40, 30, (10, 9, 7, 4), (0, 0, 0, 0, 10))
    after = SpecCounts(11, 44, 33, (11, 10, 8, 4), (0, 0, 0, 0, 11))
    timings = {}
    for name, make in (("ray.serve.metrics", None), ("no-op", NoOp)):
        metrics = RouterMetrics() if make is None else RouterMetrics(make)
        timer = metrics.timer()
        for _ in range(2):  # warm-up pass, then the timed one
            started = time.perf_counter()
            for _ in range(rounds):
                metrics.round("draft", before, after)
                metrics.pool_load("draft", load)
                metrics.pool_load("target", load)
                timer.emitted(4, False)
            seconds = time.perf_counter() - started
        timings[name] = seconds / rounds
    return timings


def metrics_cost(rounds: int) -> dict:
    """`_time_rounds` in a Ray task (where ray.serve.metrics records into Ray's exporter)."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a throwaway local cluster
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        timings = ray.get(ray.remote(_time_rounds).remote(rounds))
    finally:
        ray.shutdown()
    return {"rounds": rounds, "us_per_round": 1e6 * timings["ray.serve.metrics"],
            "no_op_us_per_round": 1e6 * timings["no-op"],
            "cost_us_per_round": 1e6 * (timings["ray.serve.metrics"] - timings["no-op"])}


def report_md(levels: list[dict], cost: dict | None, config: dict) -> str:
    lines = [f"# gRPC against HTTP, {config['target']} ({config['dtype']}), target-only, "
             f"{config['requests']} HumanEval prompts x {config['max_tokens']} tokens, greedy",
             "", "`" + config["command"] + "`", "",
             "| streams | HTTP tok/s | gRPC tok/s | gRPC/HTTP | HTTP inter-token ms | gRPC inter-token ms | "
             "gRPC - HTTP ms/token | HTTP TTFT ms | gRPC TTFT ms |", "|---|---|---|---|---|---|---|---|---|"]
    for lv in levels:
        h, g = lv["http"], lv["grpc"]
        lines.append(f"| {lv['streams']} | {h['tok_s']:.2f} | {g['tok_s']:.2f} | {lv['grpc_over_http_tok_s']:.3f}x | "
                     f"{h['inter_token_ms']:.2f} | {g['inter_token_ms']:.2f} | "
                     f"{lv['grpc_minus_http_ms_per_token']:+.2f} | {h['ttft_ms']:.1f} | {g['ttft_ms']:.1f} |")
    if cost:
        lines += ["", f"Metrics per round (round + 2 pool loads + 1 emitted, {cost['rounds']} rounds in a Ray task): "
                  f"{cost['us_per_round']:.1f} us with ray.serve.metrics, {cost['no_op_us_per_round']:.1f} us on "
                  f"no-ops: **{cost['cost_us_per_round']:.1f} us per round**."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--requests", type=int, default=16, help="prompts per level and transport")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="turns of each transport per level (A B, B A, ...)")
    parser.add_argument("--metric-rounds", type=int, default=20000, help="0 skips the metrics' cost")
    parser.add_argument("--out", default="bench-results/transport")
    args = parser.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    argv = sys.argv[1:] if argv is None else argv
    config = {**vars(args), "command": " ".join(["python -m specserve.benchmarks.transport", *argv])}
    cost = metrics_cost(args.metric_rounds) if args.metric_rounds else None
    if cost:
        print(f"metrics: {cost['cost_us_per_round']:.1f} us per round", flush=True)

    models.pull(args.target)
    serve = serve_config(args.target, None, args.dtype, PORT)
    grpc_port = serve["grpc_options"]["port"]
    prompts = [p.text for p in humaneval(args.requests).prompts]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(serve, f)
    server = start_server(f.name, str(out / "serve.log"))
    try:
        wait_healthy(f"http://127.0.0.1:{PORT}", 600, server)
        rows = transports_run(prompts, http_url=f"http://127.0.0.1:{PORT}", grpc_target=f"127.0.0.1:{grpc_port}",
                              streams=args.streams, rounds=args.rounds, max_tokens=args.max_tokens)
    finally:
        stop_server(server)
    levels = overhead(rows)
    (out / "results.json").write_text(json.dumps({"config": config, "rows": rows, "levels": levels,
                                                  "metrics_cost": cost}, indent=1))
    md = report_md(levels, cost, config)
    (out / "results.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
