"""The load-aware speculation policy (specserve.policy): pure, on traces of load and acceptance.

The traces follow what the pools report on this machine's default pair (a target step of
~75 ms plus ~3.4 ms per batch token, a draft step of ~24 ms plus ~0.7 ms per token), with
seeded noise.
"""

from __future__ import annotations

import json
import random

import pytest

from specserve.policy import (AcceptanceTracker, DecodeCurve, LoadModel, MeasuredModes, PolicyConfig, PrefillWatch, RecentPeak,
                              SpeculationPolicy, StepTimeModel, _EpochGoodput, _ModeGoodput,
                              switch_catch_up_tokens)
from specserve.protocol import SamplingParams, Speculation, TokenTree, VerifyResult
from specserve.request_state import RequestState, room_tokens

TARGET = (0.075, 0.0034)  # fixed s, s per token
DRAFT = (0.024, 0.0007)


def step(line: tuple[float, float], tokens: float, rng: random.Random, noise: float = 0.1) -> float:
    return (line[0] + line[1] * tokens) * (1 + rng.uniform(-noise, noise))


def loaded_model(rng: random.Random, batches=(1, 2, 4, 8)) -> LoadModel:
    """A load model that has seen target passes of several sizes and some draft steps."""
    load = LoadModel()
    for _ in range(20):
        for b in batches:
            load.observe_target(b, b * 5, step(TARGET, b * 5, rng))
            load.observe_draft(b, step(DRAFT, b, rng))
        load.observe_target(1, 256, step(TARGET, 256, rng))  # a prefill chunk
    return load


def measured(rate: float, positions: int = 8) -> AcceptanceTracker:
    return AcceptanceTracker([rate] * positions, prior=rate, rounds=10, ages=[0] * positions)


def test_step_model_recovers_the_line_from_noisy_passes():
    rng = random.Random(0)
    model = StepTimeModel()
    for _ in range(300):
        tokens = rng.choice([1, 3, 5, 17, 40, 256])
        model.observe(tokens, step(TARGET, tokens, rng, noise=0.05))
    fixed, per_token = model.coefficients()
    assert fixed == pytest.approx(TARGET[0], rel=0.15)
    assert per_token == pytest.approx(TARGET[1], rel=0.15)


def test_step_model_with_one_batch_size_leans_on_the_prior_knee():
    model = StepTimeModel(prior_tokens=32)
    for _ in range(50):
        model.observe(1, 0.08)
    fixed, per_token = model.coefficients()
    assert model.predict(1) == pytest.approx(0.08, rel=0.01)  # what it saw
    assert fixed / per_token == pytest.approx(33, rel=0.1)  # the knee it assumed
    assert not StepTimeModel().observed and StepTimeModel().predict(10) == 0.0


def test_acceptance_counts_positions_until_the_first_rejection():
    tracker = AcceptanceTracker([0.5] * 4, prior=0.5, weight=0.5)
    tracker.observe(4, 2)  # positions 0, 1 accepted, 2 rejected, 3 unseen
    assert tracker.rates == [0.75, 0.75, 0.25, 0.5]
    tracker.observe(4, 4)
    assert tracker.rates == [0.875, 0.875, 0.625, 0.75]
    assert tracker.expected_tokens(0) == 1.0
    assert tracker.expected_tokens(2) == pytest.approx(1 + 0.875 + 0.875 ** 2)


def test_new_requests_start_from_what_the_deployment_measured():
    policy = SpeculationPolicy()
    first = policy.tracker("draft/chain", 4)
    for _ in range(200):
        first.observe(4, 4)
    second = policy.tracker("draft/chain", 4)
    assert second.rates[0] > 0.95 and second.rounds == 200
    assert policy.tracker("medusa/tree", 4).rates[0] == PolicyConfig().prior_acceptance  # another kind
    # one request ending on a streak of rejections does not set the start of the next: the
    # deployment's estimate averages many requests' rounds (a request's own reacts faster)
    for _ in range(10):
        second.observe(4, 0)
    assert second.rates[0] < 0.4 and policy.tracker("draft/chain", 4).rates[0] > 0.75


@pytest.mark.parametrize("draft_cost", ["pool", "co_located"])
def test_k_falls_to_zero_as_load_rises_and_comes_back_when_it_falls(draft_cost):
    rng = random.Random(1)
    load = loaded_model(rng)
    policy, acceptance = SpeculationPolicy(), measured(0.75)
    batches = [1] * 20 + [2, 4, 8, 16, 32, 64, 128] + [256] * 20 + [64, 16, 4] + [1] * 20
    ks, k = [], 4
    for batch in batches:
        k = policy.choose(acceptance, load, current=k, max_k=8, batch=batch, draft_cost=draft_cost).k
        ks.append(k)
    assert all(k > 0 for k in ks[:20]), ks
    assert all(k == 0 for k in ks[27:47]), ks  # saturated: off
    assert all(k > 0 for k in ks[-20:]), ks  # recovered
    assert ks[20:27] == sorted(ks[20:27], reverse=True)  # down monotonically with the load


def test_it_does_not_flap_on_a_noisy_trace_at_the_threshold():
    """The batch hovers around the size where speculation stops paying (about 18 requests
    here) and step times are noisy. Deciding on the raw batch without hysteresis flips the
    decision again and again; the policy as configured (batch EMA, hysteresis) a few times."""
    def switches(hysteresis: float, smoothed: bool) -> int:
        rng = random.Random(2)
        load = loaded_model(rng)
        policy, acceptance = SpeculationPolicy(PolicyConfig(hysteresis=hysteresis)), measured(0.7)
        k, changes = 4, 0
        for _ in range(400):
            batch = rng.choice([12, 14, 16, 18, 20, 22, 24])
            load.observe_target(batch, batch * (1 + k), step(TARGET, batch * (1 + k), rng, noise=0.2))
            new = policy.choose(acceptance, load, current=k, max_k=8,
                                batch=load.batch_ema if smoothed else batch).k
            changes += new != k
            k = new
        return changes

    assert switches(0.0, smoothed=False) >= 20
    assert switches(PolicyConfig().hysteresis, smoothed=True) <= 3


def test_it_never_speculates_where_its_own_model_says_speculation_loses():
    rng = random.Random(3)
    policy = SpeculationPolicy()
    for _ in range(500):
        load = loaded_model(rng, batches=(1, rng.choice([2, 8, 32])))
        acceptance = measured(rng.uniform(0.05, 0.95))
        current = rng.randrange(9)
        decision = policy.choose(acceptance, load, current=current, max_k=8, batch=rng.choice([1, 4, 16, 64, 256]),
                                 draft_cost=rng.choice(["pool", "co_located"]))
        assert decision.k == 0 or decision.goodput[decision.k] > decision.goodput[0]


def drafted_round(tracker: AcceptanceTracker, k: int, rate: float, rng: random.Random, asked: int | None = None) -> None:
    """One round of k drafted positions, each accepted with probability `rate`."""
    accepted = 0
    while accepted < k and rng.random() < rate:
        accepted += 1
    tracker.observe(k, accepted, asked=asked)


@pytest.mark.parametrize("probe_every", [16, 10 ** 9])
def test_an_unlucky_estimate_of_a_deep_position_is_measured_again(probe_every):
    """Drafts are accepted 90% of the time at every position, but the request's first rounds
    rejected at position 1, so its estimate there is 0.3 and its best k looks like 1. Without
    probing, position 1 is never drafted again and the request stays at k = 1 for good."""
    rng = random.Random(9)
    load = loaded_model(rng)
    policy = SpeculationPolicy(PolicyConfig(probe_every=probe_every))
    tracker = AcceptanceTracker([0.9, 0.3, 0.9, 0.9, 0.9, 0.9], prior=0.6, rounds=10, ages=[0] * 6)
    k, reasons = 1, set()
    for _ in range(300):
        decision = policy.choose(tracker, load, current=k, max_k=6, batch=1)
        k = decision.k
        reasons.add(decision.reason)
        if k == 0:
            tracker.relax()
        else:
            drafted_round(tracker, k, 0.9, rng)
    if probe_every == 16:
        assert k >= 3 and "probe" in reasons
    else:
        assert k == 1 and reasons == {"model"}


def test_a_request_that_stops_speculating_drifts_toward_the_deployment_not_the_prior():
    policy = SpeculationPolicy(PolicyConfig(prior_acceptance=0.6))
    for _ in range(300):
        policy.tracker("draft/chain", 2).observe(2, 2)  # the deployment: accepted almost always
    unlucky = policy.tracker("draft/chain", 2)
    unlucky.rates, unlucky.ages = [0.1, 0.1], [0, 0]  # its own drafts, rejected
    for _ in range(200):
        unlucky.relax()
    assert unlucky.rates[0] > 0.9 and unlucky.ages == [200, 200]
    alone = AcceptanceTracker([0.1], prior=0.6)
    for _ in range(200):
        alone.relax()
    assert alone.rates[0] == pytest.approx(0.6, abs=0.01)


def test_a_draft_call_overhead_measured_in_a_burst_does_not_keep_speculation_off():
    """The draft call's overhead is measured only in rounds that call the draft pool. One
    measured while a round queued behind another request's draft-pool prefill (0.7 s) must not
    keep speculation off for good: once no round has called the draft pool for a while, it
    drifts back toward the target-only overhead and the policy drafts again (while rounds with
    and without draft calls mix, each keeps its own measurement: the next test)."""
    load = loaded_model(random.Random(11))
    policy = SpeculationPolicy()
    good = AcceptanceTracker([0.8] * 4, rounds=50, ages=[0] * 4)
    load.observe_overhead(0.7, draft_call=True)
    assert policy.choose(good, load, current=0, max_k=4, batch=1).k == 0
    for _ in range(load.overhead_stale_rounds):
        load.observe_overhead(0.01)
    assert load.round_overhead(True) == pytest.approx(0.7)  # not stale yet
    for _ in range(150):
        load.observe_overhead(0.01)
    assert load.round_overhead(True) < 0.02
    assert policy.choose(good, load, current=0, max_k=4, batch=1).k > 0


def test_a_draft_pool_round_pays_its_own_round_trip():
    """Rounds that call the draft pool carry one more RPC than target-only rounds; the two
    overheads are kept apart, so turning speculation off does not inherit the draft's."""
    load = loaded_model(random.Random(10))
    for _ in range(50):
        load.observe_overhead(0.002)
        load.observe_overhead(0.030, draft_call=True)
    assert load.round_overhead(False) == pytest.approx(0.002, rel=1e-3)
    assert load.round_overhead(True) == pytest.approx(0.030, rel=1e-3)
    policy = SpeculationPolicy()
    pool = policy.round_seconds(2, load, 1, nodes=2, width=1, draft_cost="pool")
    heads = policy.round_seconds(2, load, 1, nodes=2, width=1, draft_cost="co_located")
    off = policy.round_seconds(0, load, 1, nodes=0, width=1, draft_cost="pool")
    assert pool == pytest.approx(0.030 + 2 * load.draft.predict(1) + load.target.predict(3))
    assert heads == pytest.approx(0.002 + 0.02 * load.target.predict(1) + load.target.predict(3), rel=1e-3)
    assert off == pytest.approx(0.002 + load.target.predict(1), rel=1e-3)


