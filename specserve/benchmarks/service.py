"""Service mode: specserve served by `serve run`, measured through its HTTP API.

One server for the whole sweep. Every specserve variant is a per-request ``speculation``
override on the same deployment, so all of them share the same pools and the same warm caches.
At each concurrency, each workload's prompts (token ids, the same as in library mode) are
streamed by that many concurrent clients; time to first token and the gaps between text chunks
(inter-token latency as a client sees it; a speculative round can deliver several tokens in one
chunk) come from the arrival times of the server-sent events.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from specserve.benchmarks.http import run_level, start_server, steady_state, stop_server, wait_healthy
from specserve.benchmarks.systems import CANNOT_RUN, FAILED, K, OK, SERVED, ServiceRun, System
from specserve.benchmarks.workloads import Workload
from specserve.grpc import grpc_options

Encoded = list[tuple[Workload, list[list[int]]]]


def serve_config(target: str, draft: str | None, dtype: str, port: int, heads: str | None = None,
                 draft_quantize: str = "none") -> dict:
    """A Serve config for the benchmark pair on this machine (like manifests/local.yaml; with
    `heads`, the target pool is co-located with them, as in manifests/local-medusa.yaml)."""
    threads = 2  # pools take turns within a round: each may use both cores

    def pool(model: str, cpus: float) -> dict:
        return {"model": model, "dtype": dtype, "torch_threads": threads, "num_replicas": 1,
                "ray_actor_options": {"num_cpus": cpus}, "max_batch_size": 16}

    args = {"model_name": "bench", "target": pool(target, 1.0),
            "speculation": {"method": "draft" if draft else "none", "k": K, "draft_min_confidence": 0.5},
            "router": {"ray_actor_options": {"num_cpus": 0.1}, "max_ongoing_requests": 32,
                       "max_queued_requests": 32}}
    if draft:
        args["draft"] = pool(draft, 0.5) | {"quantize": draft_quantize}
    if heads:
        args["target"]["heads"] = heads
    return {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": port},
            "grpc_options": grpc_options(),
            "applications": [{"name": "specserve-bench", "route_prefix": "/",
                              "import_path": "specserve.serve:build_app", "args": args}]}


def manifest_port(manifest: str) -> int:
    import yaml

    with open(manifest) as f:
        return int((yaml.safe_load(f).get("http_options") or {}).get("port", 8000))


def _log_tail(path: Path, lines: int = 5) -> str:
    try:
        tail = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()][-lines:]
    except OSError:
        return ""
    return " | ".join(tail)[-400:]


def run_service(systems: list[System], encoded: Encoded, *, manifest: str | None, url: str, max_tokens: int,
                requests: int, concurrency: list[int], log_path: Path, bar, repeats: int = 1,
                turns: str = "waves", startup_timeout_s: float = 900,
                level_done: Callable[[list[ServiceRun]], None] | None = None) -> list[ServiceRun]:
    """At concurrency c each workload sends its first max(requests, c) prompts over c streams,
    once per system per pass, in `repeats` passes whose tokens and wall times add up; the
    systems take turns as `measuring_turns` orders them. Starts `serve run MANIFEST` for the
    sweep; with no manifest, measures the server at ``url``. `level_done` gets the runs of every
    level finished so far after each (concurrency, workload) level, so a long sweep keeps what it
    measured."""
    import httpx

    levels = [(c, w, ids[:max(requests, c)]) for c in concurrency for w, ids in encoded]
    cells = [(c, w, ids, s) for c, w, ids in levels for s in systems]
    order = {(c, len(ids)): measuring_turns(systems, repeats, len(ids), c, turns) for c, _, ids in levels}
    bar.set_description("serve run (starting)" if manifest else f"server at {url}")
    server = start_server(manifest, str(log_path)) if manifest else None
    try:
        try:
            wait_healthy(url, startup_timeout_s, server)
            model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        except Exception as exc:
            bar.update(sum(len(t) for t in order.values()))
            reason = f"the server did not start: {exc} (log {log_path}: {_log_tail(log_path)})"
            return [ServiceRun(s.name, s.method, w.name, c, status=CANNOT_RUN, reason=reason) for c, w, _, s in cells]
        refused = {}
        for system in systems:  # warm-up, and the place where a refused method says why
            bar.set_description(f"{system.name} (warm-up)")
            try:
                asyncio.run(run_level(url, model, [encoded[0][1][0]], 4, 1, None, speculation=speculation(system)))
            except Exception as exc:
                refused[system.name] = str(exc).splitlines()[0][:300]
        runs = {(c, w.name, s.name): ServiceRun(s.name, s.method, w.name, c) for c, w, _, s in cells}
        finished = []
        for c, workload, prompt_ids in levels:
            for system, pass_index, prompts in order[c, len(prompt_ids)]:
                bar.set_description(f"{system.name} x{c} {workload.name}")
                run = runs[c, workload.name, system.name]
                if system.name in refused:
                    run.status, run.reason = CANNOT_RUN, refused[system.name]
                elif run.status == OK:  # a pass that failed ends the cell's measuring
                    try:
                        measure(run, url, model, [prompt_ids[i] for i in prompts], max_tokens, speculation(system),
                                pass_index=pass_index)
                    except Exception as exc:
                        run.status, run.reason = FAILED, f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                bar.update(1)
            finished += [runs[c, workload.name, s.name] for s in systems]
            if level_done is not None:
                level_done(list(finished))
        return list(runs.values())
    finally:
        if server is not None:
            bar.set_description("serve run (stopping)")
            stop_server(server)


TURNS = {"waves": "per wave of as many requests as streams, A B .. B A, the order rotated from wave to wave "
                  "(at 1 stream a wave is one prompt)",
         "streams": "per pass, A B .. B A, each further pair of passes rotated: in each turn the streams send all "
                    "the level's requests, each stream its next as soon as its last one ended (closed loop)"}
TURN_MODES = tuple(TURNS)


def turn_count(systems: list[System], encoded: Encoded, *, concurrency: list[int], requests: int,
               repeats: int, turns: str = "waves") -> int:
    """How many turns `run_service` measures (its progress bar's total)."""
    return sum(len(measuring_turns(systems, repeats, len(ids[:max(requests, c)]), c, turns))
               for c in concurrency for _, ids in encoded)


def measuring_turns(systems: list[System], repeats: int, prompts: int, concurrency: int,
                    turns: str = "waves") -> list[tuple[System, int, list[int]]]:
    """One level's measuring order: (system, pass, the prompts it sends) in turn. `turns`
    "streams": each pass is one turn per system, A B C C B A, in which `concurrency` streams
    send all the prompts, each stream its next as soon as its last one ended (closed loop: the
    level's load held, as a service at that concurrency sees it); each further pair of passes
    rotates the order (B C A A C B), so over 2 x len(systems) passes every system holds the
    middle alike (at chat 8 streams adaptive's two middle turns, between always on's, ran the
    target's passes 5-8% slower than always off's, which the same turns without always on
    between did not: docs/bench/adaptive-streams-epyc). "waves": the prompts go
    in waves of `concurrency` (the last one may be short), and each wave gets its own turns,
    A B C C B A over the passes, the order rotated from wave to wave; a pass adds up its turns.
    A B .. B A cancels drift that is linear over the level; the rotation keeps one system from
    holding the level's middle in every wave. Why: with whole passes as turns, the middle
    system's passes took the level's middle minutes, and twice it ran the same work measurably
    slower there: at 1 stream adaptive made always on's choices in every round with verify
    passes 6% slower (a wave of 8 requests one after another there takes ~2.5 min), and at 4
    streams with 256-token answers adaptive's off epochs ran the target's passes ~12-15% slower
    than always off's (docs/bench/adaptive-4-epyc-long). One wave (prompts <= concurrency)
    leaves nothing to rotate: its turns are A B C C B A."""
    def order(pass_index: int, shift: int) -> list[System]:
        shift %= len(systems)
        rotated = systems[shift:] + systems[:shift]
        return rotated if pass_index % 2 == 0 else rotated[::-1]

    if turns not in TURN_MODES:
        raise ValueError(f"turns must be one of {', '.join(TURN_MODES)}, not {turns!r}")
    closed_loop = turns == "streams"  # one wave of every prompt: the pairs of passes rotate instead
    size = prompts if closed_loop else concurrency
    waves = [list(range(start, min(start + size, prompts))) for start in range(0, prompts, size)]
    return [(s, p, wave) for w, wave in enumerate(waves) for p in range(repeats)
            for s in order(p, p // 2 if closed_loop else w)]


def speculation(system: System) -> dict | None:
    """The request's ``speculation`` override; none for `served` (the deployment's own settings)."""
    from specserve.protocol import LEGACY_METHODS

    if system.method == SERVED:
        return None
    return {"method" if system.method in LEGACY_METHODS else "proposer": system.method, **system.options}


def measure(run: ServiceRun, url: str, model: str, prompt_ids: list[list[int]], max_tokens: int, spec: dict,
            pass_index: int = 0) -> None:
    """`run`'s requests of `prompt_ids`, in pass `pass_index`: a pass adds up its turns' tokens
    and times, and every turn adds its latencies (the outputs compared with target-only are the
    first pass's, in the order of its turns)."""
    wall_s, results = asyncio.run(run_level(url, model, prompt_ids, max_tokens, run.concurrency, None,
                                            speculation=spec))
    first = pass_index == 0
    run.wall_s += wall_s
    run.add_to_pass(pass_index, sum(r.tokens for r in results), wall_s)
    steady = steady_state(results, run.concurrency)
    if steady is not None:
        run.add_steady_state(*steady)
    if first:
        run.requests += len(results)
    for r in results:
        run.tokens += r.tokens
        run.target_steps += r.speculation.get("target_steps", 0)
        run.overhead_s += r.speculation.get("round_trip_overhead_ms_per_round", 0.0) \
            * r.speculation.get("target_steps", 0) / 1000
        run.add_k_histogram(r.speculation.get("k_histogram") or {})
        run.add_policy_decisions(r.speculation.get("policy_decisions") or {})
        run.ttft_s.append(r.ttft_s)
        run.itl_s += [b - a for a, b in zip(r.chunk_times, r.chunk_times[1:])]
        if first:
            run.texts.append(r.text)
