"""Shared pieces of the hardening checks: tests/test_hardening.py, tests/test_fuzz.py and the
faults, soak and fuzz scripts (`python -m specserve.benchmarks.faults|soak|fuzz`).

- a small SmolLM2 app (target, draft and router pools on fractions of a CPU) and a local Ray
  cluster on ports of the caller's choosing, so a script never touches someone else's cluster;
- the replicas of an app as the Serve controller lists them, killed with `ray.kill` and asked
  their memory with `__ray_call__` (no dashboard needed: `ray.util.state` is not);
- the pools' cached-request counts, read from every live replica (the leak the checks look for);
- one HTTP stream, read to its end or to a failure, with the outcome a client would see
  (optionally resuming it where it broke, with `resume_token_ids`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

SMOL = "smollm2-135m-instruct"
POOLS = ("TargetPool", "DraftPool", "CoLocatedPool")


def smol_app_args(model_name: str = "smol", *, target_replicas: int = 2, draft_replicas: int = 1,
                  router_replicas: int = 1, pool_cpus: float = 0.25, max_ongoing: int = 32,
                  target: str = SMOL, draft: str | None = SMOL, k: int = 3,
                  abandoned_cache_s: float | None = None) -> dict:
    """Args for `build_app`: float32 pools (outputs comparable to transformers' greedy decoding),
    one torch thread each, fast health checks (a killed replica is noticed in seconds), and a
    fixed k so every round drafts."""
    pool = {"dtype": "float32", "torch_threads": 1, "ray_actor_options": {"num_cpus": pool_cpus},
            "health_check_period_s": 2, "health_check_timeout_s": 30}
    if abandoned_cache_s is not None:
        pool["abandoned_cache_s"] = abandoned_cache_s
    args = {
        "model_name": model_name,
        "target": {"model": target, "num_replicas": target_replicas, **pool},
        "speculation": {"proposer": "draft" if draft else "none", "k": k, "policy": "fixed",
                        "draft_min_confidence": 0.0, "draft_timeout_s": 3, "draft_retry_after_s": 0.5},
        "router": {"num_replicas": router_replicas, "ray_actor_options": {"num_cpus": 0.05},
                   "max_ongoing_requests": max_ongoing, "max_queued_requests": max_ongoing,
                   "target_retry_timeout_s": 60},
    }
    if draft:
        args["draft"] = {"model": draft, "num_replicas": draft_replicas, **pool}
    return args


# ---- a cluster of our own, or one we were given ---------------------------------------------

@contextlib.contextmanager
def local_cluster(http_port: int, grpc_port: int, num_cpus: int = 4) -> Iterator[None]:
    """A new local Ray cluster (never an existing one: address="local") with Serve's HTTP and
    gRPC proxies on the given ports; shut down on exit, with everything it ran."""
    import ray
    from ray import serve

    from specserve.grpc import grpc_options

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port}, grpc_options=grpc_options(grpc_port))
        yield
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


@contextlib.contextmanager
def connected(address: str) -> Iterator[None]:
    """A driver on a cluster someone else runs: on exit it disconnects and stops nothing."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address=address, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def deploy(args: dict, app: str, route_prefix: str) -> None:
    from ray import serve

    from specserve.serve import build_app

    serve.run(build_app(args), name=app, route_prefix=route_prefix)


# ---- replicas ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Replica:
    deployment: str
    replica_id: str
    actor_name: str

    def actor(self):
        import ray
        from ray.serve._private.constants import SERVE_NAMESPACE

        return ray.get_actor(self.actor_name, namespace=SERVE_NAMESPACE)


def replicas(app: str) -> dict[str, list[Replica]]:
    """The running replicas of each deployment of `app`, as the Serve controller routes to them
    (its `_all_running_replicas`, which Ray's own Serve tests use; `ray.util.state` would need
    the dashboard)."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    running = ray.get(controller._all_running_replicas.remote(), timeout=30)
    out: dict[str, list[Replica]] = {}
    for deployment_id, infos in running.items():
        if deployment_id.app_name == app:
            out[deployment_id.name] = [Replica(deployment_id.name, i.replica_id.unique_id, i.actor_name) for i in infos]
    return out


def kill(replica: Replica) -> None:
    """Kill the replica's actor as a crash would (no graceful shutdown); Serve starts another."""
    import ray

    ray.kill(replica.actor(), no_restart=True)


def _own_rss(_actor) -> tuple[int, int]:
    import psutil

    process = psutil.Process()
    return process.pid, process.memory_info().rss


def replica_rss(replica: Replica, timeout_s: float = 20) -> tuple[int, int]:
    """(pid, resident set size in bytes) of the replica's process, measured inside it."""
    import ray

    return ray.get(replica.actor().__ray_call__.remote(_own_rss), timeout=timeout_s)


def running_replica_counts(app: str) -> dict[str, int]:
    from ray import serve

    status = serve.status().applications.get(app)
    if status is None:
        return {}
    return {name: d.replica_states.get("RUNNING", 0) for name, d in status.deployments.items()}


def wait_until(condition: Callable[[], bool], timeout_s: float = 60, interval_s: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if condition():
                return True
        except Exception:  # a replica that just died, a controller busy restarting it
            pass
        time.sleep(interval_s)
    return False


# ---- cached requests in the pools ----------------------------------------------------------

def cached_requests(app: str, deployment: str, max_calls: int = 64) -> dict[str, int]:
    """Requests holding a KV cache on each live replica of a pool. Stats calls land on
    uniformly random replicas, so call until every replica the controller lists has answered.
    Raises if one never does (a count for only some replicas would hide a leak)."""
    from ray import serve

    live = {r.replica_id for r in replicas(app).get(deployment, [])}
    handle = serve.get_deployment_handle(deployment, app)
    seen: dict[str, int] = {}
    for _ in range(max_calls):
        if live <= seen.keys():
            break
        try:
            s = handle.stats.remote().result(timeout_s=20)
        except Exception:  # a replica that just died, before this handle heard of it
            continue
        seen[s["replica"]] = s["requests"]
    missing = live - seen.keys()
    if missing:
        raise RuntimeError(f"{deployment}: replicas {sorted(missing)} did not answer stats")
    return {rid: n for rid, n in seen.items() if rid in live}


def total_cached_requests(app: str) -> int:
    pools = [name for name in replicas(app) if name in POOLS]
    return sum(sum(cached_requests(app, pool).values()) for pool in pools)


# ---- one HTTP stream as a client sees it ----------------------------------------------------

@dataclass
class StreamOutcome:
    text: str = ""
    chunks: int = 0
    finish_reason: str | None = None
    done: bool = False  # "data: [DONE]" arrived
    error: str | None = None  # an in-band error, a bad status, a broken or timed-out connection
    refused: bool = False  # the server answered with an error (a 4xx, an in-band error): not resumed
    seconds: float = 0.0
    tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # with resumes: the ids received so far
    interruptions: list[str] = field(default_factory=list)  # how each resumed attempt broke

    @property
    def completed(self) -> bool:
        return self.done and self.error is None and self.finish_reason is not None


async def stream_completion(http, url: str, body: dict, *, on_chunk: Callable[[int], None] | None = None,
                            timeout_s: float = 300, resumes: int = 0, resume_wait_s: float = 1.0) -> StreamOutcome:
    """POST a streaming completion and read it to the end; every failure is recorded, never
    raised, so a load generator counts it. `on_chunk(i)` runs after text chunk i. `resumes`:
    when the stream breaks (the connection drops, or it ends without `[DONE]`, or a 5xx: a
    router replica died), send it again with the token ids received so far, up to this many
    times, as a client that keeps its streams would."""
    outcome = StreamOutcome()
    started = time.perf_counter()
    body = {**body, "stream": True, **({"return_token_ids": True} if resumes else {})}
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                try:
                    await _read_stream(http, url, body, outcome, on_chunk, started)
                except Exception as exc:  # connection reset, incomplete chunked body ...
                    outcome.error = f"{type(exc).__name__}: {exc}"
                if outcome.completed or outcome.refused or len(outcome.interruptions) >= resumes:
                    break
                outcome.interruptions.append(outcome.error or f"ended without [DONE] after {outcome.chunks} chunks")
                outcome.error, outcome.done, outcome.finish_reason = None, False, None
                body = {**body, "resume_token_ids": list(outcome.token_ids)}
                await asyncio.sleep(resume_wait_s)  # Serve notices the dead replica and routes to another
    except TimeoutError:
        outcome.error = f"no end within {timeout_s:.0f} s"
    outcome.seconds = time.perf_counter() - started
    return outcome


async def _read_stream(http, url, body, outcome: StreamOutcome, on_chunk, started: float) -> None:
    async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            outcome.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            outcome.refused = response.status_code < 500
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                outcome.done = True
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                outcome.error = f"in-band error: {chunk['error'].get('message')}"
                outcome.refused = True
                continue
            if chunk.get("usage"):
                outcome.tokens = chunk["usage"]["completion_tokens"]
            if not chunk.get("choices"):
                continue
            choice = chunk["choices"][0]
            outcome.token_ids += choice.get("token_ids") or []
            outcome.text += choice.get("text") or ""
            outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason
            outcome.chunk_times.append(time.perf_counter() - started)
            if on_chunk is not None:
                on_chunk(outcome.chunks)
            outcome.chunks += 1


def greedy_reference(model: str, prompts: list[str], max_tokens: int) -> dict[str, str]:
    """What the target alone writes for each prompt (transformers' greedy decoding, float32):
    the text every exact stream must equal."""
    import torch

    from specserve import models

    tokenizer = models.load_tokenizer(model)
    lm = models.load_causal_lm(model, dtype="float32")
    out = {}
    for prompt in prompts:
        ids = tokenizer.encode(prompt)
        with torch.no_grad():
            new = lm.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=0)[0, len(ids):].tolist()
        if tokenizer.eos_token_id in new:
            new = new[: new.index(tokenizer.eos_token_id) + 1]
        out[prompt] = tokenizer.decode(new, skip_special_tokens=True)
    return out
