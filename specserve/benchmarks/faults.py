"""Fault injection under load: kill a draft, a target or a router replica while streams run, and
count what the clients saw.

    python -m specserve.benchmarks.faults [--rounds 3] [--streams 8] [--max-tokens 96] [--resumes 3] [--out DIR]

Starts its own local Ray cluster (HTTP and gRPC on --port and --port + 1000, never the default
ones) with a SmolLM2 app of 2 target, 1 draft and 2 router replicas, or drives an app already
running (--address, --app, --url). For each kind and round: `--streams` greedy streams start, a
replica of that kind is killed with `ray.kill` once every stream has begun, the streams are read
to the end, then Serve's replacement is awaited and fresh requests are sent. Writes
faults.json and faults.md into --out.

The guarantees checked (tests/test_hardening.py asserts them at a small scale):
- draft killed: every stream completes, exactly (a failed draft call drafts by prompt lookup);
- target killed: every stream completes, exactly (the round is retried on the other target);
- router killed: the streams on that router break (no [DONE]), never hang or get a wrong token;
  clients that resume (`--resumes N`: send the request again with the token ids received,
  `resume_token_ids`) complete them exactly on another router; with `--resumes 0` they fail
  with an error the client sees. Streams on the other router complete exactly; new requests
  succeed after the replacement starts; the pools release the dead router's caches once no call
  has touched them for `abandoned_cache_s` (20 s in the local app; the report counts what is
  left a minute after the fresh requests, so a connected app with the 300 s default shows them).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specserve.benchmarks import reliability as rel

KINDS = {"draft": "DraftPool", "target": "TargetPool", "router": "Router"}
PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "1, 2, 3, 4,",
           "Write a haiku about the sea.", "import numpy as np\n", "The three primary colors are",
           "Dear Sir or Madam,"]


@dataclass
class FaultRun:
    kind: str
    streams: int
    completed: int = 0
    exact: int = 0
    failed: int = 0  # ended with an error the client saw
    resumed: int = 0  # streams that broke and were resumed by their client (see `resumes`)
    hung: int = 0  # no end within the stream timeout
    inexact: int = 0  # completed with text other than the target's: never acceptable
    killed: str = ""  # "Deployment replica-id"
    killed_at: float = 0.0  # time.monotonic() of the kill
    open_at_kill: int = 0  # streams still running when the replica died (0: the kill proved nothing)
    recovered_s: float | None = None  # until Serve ran the replica count again
    after_ok: int = 0  # fresh requests after recovery that completed exactly
    after_sent: int = 0
    cached_after: int | None = None  # requests holding caches in the pools once all is over
    phases_s: dict[str, float] = field(default_factory=dict)  # streams, recovery, fresh requests, caches
    errors: list[str] = field(default_factory=list)


def choose_victim(app: str, kind: str) -> rel.Replica:
    """The replica to kill: for the target, one that holds a request's cache (a busy one)."""
    deployment = KINDS[kind]
    candidates = rel.replicas(app)[deployment]
    if kind == "target":
        counts = rel.cached_requests(app, deployment)
        busy = [r for r in candidates if counts.get(r.replica_id, 0) > 0]
        candidates = busy or candidates
    return random.choice(candidates)


async def _streams_with_a_kill(url: str, model: str, prompts: list[str], max_tokens: int, app: str, kind: str,
                               run: FaultRun, timeout_s: float, resumes: int) -> list[rel.StreamOutcome]:
    """Start every stream; once each has sent a chunk, kill a replica (off the event loop, so
    the streams keep being read)."""
    import httpx

    started = asyncio.Event()
    begun: set[int] = set()
    ended: set[int] = set()

    def on_chunk_of(i):
        def on_chunk(_):
            begun.add(i)
            if len(begun) == len(prompts):
                started.set()
        return on_chunk

    async def killer():
        try:
            await asyncio.wait_for(started.wait(), timeout_s)
        except TimeoutError:
            pass  # kill anyway: the streams that have not begun must survive it too
        victim = await asyncio.to_thread(choose_victim, app, kind)
        run.killed = f"{victim.deployment} {victim.replica_id}"
        await asyncio.to_thread(rel.kill, victim)
        run.killed_at = time.monotonic()
        run.open_at_kill = len(prompts) - len(ended)

    async def stream(http, i, body):
        try:
            return await rel.stream_completion(http, url, body, on_chunk=on_chunk_of(i), timeout_s=timeout_s,
                                               resumes=resumes)
        finally:
            ended.add(i)

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30)) as http:
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0}
        streams = [stream(http, i, {**body, "prompt": p}) for i, p in enumerate(prompts)]
        outcomes, _ = await asyncio.gather(asyncio.gather(*streams), killer())
    return outcomes


