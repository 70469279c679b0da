"""HTTP client side of service mode: streaming completions, concurrent levels, `serve run`.

    python -m specserve.benchmarks.http [flags]     # the same as: specserve bench --preset http [flags]

`specserve bench`'s service mode (service.py) uses these; this module's main is the `http` preset
(`serve run manifests/local.yaml`, HumanEval at 1 and 4 streams, speculation off and on; --url
measures a server already running, --manifest manifests/local-medusa.yaml serves Medusa heads).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field


@dataclass
class StreamResult:
    text: str = ""
    tokens: int = 0
    ttft_s: float = 0.0
    seconds: float = 0.0
    speculation: dict = field(default_factory=dict)
    chunk_times: list[float] = field(default_factory=list)  # arrival of each text chunk, s after the request
    started_s: float = 0.0  # when the request was sent, s after its level began (run_level)


async def stream_completion(http, url: str, model: str, prompt: str | list[int], max_tokens: int, method: str | None,
                            *, speculation: dict | None = None, extra: dict | None = None) -> StreamResult:
    """Stream one greedy completion. ``speculation`` (e.g. {"method": "draft", "k": 4}) overrides
    ``method``; ``extra`` adds body fields (e.g. ``ignore_eos``)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **(extra or {})}
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
                result.speculation = chunk["usage"].get("speculation", {})  # specserve's extension
    result.seconds = time.perf_counter() - started
    return result


async def run_level(url, model, prompts, max_tokens, concurrency, method, *, speculation: dict | None = None,
                    extra: dict | None = None, transport=None) -> tuple[float, list[StreamResult]]:
    """`prompts` streamed by `concurrency` clients, each sending its next prompt as soon as its
    last one ended (a closed loop); the level's wall time and each prompt's result, in order."""
    import httpx

    queue = list(prompts)
    results: list[StreamResult] = [None] * len(prompts)  # type: ignore[list-item]

    async with httpx.AsyncClient(timeout=3600, transport=transport) as http:
        async def worker():
            while queue:
                index = len(prompts) - len(queue)
                prompt = queue.pop(0)
                sent = time.perf_counter() - started
                results[index] = await stream_completion(http, url, model, prompt, max_tokens, method,
                                                         speculation=speculation, extra=extra)
                results[index].started_s = sent

        started = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        return time.perf_counter() - started, results


def steady_state(results: list[StreamResult], concurrency: int) -> tuple[int, float] | None:
    """The tokens and request-seconds of a closed-loop level's requests that ended before the
    first stream ran out of prompts: while all `concurrency` streams were busy, so `concurrency`
    x tokens / request-seconds is the throughput at that load, without the end where fewer
    streams are left (the last `concurrency` - 1 requests run at a falling load). None when no
    request ended in that state (as many prompts as streams: one wave, all tail)."""
    if len(results) <= concurrency:
        return None
    ends = sorted(r.started_s + r.seconds for r in results)
    first_idle = ends[len(results) - concurrency]  # this end found the queue empty
    kept = [r for r in results if r.started_s + r.seconds <= first_idle]
    return sum(r.tokens for r in kept), sum(r.seconds for r in kept)


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


def main(argv: list[str] | None = None) -> int:
    """`python -m specserve.benchmarks.http` is `specserve bench --preset http`."""
    from specserve.benchmarks.suite import main as bench

    return bench(["--preset", "http", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