def test_a_round_that_spans_several_passes_pays_for_every_pass_s_drafts():
    """16 requests in flight on pools of batch 8 (this machine's default pair, lines fitted from
    a 16-stream trace): a round spans two passes of each pool, and each request waits for the
    other batch's drafting and verifying as well as its own. Counted as a constant overhead
    (what an off round measured of the other pass), the other batch's drafts were free: the
    model priced k = 1 at 1.2x off, and every model epoch there lost to off. Priced per pass,
    off wins, as measured."""
    target, draft = (0.17, 0.0079), (0.067, 0.004)
    load = LoadModel()
    for _ in range(30):
        for tokens in (8, 16, 24, 40):
            load.observe_target(8, tokens, target[0] + target[1] * tokens)
            load.observe_draft(tokens // 2, draft[0] + draft[1] * (tokens // 2))
    chat = measured(0.6)
    policy = SpeculationPolicy()
    one_pass = load.target.predict(8)
    load.in_flight = 16
    assert load.passes(8) == 2
    assert policy.round_seconds(0, load, 8, nodes=0, width=1, draft_cost="pool") == pytest.approx(2 * one_pass)
    assert policy.round_seconds(1, load, 8, nodes=1, width=1, draft_cost="pool") == pytest.approx(
        2 * (load.draft.predict(8) + load.target.predict(16)))
    assert policy.choose(chat, load, current=1, max_k=4, batch=8).k == 0
    # the same round seen as one pass plus the other pass's time as overhead: speculation "wins"
    load.in_flight = 8
    for _ in range(50):
        load.observe_overhead(one_pass)
        load.observe_overhead(one_pass, draft_call=True)
    assert policy.choose(chat, load, current=1, max_k=4, batch=8).k > 0
    # at 8 in flight (one pass a round, nothing to wait for) off wins again
    for _ in range(50):
        load.observe_overhead(0.0)
        load.observe_overhead(0.0, draft_call=True)
    assert policy.choose(chat, load, current=1, max_k=4, batch=8).k == 0


def test_low_acceptance_turns_speculation_off_even_when_idle():
    load = loaded_model(random.Random(4))
    decision = SpeculationPolicy().choose(measured(0.05), load, current=4, max_k=8, batch=1)
    assert decision.k == 0


def test_a_new_request_warms_up_at_its_configured_depth_unless_that_loses_at_this_load():
    policy, load = SpeculationPolicy(), loaded_model(random.Random(5))
    idle = policy.choose(policy.tracker("draft/chain", 8), load, current=8, max_k=8, batch=1)
    assert (idle.k, idle.reason) == (8, "warmup")
    # a burst on a saturated pool: even at the prior acceptance drafting loses, so it does not
    saturated = policy.choose(policy.tracker("draft/chain", 8), load, current=8, max_k=8, batch=256)
    assert (saturated.k, saturated.reason) == (0, "warmup")
    assert saturated.goodput[0] == max(saturated.goodput.values())


def _state(spec: Speculation) -> RequestState:
    return RequestState("r", [1, 2, 3], SamplingParams(max_tokens=100), spec)


def test_an_explicit_setting_wins_over_the_policy():
    adaptive = Speculation(proposer="draft", k=6, policy="adaptive")
    explicit = adaptive.overridden(k=3)  # a request's {"k": 3}
    assert explicit.policy == "fixed"
    assert adaptive.overridden(k=3, policy="adaptive").policy == "adaptive"
    assert adaptive.overridden(acceptance="exact").policy == "adaptive"  # not a depth setting
    policy, load = SpeculationPolicy(), loaded_model(random.Random(6))
    state = _state(explicit)
    state.output_ids = [7]
    assert state.plan_round(policy, load, batch=512) is None and state.round_k() == 3


def test_a_seeded_sampled_request_keeps_its_depth_so_the_seed_reproduces():
    policy, load = SpeculationPolicy(PolicyConfig(warmup_rounds=0)), loaded_model(random.Random(8))
    spec = Speculation(proposer="draft", k=4, policy="adaptive")
    seeded = RequestState("r", [1, 2, 3], SamplingParams(temperature=0.8, seed=3, max_tokens=100), spec)
    seeded.output_ids = [7]
    assert seeded.plan_round(policy, load, batch=1024) is None and seeded.round_k() == 4
    assert seeded.usage_stats()["policy"] == "fixed"
    unseeded = RequestState("r", [1, 2, 3], SamplingParams(temperature=0.8, max_tokens=100), spec)
    unseeded.output_ids = [7]
    unseeded.acceptance = measured(0.8)
    assert unseeded.plan_round(policy, load, batch=1024).k == 0


def test_request_state_follows_the_policy_and_records_its_decisions():
    policy, load = SpeculationPolicy(PolicyConfig(warmup_rounds=0)), loaded_model(random.Random(7))
    state = _state(Speculation(proposer="draft", k=4, policy="adaptive"))
    state.output_ids = [7]
    state.acceptance = measured(0.8)
    state.plan_round(policy, load, batch=1)
    assert state.round_k() > 0
    state.commit(VerifyResult("r", 2, [5, 6, 8]), TokenTree.chain([5, 6, 9, 9][: state.round_k()]))
    state.plan_round(policy, load, batch=1024)
    assert state.round_k() == 0
    state.commit(VerifyResult("r", 0, [4]), TokenTree())
    usage = state.usage_stats()
    assert usage["speculation_off_share"] == 0.5
    assert sum(usage["k_histogram"].values()) == 2 and usage["k_histogram"]["0"] == 1
    assert usage["policy"] == "adaptive"


def run_modes(modes: MeasuredModes, segments, rng: random.Random, noise: float = 0.2) -> list[dict]:
    """Drive MeasuredModes with requests that run rounds back to back, as the router's do.
    `segments`: (seconds, requests in flight, goodput with the model's choice, goodput with
    speculation off), all requests together; a round off emits 1 token, one of the model 2, and
    each lasts what its mode's goodput gives a request, +-`noise`. Returns the epochs begun, in
    order: {"epoch", "t", "in_flight", "mode", "warm_up"}."""
    import heapq

    epochs, now, order = [], 0.0, 0
    for seconds, in_flight, model_goodput, off_goodput in segments:
        end = now + seconds
        ready = [(now, i, None, 0.0) for i in range(in_flight)]  # (when, order, the round ending then, its s)
        order = in_flight
        while ready:
            now, _, ticket, round_s = heapq.heappop(ready)
            if ticket is not None:
                modes.end(ticket, 2 if ticket.mode == "model" else 1, round_s)
            if now >= end:
                continue  # the segment is over: this request's rounds stop
            ticket = modes.begin(now, in_flight)
            if not epochs or epochs[-1]["epoch"] != modes.epoch:
                epochs.append({"epoch": modes.epoch, "t": now, "in_flight": in_flight, "mode": ticket.mode,
                               "warm_up": modes.warming_up})
            tokens = 2 if ticket.mode == "model" else 1
            round_s = tokens * in_flight / (model_goodput if ticket.mode == "model" else off_goodput)
            round_s *= 1 + rng.uniform(-noise, noise)
            order += 1
            heapq.heappush(ready, (now + round_s, order, ticket, round_s))
        now = end
    return epochs


def measured_epochs(epochs: list[dict]) -> list[str]:
    """The modes of the epochs that measure (warm-ups left out)."""
    return [e["mode"] for e in epochs if not e["warm_up"]]


def test_measured_goodput_turns_speculation_off_where_it_loses_and_back_on_when_load_falls():
    """At 8 requests speculating measures 20 tok/s and off 26 (the default pair on 2 cores, where
    the per-round model sees too little of speculation's cost); alone, speculation wins."""
    modes = MeasuredModes(epoch_s=2.0)
    epochs = run_modes(modes, [(20, 1, 10, 7.5), (200, 8, 20, 26), (20, 1, 10, 7.5)], random.Random(3))
    alone = [e for e in epochs if e["in_flight"] == 1]
    assert all(e["mode"] == "model" for e in alone) and len({e["t"] >= 200 for e in alone}) == 2
    loaded = measured_epochs([e for e in epochs if e["in_flight"] == 8])
    assert loaded[:2] == ["model", "off"]  # both measured first
    assert loaded.count("off") >= 0.75 * len(loaded)  # then mostly off ...
    assert 2 <= loaded.count("model") <= 8  # ... measuring the model again now and then
    assert modes.current == "model" and modes.levels[MeasuredModes.level(8)].off > \
        modes.levels[MeasuredModes.level(8)].model


def test_a_first_look_at_the_model_above_a_level_that_runs_off_keeps_to_the_budget():
    """The model's lead falls as load rises: above a level that decided off, the first look at
    the model is an exploration, due once the level ran ~19x the lower level's last warm-up
    (explore_budget 5%); off runs and is measured meanwhile. Above a level that runs the
    model, or at a level with none below, the look is at once."""
    for seed in range(3):
        modes = MeasuredModes(epoch_s=2.0)
        epochs = run_modes(modes, [(200, 8, 20, 26), (150, 16, 22, 34)], random.Random(seed))
        lower = modes.levels[MeasuredModes.level(8)]
        assert modes._best(lower) == "off" and lower.warm_up_s > 0
        wait = modes._budget_wait(lower.warm_up_s)
        sixteen = [e for e in epochs if e["in_flight"] == 16]
        looks = [e["t"] - 200 for e in sixteen if e["mode"] == "model"]
        assert looks and min(looks) >= wait > 10, (looks, wait)
        assert sixteen[0]["mode"] == "off" and modes.levels[MeasuredModes.level(16)].off is not None
        # above a level where the model won, and at a fresh level, the look is at once
        for segments in ([(200, 8, 36, 26), (150, 16, 22, 34)], [(150, 16, 22, 34)]):
            modes = MeasuredModes(epoch_s=2.0)
            start = sum(seconds for seconds, *_ in segments[:-1])
            epochs = run_modes(modes, segments, random.Random(seed))
            assert [e["mode"] for e in epochs if e["in_flight"] == 16][0] == "model", segments
            assert modes._first_look_s(MeasuredModes.level(16)) == 0.0
            assert min(e["t"] for e in epochs if e["in_flight"] == 16 and e["mode"] == "model") == start


def test_a_first_look_above_a_level_that_runs_off_does_not_begin_while_prompts_prefill():
    """Such a look is an exploration, and no exploration begins while prompts prefill: at chat
    16 streams the look opened at a wave's start, the draft pool prefilled the wave's prompts
    beside the target's, and the wave's prefills took 64 s against always on's 53 and always
    off's 48 (that pass 0.82x always off). A look with no level below that runs off begins at
    once, prefilling or not (always on prefills the same prompts)."""
    modes = MeasuredModes(epoch_s=1.0, max_token_error=None)
    lower = modes._measured(MeasuredModes.level(8))
    lower.model, lower.off, lower.warm_up_s = 8.3, 7.7, 6.0  # decided off (lead < 1.2)
    lower.measurements = {"model": 2, "off": 1}
    assert modes._best(lower) == "off"
    level = modes._measured(MeasuredModes.level(16))
    level.clock, level.seen = 10 * modes._budget_wait(6.0), 0.0  # the budget allows the look
    level.off, level.measurements, level.epochs = 9.8, {"off": 3}, 3
    assert modes._first_look_s(MeasuredModes.level(16)) == 6.0
    assert modes._next(MeasuredModes.level(16), 16, prefilling=True, catching_up=False) == ("off", False)
    assert modes._next(MeasuredModes.level(16), 16, prefilling=False, catching_up=False) == ("model", False)
    # with the model the lower level's decision, the look begins while prompts prefill
    lower.model = 10.0
    assert modes._first_look_s(MeasuredModes.level(16)) == 0.0
    assert modes._next(MeasuredModes.level(16), 16, prefilling=True, catching_up=False) == ("model", False)


def test_measured_goodput_keeps_the_model_where_speculation_wins_and_does_not_flap():
    """Speculation 30% better at 4 requests, noisy rounds: off runs only to re-measure it."""
    modes = MeasuredModes(epoch_s=2.0)
    runs = measured_epochs(run_modes(modes, [(300, 4, 13, 10)], random.Random(4), noise=0.3))
    off = [i for i, mode in enumerate(runs) if mode == "off"]
    assert 1 <= len(off) <= len(runs) // modes.explore_every + 1
    assert all(b - a > 1 for a, b in zip(off, off[1:]))  # never two off epochs in a row


def test_explorations_back_off_while_they_confirm_the_better_mode_and_follow_a_change():
    """Each exploration of the worse mode costs (on a CPU, the draft pool's catch-up burst), so
    while explorations keep confirming off, they come ever more rarely; when speculation starts
    winning at that load, the next exploration finds it and the model runs again."""
    modes = MeasuredModes(epoch_s=2.0)
    epochs = run_modes(modes, [(300, 8, 20, 26), (300, 8, 30, 20)], random.Random(5))
    first = measured_epochs([e for e in epochs if e["t"] < 300])
    explored = [i for i in range(2, len(first)) if first[i] == "model"]  # after the first measurements
    assert 3 <= len(explored) <= 6  # every 5th epoch would be 15 or more
    waits = [b - a for a, b in zip(explored, explored[1:])]  # epochs off between explorations
    # ever more rarely (the epochs' wait doubles up to max_explore_every; the budget's, which an
    # exploration's shortfall against off lengthens, spaces the first ones already)
    assert waits == sorted(waits) and waits[-1] > waits[0]
    assert measured_epochs(epochs)[-10:].count("model") >= 8  # speculation wins now: found, and kept
    # each exploration of the model opened with a warm-up
    assert all(before["warm_up"] for before, e in zip(epochs, epochs[1:])
               if e["t"] < 300 and e["mode"] == "model" and not e["warm_up"])
    assert modes.levels[MeasuredModes.level(8)].explore_every <= modes.max_explore_every


def test_explorations_back_off_where_the_modes_tie():
    """Where speculating and not measure the same (within the hysteresis), no exploration can
    change much, and each one costs: they come ever more rarely too, whichever mode runs."""
    modes = MeasuredModes(epoch_s=2.0)
    runs = measured_epochs(run_modes(modes, [(500, 8, 25, 25.5)], random.Random(7), noise=0.01))
    switches = [i for i in range(2, len(runs)) if runs[i] != runs[i - 1]]
    assert 3 <= len(switches) <= 16  # off runs, each exploration two switches; every 5th epoch: more than 30
    assert modes.levels[MeasuredModes.level(8)].explore_every > modes.explore_every


def test_an_exploration_of_off_that_finds_a_tie_overturns_the_decision():
    """A level that decided for the model (it led by more than `model_margin`) turns to off
    where it leads by at most `keep_margin`, so an exploration of off that brings off within
    that overturns the decision, and the next exploration (of the model, now the worse mode)
    waits the first interval again, not twice as long. One that finds the model still past
    `keep_margin`, if no longer past `model_margin`, leaves it (hysteresis: at code 4 streams
    on an AVX-512 EPYC the lead went 1.25, 1.23, 1.17 over three pairs, and the single margin
    turned the wave of the third to off in its middle, its drafts' prompts paid)."""
    level = MeasuredModes.level(4)

    def explore_off(off_tok_s: float) -> MeasuredModes:
        modes = MeasuredModes(epoch_s=1.0, max_token_error=None)
        modes.levels[level] = _ModeGoodput(model=10.0, off=8.2, epochs=5, measurements={"model": 5, "off": 5},
                                           explore_every=10, next_explore=5, warmed=True, seen=0.0)
        now, rounds = 0.0, []
        while not rounds or modes.epoch == rounds[0].epoch:  # the exploration's epoch, to its close
            ticket = modes.begin(now, 4)
            rounds.append(ticket)
            modes.end(ticket, tokens=1, seconds=4 / off_tok_s)  # off's goodput at 4 requests
            now += 0.25
        assert rounds[0].mode == "off"  # explored: the level had decided for the model (10 > 1.2 x 8.2)
        modes.begin(now, 4)  # the next epoch: the decision
        return modes

    modes = explore_off(12.0)
    measured = modes.levels[level]
    assert measured.off == pytest.approx(8.2 + 0.3 * 3.8)  # 9.34: the model 1.07x, within keep_margin
    assert modes.current == "off" and measured.decided == "off"
    assert measured.explore_every == modes.explore_every  # reset (counted as not overturning, it doubled to 20)
    modes = explore_off(9.0)
    measured = modes.levels[level]
    assert measured.off == pytest.approx(8.2 + 0.3 * 0.8)  # 8.44: the model 1.18x, under model_margin
    assert modes.current == "model" and measured.decided == "model"  # past keep_margin: kept
    assert measured.explore_every == 2 * 10
    # from off the model must lead by model_margin again
    measured.decided = "off"
    assert modes._best(measured) == "off"


def test_an_epoch_measures_the_rounds_that_began_in_it_whole():
    """At 16 streams on this CPU a round of the model took ~5 s and one off ~1.5 s, longer than
    a 4-s epoch: counting the tokens of whatever rounds ended in an epoch credited each mode with
    the other's rounds. An epoch counts the rounds that began in its window, each whole even
    where it ends after the window (the tail runs the same mode until they have), and no round
    that began before it; goodput = their tokens / their seconds x requests in flight."""
    modes = MeasuredModes(epoch_s=4.0, max_token_error=None)
    before = modes.begin(0.0, 4)  # 4 requests; this epoch needs 4 round starts and 4 s
    others = [modes.begin(t, 4) for t in (0.1, 0.2, 0.3)]
    assert all(r.counted and r.mode == "model" for r in [before, *others])
    long = modes.begin(3.9, 4)  # still in the window: counted, whole, though it ends at 9.9
    late = modes.begin(4.5, 4)  # after the window: the tail, same mode, not counted
    assert long.counted and not late.counted and late.mode == "model"
    for r in (before, *others):
        modes.end(r, 4, 3.0)
    waiting = modes.begin(8.0, 4)
    assert waiting.mode == "model"  # `long` still runs: the epoch waits for it
    assert modes.levels[MeasuredModes.level(4)].model is None
    modes.end(late, 2, 2.0)  # not counted
    modes.end(waiting, 2, 1.5)
    modes.end(long, 8, 6.0)
    nxt = modes.begin(10.0, 4)
    assert nxt.mode == "off" and nxt.counted  # measured: the next epoch opens at once
    assert modes.levels[MeasuredModes.level(4)].model == pytest.approx((4 * 4 + 8) / (4 * 3.0 + 6.0) * 4)
    modes.end(before, 100, 1.0)  # a round of an epoch gone counts nowhere
    assert modes._tokens == 0


def test_an_epoch_that_changes_the_mode_measures_once_the_other_mode_s_rounds_ended():
    """Rounds of the last epoch's tail share the target's passes with the next epoch's first
    rounds: off's first rounds after the model ran beside 4-token verifies and the draft pool's
    work (chat, 8 streams: off measured 8.0 tok/s against the model's 9.0 where always off was
    9% faster). A switch's window opens once the other mode's rounds ended, its time from then."""
    modes = MeasuredModes(epoch_s=1.0, max_token_error=None)
    window = [modes.begin(t, 3) for t in (0.0, 0.1, 0.2)]
    tail = modes.begin(1.5, 3)  # after the window: the model's tail
    for r in window:
        modes.end(r, 4, 1.0)
    first_off = modes.begin(2.0, 3)  # off now, but the model's tail still runs
    assert first_off.mode == "off" and not first_off.counted and modes._settling
    assert modes.begin(2.5, 3).mode == "off"  # still settling: uncounted
    modes.end(tail, 3, 1.5)
    modes.end(first_off, 1, 0.5)
    counted = [modes.begin(t, 3) for t in (3.0, 3.1, 3.2)]
    assert all(r.counted and r.mode == "off" for r in counted)
    counted.append(modes.begin(3.9, 3))
    assert counted[-1].counted  # the window runs from 3.0, not from the switch at 2.0
    for r in counted:
        modes.end(r, 1, 0.5)
    assert modes.begin(4.1, 3).mode == "model"  # off measured, on its own rounds only
    assert modes.levels[MeasuredModes.level(3)].off == pytest.approx(4 / 2.0 * 3)


def test_a_switch_whose_other_mode_s_rounds_hang_measures_nothing():
    modes = MeasuredModes(epoch_s=1.0, max_epoch_s=10.0)
    window = [modes.begin(t, 3) for t in (0.0, 0.1, 0.2)]
    stuck = modes.begin(1.5, 3)  # a tail round that never ends
    for r in window:
        modes.end(r, 4, 1.0)
    epoch = modes.begin(2.0, 3).epoch
    assert modes.begin(13.0, 3).epoch > epoch  # given up after max_epoch_s
    assert modes.levels[MeasuredModes.level(3)].off is None
    modes.end(stuck, None)


def test_a_round_that_overlapped_an_arrival_is_not_measured():
    """Prompt prefills and draft pools' catch-ups come with arrivals, in either mode: a round
    that overlapped one measured the arrival, not its mode (taking only the prefills' time out
    of it left the slower passes it shared and the catch-ups in: at code 4 streams the model's
    epoch at a wave's turnover measured it 1.05x off where its mid-wave first look had 1.24x)."""
    modes = MeasuredModes(epoch_s=1.0, max_token_error=None)
    rounds = [modes.begin(t, 3) for t in (0.0, 0.1, 0.2)]
    modes.end(rounds[0], 4, 2.0)
    modes.end(rounds[1], 1, 6.0, overlapped=True)  # four prompts prefilled meanwhile: left out
    modes.end(rounds[2], 2, 1.0)
    assert modes.begin(1.0, 3).mode == "off"  # the window closed with all its rounds ended
    assert modes.levels[MeasuredModes.level(3)].model == pytest.approx((4 + 2) / (2.0 + 1.0) * 3)


def test_epochs_at_a_turnover_measure_the_modes_as_between_arrivals():
    """Both modes' epochs at the same level, each with some rounds at a wave's turnover (slow,
    overlapping arrivals): the estimates are the rounds between arrivals', so the mode an
    epoch at a turnover happened to run is not measured low."""
    modes = MeasuredModes(epoch_s=1.0, max_token_error=None)
    level = modes._measured(MeasuredModes.level(4))
    for mode, tokens, turnover in (("model", 3, False), ("model", 3, True), ("off", 1, True)):
        modes._start(0.0, MeasuredModes.level(4), 4, mode, False)
        rounds = [modes.begin(0.1 * i, 4) for i in range(4)]
        for i, r in enumerate(rounds):
            slow = turnover and i == 0
            modes.end(r, 1 if slow else tokens, 6.0 if slow else 1.0, overlapped=slow)
        assert modes._close(1.0, now=1.0)
    assert level.model == pytest.approx(3 * 4) and level.off == pytest.approx(4)


def test_the_model_s_window_stays_open_until_its_tokens_a_round_are_known():
    """The model's rounds emit 1 to k+1 tokens each: at code 4 streams a first look of 10 rounds
    (3.0 tokens a round, standard error 0.44) measured the model below off where always on's 403
    rounds averaged 3.5, and the level ran off. Its window stays open until the ended rounds pin
    their mean to `max_token_error`, or `max_window_epochs` epochs passed; off's (one token a
    round) closes as before."""
    modes = MeasuredModes(epoch_s=1.0, max_token_error=0.1, max_window_epochs=5.0)
    draws = iter([5, 2, 1, 5, 3, 2, 3, 2, 2, 5])  # the first look's tokens, then steady 4-token rounds
    t, tokens = 0.0, []
    while (ticket := modes.begin(t, 4)).mode == "model":  # each round ends before the next begins
        assert ticket.counted
        tokens.append(next(draws, 4))
        modes.end(ticket, tokens[-1], 0.5)
        t += 0.25
    # 10 noisy rounds were not enough (relative error 0.15); the 4-token rounds after them were
    assert 10 < len(tokens) < 20 and t < 5.0
    mean = sum(tokens) / len(tokens)
    error = (sum((x - mean) ** 2 for x in tokens) / (len(tokens) - 1) / len(tokens)) ** 0.5
    assert error <= 0.1 * mean
    assert modes.levels[MeasuredModes.level(4)].model == pytest.approx(sum(tokens) / (0.5 * len(tokens)) * 4)

    capped = MeasuredModes(epoch_s=1.0, max_token_error=0.01, max_window_epochs=3.0)
    rounds = 0
    while (ticket := capped.begin(0.1 * rounds, 4)).mode == "model":  # 1 and 5 tokens in turn: never precise
        capped.end(ticket, 1 + 4 * (rounds % 2), 0.05)
        rounds += 1
    assert rounds == 30  # the window closed at its cap, 3 epochs
    assert capped.levels[MeasuredModes.level(4)].model is not None

    alike = MeasuredModes(epoch_s=1.0, max_token_error=0.1)
    rounds = 0
    while (ticket := alike.begin(0.5 * rounds, 4)).mode == "model":  # one token a round, every round
        alike.end(ticket, 1, 0.4)
        rounds += 1
    assert rounds == 8  # a spread of 0 is believed from two rounds per request in flight, not three

    off = MeasuredModes(epoch_s=1.0, max_token_error=0.01)
    off._measured(MeasuredModes.level(4)).model = 5.0  # measured: off's turn
    window = [off.begin(t, 4) for t in (0.0, 0.1, 0.2, 0.3)]
    assert all(r.mode == "off" and r.counted for r in window)
    for r in window:
        off.end(r, 1, 0.5)
    off.begin(1.0, 4)  # closed by time and round starts, as before: one token a round is exact
    assert off.levels[MeasuredModes.level(4)].off == pytest.approx(8.0)


def test_a_level_not_seen_for_a_while_is_measured_afresh():
    """A level where no round began for `stale_s` (the pools may have been rescaled since)
    starts afresh: the model first, then off. Sooner than that, a level that load comes back to
    keeps its estimates: relearning it after a minute cost a closed loop at chat 8 streams ~10% a turn."""
    modes = MeasuredModes(epoch_s=1.0, max_token_error=None)
    assert modes.stale_s == 3600.0
    level = MeasuredModes.level(8)
    stale = modes._measured(level)
    stale.model, stale.off = 13.2, 8.8
    assert modes.begin(0.0, 8).mode == "model"
    modes.begin(0.0, 1)  # the load falls below the measured levels ...
    assert modes.begin(600.0, 8).mode == "model" and modes.levels[level].model == 13.2  # ... back in 10 min: kept
    modes.begin(600.0, 1)
    ticket = modes.begin(4300.0, 8)  # ... back after an idle hour: measured afresh
    fresh = modes.levels[level]
    assert ticket.mode == "model" and (fresh.model, fresh.off, fresh.warmed) == (None, None, False)
    rounds = [ticket] + [modes.begin(4300.0 + 0.1 * i, 8) for i in range(1, 8)]
    for r in rounds:
        modes.end(r, 2, 2.0)  # the model: 8 tok/s
    assert modes.begin(4302.0, 8, off_predicted=7.0).mode == "off"  # 8 is within off_margin of 7: off is measured
    assert modes.levels[level].model == pytest.approx(8.0)


def test_the_model_s_estimate_follows_the_acceptance():
    """Chat at 8 streams after code at 8 inherited code's estimate of the model (13.2 tok/s
    where chat's own epochs measured 6.3-9.5) and ran it while always off ran 1.2x always on.
    The model's goodput at a load scales with the tokens its rounds emit: the estimate is scaled
    by the yield expected now (the requests' acceptance) over the yield it was measured at, so
    a workload with poorer drafts goes to off without a look at the model, one with the drafts
    it was measured at goes back to it, and epochs at another yield average in alike."""
    level = MeasuredModes.level(4)
    modes = MeasuredModes(epoch_s=4.0, max_token_error=None, model_margin=0.2, yield_weight=1.0)
    # code: 2 tokens a round where its drafts expect 3.5, the model 2x off
    assert four_request_epoch(modes, 0.0, 2, model_yield=3.5) == "model"
    assert four_request_epoch(modes, 5.0, 1, model_yield=3.5) == "off"
    # chat's drafts expect 1.4 tokens a round: the model is 0.8x off, so off, without a look at it
    assert four_request_epoch(modes, 10.0, 1, model_yield=1.4) == "off"
    measured = modes.levels[level]
    assert (measured.model, measured.off, measured.model_yield) == (pytest.approx(2.0), pytest.approx(1.0), 3.5)
    assert modes.model_estimate(measured) == pytest.approx(0.8)
    assert modes.estimates(4)["model_scaled"] == pytest.approx(0.8)
    # code's acceptance again: the model
    assert four_request_epoch(modes, 15.0, 2, model_yield=3.5) == "model"
    assert modes.model_estimate(measured) == pytest.approx(2.0)
    # better drafts than measured do not raise it: the requests' estimates lag behind drafts
    # better than they have seen, so the measurement may already hold them (found by exploring)
    modes.begin(25.0, 4, model_yield=7.0)
    assert modes.model_estimate(measured) == pytest.approx(2.0)

    # The model running on (off predicted far below it): code's epoch, 3 tokens a round at
    # 3.5, then chat's, 1 at 1.5 (still far ahead of off's prediction at its own yield: 1.29 >
    # 1.6 x 0.5): the second epoch weighs 1/2, its yield too.
    modes = MeasuredModes(epoch_s=4.0, max_token_error=None, yield_weight=1.0)
    assert four_request_epoch(modes, 0.0, 3, model_yield=3.5, off_predicted=0.5) == "model"
    assert four_request_epoch(modes, 5.0, 1, model_yield=1.5, off_predicted=0.5) == "model"
    modes.begin(10.0, 4, model_yield=1.5, off_predicted=0.5)
    measured = modes.levels[level]
    assert (measured.model, measured.model_yield) == (pytest.approx(2.0), pytest.approx(2.5))
    assert modes.model_estimate(measured) == pytest.approx(2.0 * 1.5 / 2.5)
    # no yields given (a caller that does not know the acceptance): the goodput as measured
    plain = MeasuredModes(epoch_s=4.0, max_token_error=None)
    four_request_epoch(plain, 0.0, 2)
    plain.begin(5.0, 4)
    assert plain.levels[level].model_yield is None and plain.model_estimate(plain.levels[level]) == pytest.approx(2.0)


def test_a_mode_s_first_epochs_weigh_alike():
    """One short draw must not set a mode's estimate for good: its second epoch weighs as much
    as its first (then 1/3, then the EMA's weight)."""
    modes = MeasuredModes(epoch_s=1.0, max_token_error=None, weight=0.3)
    level = modes._measured(MeasuredModes.level(3))
    for goodput, expected in ((6.0, 6.0), (9.0, 7.5), (9.0, 8.0), (4.0, 8.0 - 0.3 * 4.0)):
        modes._start(0.0, MeasuredModes.level(3), 3, "model", False)
        for r in [modes.begin(t, 3) for t in (0.0, 0.1, 0.2)]:
            modes.end(r, int(goodput), 3.0)  # goodput tokens in 3 s x 3 requests / 3 rounds
        assert modes._close(1.0, now=1.0) and level.model == pytest.approx(expected)


def test_an_epoch_that_kept_under_half_its_rounds_measures_nothing_and_the_mode_is_measured_again():
    """At code 16 streams the model's first look opened while the wave's last prompts
    prefilled: 15 of its 16 rounds waited for them, and the one left (2 tokens in 2.7 s)
    measured the model at 11.8 tok/s where always on's steady state ran ~20, so off won and
    the switch back never fitted the budget. Under half the rounds kept: nothing measured."""
    modes = MeasuredModes(epoch_s=1.0, max_token_error=None)
    rounds = [modes.begin(t, 4) for t in (0.0, 0.1, 0.2, 0.3)]
    for r in rounds[:3]:
        modes.end(r, 4, 3.0, overlapped=True)  # overlapped the prefills: left out
    modes.end(rounds[3], 2, 2.7)
    again = modes.begin(3.5, 4)
    assert again.mode == "model" and again.counted  # measured nothing: the model again
    assert modes.levels[MeasuredModes.level(4)].model is None
    rest = [again] + [modes.begin(t, 4) for t in (3.6, 3.7, 3.8)]
    modes.end(rest[0], 2, 3.0, overlapped=True)  # one of four left out: 3 kept, measured
    for r in rest[1:]:
        modes.end(r, 4, 1.0)
    assert modes.begin(4.6, 4).mode == "off"
    assert modes.levels[MeasuredModes.level(4)].model == pytest.approx(12 / 3.0 * 4)


def test_an_adaptive_request_in_a_burst_leaves_its_prompt_s_catch_up_to_its_next_round():
    """A burst's requests enter one by one, so the first ones would decide at the load of the
    few before them; a first round that begins while other prompts prefill does not start its
    draft pool's catch-up (its next round, at the burst's load, decides). A lone request's
    does, a fixed setting's is not held back, and neither is one below the levels the epochs
    measure (the model speculates there anyway: held back, it would draft out of step with
    the others)."""
    prompt = list(range(1, 41))

    def request(policy):
        return RequestState("r", prompt, SamplingParams(max_tokens=100),
                            Speculation(proposer="draft", k=4, policy=policy), prefill_without_draft=True)

    adaptive = request("adaptive")
    assert adaptive.draft_sync_due() and not adaptive.draft_sync_due(others_prefilling=True)
    assert request("fixed").draft_sync_due(others_prefilling=True)
    assert adaptive.draft_sync_due(others_prefilling=True, measured_level=False)
    adaptive.output_ids = [7]  # its next round: the catch-up is due whoever prefills
    assert adaptive.draft_sync_due(others_prefilling=True)


def test_a_wave_s_first_requests_leave_their_prompts_catch_up_where_the_recent_peak_is_measured():
    """A wave's first requests enter at 1, 2, ... in rounds, below the levels the epochs
    measure, the first with no other prompt prefilling: where the router's recent peak is a
    measured level, their first rounds leave the prompt's catch-up to their next round anyway.
    At a steady measured level a lone prefill still starts its own, and where the peak is not
    measured (2 streams) nothing changes."""
    modes, peak = MeasuredModes(), RecentPeak(window_s=30)
    prompt = list(range(1, 41))

    def due(in_rounds, others_prefilling, now, policy="adaptive"):
        state = RequestState("r", prompt, SamplingParams(max_tokens=100),
                             Speculation(proposer="draft", k=4, policy=policy), prefill_without_draft=True)
        peak.observe(now, in_rounds)
        return state.draft_sync_due(others_prefilling=others_prefilling, measured_level=modes.measures(in_rounds),
                                    peak_measured=modes.measures(peak.value(now)))

    assert due(1, False, now=0.0) and due(2, True, now=1.0)  # 2 streams: no wave held back
    for level in range(1, 9):  # a wave of 8 ended
        peak.observe(2.0, level)
    assert not due(1, False, now=10.0) and not due(2, True, now=10.5)  # the next wave's first two
    assert due(1, False, now=10.0, policy="fixed")
    assert due(8, False, now=11.0)  # steady at 8, no other prompt prefilling: its own starts now
    assert not due(8, True, now=11.0)
    assert due(1, False, now=45.0)  # the peak went stale: a lone request after a quiet spell


def test_a_catch_up_left_to_a_later_round_is_owed_until_it_starts():
    """The router's warm-up of the model waits for owed catch-ups as for running ones: a
    request of a burst owes its prompt's until its second round starts it, and one that ran
    off owes what it emitted; a running catch-up, a round's usual sync and co-located heads
    owe nothing."""
    prompt = list(range(1, 41))
    state = RequestState("r", prompt, SamplingParams(max_tokens=100),
                         Speculation(proposer="draft", k=4, policy="adaptive"), prefill_without_draft=True)
    assert state.draft_catch_up_owed()  # the prompt: 40 unseen tokens
    state.output_ids = [7]  # its first round left it (others prefilled)
    assert state.draft_catch_up_owed()
    state.sync_request()
    assert not state.draft_catch_up_owed()  # it runs: PrefillWatch counts it
    state.draft_syncing = False
    state.output_ids = [7, 8, 9]
    assert not state.draft_catch_up_owed()  # 2 tokens behind: the next round's usual sync
    state.output_ids = list(range(7, 27))  # 20 tokens emitted with speculation off
    assert state.draft_catch_up_owed()
    state.output_ids = list(range(7, 7 + 99))  # one token of room left: no draft, no catch-up
    assert not state.draft_catch_up_owed()
    heads = RequestState("r", prompt, SamplingParams(max_tokens=100),
                         Speculation(proposer="medusa", k=4, policy="adaptive"), prefill_without_draft=True)
    assert not heads.draft_catch_up_owed()


def test_an_epoch_whose_load_changed_measures_nothing():
    modes = MeasuredModes(epoch_s=1.0, max_token_error=None)
    first = modes.begin(0.0, 8)
    assert first.mode == "model"
    second = modes.begin(0.5, 4)  # 8 -> 4 requests mid-epoch: nothing measured, a new epoch at 4
    assert second.mode == "model" and second.epoch != first.epoch
    modes.end(first, 100, 1.0)
    modes.end(second, 10, 1.0)
    [modes.end(modes.begin(t, 4), 10, 1.0) for t in (0.6, 0.7, 0.8, 1.5)]
    assert modes.begin(1.6, 4).mode == "off"
    assert modes.levels[MeasuredModes.level(8)].model is None
    assert modes.levels[MeasuredModes.level(4)].model == pytest.approx(10 / 1.0 * 4)


def test_n_streams_stay_in_one_level():
    """N streams keep N-1 or N requests in flight (one is often between rounds): both count as
    one level, or every flip would drop the epoch."""
    for streams in (4, 8, 16, 32):
        assert MeasuredModes.level(streams - 1) == MeasuredModes.level(streams)
    assert len({MeasuredModes.level(n) for n in (2, 4, 8, 16)}) == 4


def test_the_router_s_measured_off_turns_an_adaptive_request_off_but_not_an_explicit_setting():
    policy, load = SpeculationPolicy(), loaded_model(random.Random(5))
    adaptive = _state(Speculation(proposer="draft", k=4, policy="adaptive"))
    adaptive.acceptance = measured(0.9)
    assert adaptive.plan_round(policy, load, batch=1).k > 0
    decision = adaptive.plan_round(policy, load, batch=1, measured_off=True)
    assert (decision.k, decision.reason, adaptive.round_k()) == (0, "measured", 0)
    assert adaptive.plan_round(policy, load, batch=1).k > 0  # the next epoch's model choice
    fixed = _state(Speculation(proposer="draft", k=4))
    assert fixed.plan_round(policy, load, batch=1, measured_off=True) is None and fixed.round_k() == 4


def test_where_epochs_measure_the_modes_a_draft_pool_request_drafts_its_whole_depth_or_nothing():
    """There whether to speculate is the measured epochs' call, for every steered request at
    once, and a draft-pool request drafts its whole configured depth: the epochs then compare
    always on with always off. Requests that each turned the draft pool on or off split the
    target's passes into waves and owed it catch-ups, and depths the model picked from
    estimates learnt in the few rounds that speculated measured its estimates, not
    speculation (see RequestState.plan_round). Heads have neither cost: there the model still
    turns a request off."""
    policy, load = SpeculationPolicy(), loaded_model(random.Random(5))
    for proposer, co_located in (("draft", False), ("medusa", True)):
        state = _state(Speculation(proposer=proposer, k=4, policy="adaptive"))
        state.acceptance = measured(0.3)
        assert state.plan_round(policy, load, batch=64).k == 0  # saturated: the model says off
        decision = state.plan_round(policy, load, batch=64, measured_level=True)
        if co_located:
            assert decision.k == 0
        else:
            assert (decision.k, decision.reason) == (4, "measured")
        assert state.plan_round(policy, load, batch=64, measured_off=True, measured_level=True).k == 0


def test_a_request_alone_may_draft_up_to_solo_k_and_sharing_the_rounds_at_most_k():
    """Alone, a deep draft where the draft is sure costs only the request's own round; sharing
    the target's passes it would lengthen every request's round, which its own goodput does not
    count (a cap of 8 for every request ran code at 8 streams at 0.70x always on's k = 4)."""
    policy, load = SpeculationPolicy(), loaded_model(random.Random(9))
    spec = Speculation(proposer="draft", k=4, solo_k=8, policy="adaptive")
    assert (spec.cap(alone=True), spec.cap(alone=False)) == (8, 4)
    state = _state(spec)
    state.output_ids = [7]
    state.acceptance = measured(0.99)  # drafts this good pay deeper than 4 at batch 1
    alone = state.plan_round(policy, load, batch=1, alone=True)
    assert alone.k > 4 and max(alone.goodput) == 8
    shared = state.plan_round(policy, load, batch=2)
    assert shared.k == 4 and max(shared.goodput) == 4
    assert state.plan_round(policy, load, batch=64, measured_level=True).k == 4  # the epochs' depth stays k
    # a tree's depth is its own; solo_k is a chain's
    assert Speculation(proposer="draft", shape="tree", k=4, solo_k=8, policy="adaptive").cap(alone=True) == 12


def test_solo_k_belongs_to_the_adaptive_policy_and_a_request_s_own_k_drops_it():
    from specserve.protocol import SpecserveError
    from specserve.serve.config import AppArgs
    from specserve.serve.openai_api import SpeculationOverride

    deployment = Speculation(proposer="draft", k=4, solo_k=8, policy="adaptive")
    assert deployment.overridden(k=6, policy="adaptive").cap(alone=True) == 6  # its k is its longest chain
    assert deployment.overridden(k=3).policy == "fixed" and deployment.overridden(k=3).solo_k == 0
    assert deployment.overridden(policy="fixed").solo_k == 0
    assert deployment.overridden(acceptance="exact").solo_k == 8
    assert SpeculationOverride(solo_k=12).apply_to(deployment).cap(alone=True) == 12
    assert "up to 8 alone" in deployment.describe()
    with pytest.raises(SpecserveError, match="at least|in \\[k"):
        SpeculationOverride(solo_k=2).apply_to(deployment)
    with pytest.raises(SpecserveError, match="adaptive"):
        SpeculationOverride(k=4, solo_k=8).apply_to(deployment)  # an explicit k alone means fixed
    for speculation, message in (({"solo_k": 8, "policy": "fixed"}, "adaptive"), ({"solo_k": 3, "k": 4}, "solo_k")):
        with pytest.raises(ValueError, match=message):  # refused when the app is built
            AppArgs.model_validate({"target": {"model": "fake"}, "draft": {"model": "fake"},
                                    "speculation": speculation})
    built = AppArgs.model_validate({"target": {"model": "fake"}, "draft": {"model": "fake"},
                                    "speculation": {"solo_k": 8}})
    assert built.speculation.spec().cap(alone=True) == 8


def test_a_request_turned_off_by_an_unlucky_estimate_comes_back():
    """Drafts are accepted 80% of the time, but the deployment's estimate says 10% (what a
    stretch of bad prompts left): at batch 1 the model turns speculation off. Off, nothing is
    drafted and nothing measured, so only probing from off can bring it back, and it does."""
    rng = random.Random(12)
    load = loaded_model(rng)
    policy = SpeculationPolicy()
    shared = policy.tracker("draft/chain", 2).shared
    shared.rates, shared.ages, shared.rounds = [0.1, 0.1], [0, 0], 50
    tracker = policy.tracker("draft/chain", 2)
    tracker.ages = [0, 0]  # it has drafted (a new request's first round measures its own drafts)
    assert policy.choose(tracker, load, current=2, max_k=2, batch=1).k == 0
    ks, reasons = [], set()
    k = 0
    for _ in range(300):
        decision = policy.choose(tracker, load, current=k, max_k=2, batch=1)
        k = decision.k
        ks.append(k)
        reasons.add(decision.reason)
        if k == 0:
            tracker.relax()
        else:
            drafted_round(tracker, k, 0.8, rng)
    assert "probe" in reasons and ks[-50:].count(0) == 0  # back on, for good
    assert shared.rates[0] > 0.5  # and the deployment learned it too


def test_no_probing_from_off_when_speculation_clearly_loses():
    """Saturated (batch 64, the draft pool's steps on top): one drafted level loses to no
    speculation even at the prior acceptance, so the policy stays off and does not probe."""
    load = loaded_model(random.Random(13))
    tracker = measured(0.5)
    tracker.ages = [10 ** 6] * 8
    decision = SpeculationPolicy().choose(tracker, load, current=0, max_k=4, batch=64)
    assert decision.k == 0 and decision.reason == "model"


def test_only_requests_the_policy_steers_are_adaptive():
    assert _state(Speculation(proposer="draft", k=4, policy="adaptive")).adaptive
    assert not _state(Speculation(proposer="draft", k=4)).adaptive
    seeded = RequestState("r", [1, 2, 3], SamplingParams(temperature=0.8, seed=3, max_tokens=100),
                          Speculation(proposer="draft", k=4, policy="adaptive"))
    assert not seeded.adaptive and seeded.usage_stats()["policy"] == "fixed"


def test_a_catch_up_is_spread_over_the_rounds_left():
    """A request that was off must let the draft pool prefill what it missed before it drafts
    again. Spread over many remaining rounds that is cheap; with a few tokens left it is not,
    and the policy stays off (nor does it probe)."""
    load = loaded_model(random.Random(14))
    policy = SpeculationPolicy()
    good = measured(0.8)
    assert policy.choose(good, load, current=0, max_k=4, batch=1).k > 0
    assert policy.choose(good, load, current=0, max_k=4, batch=1, catch_up=600, room=1000).k > 0
    assert policy.choose(good, load, current=0, max_k=4, batch=1, catch_up=600, room=8).k == 0
    poor = measured(0.1)
    poor.prior, poor.ages = 0.6, [10 ** 6] * 8  # measured badly, long ago: probing is due
    assert policy.choose(poor, load, current=0, max_k=4, batch=1).reason == "probe"
    late = policy.choose(poor, load, current=0, max_k=4, batch=1, catch_up=600, room=8)
    assert late.k == 0 and late.reason == "model"
    # heads and prompt lookup have no catch-up to pay
    assert policy.choose(good, load, current=0, max_k=4, batch=1, catch_up=600, room=8,
                         draft_cost="co_located").k > 0


def test_request_state_tells_the_policy_what_the_draft_pool_missed():
    seen = []

    class Recording(SpeculationPolicy):
        def choose(self, acceptance, load, **kwargs):
            seen.append((kwargs["catch_up"], kwargs["room"]))
            return super().choose(acceptance, load, **kwargs)

    policy, load = Recording(PolicyConfig(warmup_rounds=0)), loaded_model(random.Random(15))
    state = _state(Speculation(proposer="draft", k=4, policy="adaptive"))
    state.acceptance = measured(0.8)
    state.plan_round(policy, load, batch=1)
    assert seen[-1] == (3, 100)  # the prompt: the draft pool has seen nothing yet
    state.propose_request()
    state.commit(VerifyResult("r", 2, [5, 6, 8]), TokenTree.chain([5, 6, 9]))
    state.plan_round(policy, load, batch=1)
    assert seen[-1] == (3, 97)  # the round's three tokens
    state.commit(VerifyResult("r", 0, [4]), TokenTree())  # a round without a draft
    state.plan_round(policy, load, batch=1)
    assert seen[-1] == (4, 96)


def test_a_probe_from_off_weighs_the_prefill_it_makes_the_draft_pool_do():
    """A probe from off makes the draft pool prefill everything the request emitted while off;
    a probe that finds nothing leaves speculation off, so that prefill is not spread over the
    rounds left but over those until the next probe. A small gap is probed; a long one is not:
    spread over those rounds it costs more than even drafts that were all accepted would gain."""
    load = loaded_model(random.Random(14))
    policy = SpeculationPolicy()
    poor = measured(0.1)
    poor.prior, poor.ages = 0.6, [10 ** 6] * 8  # probing is due
    assert policy.choose(poor, load, current=0, max_k=4, batch=4, catch_up=8, room=10 ** 6).reason == "probe"
    long_gap = policy.choose(poor, load, current=0, max_k=4, batch=4, catch_up=2000, room=10 ** 6)
    assert (long_gap.k, long_gap.reason) == (0, "model")


def test_the_policy_trace_records_a_round_and_what_the_decision_came_from(tmp_path):
    from specserve.protocol import PoolLoad
    from specserve.serve.policy_trace import PolicyTrace, trace_line

    load = loaded_model(random.Random(16))
    policy = SpeculationPolicy()
    state = _state(Speculation(proposer="draft", k=4, policy="adaptive"))
    decision = state.plan_round(policy, load, batch=1)
    result = VerifyResult("r", 1, [7, 8], load=PoolLoad.measured(3, 9, 1, 0.2, queued=2))
    trace = PolicyTrace(str(tmp_path / "trace.jsonl"))
    for mode in ("model", "off"):
        trace.write(trace_line(state, decision, mode=mode, in_flight=3, load=load, catch_up=3,
                               k=state.round_k(), round_s=0.25, result=result, proposal=None,
                               warming_up=mode == "model", counted=mode == "off", overlapped=mode == "off", epoch=7,
                               estimates={"model": 4.0, "off": None}, drafted_ahead=mode == "model",
                               ahead_wait_s=0.0123 if mode == "model" else None))
    lines = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert [(line["mode"], line["warming_up"], line["counted"], line["overlapped"], line["epoch"])
            for line in lines] == [("model", True, False, False, 7), ("off", False, True, True, 7)]
    assert lines[0]["estimates"] == {"model": 4.0, "off": None}
    first = lines[0]
    assert first["k"] == decision.k and first["reason"] == decision.reason == "warmup"
    assert first["goodput"] == {str(k): pytest.approx(g, abs=1e-3) for k, g in decision.goodput.items()}
    assert first["target_step"] == pytest.approx(list(load.target.coefficients()), abs=1e-5)
    assert first["target_load"] == {"calls": 3, "tokens_per_pass": 9.0, "seconds_per_pass": 0.2, "passes": 1,
                                     "queued": 2}
    assert first["draft_load"] is None and first["accepted"] == 1 and first["acceptance"] == [0.6] * 4
    assert first["off_predicted"] == pytest.approx(load.off_goodput(), abs=1e-3)
    assert first["decode_drift"] is None and first["off_overhead_s"] is None  # no decode passes timed, no off round
    assert first["drafted"] == 0 and first["survival"] == first["survival_accepted"] == []
    # where the round's time went
    assert first["verify_s"] == 0.0 and first["draft_s"] is None
    assert (first["drafted_ahead"], first["ahead_wait_s"]) == (True, 0.0123)
    assert (lines[1]["drafted_ahead"], lines[1]["ahead_wait_s"]) == (False, None)


def test_a_depth_asked_for_is_a_cap_the_proposer_may_stop_short_of():
    """A draft model stops where its confidence falls: asked for 4 it drafts 1-4 positions. The
    tracker measures how often it goes on at each position, and the expected drafted levels
    (the proposer's steps) and tokens of a round follow from that (checked exactly, then
    against rounds)."""
    halves = AcceptanceTracker([1.0] * 4, survival=[1.0, 0.5, 0.5, 0.5])
    assert halves.expected_drafted(4) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert halves.expected_tokens(4) == pytest.approx(1 + 1.875)
    tokens, drafted = halves.expectations(4)
    assert tokens == pytest.approx([halves.expected_tokens(k) for k in range(5)])
    assert drafted == pytest.approx([halves.expected_drafted(k) for k in range(5)])

    rng = random.Random(18)
    tracker = AcceptanceTracker([0.6] * 4, weight=0.02)
    drafted, tokens, rounds = 0, 0, 3000
    for _ in range(rounds):
        depth = 1
        while depth < 4 and rng.random() < 0.5:
            depth += 1
        accepted = 0
        while accepted < depth and rng.random() < 0.9:
            accepted += 1
        tracker.observe(depth, accepted, asked=4)
        drafted, tokens = drafted + depth, tokens + accepted + 1
    assert tracker.survive(0) == pytest.approx(1.0)
    assert [tracker.survive(d) for d in (1, 2, 3)] == pytest.approx([0.5] * 3, abs=0.12)
    assert tracker.expected_drafted(4) == pytest.approx(drafted / rounds, rel=0.1)
    assert tracker.expected_tokens(4) == pytest.approx(tokens / rounds, rel=0.1)


def test_a_draft_that_goes_on_where_it_is_right_is_credited_for_it():
    """A draft model goes on where it is confident, and that is where it is right: in easy
    stretches it drafts deep and is accepted, in hard ones it stops early and is rejected. The
    chance that it drafts a position after an accepted one is then higher than after any drafted
    one, and expected tokens must use the former (the cost, drafted levels, the latter)."""
    rng = random.Random(23)
    tracker = AcceptanceTracker([0.6] * 4, weight=0.001)  # a slow EMA: close to the mean
    drafted, tokens, rounds = 0, 0, 20000
    for _ in range(rounds):
        go_on, right = (0.95, 0.95) if rng.random() < 0.5 else (0.2, 0.3)
        depth = 1
        while depth < 4 and rng.random() < go_on:
            depth += 1
        accepted = 0
        while accepted < depth and rng.random() < right:
            accepted += 1
        tracker.observe(depth, accepted, asked=4)
        drafted, tokens = drafted + depth, tokens + accepted + 1
    assert tracker.expected_tokens(4) == pytest.approx(tokens / rounds, rel=0.05)
    assert tracker.expected_drafted(4) == pytest.approx(drafted / rounds, rel=0.05)
    assert tracker.survive_accepted(1) > tracker.survive(1) + 0.1
    # the same rates with survival after any draft: the deep positions' credit falls short
    unconditional = AcceptanceTracker(list(tracker.rates), survival=list(tracker.survival))
    assert unconditional.expected_tokens(4) < 0.9 * tokens / rounds


def test_a_draft_that_stops_when_unsure_keeps_its_cap_where_it_is_cheap():
    """Drafts that are accepted 95% of the time where the draft goes on, and it goes on 60% of
    the time: a cap of 4 costs steps and verified nodes only where the draft is sure, so at
    batch 1 the policy keeps the cap; saturated, it turns speculation off."""
    load = loaded_model(random.Random(17))
    policy = SpeculationPolicy()
    sure = AcceptanceTracker([0.95] * 4, rounds=50, ages=[0] * 4, survival=[1.0, 0.6, 0.6, 0.6])
    assert policy.choose(sure, load, current=4, max_k=4, batch=1).k == 4
    assert policy.choose(sure, load, current=4, max_k=4, batch=256).k == 0
    charged_in_full = policy.round_seconds(4, load, 1, nodes=4, width=1, draft_cost="pool")
    assert charged_in_full > policy.round_seconds(4, load, 1, nodes=sure.expected_drafted(4), width=1,
                                               draft_cost="pool")


def test_positions_a_request_stopped_drafting_age_back_toward_the_deployment():
    """The deployment's drafts are accepted 90% of the time at every position, but one
    request's first rounds were rejected at position 1, so its estimate there is 0.3 and its
    best k looks like 1. Rounds at k = 1 never measure position 1; without probing, its
    estimate still ages back toward the deployment's and the request drafts deeper again."""
    rng = random.Random(9)
    load = loaded_model(rng)
    policy = SpeculationPolicy(PolicyConfig(probe_every=10 ** 9))
    shared = policy.tracker("draft/chain", 6).shared
    shared.rates, shared.ages, shared.rounds = [0.9] * 6, [0] * 6, 50
    tracker = policy.tracker("draft/chain", 6)
    tracker.rates[1], tracker.ages = 0.3, [0] * 6
    assert policy.choose(tracker, load, current=1, max_k=6, batch=1).k == 1
    k, ks = 1, []
    for _ in range(150):
        k = policy.choose(tracker, load, current=k, max_k=6, batch=1).k
        ks.append(k)
        if k == 0:
            tracker.relax()
        else:
            drafted_round(tracker, k, 0.9, rng, asked=k)
    assert ks[0] == 1 and min(ks[-30:]) >= 3
    assert tracker.rates[1] > 0.7
    alone = AcceptanceTracker([0.9, 0.3], prior=0.6, rounds=10, ages=[0, 0])  # nothing shared: frozen
    alone.observe(1, 1, asked=1)
    assert alone.rates[1] == 0.3


def two_streams_of_code() -> LoadModel:
    """What code at 2 streams measured (policy trace): target passes 0.19 s + 6.4 ms per token,
    draft steps 0.093 s + 3.1 ms per token (two pools on two cores), 2 requests per pass."""
    load = LoadModel()
    for _ in range(20):
        for b in (1, 2, 4):
            load.observe_target(b, b, 0.19 + 0.0064 * b)
            load.observe_target(b, 5 * b, 0.19 + 0.0064 * 5 * b)
            load.observe_draft(b, 0.093 + 0.0031 * b)
        load.observe_overhead(0.01)
        load.observe_overhead(0.015, draft_call=True)
    return load


def test_a_request_whose_drafts_beat_the_deployment_s_estimate_finds_out_at_once():
    """Code after chat: the deployment measured 0.6 per position, at which no depth beats no
    speculation at 2 streams of code; this request's drafts are accepted 85% of the time, at
    which drafting wins. A new request's positions are its own to measure: its first round
    probes the configured depth (drafts could pay here), its first measurements weigh more than
    the EMA's tenth, and it speculates within a few rounds rather than after several probes."""
    rng = random.Random(21)
    load = two_streams_of_code()
    policy = SpeculationPolicy()
    shared = policy.tracker("draft/chain", 4).shared
    shared.rates, shared.rounds = [0.6] * 4, 500
    assert policy.choose(measured(0.6, 4), load, current=0, max_k=4, batch=2).k == 0
    assert policy.choose(measured(0.85, 4), load, current=0, max_k=4, batch=2).k > 0
    tracker = policy.tracker("draft/chain", 4)
    first = policy.choose(tracker, load, current=4, max_k=4, batch=2, catch_up=150, room=64)
    assert (first.k, first.reason) == (4, "probe")
    k, ks = first.k, []
    for _ in range(40):
        drafted_round(tracker, k, 0.85, rng) if k else tracker.relax()
        k = policy.choose(tracker, load, current=k, max_k=4, batch=2).k
        ks.append(k)
    assert ks[:10].count(0) <= 2 and ks[10:].count(0) <= 3


def test_no_probe_where_even_drafts_that_were_all_accepted_would_lose():
    """Saturated (64 requests per pass of two-pool code): a new request does not draft to
    measure, since not even perfect drafts would beat no speculation there."""
    policy = SpeculationPolicy()
    shared = policy.tracker("draft/chain", 4).shared
    shared.rounds = 500
    decision = policy.choose(policy.tracker("draft/chain", 4), two_streams_of_code(), current=4, max_k=4,
                             batch=64, catch_up=150, room=64)
    assert (decision.k, decision.reason) == (0, "model")


def test_a_request_s_first_measurements_weigh_more_than_the_ema():
    """The starting estimate counts as `prior_rounds` rounds: the first measurement of a
    position weighs 1/(prior_rounds + 1), falling to the EMA's weight."""
    tracker = AcceptanceTracker([0.6] * 2, prior=0.6, weight=0.1, prior_rounds=3)
    tracker.observe(1, 1)
    assert tracker.rates[0] == pytest.approx(0.6 + 0.4 / 4) and tracker.measured == [1]
    for _ in range(20):
        tracker.observe(1, 1)
    before = tracker.rates[0]
    tracker.observe(1, 0)
    assert tracker.rates[0] == pytest.approx(before * 0.9)  # the EMA's weight from here on


def test_where_the_router_measures_modes_requests_do_not_probe_from_off():
    """At 3 or more requests the measured epochs explore; there a new or off request does not
    also draft to measure its drafts (each such probe makes the draft pool prefill what the
    request emitted, on cores the target shares)."""
    assert not MeasuredModes().measures(2) and MeasuredModes().measures(3)
    policy, load = SpeculationPolicy(), two_streams_of_code()
    policy.tracker("draft/chain", 4).shared.rounds = 500
    fresh = policy.tracker("draft/chain", 4)
    kwargs = dict(current=4, max_k=4, batch=2, catch_up=150, room=64)
    assert policy.choose(fresh, load, **kwargs).reason == "probe"
    quiet = policy.choose(fresh, load, **kwargs, probe_from_off=False)
    assert (quiet.k, quiet.reason) == (0, "model")


def test_the_policy_module_s_examples_hold():
    import doctest

    import specserve.policy

    assert doctest.testmod(specserve.policy).failed == 0


def test_rounds_that_overlap_a_prompt_prefill_are_not_learnt_as_round_overhead():
    """At 16 streams a round can wait tens of seconds for other requests' prompt prefills; that
    wait comes once per arriving request, so a round whose span touched any prefill (one that
    began before it, during it, or was still running when it began) is not measured, and once
    every prefill has ended (an aborted one included) rounds are measured again."""
    watch = PrefillWatch()
    first = watch.start(prefill=True)
    assert not watch.clear(first)  # a prefill round is never round overhead
    during = watch.start(prefill=False)  # begins while the prefill runs
    watch.end(first)
    assert not watch.clear(during)
    spanning = watch.start(prefill=False)
    other = watch.start(prefill=True)  # a prefill begins and ends inside this round
    watch.end(other)
    assert not watch.clear(spanning)
    after = watch.start(prefill=False)
    watch.end(after)
    assert watch.clear(after)
    aborted = watch.start(prefill=True)
    watch.end(aborted)  # the router ends a round's mark however the round ended
    assert watch.active == 0 and watch.clear(watch.start(prefill=False))


def test_a_few_requests_are_left_to_the_model():
    """At 2 requests a 4 s epoch holds a prompt's prefill or two, which swing its goodput
    more than the modes differ (code at 2 streams: 4.5-10.6 tok/s epochs in either mode), and an
    off epoch leaves every request a draft-pool catch-up that keeps the next model epoch off:
    there the model alone decides."""
    modes = MeasuredModes(epoch_s=1.0)
    for second in range(20):
        ticket = modes.begin(float(second), 2)
        assert ticket.mode == "model" and not ticket.counted
        modes.end(ticket, 100, 1.0)
    assert modes.levels == {}


def test_an_epoch_whose_rounds_hang_measures_nothing_but_an_idle_one_does():
    """Rounds still running `max_epoch_s` after their epoch began (a pool stuck): the epoch is
    not a measurement of its mode. An epoch whose rounds all ended measures them however long
    the steered requests then paused (only fixed-setting requests ran, or none): goodput is over
    the rounds' own time."""
    modes = MeasuredModes(epoch_s=1.0, max_epoch_s=10.0)
    stuck = [modes.begin(t, 3) for t in (0.0, 0.1, 0.2)]
    assert modes.begin(5.0, 3).mode == "model" and modes.levels[MeasuredModes.level(3)].model is None
    fresh = modes.begin(10.5, 3)  # 10.5 s: given up, the model is measured again
    assert fresh.counted and fresh.epoch != stuck[0].epoch
    assert modes.levels[MeasuredModes.level(3)].model is None
    for r in (fresh, *(modes.begin(t, 3) for t in (10.6, 10.7, 11.5))):
        modes.end(r, 3, 1.0)
    assert modes.begin(40.0, 3).mode == "off"  # 30 s idle, then: measured all the same
    assert modes.levels[MeasuredModes.level(3)].model == pytest.approx(9.0)


def test_a_wave_measures_the_model_first_and_explorations_wait_for_prompt_prefills():
    """A wave of new requests, each in its first round (its prompt's prefill), costs nothing to
    switch to the model: their draft pools prefill the prompts alongside the target, which is
    what speculating costs at all (always on pays it too). So a new level looks at the model
    first, then off (a switch to off is free). Off first, a one-wave pass at code 4 or 8
    streams switched late or never, since the switch's cost grows with every token emitted off
    (0.94x and 0.92x always on). That first look warms up while the prompts prefill in either
    pool, as a switch does while catch-ups run, but is no switch: it takes nothing from the
    budget. Measured from the first rounds, chat at 4 streams put the model at 2.3 tok/s (the
    wave's draft prefills in the epoch) against off's 3.8, and ran off. An exploration of the
    model that falls due while a prompt prefills waits: its epoch would make requests that ran
    off catch up exactly while the target prefills. A request's first round is never counted."""
    modes = MeasuredModes(epoch_s=4.0, max_token_error=None)
    level = MeasuredModes.level(8)
    firsts = [modes.begin(0.1 * i, 8, prefilling=True, first_round=True) for i in range(8)]
    assert all(r.mode == "model" and not r.counted for r in firsts) and modes.warming_up
    for r in firsts:
        modes.end(r, 1, 3.0)
    warm = modes.begin(5.0, 8, catching_up=True)  # their draft pools prefill the prompts: still warming up
    assert warm.mode == "model" and not warm.counted and modes.warming_up
    modes.end(warm, 1, 3.0)

    def epoch(start: float, tokens: int, seconds: float = 1.0, **kwargs) -> str:
        """An epoch's rounds: 8 begin at `start`, then one 4 s later (the window's end: the
        tail's first, not counted), and each emits `tokens` in `seconds`."""
        rounds = [modes.begin(start + 0.01 * i, 8, **kwargs) for i in range(8)]
        rounds.append(modes.begin(start + 4.0, 8))
        for r in rounds:
            modes.end(r, tokens, seconds)
        return rounds[0].mode

    assert epoch(9.0, 1, seconds=2.0) == "model" and not modes.warming_up  # settled: the model's window
    measured = modes.levels[level]
    assert measured.explore_after == 0.0 and measured.switched_at is None  # the first look was no switch
    assert epoch(14.0, 1, prefilling=True) == "off"  # then off: free, even while prompts prefill
    assert measured.model == pytest.approx(4.0)  # 8 tokens in 16 round-seconds x 8 requests
    assert epoch(19.0, 1) == "off"  # off measured better: it stays
    assert measured.off == pytest.approx(8.0)
    measured.next_explore, measured.explore_after = measured.epochs, 0.0  # an exploration is due
    assert epoch(24.0, 1, prefilling=True) == "off"  # it waits for the prefill
    assert modes.begin(29.0, 8).mode == "model" and modes.warming_up  # and runs once none is running
    # a level reached in mid-wave, its requests having run off: the switch has a cost, and off runs first
    modes = MeasuredModes(epoch_s=4.0, max_token_error=None)
    assert modes.begin(0.0, 8, switch_cost_s=20.0).mode == "off"
    # a request that drafted its last round is synced; one that ran off has its text to catch up
    assert switch_catch_up_tokens([(5, 4), (9, 4), (300, 4), (40, 4)]) == 340
    # where the model measured better, a prefill's epoch runs the model
    modes = MeasuredModes(epoch_s=4.0, max_token_error=None)
    modes._measured(level).model, modes._measured(level).off = 20.0, 12.0
    assert modes.begin(0.0, 8, prefilling=True).mode == "model"


def four_request_epoch(modes: MeasuredModes, start: float, tokens: int, **begin) -> str:
    """An epoch at 4 requests: 4 rounds begin at `start`, then one 4 s later (the window's end),
    each emitting `tokens` in 4 s (6 tokens: 6 tok/s in all); the mode it ran."""
    rounds = [modes.begin(start + 0.01 * i, 4, **begin) for i in range(4)]
    rounds.append(modes.begin(start + 4.0, 4, **begin))
    for r in rounds:
        modes.end(r, tokens, 4.0)
    return rounds[0].mode


def test_off_is_not_measured_where_the_model_beats_its_prediction_widely():
    """Off's costs are the target's passes, which the load model sees whole, so off can be
    predicted (LoadModel.off_goodput); the model's cannot, so it is measured. Where the model
    measured above the prediction by more than `off_margin`, an epoch of off would only confirm
    it, at the price of the epoch and of a switch back (code at 4 streams: one off epoch at 3.9
    tok/s against the model's 6.1 was half of adaptive's gap to always on). Off is measured as
    before where the two are close, or where nothing predicts it; and where the model falls
    back toward the prediction, off is explored again."""
    level = MeasuredModes.level(4)
    for off_predicted, runs_off in ((3.5, False), (5.0, True), (None, True)):
        modes = MeasuredModes(epoch_s=4.0, off_margin=0.4, max_token_error=None)
        # the model first: 6 tok/s in all
        assert four_request_epoch(modes, 0.0, 6, off_predicted=off_predicted) == "model"
        assert (four_request_epoch(modes, 5.0, 6, off_predicted=off_predicted) == "off") == runs_off, off_predicted
        assert modes.levels[level].model == pytest.approx(6.0)
    # 6 > 1.4 x 3.5: off is never measured, not even when an exploration falls due ...
    modes = MeasuredModes(epoch_s=4.0, off_margin=0.4, explore_every=2, max_token_error=None)
    assert [four_request_epoch(modes, 5.0 * i, 6, off_predicted=3.5) for i in range(12)] == ["model"] * 12
    assert modes.levels[level].off is None
    assert modes.estimates(4)["off_predicted"] == 3.5
    # ... until the model measures close to it (acceptance fell, say): then off is measured
    assert "off" in [four_request_epoch(modes, 60.0 + 5.0 * i, 4, off_predicted=3.5) for i in range(8)]
    assert modes.levels[level].off is not None
    # the default margin leaves room for the prediction's error (0.87-1.09x off's first epochs
    # before its drift was set) and the model's margin over off
    for ratio, runs_off in ((1.25, True), (1.4, False)):
        modes = MeasuredModes(epoch_s=4.0, max_token_error=None)
        assert four_request_epoch(modes, 0.0, 6, off_predicted=6 / ratio) == "model"
        assert (four_request_epoch(modes, 5.0, 6, off_predicted=6 / ratio) == "off") == runs_off, ratio

    # the prediction: every request in flight in one pass of the target's fitted step time
    load = LoadModel(in_flight=4, overhead_s=0.1)
    assert load.off_goodput() is None  # nothing observed yet
    for tokens in (4, 20, 8, 16):
        load.observe_target(4, tokens, 0.8 + 0.03 * tokens)
    assert load.off_goodput() == pytest.approx(4 / (0.1 + 0.8 + 0.03 * 4), rel=0.05)


def running_decided(lead: float, due: bool, in_flight: int = 4) -> MeasuredModes:
    """A level that measured off at 5 tok/s and the model at `lead` times that (one pair),
    running the mode it decided for; `due`: an exploration of the other falls due."""
    modes = MeasuredModes(epoch_s=4.0, explore_every=2, max_token_error=None)
    measured = modes._measured(MeasuredModes.level(in_flight))
    measured.model, measured.off, measured.lead, measured.pairs = 5.0 * lead, 5.0, lead, 1
    if due:
        measured.epochs = measured.next_explore = 6
    modes.current = modes._best(measured)
    return modes


def test_off_is_explored_only_where_the_requests_have_room_to_come_back():
    """Code at 4 streams, 64-token answers (AVX-512 EPYC): once off ran in mid-wave, switching
    back did not pay back the draft pools' catch-ups of what it emitted, so every exploration of
    off there ran off to the wave's end, ~10% below both fixed settings. While the model runs an
    exploration of off begins only where the steered requests may still emit
    `explore_off_room_epochs` epochs of off's tokens each. A first measurement of off is not
    held back (held back, it never came at chat 4 streams: 0.80x always off), nor is a
    decision for off."""
    def second_epoch(room: float | None) -> str:
        modes = MeasuredModes(epoch_s=4.0, off_margin=0.4, max_token_error=None)
        assert four_request_epoch(modes, 0.0, 6, off_predicted=5.0, room_tokens=room) == "model"
        return four_request_epoch(modes, 5.0, 6, off_predicted=5.0, room_tokens=room)

    assert second_epoch(room=40.0) == "off"  # off's first measurement ...
    assert second_epoch(room=1.0) == "off"  # ... whatever the room

    # an exploration of off waits for room (off measured at 5 tok/s: 1.25 tokens a request-second,
    # 20 for four 4-s epochs; predicted at 7, not far enough under the model's 8 to skip off); the
    # model's decision runs on
    modes = running_decided(1.6, due=True)
    assert modes.begin(0.0, 4, off_predicted=7.0, room_tokens=9.0).mode == "model"
    assert modes.begin(0.1, 4, off_predicted=7.0, room_tokens=9.0).mode == "model"  # same epoch
    modes = running_decided(1.6, due=True)
    ticket = modes.begin(0.0, 4, off_predicted=7.0, room_tokens=40.0)
    assert ticket.mode == "off" and modes._exploring
    assert running_decided(1.6, due=True).begin(0.0, 4, off_predicted=7.0, room_tokens=19.0).mode == "model"
    assert running_decided(1.6, due=True).begin(0.0, 4, off_predicted=7.0, room_tokens=20.0).mode == "off"
    assert running_decided(1.6, due=True).begin(0.0, 4, off_predicted=7.0, room_tokens=None).mode == "off"
    # where off is the decision the room does not matter: switching to it costs nothing
    assert running_decided(1.04, due=False).begin(0.0, 4, off_predicted=5.0, room_tokens=2.0).mode == "off"


def test_the_model_is_explored_only_where_the_requests_have_room_for_its_warm_up_and_window():
    """Chat at 4 streams (AVX-512 EPYC), off decided: an exploration of the model began with 51
    tokens left per request, warmed up on the draft pools' catch-ups while the wave's first
    requests ended, and its window measured nothing (0.93x always off). It begins only where the
    steered requests may still emit `explore_model_room_epochs` epochs of the model's tokens each."""
    # the model estimated at 5.2 tok/s at 4 requests: 1.3 tokens a request-second, 15.6 for three 4-s epochs
    assert running_decided(1.04, due=True).current == "off"
    assert running_decided(1.04, due=True).begin(0.0, 4, off_predicted=5.0, room_tokens=15.0).mode == "off"
    modes = running_decided(1.04, due=True)
    assert modes.begin(0.0, 4, off_predicted=5.0, room_tokens=16.0).mode == "model" and modes._exploring
    assert running_decided(1.04, due=True).begin(0.0, 4, off_predicted=5.0, room_tokens=None).mode == "model"
    # not due: off runs whatever the room
    assert running_decided(1.04, due=False).begin(0.0, 4, off_predicted=5.0, room_tokens=90.0).mode == "off"


def test_off_is_predicted_from_the_decode_passes_the_target_timed_not_from_the_model_s_rounds():
    """A speculating router sees verifies of several rows a call, slowed by the draft pool on
    the same cores, and target-only rounds that wait on other requests' verifies. A line fitted
    on those put off at 8.8-11 tok/s where off's epochs measured 14-20 (code, 8 and 16 streams),
    so off was never measured. Off's pass comes from the decode passes the target timed at
    startup, its drift from off's own passes, its overhead from off's own rounds."""
    timed = ((1, 0.25), (2, 0.28), (4, 0.33), (8, 0.40), (16, 0.60))
    load = LoadModel(in_flight=16, decode=DecodeCurve(timed))
    assert load.off_goodput() == pytest.approx(16 / 0.60)  # known before any pass: the pool timed them
    rng = random.Random(3)
    for _ in range(200):  # the model's rounds: verifies of 5 rows a call beside the draft pool
        calls = rng.choice((8, 12, 16))
        load.observe_target(calls, 5 * calls, 0.5 + 0.015 * 5 * calls)
        load.observe_target(calls, calls, 0.9)  # ... a decode pass of catch-up rounds, slowed by the draft pool
        load.observe_overhead(0.3)  # target-only rounds waiting on others' verifies
        load.observe_overhead(0.05, draft_call=True, off=True)  # drafted: never off's
    assert load.decode.drift == 1.0 and load.off_overhead_s is None
    assert load.off_goodput() == pytest.approx(16 / 0.60)
    without = LoadModel(in_flight=16, target=load.target, overhead_s=load.overhead_s)
    assert without.off_goodput() < 0.6 * load.off_goodput()  # the fitted line's prediction, far below
    # off's own rounds: their decode passes move the drift, their overhead is off's
    for _ in range(16 * 60):  # 60 passes of 16 calls, each reported by each of its requests
        load.observe_target(16, 16, 0.72, off=True)
        load.observe_target(16, 16 + 256, 3.0, off=True)  # a pass with a prompt's chunk: not a decode pass
        load.observe_overhead(0.03, off=True)
    assert load.decode.drift == pytest.approx(1.2, rel=0.01) and load.off_overhead_s == pytest.approx(0.03)
    assert load.off_goodput() == pytest.approx(16 / (0.03 + 0.72), rel=0.01)
    load.in_flight = 12  # between timed passes, at the drift
    assert load.off_goodput() == pytest.approx(12 / (0.03 + 1.2 * 0.50), rel=0.01)
    with pytest.raises(ValueError, match="ascending"):
        DecodeCurve(((4, 0.3), (2, 0.2)))


def test_one_slow_first_round_does_not_set_off_s_overhead():
    """Off's overhead is the median of its recent rounds, known once a few were seen: the
    bench's first request, alone, took 0.49 s a round outside its pass, then ~0.01 s; an EMA
    seeded by that round kept off predicted at ~0.7x for minutes, so off was never measured at
    chat 8 (docs/bench/off-curve-avx2, owed-chat8)."""
    load = LoadModel(in_flight=8, decode=DecodeCurve(((1, 0.4), (8, 0.8))))
    load.observe_overhead(0.49, off=True)
    load.observe_overhead(0.012, off=True)
    assert load.off_overhead_s is None and load.off_goodput() == pytest.approx(8 / 0.8)  # too few yet
    load.observe_overhead(0.014, off=True)
    assert load.off_overhead_s == pytest.approx(0.014)
    assert load.off_goodput() == pytest.approx(8 / 0.814)
    for _ in range(20):  # the window moves on: off's rounds under load cost more
        load.observe_overhead(0.05, off=True)
    assert load.off_overhead_s == pytest.approx(0.05)
    load.observe_overhead(3.0, draft_call=True, off=True)  # a drafted round is never off's
    assert load.off_overhead_s == pytest.approx(0.05)


def test_the_model_runs_only_where_it_measured_clearly_above_off():
    """The model's epochs leave out costs whole waves pay (the draft pool's prefill of each new
    prompt, a wave's spread ends): where they tied, off won over the passes (chat 4: 1.07x, code
    8: 1.09x, chat 8: 1.29x always on). So the model runs only where it leads off by more than
    `model_margin`, at the first decision and after."""
    for off_tokens, decision in ((21, "off"), (19, "off"), (17, "model")):  # the model 20 tok/s
        modes = MeasuredModes(epoch_s=4.0, model_margin=0.1, max_token_error=None)
        modes_run = [four_request_epoch(modes, 5.0 * i, tokens) for i, tokens in enumerate((20, off_tokens))]
        assert modes_run == ["model", "off"]
        assert four_request_epoch(modes, 10.0, off_tokens) == decision
    # later, the model running (20 against 17, paired: its lead 1.18x): its own epochs alone do
    # not move the lead, which is its pairs' (what slows the running mode slows the other too:
    # see test_the_modes_are_compared_in_adjacent_epochs_as_a_ratio)
    assert four_request_epoch(modes, 15.0, 20) == "model"
    modes.levels[MeasuredModes.level(4)].model = 18.0
    assert four_request_epoch(modes, 20.0, 18) == "model"
    measured = modes.levels[MeasuredModes.level(4)]  # paired: the first look and off, off and the switch back
    assert measured.pairs == 2 and modes.model_lead(measured) == measured.lead > 1.1
    # where no pair was measured (the two modes' epochs far apart), the estimates' ratio decides
    modes = MeasuredModes(epoch_s=4.0, model_margin=0.1, max_token_error=None)
    modes.levels[MeasuredModes.level(4)] = _ModeGoodput(model=18.0, off=17.0, epochs=2, warmed=True, seen=0.0,
                                                        measurements={"model": 1, "off": 1})
    assert four_request_epoch(modes, 0.0, 18) == "off"  # 18 is under 10% ahead of 17
    # by default the model must lead by 20%: chat at 8 streams measured it 1.13-1.20x off where
    # always off ran 1.08x always on over the passes
    modes = MeasuredModes(epoch_s=4.0, max_token_error=None)
    assert [four_request_epoch(modes, 5.0 * i, tokens) for i, tokens in enumerate((23, 20, 20))] == \
        ["model", "off", "off"]


def test_the_modes_are_compared_in_adjacent_epochs_as_a_ratio():
    """Each mode's estimate is of when its epochs ran, and the running mode's moves on while the
    other's stays: on this CPU the passes drift by 10% (standard deviation over 4-s windows),
    and at code 8 streams off's estimate sank in a wave's tail to 15.19 tok/s while the model's
    kept its mid-wave 18.24, and the next wave ran the model where always off ran 1.05x always
    on. So the decision takes the model's lead over off from pairs of adjacent epochs of the two
    modes. Here the model leads off by 11% (20 against 18 tok/s), then the machine slows both by
    20%: off's estimate sinks to ~14.4 while the model's, measured fast, stays far above 1.2x
    that, but the lead stays 1.11x and the level stays off but for its explorations."""
    modes = MeasuredModes(epoch_s=2.0)
    epochs = run_modes(modes, [(60, 8, 20, 18), (120, 8, 16, 14.4)], random.Random(0), noise=0.1)
    slow = measured_epochs([e for e in epochs if e["t"] >= 60])
    measured = modes.levels[MeasuredModes.level(8)]
    assert measured.model > 1.2 * measured.off  # the estimates, measured apart, would run the model
    assert measured.pairs >= 3 and modes.model_lead(measured) == pytest.approx(1.11, abs=0.06)
    assert slow[:12].count("model") <= 1 and slow.count("off") >= 0.9 * len(slow)
    # a pair is two adjacent epochs at about the same load: a tail's epoch at 6 requests in flight
    # after one at 8 (both the level of 6-11) does not pair
    level = MeasuredModes.level(8)
    for in_flight, pairs in ((8, 1), (7, 1), (6, 0)):
        modes = MeasuredModes(epoch_s=1.0, max_token_error=None)
        modes.levels[level] = _ModeGoodput(model=20.0, epochs=1, warmed=True, seen=0.0, measurements={"model": 1},
                                           last_epoch=_EpochGoodput("model", 20.0, 8.0, None, closed_at=0.0))
        rounds = [modes.begin(0.1 * i, in_flight) for i in range(in_flight)]  # off's first epoch, at once
        for r in rounds:
            modes.end(r, 1, in_flight / 16.0)
        modes.begin(1.0, in_flight)  # its close
        assert rounds[0].mode == "off" and modes.levels[level].pairs == pairs, in_flight
    assert modes.levels[level].lead is None and modes.model_lead(modes.levels[level]) == pytest.approx(20 / 16)


def test_an_epoch_of_the_model_measured_behind_off_makes_off_measured_at_once():
    """A lead from pairs moves only when both modes measure. The model leads 1.3x at 8 requests
    for 160 s, then the workload changes at the same load and the model measures 15 tok/s against
    off's 20: the model's next epoch shows it behind off's estimate, so off is measured at once,
    pairs with it, and the level runs off; without that, the old lead ran the model for the whole
    150 s (until an exploration was due)."""
    def first_off_after_the_change(contradicted: bool) -> float | None:
        modes = MeasuredModes(epoch_s=2.0)
        if not contradicted:
            modes._contradicts = lambda *args: False
        epochs = run_modes(modes, [(160, 8, 26, 20), (150, 8, 15, 20)], random.Random(3))
        return next((e["t"] - 160 for e in epochs if e["t"] >= 160 and e["mode"] == "off"), None)

    assert first_off_after_the_change(True) < 10  # the first model epoch after the change, then off
    assert first_off_after_the_change(False) is None

    # Off's estimate counts only at about its own load: a wave's tail (6 requests after off's
    # 8) emits less whatever the mode
    level = MeasuredModes.level(8)
    for in_flight, due in ((8, True), (6, False)):
        modes = MeasuredModes(epoch_s=1.0, max_token_error=None)
        modes.levels[level] = _ModeGoodput(model=26.0, off=20.0, lead=1.3, pairs=2, off_in_flight=8.0, epochs=6,
                                           measurements={"model": 4, "off": 2}, warmed=True, seen=0.0,
                                           next_explore=20, explore_every=10)
        # the level's epoch of the model, decided by its lead
        rounds = [modes.begin(0.1 * i, in_flight) for i in range(in_flight)]
        for r in rounds:
            modes.end(r, 2, 2 * in_flight / 15.0)  # 15 tok/s
        after = modes.begin(1.5, in_flight)  # the epoch closed
        assert rounds[0].mode == "model" and modes.levels[level].off_due == due, in_flight
        assert after.mode == ("off" if due else "model"), in_flight


def test_off_is_not_measured_while_the_model_s_requests_owe_their_draft_pools_catch_ups():
    """A second wave at a level that measured only the model: its prompts are left to the
    requests' second rounds, so an epoch of off at the wave's start would leave every prompt
    owed, and the switch back would have to pay for them all. Off is measured once the draft
    pools caught up (then the switch back owes only what off emitted)."""
    level = MeasuredModes.level(8)
    modes = MeasuredModes(epoch_s=1.0, max_token_error=None)
    modes.levels[level] = _ModeGoodput(model=18.0, epochs=1, measurements={"model": 1}, warmed=True, seen=0.0)
    now, seen = 0.0, []
    for catching_up in (True, True, False):  # each an epoch's worth of rounds
        rounds = [modes.begin(now + 0.2 * i, 8, catching_up=catching_up) for i in range(8)]
        for r in rounds:
            modes.end(r, 3, 8 * 3 / 18.0)
        seen.append(rounds[0].mode)
        now += 2.0
    assert seen == ["model", "model", "off"]  # the first epoch once they caught up measures off

    # the wait is for a level expected to decide for the model: by its estimate over off's
    # prediction with the margin (18 against 14.5 x 1.2 = 17.4: it waits; 16 x 1.2 = 19.2: off
    # is the likely decision, and is measured at once, catch-ups owed or not)
    for off_predicted, expected in ((14.5, ["model", "model", "off"]), (16.0, ["off"])):
        modes = MeasuredModes(epoch_s=1.0, max_token_error=None)
        modes.levels[level] = _ModeGoodput(model=18.0, epochs=1, measurements={"model": 1}, warmed=True, seen=0.0)
        modes.current = "model"
        now, seen = 0.0, []
        for catching_up in (True, True, False)[:len(expected)]:
            rounds = [modes.begin(now + 0.2 * i, 8, catching_up=catching_up, off_predicted=off_predicted)
                      for i in range(8)]
            for r in rounds:
                modes.end(r, 3, 8 * 3 / 18.0)
            seen.append(rounds[0].mode)
            now += 2.0
        assert seen == expected, off_predicted
        assert not modes._off_clearly_loses(modes.levels[level])  # off_margin does not decide it

    # where off is already the decision, it runs whatever is owed: it leaves catch-ups for later
    modes = MeasuredModes(epoch_s=1.0, max_token_error=None)
    modes.levels[level] = _ModeGoodput(model=18.0, off=17.0, lead=1.06, pairs=1, epochs=2, warmed=True, seen=0.0,
                                       measurements={"model": 1, "off": 1}, next_explore=20)
    rounds = [modes.begin(0.2 * i, 8, catching_up=True) for i in range(8)]
    assert rounds[0].mode == "off"


def test_a_switch_to_the_model_warms_up_until_the_draft_pools_caught_up_then_measures_it():
    """An epoch of the model after epochs off would spend its first seconds on every request's
    draft-pool catch-up (code at 16 streams: 26-356 tokens per request), measuring the switch,
    not the mode: measured so, the model's first epochs at code 16 ran through 978 and 1350
    tokens of catch-ups, and the level ran off although always on was 12% faster. So a switch
    to the model warms up, unmeasured, for at least an epoch and on while catch-ups run (at most
    max_warm_up_epochs), and the model's window opens after."""
    modes = MeasuredModes(epoch_s=4.0, max_warm_up_epochs=4, max_token_error=None)
    level = MeasuredModes.level(3)
    measured = modes._measured(level)
    measured.model, measured.off, measured.epochs, measured.next_explore = 10.0, 12.0, 6, 6  # off leads; due
    measured.measurements = {"model": 3, "off": 3}  # six epochs measured
    modes.current = "off"
    warm = modes.begin(0.0, 3)
    assert warm.mode == "model" and not warm.counted and modes.warming_up  # the exploration warms up
    modes.end(warm, 1, 5.0)
    assert not modes.begin(3.0, 3, catching_up=True).counted and modes.warming_up
    assert not modes.begin(5.0, 3, catching_up=True).counted and modes.warming_up  # catch-ups still run
    assert (measured.model, measured.epochs) == (10.0, 6)  # a warm-up measures nothing
    rounds = [modes.begin(t, 3) for t in (7.0, 7.1, 7.2)]  # caught up: the model's window
    assert all(r.counted for r in rounds) and not modes.warming_up
    rounds.append(modes.begin(11.0, 3))  # the window's end: the tail
    for r in rounds:
        modes.end(r, 10, 1.0)
    assert modes.begin(11.5, 3).mode == "model"  # 30 tok/s: now clearly above off's 12, the model stays
    assert measured.model == pytest.approx(10.0 + 0.3 * (30.0 - 10.0)) and measured.epochs == 7
    assert not modes.warming_up  # staying on the model needs no warm-up

    # catch-ups that never end (requests keep arriving) end the warm-up at its cap
    modes = MeasuredModes(epoch_s=4.0, max_warm_up_epochs=4, max_token_error=None)
    modes.current = "off"
    assert modes.begin(0.0, 16).mode == "model" and modes.warming_up  # first measurement of the model
    assert modes.begin(15.0, 16, catching_up=True).mode == "model" and modes.warming_up
    assert modes.begin(16.0, 16, catching_up=True).counted and not modes.warming_up
    # a switch to off needs none, nor does the model below the measured levels
    modes = MeasuredModes(epoch_s=1.0, max_token_error=None)
    for r in [modes.begin(t, 3) for t in (0.0, 0.1, 0.2, 1.0)]:
        modes.end(r, 1, 0.5)
    assert modes.begin(1.1, 3).mode == "off" and not modes.warming_up
    assert modes.begin(1.2, 2).mode == "model" and not modes.warming_up


def test_explorations_keep_to_their_budget_of_the_time_by_what_the_last_switch_cost():
    """A switch to the model costs its warm-up (code at 16 streams on 2 cores: ~40 s of
    catch-ups, run at about half off's goodput, and an exploration in each 5-minute pass cost
    ~10%). So after a warm-up of W s a level explores no sooner than W / explore_budget s later,
    however many epochs are due; cheap switches (one-epoch warm-ups) come more often."""
    level = MeasuredModes.level(16)

    def epoch(modes: MeasuredModes, start: float, catching_up: bool = False) -> tuple[str, bool]:
        """16 rounds from `start` and the tail's first 4 s later (off emits 2 tokens, the
        model 1: off leads); the epoch's mode and whether it began a warm-up."""
        first = modes.begin(start, 16, catching_up=catching_up)
        warming_up = modes.warming_up
        rounds = [first] + [modes.begin(start + 0.01 * i, 16, catching_up=catching_up) for i in range(1, 16)]
        rounds.append(modes.begin(start + 4.0, 16, catching_up=catching_up))
        for r in rounds:
            modes.end(r, 2 if r.mode == "off" else 1, 2.0)
        return first.mode, warming_up

    def explorations(budget: float, warm_up_s: float) -> tuple[list[float], MeasuredModes]:
        """When the switches to the model began over 1,000 s, the first after a warm-up of
        `warm_up_s` (catch-ups running)."""
        modes = MeasuredModes(epoch_s=4.0, max_warm_up_epochs=10, explore_budget=budget)
        measured = modes._measured(level)
        measured.model, measured.off, measured.epochs, measured.next_explore = 10.0, 12.0, 6, 6  # off leads; due
        modes.current = "off"
        t, switches, was_warming_up = 0.0, [], False
        while t < 1000.0:
            mode, warming_up = epoch(modes, t, catching_up=t < warm_up_s)
            if warming_up and not was_warming_up:
                switches.append(t)
            t, was_warming_up = t + 4.2, warming_up
        return switches, modes

    switches, modes = explorations(0.05, warm_up_s=40.0)
    measured = modes.levels[level]
    assert switches[0] == 0.0  # the exploration due at once; the next ...
    assert switches[1] >= 40.0 + 19 * 40.0  # ... once its 40-s warm-up was 5% of the time since
    assert measured.warm_up_s == pytest.approx(4.0)  # later ones warmed up for an epoch ...
    assert all(b - a >= 19 * 4.0 for a, b in zip(switches[1:], switches[2:]))  # ... and wait 19 times that
    unbudgeted, _ = explorations(1.0, warm_up_s=40.0)
    assert len(unbudgeted) >= 4 and unbudgeted[1] < 200.0  # by the epochs alone: every 5, 10, 20, 40
    cheap, _ = explorations(0.05, warm_up_s=0.0)  # one-epoch warm-ups only
    assert len(cheap) > len(switches) and cheap[1] < 150.0
    # 19 x (the 4-s warm-up + the half of its ~4.2-s window the model fell short of off by)
    assert all(b - a >= 19 * (4.0 + 2.0) for a, b in zip(cheap, cheap[1:]))
    # an exploration that measured the model at par costs its warm-up alone: 76 s apart
    modes = MeasuredModes(epoch_s=4.0, explore_budget=0.05, max_token_error=None)
    measured = modes._measured(level)
    measured.model, measured.off, measured.clock = 10.0, 12.0, 100.0
    modes._level, modes.current, modes._exploring = level, "model", True
    for tokens in (12, 8):  # 12 tok/s: at par with off, then 8: a third short
        modes._starts, modes._kept, modes._tokens, modes._seconds, modes._in_flight = 1, 1, tokens, 1.0, 1
        measured.explore_after = 0.0
        assert modes._close(6.0, now=6.0)
        assert measured.explore_after == pytest.approx(0.0 if tokens == 12 else 100.0 + 19 * 6.0 / 3)


def test_a_level_s_first_measurement_of_the_model_waits_until_its_switch_fits_the_budget():
    """Measuring the model first at a level whose requests ran off (reached in mid-wave) costs
    a switch too: every request's draft pool catches up on its whole text (code at 16 streams:
    ~2,300 tokens, ~40 s of a 2-core CPU, in a 5-minute pass where always on and always off
    finish within 4% of each other). So the level runs off until the switch's predicted cost
    is `explore_budget` of the time since the level began; a cheap switch (heads, a fast draft
    pool, a wave still in its first rounds) measures the model at once."""
    def epoch(modes: MeasuredModes, start: float, cost: float) -> tuple[str, bool]:
        rounds = [modes.begin(start + 0.01 * i, 16, switch_cost_s=cost) for i in range(16)]
        warming_up = modes.warming_up
        rounds.append(modes.begin(start + 4.0, 16, switch_cost_s=cost))
        for r in rounds:
            modes.end(r, 1, 2.0)
        return rounds[0].mode, warming_up

    modes = MeasuredModes(epoch_s=4.0, explore_budget=0.05)  # reached in mid-wave: requests that ran off
    first = [modes.begin(0.1 * i, 16, switch_cost_s=40.0) for i in range(16)]
    assert all(r.mode == "off" for r in first)  # 40 s to catch up: off
    for r in first:
        modes.end(r, 1, 3.0)
    t, modes_run = 5.0, []
    while t < 1000.0:
        modes_run.append((t, *epoch(modes, t, cost=40.0)))
        t += 4.5
    switched = next(t for t, mode, _ in modes_run if mode == "model")
    assert 19 * 40.0 <= switched < 19 * 40.0 + 10.0  # off until 40 s is 5% of the level's time
    assert all(mode == "off" for t, mode, _ in modes_run if t < switched)
    assert modes.levels[MeasuredModes.level(16)].off is not None  # measured meanwhile

    modes = MeasuredModes(epoch_s=4.0, explore_budget=0.05)
    assert epoch(modes, 0.0, cost=0.0)[0] == "model"  # nothing to catch up: the model at once

    # the router's prediction of a catch-up: the target's step time, which prompt prefills fit
    # too (the draft pool's decode passes alone put a prefill's per-token cost far too low)
    load = LoadModel()
    assert load.catch_up_s(2000) == 0.0  # nothing observed yet
    for tokens in (16, 256, 16, 512):
        load.observe_target(16, tokens, 0.2 + 0.02 * tokens)
    assert load.catch_up_s(2000) == pytest.approx(0.2 + 0.02 * 2000, rel=0.05) and load.catch_up_s(0) == 0.0
    for tokens in (8, 12, 8, 16):
        load.observe_draft(tokens, 0.3 + 0.001 * tokens)
    assert load.catch_up_s(2000) == pytest.approx(0.2 + 0.02 * 2000, rel=0.05)


def test_a_level_s_budget_counts_only_the_time_it_ran():
    """A wave's start passes through 3-5 requests in flight in moments and its end reaches them
    again a wave later. On wall time that level's switch had long fitted the budget, so each
    wave's end opened a first look at the model, its warm-up and catch-ups included (code at 8
    streams on an AVX-512 EPYC, where off ran at 6-11 requests and always off ran 1.21x always
    on). On the level's own clock it has run for moments: off, until the switch fits by the
    time the level itself ran."""
    modes = MeasuredModes(epoch_s=1.0, max_token_error=None, explore_budget=0.05)
    low, high = MeasuredModes.level(4), MeasuredModes.level(8)
    passing = modes.begin(0.0, 4, first_round=True)  # the wave's start at 4 requests ...
    modes.end(passing, 1, 0.1)
    modes.levels[high] = _ModeGoodput(model=20.0, off=30.0, epochs=5, measurements={"model": 2, "off": 3},
                                      next_explore=1000, warmed=True)
    t = 0.1
    while t < 50.0:  # ... then a wave at 8 requests in flight, off (under stale_s: the level stays)
        ticket = modes.begin(t, 8)
        assert ticket.mode == "off"
        modes.end(ticket, 1, 0.2)
        t += 0.25
    assert modes.levels[low].clock < 0.1
    runs = []
    while t < 110.0:  # its end at 4, whose requests ran off: a switch would cost 1 s of catch-ups
        ticket = modes.begin(t, 4, switch_cost_s=1.0)
        runs.append((t, ticket.mode))
        modes.end(ticket, 1, 0.2)
        t += 0.25
    switched = next(t for t, mode in runs if mode == "model")
    assert 50.0 + 19 * 1.0 <= switched < 50.0 + 19 * 1.0 + 5.0  # 1 s is 5% of the level's own 20 s
    assert modes.levels[low].off is not None  # off measured meanwhile


def test_an_exploration_of_the_model_also_waits_for_its_predicted_switch_to_fit_the_budget():
    """The last switch's warm-up says little about the next one when the requests in flight
    have much more to catch up now (code at 8 streams: a switch that had warmed up in seconds at
    a wave's start was followed by one predicted at 47 s, which went ahead and cost 12% of the
    pass). So an exploration of the model waits until its predicted cost is `explore_budget`
    of the time since the level's last switch; one back to off costs nothing and does not."""
    level = MeasuredModes.level(8)

    def first_switch(cost: float) -> float | None:
        modes = MeasuredModes(epoch_s=4.0, explore_budget=0.05)
        measured = modes._measured(level)
        measured.model, measured.off, measured.epochs, measured.next_explore = 10.0, 12.0, 6, 6  # off leads; due
        measured.since = measured.switched_at = 0.0  # the last switch: at 0 s, cheap (explore_after 0)
        modes.current = "off"
        t = 1.0
        while t < 1000.0:
            rounds = [modes.begin(t + 0.01 * i, 8, switch_cost_s=cost) for i in range(8)]
            rounds.append(modes.begin(t + 4.0, 8, switch_cost_s=cost))
            for r in rounds:
                modes.end(r, 3, 2.0)  # off measures 12 again: it stays the better mode
            if rounds[0].mode == "model":
                return t
            t += 4.5
        return None

    assert first_switch(0.0) < 10.0  # due, and nothing to catch up: at once
    assert 19 * 40.0 <= first_switch(40.0) < 19 * 40.0 + 10.0  # once 40 s is 5% of the time since
    assert first_switch(60.0) is None  # 1,140 s: not within this run

    modes = MeasuredModes(epoch_s=4.0, explore_budget=0.05)  # the model leads: exploring off is free
    measured = modes._measured(level)
    measured.model, measured.off, measured.epochs, measured.next_explore = 13.0, 10.0, 6, 6
    measured.since = measured.switched_at = 0.0
    modes.current = "model"
    ticket = modes.begin(1.0, 8, switch_cost_s=1000.0)
    assert ticket.mode == "off" and modes._exploring


def test_a_switch_to_the_model_waits_until_it_pays_back_before_the_requests_end():
    """Chat at 8 streams (AVX2 EPYC): near each wave's end off's estimate sank under code's
    model estimate by the margin, and the level switched to the model with ~30 tokens a request
    left: 12.7 s of catch-ups predicted for ~3 s saved. A switch to the model (a decision, an
    exploration, a first look) runs only where it saves more than it costs before the steered
    requests end; a new wave owes nothing, and an unbounded room always pays."""
    level = MeasuredModes.level(8)

    def mode(model: float | None, off: float | None, cost: float, room: float | None, due: bool = False) -> str:
        modes = MeasuredModes(epoch_s=4.0)
        measured = modes._measured(level)
        measured.model, measured.off, measured.clock = model, off, 1000.0  # the budget is no bar
        if due:
            measured.epochs, measured.next_explore = 6, 6
        modes.current = "off"
        return modes.begin(1.0, 8, switch_cost_s=cost, room_tokens=room).mode

    # the decision: the model leads by 23% (just past the margin), so it saves 18% of the time left
    assert mode(15.9, 12.97, cost=12.7, room=30) == "off"  # 18.5 s left off: saves 3.4 s
    assert mode(15.9, 12.97, cost=12.7, room=100) == "off"  # 62 s left off: saves 11.3 s, still short
    assert mode(15.9, 12.97, cost=12.7, room=300) == "model"  # 185 s left off: saves 34 s
    assert mode(15.9, 12.97, cost=0.0, room=30) == "model"  # a new wave: nothing to catch up
    assert mode(15.9, 12.97, cost=12.7, room=None) == "model"  # no bound on the room
    # an exploration bets on the least lead the margin lets run: 1/6 of the time left
    assert mode(10.0, 12.0, cost=5.0, room=30, due=True) == "off"  # 20 s left off: 3.3 s
    assert mode(10.0, 12.0, cost=5.0, room=300, due=True) == "model"
    # a level's first look, off measured (a level reached in mid-wave)
    assert mode(None, 12.0, cost=5.0, room=30) == "off"
    assert mode(None, 12.0, cost=5.0, room=300) == "model"
    # the router's argument: the steered requests' tokens left, on average
    first, second = _state(Speculation(k=4)), _state(Speculation(k=4))  # max_tokens 100 each
    second.output_ids.extend([7] * 40)
    assert room_tokens([first, second]) == 80.0 and room_tokens([]) is None


def test_an_exploration_that_measured_nothing_goes_on_then_backs_off():
    """An exploration's epoch whose rounds all failed (or hung) measured nothing: it goes on,
    up to explore_retries more epochs; one that stays unmeasured ends, the better mode runs
    again, and the next exploration waits twice as long."""
    level = MeasuredModes.level(3)

    def explore(modes: MeasuredModes, start: float, tokens: int | None) -> str:
        """A window of 3 rounds at 3 requests from `start`; tokens None: they fail."""
        rounds = [modes.begin(t, 3) for t in (start, start + 0.1, start + 0.2, start + 4.0)]
        for r in rounds:
            modes.end(r, tokens, 1.0)
        return rounds[0].mode

    modes = MeasuredModes(epoch_s=4.0, explore_retries=2, max_token_error=None)
    measured = modes._measured(level)
    measured.model, measured.off, measured.epochs, measured.next_explore = 10.0, 12.0, 6, 6
    measured.measurements = {"model": 3, "off": 3}  # six epochs measured
    modes.current = "off"
    assert modes.begin(0.0, 3).mode == "model" and modes.warming_up
    assert explore(modes, 4.0, None) == "model"  # warmed up; its rounds fail: nothing measured
    assert (measured.model, measured.epochs) == (10.0, 6)
    assert explore(modes, 8.1, 10) == "model"  # it goes on: 30 tok/s
    assert modes.begin(12.2, 3).mode == "model"
    assert measured.model == pytest.approx(10.0 + 0.3 * (30.0 - 10.0)) and measured.epochs == 7

    modes = MeasuredModes(epoch_s=4.0, explore_retries=2, max_token_error=None)
    measured = modes._measured(level)
    measured.model, measured.off, measured.epochs, measured.next_explore = 10.0, 12.0, 6, 6
    modes.current = "off"
    modes.begin(0.0, 3)
    assert [explore(modes, t, None) for t in (4.0, 8.1, 12.2)] == ["model"] * 3  # the exploration, 2 retries
    assert modes.begin(16.3, 3).mode == "off"
    assert (measured.model, measured.epochs) == (10.0, 6)
    assert measured.explore_every == 2 * modes.explore_every and measured.next_explore == 6 + measured.explore_every


def test_a_draft_pools_catch_up_is_a_prefill_to_the_watch_but_no_prompt_prefill():
    """Catch-ups keep their rounds out of the overhead learnt, as prompt prefills do; they do
    not stop explorations or first measurements (`active` counts prompts only), which would
    stop every exploration of the model by its own catch-ups. A round that overlapped one is
    not measured by MeasuredModes either (see test_a_round_that_overlapped_an_arrival_is_not_measured)."""
    from specserve.policy import draft_catches_up

    watch = PrefillWatch()
    mine = watch.start(prefill=False)
    catch_up = watch.start(prefill=False, catch_up=True)
    assert (watch.active, watch.catching_up) == (0, 1) and not watch.clear(catch_up)
    watch.end(catch_up)
    assert not watch.clear(mine)
    assert watch.clear(watch.start(prefill=False))
    assert [draft_catches_up(n, depth=4) for n in (1, 5, 10, 11, 300)] == [False, False, False, True, True]


def test_a_serving_request_catches_its_draft_pool_up_in_the_background():
    """While the draft pool prefills what it has not seen (the prompt, or what was emitted with
    speculation off), the request's rounds run target-only instead of waiting for it."""
    prompt = list(range(1, 41))
    state = RequestState("r", prompt, SamplingParams(max_tokens=100), Speculation(proposer="draft", k=4),
                         prefill_without_draft=True)
    assert state.round_k() == 0 and state.draft_sync_due()  # first round: the prompt, in the background
    sync = state.sync_request()
    assert (sync.token_ids, sync.k) == (prompt, 1) and state.draft_syncing and state.draft_synced == 40
    state.output_ids = [7]
    assert state.round_k() == 0 and not state.draft_sync_due()  # one catch-up at a time
    state.draft_syncing = False  # it ended
    assert state.round_k() == 4 and not state.draft_sync_due()  # 1 token behind: the round's usual sync
    state.output_ids = list(range(7, 27))  # 20 tokens emitted with speculation off
    state.policy_k = 0
    assert not state.draft_sync_due()  # off: nothing to catch up for
    state.policy_k = 4
    assert state.draft_sync_due()


def test_background_catch_up_is_left_out_where_it_would_change_what_runs():
    prompt = list(range(1, 41))
    seeded = RequestState("r", prompt, SamplingParams(temperature=0.8, seed=3, max_tokens=100),
                          Speculation(proposer="draft", k=4), prefill_without_draft=True)
    assert not seeded.draft_sync_due()  # its draws follow its drafts: the depth stays pinned
    library = RequestState("r", prompt, SamplingParams(max_tokens=100), Speculation(proposer="draft", k=4))
    assert not library.draft_sync_due()  # the library decoder runs its rounds in order
    for proposer in ("ngram", "none"):
        state = RequestState("r", prompt, SamplingParams(max_tokens=100), Speculation(proposer=proposer, k=4),
                             prefill_without_draft=True)
        assert not state.draft_sync_due()  # no draft pool
    last = RequestState("r", prompt, SamplingParams(max_tokens=1), Speculation(proposer="draft", k=4),
                        prefill_without_draft=True)
    assert not last.draft_sync_due()  # one token left: it will never draft


def test_the_policy_cost_bench_times_every_method_and_load_and_reports_the_largest_share(capsys):
    """`make bench-policy`'s table: one row per method and requests in flight, each a policy
    cost per round as a share of the given target step, and the largest share printed last."""
    from specserve.benchmarks import policy_cost

    assert policy_cost.main(["--step-ms", "100", "--rounds", "60"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "µs" in line]
    measured = [n for n in policy_cost.STREAMS if MeasuredModes().measures(n)]  # there: both epoch modes
    assert len(rows) == len(policy_cost.METHODS) * (len(policy_cost.STREAMS) + len(measured))
    shares = [float(row.split("|")[5].strip().rstrip("%")) for row in rows]
    assert all(share > 0 for share in shares)
    assert f"largest share: {max(shares):.3f}%" in out
    seconds, speculated = policy_cost.policy_seconds_per_round(policy_cost.METHODS["draft chain k=4"], 8, 60,
                                                               random.Random(1))
    assert seconds > 0 and 0 < speculated <= 1
    _, speculated_off = policy_cost.policy_seconds_per_round(policy_cost.METHODS["draft chain k=4"], 8, 60,
                                                             random.Random(1), epochs_off=True)
    assert speculated_off == 0  # the epochs' off path is timed too


def test_a_bursts_first_rounds_decide_at_the_load_it_enters_into():
    from specserve.policy import MeasuredModes

    def modes_of_a_burst(peak):
        modes = MeasuredModes()
        # measured before: off the better at 3-11 requests in flight, the model 1.41x off at 12-22
        for level, lead in {2: 1.14, 3: 1.03, 4: 1.41}.items():
            measured = modes._measured(level)
            measured.model, measured.off, measured.lead, measured.pairs = 14.0 * lead, 14.0, lead, 2
            measured.measurements, measured.epochs, measured.warmed = {"model": 3, "off": 3}, 10, True
            measured.next_explore = 40
        modes.current = "off"
        return [modes.begin(1000.0 + n / 1000, MeasuredModes.deciding_load(n, first_round=True, peak_in_flight=peak),
                            prefilling=True, first_round=True, room_tokens=64.0).mode for n in range(1, 17)]

    # by their own count requests 3 to 11 take the modes of the levels the burst passes through
    assert modes_of_a_burst(None) == ["model"] * 2 + ["off"] * 9 + ["model"] * 5
    # at the load the wave enters into (the last wave's peak), every one runs the wave's mode
    assert modes_of_a_burst(16) == ["model"] * 16
    # a peak below the burst's own count does not hold it back
    assert modes_of_a_burst(8) == ["off"] * 11 + ["model"] * 5


def test_a_wave_s_first_round_predicts_off_at_the_load_it_decides_at():
    """Code at 4 streams (AVX-512 EPYC): the level's first look measured the model at 17.4
    tok/s, off not yet. The next wave's first round decided at the recent peak, 4 in flight,
    but off was predicted at its own count, 1: ~5 tok/s, so off "clearly lost", the whole wave
    ran the model, and off's first measurement fell in the wave's tail, measuring nothing, wave
    after wave. Predicted at the load the round decides at (`deciding_load`), off is measured
    from the wave's start."""
    load = LoadModel(in_flight=1, decode=DecodeCurve(((1, 0.20), (2, 0.205), (4, 0.22), (8, 0.30))))
    assert load.off_goodput() == pytest.approx(5.0)
    assert load.off_goodput(4) == pytest.approx(4 / 0.22)
    assert MeasuredModes.deciding_load(1, first_round=True, peak_in_flight=4) == 4
    assert MeasuredModes.deciding_load(1, first_round=False, peak_in_flight=4) == 1
    assert MeasuredModes.deciding_load(6, first_round=True, peak_in_flight=4) == 6

    deciding = MeasuredModes.deciding_load(1, first_round=True, peak_in_flight=4)

    def wave_start(off_predicted: float) -> str:
        modes = MeasuredModes()
        measured = modes._measured(MeasuredModes.level(4))
        measured.model, measured.warmed, measured.measurements = 17.4, True, {"model": 1}
        modes.current = "model"  # the last wave's tail ran below the measured levels
        return modes.begin(100.0, deciding, prefilling=True, catching_up=True, first_round=True, room_tokens=64.0,
                           off_predicted=off_predicted).mode

    assert wave_start(load.off_goodput(deciding)) == "off"
    assert wave_start(load.off_goodput()) == "model"  # predicted at 1 in flight: off never measured here

