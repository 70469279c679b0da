"""What the load-aware policy costs the router per round, against a target decode step.

    python -m specserve.benchmarks.policy_cost            # times the default target's step too
    python -m specserve.benchmarks.policy_cost --step-ms 100

Per round of one request the router runs, for the policy alone: `MeasuredModes.begin` (with
the switch cost and the catch-ups owed over every steered request, by the functions the router
calls, `switch_cost_s`, `room_tokens` and `catch_up_owed`, and off's predicted goodput), `RequestState.plan_round` (the per-request model: `SpeculationPolicy.choose`
where the epochs do not decide), the load model's updates from the pools' replies, the
request's acceptance update, and `MeasuredModes.end`. This times exactly those calls on the
real objects, with N requests in flight, and the target's step as specserve's own torch engine
runs it at batch 1 (the shortest step there is, so the ratio is an upper bound). Figures vary by
machine; the goal is a policy cost of at most 1% of a target step.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from specserve.policy import LoadModel, MeasuredModes, RecentPeak, SpeculationPolicy, _ModeGoodput
from specserve.protocol import SamplingParams, Speculation, TreeSpec
from specserve.request_state import RequestState, catch_up_owed, room_tokens, switch_cost_s

STREAMS = (1, 4, 8, 16, 64)
METHODS = {
    "draft chain k=4": Speculation(proposer="draft", k=4, policy="adaptive"),
    "draft chain k=12": Speculation(proposer="draft", k=12, policy="adaptive"),
    "medusa tree (64 nodes)": Speculation(proposer="medusa", shape="tree", policy="adaptive",
                                          tree=TreeSpec(budget=64)),
}


def policy_seconds_per_round(spec: Speculation, streams: int, rounds: int, rng: random.Random,
                             epochs_off: bool = False) -> tuple[float, float]:
    """Mean wall seconds of the policy's work in one round, with `streams` steered requests,
    and the share of those rounds that speculated. `epochs_off`: the level's epochs have
    measured off ahead of the model, so they run off (where the epochs measure: 3 or more in
    flight); else the model decides."""
    policy, load, modes, peak = SpeculationPolicy(), LoadModel(), MeasuredModes(), RecentPeak()
    if epochs_off and modes.measures(streams):
        modes.levels[MeasuredModes.level(streams)] = _ModeGoodput(
            model=10.0, off=20.0, epochs=2, measurements={"model": 1, "off": 1}, next_explore=10 ** 9, warmed=True)
    states = [RequestState(f"r{i}", list(range(1, 200)), SamplingParams(max_tokens=10 ** 6), spec,
                           prefill_without_draft=True) for i in range(streams)]
    for state in states:  # past their first round, the draft pool synced up to a few tokens ago
        state.output_ids = [7] * 20
        state.stats.target_steps = 1
        state.draft_synced = len(state.token_ids) - rng.randint(1, 12)
    now = 0.0
    elapsed = 0.0
    speculated = 0
    for i in range(rounds):
        state = states[i % streams]
        step_s = 0.1 + 0.003 * streams * (1 + rng.random() * 0.1)
        started = time.perf_counter()
        # the router's calls, in its order (serve/router.py `_rounds`)
        peak.observe(now, streams)
        deciding = modes.deciding_load(streams, first_round=False, peak_in_flight=peak.value(now))
        ticket = modes.begin(now, deciding, prefilling=False, catching_up=catch_up_owed(states), first_round=False,
                             switch_cost_s=switch_cost_s(load, states), off_predicted=load.off_goodput(deciding),
                             model_yield=state.model_yield, room_tokens=room_tokens(states))
        measured_level = modes.measures(streams)
        state.plan_round(policy, load, measured_off=ticket.mode == "off", measured_level=measured_level,
                         alone=streams == 1)
        state.draft_sync_due(others_prefilling=False, measured_level=measured_level,  # only its cost counts here
                             peak_measured=modes.measures(peak.value(now)))
        k = state.round_k()
        speculated += k > 0
        accepted = min(k, int(rng.expovariate(0.4)))
        load.observe_target(streams, streams * (k + 1), step_s)
        if k and spec.draft_cost == "pool":
            load.observe_draft(streams, 0.03)
        load.observe_overhead(0.004 + 0.002 * rng.random(), draft_call=k > 0 and spec.draft_cost == "pool")
        if state.acceptance is not None:
            state.acceptance.observe(k, accepted, asked=k)
        modes.end(ticket, accepted + 1, step_s)
        elapsed += time.perf_counter() - started
        # what the round did to the request, outside the timing
        state.output_ids.extend([7] * (accepted + 1))
        if k:
            state.draft_synced = len(state.token_ids) - accepted - 1
        now += step_s / streams
    return elapsed / rounds, speculated / rounds


def target_step_seconds(target: str, tokens: int = 48) -> float:
    """The target's decode step at batch 1 as specserve's torch engine runs it: a greedy
    target-only generation of `tokens` tokens less one of a single token (the prefill), over
    the steps between."""
    from specserve.decoder import SpeculativeDecoder
    from specserve.loading import load_pair

    pair = load_pair(target, release_model_weights=True)
    decoder = SpeculativeDecoder(pair.verifier(), pair.proposer(), tokenizer=pair.tokenizer,
                                 eos_token_ids=set(), method="none", max_context=pair.max_context)
    prompt = pair.tokenizer.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")

    def timed(max_tokens: int) -> float:
        started = time.perf_counter()
        decoder.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        return time.perf_counter() - started

    timed(4)  # warm up
    best = min(timed(tokens) - timed(1) for _ in range(3))
    return best / (tokens - 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-ms", type=float, default=None,
                        help="the target's decode step to compare with (default: time the default target's)")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--rounds", type=int, default=4000, help="rounds timed per cell (best of 3)")
    args = parser.parse_args(argv)
    if args.step_ms is None:
        print(f"timing {args.target}'s decode step at batch 1 ...", file=sys.stderr, flush=True)
        step_s = target_step_seconds(args.target)
        source = f"{args.target}, specserve's torch engine, batch 1, measured now"
    else:
        step_s, source = args.step_ms / 1000, "given (--step-ms)"
    print(f"target decode step: {step_s * 1000:.1f} ms ({source})\n")
    print("| method | requests in flight | the epochs run | policy per round | share of a target step "
          "| rounds that speculated |")
    print("|---|---|---|---|---|---|")
    worst = 0.0
    for name, spec in METHODS.items():
        for streams in STREAMS:
            for epochs in ("model", "off") if MeasuredModes().measures(streams) else ("model",):
                runs = [policy_seconds_per_round(spec, streams, args.rounds, random.Random(streams),
                                                 epochs_off=epochs == "off") for _ in range(3)]
                seconds, speculated = min(runs)
                worst = max(worst, seconds / step_s)
                print(f"| {name} | {streams} | {epochs} | {seconds * 1e6:.1f} µs | {seconds / step_s:.3%} "
                      f"| {speculated:.0%} |", flush=True)
    print(f"\nlargest share: {worst:.3%} of a target step (goal: at most 1%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