async def _fresh_requests(url: str, model: str, prompts: list[str], max_tokens: int, reference: dict[str, str],
                          timeout_s: float) -> int:
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30)) as http:
        outcomes = await asyncio.gather(*[
            rel.stream_completion(http, url, {"model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0},
                                  timeout_s=timeout_s) for p in prompts])
    return sum(o.completed and o.text == reference[p] for p, o in zip(prompts, outcomes, strict=True))


def recovered(app: str, killed: str, expected_counts: dict[str, int]) -> bool:
    """The controller has dropped the killed replica and runs as many as before (right after
    the kill it may still count the dead one as running)."""
    deployment, replica_id = killed.split(" ")
    live = {r.replica_id for r in rel.replicas(app).get(deployment, [])}
    return replica_id not in live and rel.running_replica_counts(app) == expected_counts


def run_fault(kind: str, *, url: str, app: str, model: str, prompts: list[str], max_tokens: int,
              reference: dict[str, str], timeout_s: float = 240, recovery_timeout_s: float = 180,
              resumes: int = 0) -> FaultRun:
    """One injection: streams, a kill mid-way, the outcome of each stream, Serve's recovery,
    fresh requests after it, and the caches left in the pools. `resumes`: how many times each
    stream's client resumes it where it broke."""
    expected_counts = rel.running_replica_counts(app)
    run = FaultRun(kind, len(prompts))
    phase = time.monotonic()

    def lap(name: str) -> None:
        nonlocal phase
        run.phases_s[name] = round(time.monotonic() - phase, 1)
        phase = time.monotonic()

    outcomes = asyncio.run(_streams_with_a_kill(url, model, prompts, max_tokens, app, kind, run, timeout_s, resumes))
    lap("streams")
    for prompt, o in zip(prompts, outcomes, strict=True):
        run.resumed += bool(o.interruptions)
        run.errors += [f"resumed after: {reason}" for reason in o.interruptions]
        if o.completed:
            run.completed += 1
            if o.text == reference[prompt]:
                run.exact += 1
            else:
                run.inexact += 1
                run.errors.append(f"inexact: {prompt!r}: {o.text!r}")
        elif o.error and o.error.startswith("no end"):
            run.hung += 1
            run.errors.append(o.error)
        else:
            run.failed += 1
            run.errors.append(o.error or f"ended without [DONE] after {o.chunks} chunks")
    if rel.wait_until(lambda: recovered(app, run.killed, expected_counts), recovery_timeout_s, 1.0):
        run.recovered_s = round(time.monotonic() - run.killed_at, 1)
    lap("recovery")
    run.after_sent = len(prompts)
    run.after_ok = asyncio.run(_fresh_requests(url, model, prompts, max_tokens, reference, timeout_s))
    lap("fresh requests")
    rel.wait_until(lambda: rel.total_cached_requests(app) == 0, 60, 1.0)
    with contextlib.suppress(Exception):  # None when a pool does not answer: reported as such
        run.cached_after = rel.total_cached_requests(app)
    lap("caches")
    return run


def markdown(runs: list[FaultRun], config: dict) -> str:
    lines = ["# Fault injection under load", "",
             f"`{config['command']}`: {config['streams']} greedy streams of {config['max_tokens']} tokens per "
             f"injection, {config['rounds']} round(s) per kind, model {config['model']}, "
             f"{config['seconds']:.0f} s in all; clients resume a broken stream up to {config['resumes']} time(s).", "",
             "| killed | runs | streams | completed | exact | resumed by the client | failed (clean error) | hung | "
             "inexact | fresh requests after recovery ok | recovery s (max) | caches left |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for kind in KINDS:
        rows = [r for r in runs if r.kind == kind]
        if not rows:
            continue
        recovery = [r.recovered_s for r in rows if r.recovered_s is not None]
        lines.append(
            f"| {kind} | {len(rows)} | {sum(r.streams for r in rows)} | {sum(r.completed for r in rows)} | "
            f"{sum(r.exact for r in rows)} | {sum(r.resumed for r in rows)} | {sum(r.failed for r in rows)} | {sum(r.hung for r in rows)} | "
            f"{sum(r.inexact for r in rows)} | {sum(r.after_ok for r in rows)}/{sum(r.after_sent for r in rows)} | "
            f"{max(recovery) if recovery else 'not recovered'} | {sum(r.cached_after or 0 for r in rows)} |")
    errors = sorted({e[:160] for r in runs for e in r.errors})
    if errors:
        lines += ["", "Errors the clients saw:", ""] + [f"- `{e}`" for e in errors[:20]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="injections per kind")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--resumes", type=int, default=3,
                        help="times a client resumes a broken stream (0: it fails, as a plain client's would)")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--model", default=rel.SMOL, help="target model (and draft, with the local app)")
    parser.add_argument("--port", type=int, default=8975, help="HTTP port of the local cluster (gRPC: +1000)")
    parser.add_argument("--address", help="drive an app on this running cluster instead of starting one")
    parser.add_argument("--app", default="faults", help="the application's name")
    parser.add_argument("--url", help="the application's HTTP base URL (with --address)")
    parser.add_argument("--served-name", default="smol", help="the model name the app serves")
    parser.add_argument("--out", default="bench-results/faults")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = (PROMPTS * ((args.streams + len(PROMPTS) - 1) // len(PROMPTS)))[: args.streams]
    print(f"greedy reference of {len(set(prompts))} prompts ...", flush=True)
    reference = rel.greedy_reference(args.model, sorted(set(prompts)), args.max_tokens)
    started = time.monotonic()
    if args.address:
        cluster, url = rel.connected(args.address), args.url
    else:
        cluster, url = rel.local_cluster(args.port, args.port + 1000, num_cpus=4), f"http://127.0.0.1:{args.port}/{args.app}"
    runs = []
    with cluster:
        if not args.address:
            # a dead router's caches are released after 20 s without a call (the pools' default: 300 s)
            rel.deploy(rel.smol_app_args(args.served_name, target=args.model, draft=args.model, router_replicas=2,
                                         abandoned_cache_s=20), args.app, f"/{args.app}")
        for round_ in range(args.rounds):
            for kind in args.kinds:
                run = run_fault(kind, url=url, app=args.app, model=args.served_name, prompts=prompts,
                                max_tokens=args.max_tokens, reference=reference, resumes=args.resumes)
                runs.append(run)
                print(json.dumps({"round": round_, **asdict(run)}), flush=True)
    command = " ".join(sys.argv[1:] if argv is None else argv)
    config = {"command": f"python -m specserve.benchmarks.faults {command}".strip(), "streams": args.streams,
              "max_tokens": args.max_tokens, "rounds": args.rounds, "model": args.model, "resumes": args.resumes,
              "seconds": time.monotonic() - started}
    (out / "faults.json").write_text(json.dumps({"config": config, "runs": [asdict(r) for r in runs]}, indent=1))
    (out / "faults.md").write_text(markdown(runs, config))
    print((out / "faults.md").read_text())
    lost = sum(r.hung + r.inexact for r in runs) + sum(r.failed for r in runs if r.kind != "router")
    leaked = sum(r.cached_after is None or r.cached_after > 0 for r in runs)
    return 1 if lost or leaked else 0


if __name__ == "__main__":
    raise SystemExit(main())
