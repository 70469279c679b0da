"""What a running Ray cluster's own housekeeping costs a decode on this machine.

    make serve &                                     # or any Ray cluster on this machine, idle
    python -m specserve.benchmarks.cluster_tax       # the default target, 6 turns of 24 tokens

Loads the target in this process (no Ray) and times batch-1 greedy decodes of one prompt, in
turns A B A B ...: A with every Ray process on this machine running as it is, B with all of them
paused (SIGSTOP, then SIGCONT as soon as the decode ends: a few seconds each, well inside Ray's
health-check timeouts). B over A is what the idle cluster takes from the decode's torch threads:
its workers' 10-ms signal timers, the Serve controller's loop, the dashboard's processes, idle
pools' health probes. Each costs a percent or so of a core, but a pass on two threads waits
for the slower one, so on a machine with few cores their sum costs the decode about twice its
share. Send the cluster no traffic while this runs: its requests would stall in B turns.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator

RAY_PROGRAMS = ("gcs_server", "raylet")
STOP_WAIT_S = 1.0


def is_ray_process(name: str, cmdline: list[str]) -> bool:
    """A process of a Ray cluster or of `serve run` (by its name or command line).

    >>> is_ray_process("ray::ServeController", ["ray::ServeController"])
    True
    >>> is_ray_process("raylet", ["/v/site-packages/ray/core/src/ray/raylet/raylet", "--node"])
    True
    >>> is_ray_process("python", ["/v/bin/python", "/v/site-packages/ray/dashboard/dashboard.py"])
    True
    >>> is_ray_process("python", ["/v/bin/python", "/v/bin/serve", "run", "manifests/local.yaml"])
    True
    >>> is_ray_process("python", ["/v/bin/python", "-m", "pytest", "tests/test_serve.py"])
    False
    """
    if name.startswith(("ray::", "ray-dashboard")) or name in RAY_PROGRAMS:
        return True
    args = " ".join(cmdline)
    return "/site-packages/ray/" in args or (len(cmdline) >= 3 and cmdline[1].endswith("/serve")
                                             and cmdline[2] == "run")


def ray_processes() -> list[int]:
    """Pids of this user's Ray processes on this machine, this process excluded."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "name", "cmdline", "uids"]):
        info = p.info
        if info["pid"] == os.getpid() or not info["uids"] or info["uids"].real != os.getuid():
            continue
        if is_ray_process(info["name"] or "", info["cmdline"] or []):
            found.append(info["pid"])
    return found


@contextlib.contextmanager
def paused(pids: list[int]) -> Iterator[None]:
    """`pids` stopped for the block (each seen stopped before it starts, for at most
    `STOP_WAIT_S`), and resumed however it ends."""
    import psutil

    stopped = []
    try:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
        deadline = time.monotonic() + STOP_WAIT_S
        for pid in stopped:  # a signal lands when its process next runs
            with contextlib.suppress(psutil.NoSuchProcess):
                while psutil.Process(pid).status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
                    time.sleep(0.001)
        yield
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def measure(decode: Callable[[], float], pids: list[int], turns: int,
            report: Callable[[str], None] = print) -> list[tuple[float, float]]:
    """`turns` pairs of decodes (tokens/s each), A with `pids` running then B with them
    paused; the pairs' order alternates (A B, B A, ...) so a drift of the machine falls on both."""
    pairs = []
    for turn in range(turns):
        order = ("running", "paused") if turn % 2 == 0 else ("paused", "running")
        measured = {}
        for state in order:
            with paused(pids) if state == "paused" else contextlib.nullcontext():
                measured[state] = decode()
            report(f"turn {turn + 1}/{turns}: cluster {state}: {measured[state]:.3f} tok/s")
        pairs.append((measured["running"], measured["paused"]))
    return pairs


def summary(pairs: list[tuple[float, float]]) -> str:
    """The table of turns and the median of the per-turn ratios.

    >>> print(summary([(3.0, 4.0), (3.2, 4.0)]))
    | turn | cluster running (tok/s) | cluster paused (tok/s) | paused / running |
    |---|---|---|---|
    | 1 | 3.000 | 4.000 | 1.333x |
    | 2 | 3.200 | 4.000 | 1.250x |
    median paused / running: 1.292x (the idle cluster takes 23% of the decode's speed)
    """
    ratios = [paused / running for running, paused in pairs]
    rows = [f"| {i} | {running:.3f} | {paused:.3f} | {ratio:.3f}x |"
            for i, ((running, paused), ratio) in enumerate(zip(pairs, ratios), 1)]
    median = statistics.median(ratios)
    return "\n".join(["| turn | cluster running (tok/s) | cluster paused (tok/s) | paused / running |",
                      "|---|---|---|---|", *rows,
                      f"median paused / running: {median:.3f}x (the idle cluster takes "
                      f"{1 - 1 / median:.0%} of the decode's speed)"])


def decoder_of(target: str, dtype: str, threads: int | None, tokens: int) -> Callable[[], float]:
    """A function that decodes `tokens` greedily from a fixed code prompt and returns tokens/s
    (past any end of text, so every turn decodes the same tokens)."""
    from specserve.decoder import SpeculativeDecoder
    from specserve.loading import set_torch_threads
    from specserve.protocol import SamplingParams, Speculation

    set_torch_threads(threads)
    decoder = SpeculativeDecoder.from_pretrained(target, dtype=dtype, speculation=Speculation(proposer="none"))
    prompt = decoder.tokenizer.encode("def quicksort(items: list[int]) -> list[int]:\n")
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)

    def decode() -> float:
        decoder.generate([prompt], params)
        return decoder.last_report.tokens_per_second

    decode()  # warm-up: first-call allocations and kernel selection stay out of the turns
    return decode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specserve.benchmarks.cluster_tax", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: every core)")
    ap.add_argument("--tokens", type=int, default=24, help="new tokens per decode")
    ap.add_argument("--turns", type=int, default=6, help="pairs of decodes, running and paused")
    args = ap.parse_args(argv)
    pids = ray_processes()
    if not pids:
        print("no Ray process on this machine: start the cluster first (make serve)", file=sys.stderr)
        return 2
    print(f"{len(pids)} Ray processes; loading {args.target} ...", flush=True)
    decode = decoder_of(args.target, args.dtype, args.threads, args.tokens)
    started = time.perf_counter()
    pairs = measure(decode, pids, args.turns, report=lambda line: print(line, flush=True))
    print(summary(pairs))
    print(f"({args.turns} turns of {args.tokens} tokens in {time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
