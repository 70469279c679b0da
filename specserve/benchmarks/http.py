"""Service-mode benchmark: specserve served by Ray Serve, measured through its HTTP API.

    python -m specserve.benchmarks.http --manifest manifests/local.yaml --concurrency 1 4

Starts `serve run MANIFEST` (or uses a running server with --url), then streams greedy
completions of HumanEval prompts at each concurrency, speculation on (the deployment's own:
a draft pool's, or Medusa heads' with manifests/local-medusa.yaml) and off
(`"speculation": {"proposer": "none"}` per request) in the same run. Prints aggregate
tokens/s, time to first token, the mean accepted length, and the router <-> pool round-trip
overhead per round (wall time of the pool calls minus the pools' own compute time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

from specserve.benchmarks.engine import humaneval_prompts


@dataclass
class StreamResult:
    text: str = ""
    tokens: int = 0
    ttft_s: float = 0.0
    seconds: float = 0.0
    speculation: dict = field(default_factory=dict)
    chunk_times: list[float] = field(default_factory=list)  # arrival of each text chunk, s after the request


async def stream_completion(http, url: str, model: str, prompt: str | list[int], max_tokens: int, method: str | None,
                            *, speculation: dict | None = None) -> StreamResult:
    """Stream one greedy completion. ``speculation`` (e.g. {"method": "draft", "k": 4}) overrides ``method``."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if speculation is not None:
        body["speculation"] = speculation
    elif method is not None:
        body["speculation"] = {"method": method}
    result = StreamResult()
    started = time.perf_counter()
    async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {await response.aread()!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):  # reported in-band once the stream has started
                raise RuntimeError(f"stream error: {chunk['error'].get('message', chunk['error'])}")
            if chunk.get("choices") and chunk["choices"][0]["text"]:
                result.chunk_times.append(time.perf_counter() - started)
                if not result.text:
                    result.ttft_s = result.chunk_times[0]
                result.text += chunk["choices"][0]["text"]
            if chunk.get("usage"):
                result.tokens = chunk["usage"]["completion_tokens"]
                result.speculation = chunk["usage"]["speculation"]
    result.seconds = time.perf_counter() - started
    return result


async def run_level(url, model, prompts, max_tokens, concurrency, method, *,
                    speculation: dict | None = None) -> tuple[float, list[StreamResult]]:
    import httpx

    queue = list(prompts)
    results: list[StreamResult] = [None] * len(prompts)  # type: ignore[list-item]

    async with httpx.AsyncClient(timeout=3600) as http:
        async def worker():
            while queue:
                index = len(prompts) - len(queue)
                prompt = queue.pop(0)
                results[index] = await stream_completion(http, url, model, prompt, max_tokens, method,
                                                         speculation=speculation)

        started = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        return time.perf_counter() - started, results


def wait_healthy(url: str, timeout_s: float, server: subprocess.Popen | None) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server is not None and server.poll() is not None:
            raise RuntimeError(f"serve run exited with code {server.returncode}")
        try:
            if httpx.get(f"{url}/healthz", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError(f"{url} did not become healthy in {timeout_s:.0f} s")


def start_server(manifest: str, log_path: str | None = None) -> subprocess.Popen:
    """`serve run MANIFEST` in its own process group (stop it with `stop_server`)."""
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    serve_bin = os.path.join(os.path.dirname(sys.executable), "serve")
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL
    try:
        return subprocess.Popen([serve_bin, "run", manifest], env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    finally:
        if log_path:
            log.close()


def stop_server(server: subprocess.Popen) -> None:
    try:
        os.killpg(server.pid, signal.SIGINT)  # `serve run` shuts the app and its local Ray cluster down
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
    except ProcessLookupError:  # it had already exited
        pass


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manifest", help="start `serve run MANIFEST` for the benchmark, then stop it")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--prompts", type=int, default=4, help="HumanEval prompts per level (at least the concurrency)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)

    import httpx

    server = start_server(args.manifest) if args.manifest else None
    try:
        wait_healthy(args.url, 900, server)
        model = httpx.get(f"{args.url}/v1/models").json()["data"][0]["id"]
        # warm-up: allocator growth, first-call paths
        asyncio.run(run_level(args.url, model, humaneval_prompts(1), 8, 1, None))
        rows = []
        header = (f"{'speculation':12} {'streams':>7} {'tok/s':>7} {'speedup':>8} {'TTFT p50':>9} "
                  f"{'acc.len':>8} {'overhead/round':>15}")
        print(header + "\n" + "-" * len(header), flush=True)
        for concurrency in args.concurrency:
            prompts = humaneval_prompts(max(args.prompts, concurrency))
            baseline = None
            for method in ("none", None):  # off, then the deployment's own speculation
                seconds, results = asyncio.run(run_level(args.url, model, prompts, args.max_tokens, concurrency, method))
                label = results[0].speculation.get("proposer", method or "on")
                tokens = sum(r.tokens for r in results)
                steps = sum(r.speculation.get("target_steps", 0) for r in results)
                overhead = statistics.mean(r.speculation.get("round_trip_overhead_ms_per_round", 0) for r in results)
                row = {"speculation": label, "streams": concurrency, "tokens_per_second": tokens / seconds,
                       "ttft_p50_s": statistics.median(r.ttft_s for r in results),
                       "mean_accepted_length": tokens / steps if steps else 0.0,
                       "overhead_ms_per_round": overhead, "texts": [r.text for r in results]}
                baseline = baseline or row
                row["speedup"] = row["tokens_per_second"] / baseline["tokens_per_second"]
                row["same_output"] = sum(a == b for a, b in zip(row["texts"], baseline["texts"]))
                rows.append(row)
                print(f"{label:12} {concurrency:>7} {row['tokens_per_second']:7.2f} {row['speedup']:7.2f}x "
                      f"{row['ttft_p50_s']:8.2f}s {row['mean_accepted_length']:8.2f} {overhead:12.1f} ms"
                      f"   (same output as none: {row['same_output']}/{len(results)})", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    finally:
        if server is not None:
            stop_server(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
