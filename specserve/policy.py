"""Load-aware speculation: how much to draft this round, or whether to draft at all.

Speculation trades compute for fewer sequential target steps. At low load a target step costs
about the same for 1 token as for 5, so drafting k tokens is nearly free; when the pool is
saturated every drafted token is paid in full, and verifying drafts that get rejected slows
everyone down. The policy decides per request per round, from measurements only:

- the request's acceptance: per draft position d, the probability that the token at depth d is
  accepted given that the one above it was (an EMA over the request's rounds, starting from the
  deployment-wide EMA);
- step-time models of both pools, seconds = fixed + per_token * batch_tokens, fitted online
  (least squares with forgetting) from the load signals every pool reply carries;
- the target pool's current batch: requests per pass.

For each depth k (a chain's length, a tree's depth cap, 0 = off) it predicts the system's
goodput if every request in the batch did the same:

    goodput(k) = E[tokens | k] / round_seconds(k)
    E[tokens | k] = 1 + sum_{j<k} prod_{d<=j} drafted_d * accept_d   (Leviathan et al. 2023, per position)
    round_seconds(k) = overhead(k) + P * (levels(k) * draft_step(B * width) + target_step(B * (1 + nodes(k))))

where P = max(1, requests in flight / B) is the passes a round spans: a pool that runs B requests
per pass serves N > B requests in flight in N / B passes, and every request's round waits for
the others' (16 streams on pools of batch 8: two passes a round; counted once, as a constant
overhead, the other pass's drafting and verifying was free, and the model priced k = 1-4 at
1.1-1.3x off where always on measured 0.98x and every switch to the model's choice cost); and
where drafted_d is the measured chance that the proposer drafts position d when asked and every
position above it was accepted (a draft model stops where its confidence falls, so k is a cap: a
round asked for 4 often drafts 1 or 2), levels(k) the levels it drafts (one proposer step each;
from the chance that it drafts position d after any drafted one, accepted or not: drafting comes
before verification) and nodes(k) those levels times the tree's width.

A request that was off has a one-off cost before it can draft again: the draft pool prefills
everything since its last draft. For a k > 0, that catch-up (the draft pool's per-token cost
times the tokens missed) is spread over the rounds the request has left, so a request near its
end, or one that was off for long under load, needs a clearer gain to turn speculation on.
The policy picks the best, with hysteresis: it changes k only for a gain of more than `hysteresis`
over the current choice, and never keeps a k > 0 that its own model says loses to k = 0.
A position that is never drafted is never measured, so every `probe_every` rounds the policy
drafts one level deeper than its choice, when its model says that level still beats k = 0 (or,
from k = 0, the configured depth, when drafts that were all accepted would beat k = 0 at this
load: a request that turned speculation off must be able to find out that it should turn it
back on). A request's first measurements weigh more than the EMA's weight (its prior counts as a
few rounds), so a probe moves its estimate by more than a tenth of the gap.
Pure and torch-free: the router and the library decoder feed it.

    >>> policy = SpeculationPolicy(PolicyConfig())
    >>> load = LoadModel()
    >>> for tokens, seconds in [(1, 0.080), (5, 0.082), (64, 0.29), (256, 0.95)]:
    ...     load.target.observe(tokens, seconds)
    >>> acceptance = AcceptanceTracker([0.8] * 8, rounds=5, ages=[0] * 8)  # measured: 80% per position
    >>> policy.choose(acceptance, load, current=4, max_k=8, batch=1, draft_cost="co_located").k > 0
    True
    >>> policy.choose(acceptance, load, current=4, max_k=8, batch=256, draft_cost="co_located").k
    0
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

DRAFT_COSTS = ("pool", "co_located", "free")  # a draft model pool / heads in the target pass / nothing


@dataclass(frozen=True)
class PolicyConfig:
    hysteresis: float = 0.05  # change k only for more than this relative goodput gain
    # A round's weight in the deployment-wide EMAs new requests start from: over ~50 rounds of
    # many requests, so one request's closing streak of rejections does not become the starting
    # estimate of every request after it (at 0.1 it did: on chat at 1 stream new requests began
    # below break-even, turned speculation off, measured nothing and left the estimate there).
    deployment_ema: float = 0.02
    acceptance_ema: float = 0.1  # a new round's weight in a request's acceptance EMA (at 0.3 the
    # estimate of a 90% position swings by ±0.13 from round to round, enough to pin k low)
    prior_acceptance: float = 0.6  # per-position acceptance before anything is measured
    # Speculative rounds this kind of speculation runs as configured (deployment-wide) before the
    # policy decides (unless not even drafts that were all accepted would win at this load).
    warmup_rounds: int = 2
    head_cost: float = 0.02  # co-located heads: their share of a target step
    # Every this many rounds without a draft at depth k+1, draft one level deeper than the
    # model's choice (when that still beats no speculation): a position never drafted is never
    # measured, so an early unlucky estimate would otherwise pin k below its best for good.
    # From off it probes the configured depth when drafts that were all accepted would win at
    # this load: off, nothing is drafted and nothing measured, so an estimate that a stretch of
    # bad prompts or load left low would otherwise keep speculation off for good.
    probe_every: int = 16


@dataclass
class StepTimeModel:
    """seconds ≈ fixed + per_token * tokens, fitted by weighted least squares with exponential
    forgetting. Until the observations spread over several batch sizes, the slope leans on a
    prior knee (fixed / per_token = `prior_tokens`), so a single batch size still gives a sane
    model."""

    forget: float = 0.98  # each observation's weight shrinks by this per newer observation
    prior_tokens: float = 32.0
    _w: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0

    def observe(self, tokens: float, seconds: float) -> None:
        if seconds <= 0 or tokens <= 0 or not math.isfinite(seconds):
            return
        f = self.forget
        self._w = f * self._w + 1.0
        self._x = f * self._x + tokens
        self._y = f * self._y + seconds
        self._xx = f * self._xx + tokens * tokens
        self._xy = f * self._xy + tokens * seconds

    @property
    def observed(self) -> bool:
        return self._w > 0

    def coefficients(self) -> tuple[float, float]:
        """(fixed seconds, seconds per token)."""
        if not self.observed:
            return 0.0, 0.0
        w = self._w
        mean_x, mean_y = self._x / w, self._y / w
        prior_slope = mean_y / (self.prior_tokens + mean_x)  # the mean point on a line with the prior knee
        ridge = w * self.prior_tokens ** 2  # pulls the slope to the prior while x barely varies
        sxx = self._xx - self._x * mean_x
        sxy = self._xy - self._x * mean_y
        slope = max(0.0, (sxy + ridge * prior_slope) / (sxx + ridge))
        fixed = max(0.0, mean_y - slope * mean_x)
        return fixed, slope

    def predict(self, tokens: float) -> float:
        fixed, slope = self.coefficients()
        return fixed + slope * tokens


@dataclass
class DecodeCurve:
    """Seconds of a decode pass (one new token a call) by calls in it: the passes the target
    pool timed at startup (EngineInfo.decode_pass_s), interpolated, times the drift since (an
    EMA of measured over timed, in the decode passes that ran as off's do: see CallsInFlight).
    What off's rounds cost, where a line fitted on a speculating router's passes cannot say: its
    verifies have several rows a call and share the cores with the draft pool, and that line
    put a 16-call decode pass at 1.0-1.4 s where it took 0.75-0.8 s (code, 16 streams).

        >>> curve = DecodeCurve(((1, 0.30), (2, 0.32), (4, 0.36), (8, 0.44), (16, 0.60)))
        >>> round(curve.predict(12), 3), round(curve.predict(24), 3)  # between timed passes; past the largest
        (0.52, 0.76)
        >>> for _ in range(8):  # a pass of 8 calls, each request reporting it, 25% slower than timed
        ...     curve.observe(8, 0.55)
        >>> round(curve.drift, 3)
        1.024
    """

    timed: tuple[tuple[int, float], ...]  # (calls, seconds), ascending in calls
    drift: float = 1.0
    # a pass's weight in the drift: ~the last 10 passes (a pass's time varies by ±10% here)
    smoothing: float = 0.1

    def __post_init__(self) -> None:
        if not self.timed or any(n1 <= n0 for (n0, _), (n1, _) in zip(self.timed, self.timed[1:])):
            raise ValueError(f"decode pass times must be (calls, seconds) ascending in calls, not {self.timed!r}")

    def timed_s(self, calls: float) -> float:
        """The startup time of a pass of `calls`: interpolated between timed passes, and past the
        largest along the last two's slope (a pool splits calls beyond its largest pass into
        more passes, so this errs short: off is then measured rather than ruled out)."""
        points = self.timed
        if calls <= points[0][0]:
            return points[0][1]
        if len(points) == 1:
            return points[0][1] * calls / points[0][0]
        for (n0, s0), (n1, s1) in zip(points, points[1:]):
            if calls <= n1:
                break
        return s0 + (s1 - s0) * (calls - n0) / (n1 - n0)

    def observe(self, calls: int, seconds: float) -> None:
        """A decode pass of `calls`, as one of them reports it: every request in the pass
        reports the same pass, so each report weighs 1/calls of one."""
        if calls > 0 and seconds > 0 and math.isfinite(seconds):
            self.drift += self.smoothing / calls * (seconds / self.timed_s(calls) - self.drift)

    def predict(self, calls: float) -> float:
        return self.timed_s(calls) * self.drift


@dataclass
class LoadModel:
    """What the pools' load signals say: step-time models and the target's batch (EMA); and
    the caller's own load, the requests it has in rounds."""

    target: StepTimeModel = field(default_factory=StepTimeModel)
    draft: StepTimeModel = field(default_factory=StepTimeModel)
    batch_ema: float = 1.0  # requests per target pass
    in_flight: int = 1  # requests in rounds at the caller (the router sets it before each decision)
    # Per round, outside the passes the round spans (RPCs, queueing): rounds with the target pool
    # alone, and rounds that also called a draft pool (one more RPC; None until one is seen).
    overhead_s: float = 0.0
    draft_overhead_s: float | None = None
    smoothing: float = 0.2
    # Once no round has called the draft pool for `overhead_stale_rounds` rounds, each further
    # round without one moves the draft call's overhead `overhead_relax` of its gap toward the
    # target-only one: it is measured only while requests speculate, so one taken in a burst (a
    # round queued behind another request's draft-pool prefill: 0.72 s against ~0.015 s, code at
    # 2 streams) would otherwise keep speculation off for good.
    overhead_relax: float = 0.03
    overhead_stale_rounds: int = 16
    rounds_without_draft_call: int = 0
    # Off's own: the target's decode passes as timed at startup (None: not timed, e.g. vLLM; the
    # fitted step time then stands in), and the overhead of rounds that waited on no other
    # request's verify (None until one ran; see off_goodput).
    decode: DecodeCurve | None = None
    # Off's overhead is the median of its last `off_overhead_window` rounds, once
    # `off_overhead_rounds` were seen: a router's first rounds can be slow (the bench's first
    # request, alone: 0.49 s, then ~0.01 s, chat 8), and an EMA seeded by one such round kept
    # off's prediction low for minutes, too low for off to be measured (docs/bench/off-curve-avx2).
    off_overhead_rounds: int = 3
    off_overhead_window: int = 15
    _off_overheads: deque = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._off_overheads = deque(maxlen=self.off_overhead_window)

    def observe_target(self, batch_size: int, batch_tokens: float, step_s: float, *, off: bool = False) -> None:
        """A target pass's load signal; `off`: the pass ran as off's passes run (a round of
        off, or any round while the draft pool was idle: CallsInFlight), so a decode pass there,
        one token a call, tells the decode curve's drift."""
        self.target.observe(batch_tokens, step_s)
        self.batch_ema += self.smoothing * (max(1, batch_size) - self.batch_ema)
        if off and self.decode is not None and 0 < batch_tokens <= batch_size:
            self.decode.observe(batch_size, step_s)

    def observe_draft(self, batch_tokens: int, step_s: float) -> None:
        self.draft.observe(batch_tokens, step_s)

    def catch_up_s(self, tokens: int) -> float:
        """A draft pool's time for a catch-up of `tokens` (0 before the target's first reply),
        from the target's fitted step time: an upper bound, and fitted on prompt prefills as
        well as decode passes. The draft pool's own is fitted on its decode passes, whose
        per-token slope is far below a prefill's: at code 16 streams it put a 2,000-token
        catch-up at 2.3 s, where the catch-ups took ~45 s."""
        return self.target.predict(tokens) if tokens > 0 else 0.0

    def observe_overhead(self, seconds: float, *, draft_call: bool = False, off: bool = False) -> None:
        """A round's overhead (outside the passes it spanned); `off`: a round without a draft
        that waited on no other request's verify (a round of off, or a request alone), whose
        overhead is off's."""
        seconds = max(0.0, seconds)
        if off and not draft_call:
            self._off_overheads.append(seconds)
        if not draft_call:
            self.overhead_s += self.smoothing * (seconds - self.overhead_s)
            self.rounds_without_draft_call += 1
            if self.draft_overhead_s is not None and self.rounds_without_draft_call > self.overhead_stale_rounds:
                self.draft_overhead_s += self.overhead_relax * (self.overhead_s - self.draft_overhead_s)
            return
        self.rounds_without_draft_call = 0
        if self.draft_overhead_s is None:
            self.draft_overhead_s = seconds
        else:
            self.draft_overhead_s += self.smoothing * (seconds - self.draft_overhead_s)

    @property
    def off_overhead_s(self) -> float | None:
        """Off's round overhead (see `off_overhead_rounds`); None until enough were seen."""
        if len(self._off_overheads) < self.off_overhead_rounds:
            return None
        return statistics.median(self._off_overheads)

    def passes(self, batch: float) -> float:
        """Passes of each pool a round spans at `batch` requests per pass: every request in
        flight is served once a round, so N in flight take N / batch passes (at least one)."""
        return max(1.0, self.in_flight / max(batch, 1.0))

    def round_overhead(self, draft_call: bool) -> float:
        if draft_call and self.draft_overhead_s is not None:
            return self.draft_overhead_s
        return self.overhead_s

    def off_goodput(self, in_flight: float | None = None) -> float | None:
        """Tokens per second every request in flight (or `in_flight` requests, where given: the
        load an epoch decides at, MeasuredModes.deciding_load) would emit together with
        speculation off:
        one each per target pass, all of them in that pass (a round of every request is then
        one decode pass, which a continuous batcher fills), plus off's round overhead. Off is the
        mode whose costs the model sees whole (no draft pool, no catch-ups).

        The pass: the decode curve where the target pool timed one (`decode`), else the target's
        fitted step time, which errs low while requests speculate (fitted on verifies of several
        rows a call, the draft pool sharing the cores): over the model's rounds at code 8 and 16
        streams it put off at 8.8 and 11 tok/s where off's epochs measured 14-16 and ~20. The
        overhead: off's own (`off_overhead_s`); until a few are measured, none where the curve is
        known (a round trip is ~0.03 s against a CPU pass's 0.4-0.8 s; the model's target-only
        rounds, which wait on other requests' verifies, measured 0.14-0.38 s), else the
        target-only rounds'. None before the target's first reply or timed passes."""
        in_flight = self.in_flight if in_flight is None else in_flight
        if self.decode is not None:
            return in_flight / ((self.off_overhead_s or 0.0) + self.decode.predict(in_flight))
        if not self.target.observed:
            return None
        overhead = self.off_overhead_s if self.off_overhead_s is not None else self.round_overhead(draft_call=False)
        return in_flight / (overhead + self.target.predict(in_flight))


@dataclass
class CallsInFlight:
    """A router's calls to one pool: how many are in flight, and when the last one ended. Tells
    whether the pool was idle, as far as this router knows, through a span such as a round: a
    target decode pass that ran while the draft pool was idle costs what off's passes cost,
    whichever request it served (a request with speculation off, or the policy's rounds at
    k = 0), so it tells the decode curve's drift as off's rounds do. One the draft pool shared
    the cores with does not: 8-call decode passes of catch-up rounds took 1.3-1.5 s where always
    off's took 0.82-0.85 s (chat 8, 2-core CPU).

    >>> calls = CallsInFlight()
    >>> calls.idle_since(0.0)
    True
    >>> calls.start(); calls.idle_since(0.0)
    False
    >>> calls.end(5.0); calls.idle_since(4.0), calls.idle_since(5.0)
    (False, True)
    """

    in_flight: int = 0
    last_end: float = -math.inf

    def start(self) -> None:
        self.in_flight += 1

    def end(self, now: float) -> None:
        self.in_flight = max(0, self.in_flight - 1)
        self.last_end = max(self.last_end, now)

    def idle_since(self, since: float) -> bool:
        """No call in flight now, and none ended after `since`."""
        return self.in_flight == 0 and self.last_end <= since


@dataclass
class PrefillWatch:
    """Which rounds overlapped a prefill. Two kinds: a prompt's prefill (a request's first
    round) and a draft pool's catch-up (a round whose propose call carries more than a few
    tokens the draft has not seen: the request ran without the draft for a while). A round
    that overlapped either waited for it (33-72 s per round at 16 streams on a 2-core CPU, in
    passes it did not count as its own): a wait once per arriving request or per switch of the
    draft back on, not a constant every round pays, so it must not be learnt as round overhead.
    Learnt as one, it made every depth look better than off. For the same reason
    `MeasuredModes` does not count such rounds in its epochs.

    >>> watch = PrefillWatch()
    >>> mine = watch.start(prefill=False)   # a decode round begins
    >>> theirs = watch.start(prefill=True)  # another request's first round begins meanwhile
    >>> watch.end(theirs); watch.clear(mine)
    False
    >>> watch.clear(watch.start(prefill=False))
    True
    >>> catch_up = watch.start(prefill=False, catch_up=True)  # a draft pool catches up
    >>> watch.active, watch.catching_up
    (0, 1)
    """

    active: int = 0  # requests in their first (prompt-prefill) round
    catching_up: int = 0  # rounds whose draft pool catches up on tokens it has not seen
    events: int = 0  # prefills of either kind started or ended so far

    @property
    def running(self) -> int:
        """Prefills of either kind running now."""
        return self.active + self.catching_up

    def start(self, prefill: bool, catch_up: bool = False) -> tuple[int, bool, str | None]:
        """A round begins (`prefill`: a prompt's first round; `catch_up`: its draft pool catches
        up); returns its mark."""
        kind = "prefill" if prefill else "catch_up" if catch_up else None
        mark = (self.events, self.running > 0, kind)
        if kind is not None:
            if prefill:
                self.active += 1
            else:
                self.catching_up += 1
            self.events += 1
        return mark

    def end(self, mark: tuple[int, bool, str | None]) -> None:
        """The round of `mark` ended (however it ended)."""
        kind = mark[2]
        if kind is not None:
            if kind == "prefill":
                self.active -= 1
            else:
                self.catching_up -= 1
            self.events += 1

    def clear(self, mark: tuple[int, bool, str | None]) -> bool:
        """Whether the round of `mark` (no prefill itself) saw no prefill of either kind from
        start to now."""
        events, busy, kind = mark
        return kind is None and not busy and self.events == events


@dataclass
class RecentPeak:
    """The most requests in rounds the router saw at a round's start over the last `window_s`
    seconds: the load a wave's first requests enter into, where their own count (1, 2, ...)
    says less. A minute: long enough to span the gap between waves, and the wave's tail
    before it (its last requests drain it to 1 in rounds); after load fell for good a request
    only starts its prompt's catch-up a round later for that long. Why: at code
    8 streams on a 2-core CPU a wave's first two adaptive requests, at 1 and 2 in rounds (below
    the levels MeasuredModes measures) and the first with no other prompt prefilling, started
    their prompts' draft catch-ups beside the target's first prefill in an epoch that then ran
    off; the wave's first prompt took 1.74 s to prefill against always off's 1.07 s, and every
    later first token came ~1 s behind (docs/bench/adaptive-history.md, item 33).

    >>> peak = RecentPeak(window_s=30)
    >>> for level in (1, 2, 8): peak.observe(0.0, level)
    >>> peak.observe(10.0, 1); peak.value(20.0), peak.value(35.0), peak.value(45.0)
    (8, 1, 0)
    """

    window_s: float = 60.0
    _last_seen: dict[int, float] = field(default_factory=dict)  # level -> when last seen

    def observe(self, now: float, level: int) -> None:
        self._last_seen[level] = now
        for stale in [lv for lv, seen in self._last_seen.items() if now - seen > self.window_s]:
            del self._last_seen[stale]

    def value(self, now: float) -> int:
        return max((lv for lv, seen in self._last_seen.items() if now - seen <= self.window_s), default=0)


def draft_catches_up(unseen: int, depth: int) -> bool:
    """Whether a propose call carrying `unseen` tokens its draft pool has not seen is a catch-up
    (a prefill: the request ran without the draft for a while), not a round's usual sync (the
    previous round's accepted tokens and its bonus token: at most depth + 1).

    >>> draft_catches_up(5, depth=4), draft_catches_up(11, depth=4)
    (False, True)
    """
    return unseen > 2 * (depth + 1)


def switch_catch_up_tokens(requests: Iterable[tuple[int, int]]) -> int:
    """The tokens draft pools must prefill to switch these requests to speculating, from each
    one's (unseen tokens, depth): the requests whose unseen text is a catch-up
    (draft_catches_up); one that drafted its last round is as good as synced.

        >>> switch_catch_up_tokens([(5, 4), (300, 4), (40, 4)])
        340
    """
    return sum(unseen for unseen, depth in requests if draft_catches_up(unseen, depth))


@dataclass
class AcceptanceTracker:
    """A request's drafts, measured: per draft position d (0-based) the EMA of P(token at depth
    d+1 accepted | depth d was), the EMA of P(the proposer drafts position d | it drafted the
    one before and was asked for d) — a draft model stops where its confidence falls
    (`draft_min_confidence`), a dynamic tree where its scores do, so a depth asked for is a cap,
    not what is drafted — and the EMA of drafted nodes per level (1 for chains). A position a
    round does not measure (not asked for, not reached, or no speculation at all) drifts toward
    the deployment-wide estimate instead: what a request measured long ago is stale."""

    rates: list[float]
    prior: float = 0.6
    weight: float = 0.1  # a new round's weight in the EMAs
    relax_step: float = 0.03  # per round that does not measure a position: its gap to the deployment halves in ~23
    rounds: int = 0  # speculative rounds observed
    # Per position: rounds that measured its acceptance (this tracker's own evidence). The
    # starting estimate (the prior, or the deployment's for a request) counts as `prior_rounds`
    # rounds, so the first measurements weigh 1/(prior_rounds + n) until that falls to `weight`:
    # a request whose drafts are far better than the deployment's estimate (code after chat:
    # 0.8 per position against 0.6) learns it in a few probes, not in ~10 rounds per probe.
    measured: list[int] = field(default_factory=list)
    prior_rounds: float = 3.0
    nodes_per_level: float = 1.0
    ages: list[int] = field(default_factory=list)  # per position: rounds since it was last drafted
    survival: list[float] = field(default_factory=list)  # per position; 1.0 until measured
    # Per position: P(the proposer drafts d | every position above was drafted AND accepted).
    # Not `survival`: a draft goes on where it is confident, and that is where it is right, so
    # after an accepted token it goes on more often than after any drafted one (chat at 1 stream,
    # asked for 4: 0.81/0.87/0.91 against 0.70/0.71/0.81). Expected tokens use this one, the
    # drafting cost `survival`; with `survival` for both, a round of 4 was credited 2.62 tokens
    # where it emitted 2.90, and the policy settled on k = 2 where k = 4 was faster.
    survival_accepted: list[float] = field(default_factory=list)
    # The deployment-wide tracker this one was copied from: it learns from every request's rounds.
    shared: AcceptanceTracker | None = field(default=None, repr=False)

    @classmethod
    def with_prior(cls, config: PolicyConfig, positions: int, weight: float | None = None) -> AcceptanceTracker:
        return cls([config.prior_acceptance] * positions, config.prior_acceptance,
                   config.acceptance_ema if weight is None else weight)

    def observe(self, drafted_depth: int, accepted: int, nodes: int | None = None, asked: int | None = None) -> None:
        """A round asked for `asked` levels (None: not known), drafted `drafted_depth` of them
        (`nodes` nodes; default a chain) and `accepted` of those were accepted: positions
        0..accepted-1 succeeded, position `accepted` (if drafted) failed, deeper ones were not
        reached. Positions 0..drafted_depth-1 were drafted; position drafted_depth, if asked
        for, was not (the proposer stopped there)."""
        if self.shared is not None:
            self.shared.observe(drafted_depth, accepted, nodes, asked)
        asked_for = min(drafted_depth + 1, asked or 0)
        _ema_hits(self.survival, asked_for, drafted_depth, self.weight)
        # positions 0..accepted had every position above them drafted and accepted
        after_accepts = min(accepted + 1, asked or 0)
        _ema_hits(self.survival_accepted, after_accepts, drafted_depth, self.weight)
        reached = min(drafted_depth, accepted + 1)
        if asked and self.shared is not None:
            # What this round did not measure drifts toward the deployment, as in rounds without
            # speculation: a request whose rejections cut its depth to 1 does not keep the deeper
            # positions' low estimates frozen (they are drafted only when probed, every
            # `probe_every` rounds), it lets them age back toward what every request measures.
            self._drift(rates_from=reached, survival_from=asked_for, accepted_from=after_accepts)
        if drafted_depth <= 0:
            return
        self.rounds += 1
        self.ages = [0] * drafted_depth + [a + 1 for a in self.ages[drafted_depth:]]
        for d in range(reached):
            while d >= len(self.rates):
                self.rates.append(self.prior)
            while d >= len(self.measured):
                self.measured.append(0)
            self.measured[d] += 1
            weight = max(self.weight, 1.0 / (self.prior_rounds + self.measured[d]))
            self.rates[d] += weight * ((1.0 if d < accepted else 0.0) - self.rates[d])
        per_level = (nodes if nodes is not None else drafted_depth) / drafted_depth
        self.nodes_per_level += self.weight * (per_level - self.nodes_per_level)

    def relax(self) -> None:
        """A round without speculation: drift (`relax_step` of the gap) toward what the
        deployment measures now, or the prior when there is nothing shared. So a request that
        stopped speculating because its own drafts failed tries again some time later, and one
        that stopped because of load keeps a realistic view of its drafts instead of decaying
        to a pessimistic prior that would keep it off after the load is gone."""
        self.ages = [a + 1 for a in self.ages]
        self._drift(rates_from=0, survival_from=0, accepted_from=0)

    def _drift(self, *, rates_from: int, survival_from: int, accepted_from: int) -> None:
        """Move the estimates of positions from these on `relax_step` of the way toward the
        deployment's (the prior's, with nothing shared): estimates not measured for a while."""
        shared = self.shared
        for estimates, start, toward in (
                (self.rates, rates_from, shared.rate if shared else lambda d: self.prior),
                (self.survival, survival_from, shared.survive if shared else lambda d: 1.0),
                (self.survival_accepted, accepted_from, shared.survive_accepted if shared else lambda d: 1.0)):
            for d in range(start, len(estimates)):
                estimates[d] += self.relax_step * (toward(d) - estimates[d])

    def rate(self, position: int) -> float:
        return self.rates[position] if position < len(self.rates) else self.prior

    def survive(self, position: int) -> float:
        return self.survival[position] if position < len(self.survival) else 1.0

    def survive_accepted(self, position: int) -> float:
        """P(the proposer drafts `position` | every position above it was accepted); until
        measured, what is known of its survival after any draft."""
        if position < len(self.survival_accepted):
            return self.survival_accepted[position]
        return self.survive(position)

    def age(self, position: int) -> float:
        """Rounds since a draft last reached `position` (never: infinity)."""
        return self.ages[position] if position < len(self.ages) else math.inf

    def expected_tokens(self, k: int) -> float:
        """Tokens a round asked for k positions emits on average, the target's own included:
        position d counts when it is drafted and it and every one above it are accepted (each
        factor conditioned on the positions above having been accepted)."""
        return self.expectations(k)[0][k]

    def expectations(self, max_k: int) -> tuple[list[float], list[float]]:
        """(expected_tokens(k), expected_drafted(k)) for every k in 0..max_k, in one pass."""
        tokens, drafted = [1.0], [0.0]
        accepted_run, drafted_run = 1.0, 1.0
        for d in range(max_k):
            drafted_run *= self.survive(d)
            accepted_run *= self.survive_accepted(d) * self.rate(d)
            tokens.append(tokens[-1] + accepted_run)
            drafted.append(drafted[-1] + drafted_run)
        return tokens, drafted

    def expected_drafted(self, k: int) -> float:
        """Positions a round asked for k drafts on average: a chain's nodes, and the proposer's
        steps (each step drafts a level; a proposer stops after the level it was unsure of)."""
        return self.expectations(k)[1][k]


def _ema_hits(estimates: list[float], positions: int, drafted_depth: int, weight: float) -> None:
    """One round's outcome for each of the first `positions` positions: drafted (position <
    `drafted_depth`) or not, into per-position EMAs that start at 1.0."""
    for d in range(positions):
        while d >= len(estimates):
            estimates.append(1.0)
        estimates[d] += weight * ((1.0 if d < drafted_depth else 0.0) - estimates[d])


@dataclass(frozen=True)
class Decision:
    k: int
    goodput: dict[int, float]  # tokens per second per candidate k (the model's view)
    # "warmup" (the configured depth; off where no depth wins) | "model" | "probe" (one level
    # deeper, to measure it) | "measured" (off: the router measured that, at this load, no
    # speculation gives more)
    reason: str


class SpeculationPolicy:
    """The decisions, and the deployment-wide acceptance per kind of speculation that new
    requests start from (one policy per router replica or library decoder)."""

    def __init__(self, config: PolicyConfig | None = None):
        self.config = config or PolicyConfig()
        self._shared: dict[str, AcceptanceTracker] = {}

    def tracker(self, kind: str, positions: int) -> AcceptanceTracker:
        """A new request's acceptance tracker: a copy of what this kind of speculation
        (e.g. "draft/chain") measured so far, which it keeps teaching."""
        shared = self._shared.setdefault(kind, AcceptanceTracker.with_prior(self.config, positions,
                                                                            self.config.deployment_ema))
        # The deployment's estimates are the request's prior; what it drafts and measures is its
        # own: a position it never drafted is due for a probe (where drafts could pay at all), so
        # a request whose drafts differ from the deployment's (code after chat) finds out.
        return replace(shared, rates=list(shared.rates), survival=list(shared.survival),
                       survival_accepted=list(shared.survival_accepted), ages=[], measured=[],
                       weight=self.config.acceptance_ema, shared=shared)

    def round_seconds(self, k: int, load: LoadModel, batch: float, *, nodes: float, width: float,
                      draft_cost: str) -> float:
        """Predicted wall time of a round in which every one of `batch` requests per pass is
        asked for `k` levels and drafts `nodes` nodes in all (`width` per level on average): one
        proposer step per drafted level, in each of the passes the round spans."""
        passes = load.passes(batch)
        verify = load.target.predict(batch * (1.0 + nodes))
        if k == 0:
            return load.round_overhead(draft_call=False) + passes * verify
        if draft_cost == "pool":
            draft = nodes / width * load.draft.predict(batch * width) if load.draft.observed else 0.0
        elif draft_cost == "co_located":
            draft = self.config.head_cost * load.target.predict(batch)
        else:
            draft = 0.0
        return load.round_overhead(draft_call=draft_cost == "pool") + passes * (draft + verify)

    @staticmethod
    def catch_up_seconds(load: LoadModel, batch: float, catch_up: int, draft_cost: str) -> float:
        """What drafting again costs once, before its first token: the draft pool prefills the
        `catch_up` tokens it has not seen (everything since the request last drafted), for
        each of the requests in flight (`batch` per pass). Only a draft pool has that cost (heads read the target's own
        pass; n-gram lookup indexes tokens as they come)."""
        if draft_cost != "pool" or catch_up <= 0 or not load.draft.observed:
            return 0.0
        return load.passes(batch) * batch * catch_up * load.draft.coefficients()[1]

    def choose(self, acceptance: AcceptanceTracker, load: LoadModel, *, current: int, max_k: int,
               batch: float | None = None, draft_cost: str = "pool", catch_up: int = 0,
               room: float = math.inf, probe_from_off: bool = True) -> Decision:
        """The depth for this round: 0..max_k (`batch`: requests per target pass, default the
        load model's EMA). `catch_up`: tokens the draft pool must prefill before it can draft
        (a request that was off); that one-off cost is spread over the rounds the request has
        left (`room`: tokens it may still emit), so it weighs most near the end.
        `probe_from_off=False`: the caller explores by other means (MeasuredModes' epochs), so
        a request that is off, or new, does not draft to measure its drafts."""
        if draft_cost not in DRAFT_COSTS:
            raise ValueError(f"draft_cost must be one of {DRAFT_COSTS}, got {draft_cost!r}")
        if max_k <= 0:
            return Decision(0, {}, "model")
        if not load.target.observed:
            return Decision(max_k, {}, "warmup")
        batch = load.batch_ema if batch is None else batch
        catch_up_s = self.catch_up_seconds(load, batch, catch_up, draft_cost)
        width = acceptance.nodes_per_level
        expected_tokens, expected_drafted = acceptance.expectations(max_k)
        seconds = [self.round_seconds(k, load, batch, nodes=expected_drafted[k] * width, width=width,
                                      draft_cost=draft_cost) for k in range(max_k + 1)]
        goodput = {}
        for k, tokens in enumerate(expected_tokens):
            # the catch-up, spread over the rounds the request has left
            total = seconds[k] + (catch_up_s / max(1.0, room / tokens) if k else 0.0)
            goodput[k] = tokens / total if total > 0 else 0.0
        # A measurement of drafts can pay only where drafts would win if they were all accepted
        # (a probe that finds nothing turns speculation off again: its catch-up is spread over
        # the rounds until the next probe, not all the rounds left). Asked only when due.
        def worth_measuring() -> bool:
            return self._worth_measuring(expected_drafted, seconds, catch_up_s, room, goodput[0])

        if acceptance.rounds < self.config.warmup_rounds:
            # Nothing measured yet for this kind of speculation: the configured depth, to measure
            # every position. Not where even perfect drafts lose at this load (a burst of new
            # requests on a saturated pool would otherwise each draft k, and pay a draft-pool
            # prefill of its prompt, exactly when that costs most); but the prior acceptance does
            # not decide it: a prior that says off would never be corrected (code at 2 streams:
            # the prior 0.6 priced speculation off, code's drafts accept 0.8 per position).
            return Decision(max_k if worth_measuring() else 0, goodput, "warmup")
        k = self._pick(goodput, min(current, max_k))
        if k < max_k and acceptance.age(k) >= self.config.probe_every:
            # Deeper, to measure it: from k > 0 one level, when the model says it beats no
            # speculation; from off (where nothing is drafted, so nothing measured) the
            # configured depth, when drafts could pay at this load at all.
            if k and goodput[k + 1] > goodput[0]:
                return Decision(k + 1, goodput, "probe")
            if not k and probe_from_off and worth_measuring():
                return Decision(max_k, goodput, "probe")
        return Decision(k, goodput, "model")

    def _worth_measuring(self, expected_drafted: list[float], seconds: list[float], catch_up_s: float,
                         room: float, off: float) -> bool:
        """Whether some depth, with every drafted token accepted, beats no speculation (`off`
        tokens per second) by more than the hysteresis: a measurement can only turn speculation
        on where that much is to be gained. Its catch-up is spread over the rounds the
        measurement serves: until the next probe, or the request's end (`room` tokens)."""
        bar = off * (1 + self.config.hysteresis)
        for k in range(1, len(expected_drafted)):
            tokens = 1.0 + expected_drafted[k]
            rounds = max(1.0, min(self.config.probe_every, room / tokens))
            if tokens / (seconds[k] + catch_up_s / rounds) > bar:
                return True
        return False

    def _pick(self, goodput: dict[int, float], current: int) -> int:
        """The best k, unless the current one is within the hysteresis band of it; a k that
        loses to k = 0 is never kept."""
        off = goodput[0]
        allowed = {k: g for k, g in goodput.items() if k == 0 or g > off}
        best = max(allowed, key=lambda k: (allowed[k], -k))  # ties: the smaller k
        if current in allowed and allowed[best] <= allowed[current] * (1 + self.config.hysteresis):
            return current
        return best


@dataclass(frozen=True)
class _EpochGoodput:
    """A measured epoch, as the first half of a pair (MeasuredModes, "Pairing")."""

    mode: str
    goodput: float
    in_flight: float  # requests in flight, the mean over its round starts
    model_yield: float | None  # the yield its rounds were expected to emit (a model epoch's; None: not given)
    closed_at: float  # when its last round ended (seen at a round start)


def _settling_average(average: float | None, sample: float, count: int, weight: float) -> float:
    """The `count`-th sample into an average: the first samples evenly (one short draw must not
    set it), then an EMA of `weight`."""
    if average is None:
        return sample
    return average + max(weight, 1 / count) * (sample - average)


def _averaged_yield(average: float | None, sample: float | None, count: int, weight: float) -> float | None:
    """A yield averaged as the goodput it goes with (`_settling_average`, `count` its sample's
    number); None once any sample lacked one (what was measured partly without yields stays
    unscaled)."""
    if count == 1:
        return sample
    if average is None or sample is None:
        return None
    return _settling_average(average, sample, count, weight)


@dataclass
class _ModeGoodput:
    """Per mode, the EMA of the goodput measured in its epochs (None until measured), and when
    the level explores next."""

    model: float | None = None
    off: float | None = None
    # the tokens a model round was expected to emit (the requests' acceptance: RequestState's
    # model_yield) in the epochs behind `model`, averaged alike (None: not given)
    model_yield: float | None = None
    epochs: int = 0
    measurements: dict[str, int] = field(default_factory=dict)  # epochs that measured each mode
    explore_every: int = 5  # epochs between explorations now
    next_explore: int = 5  # the epoch count at which the next exploration runs
    warm_up_s: float = 0.0  # how long the level's last switch to the model warmed up
    # the level's own time: seconds during which it was the running epochs' level (the budget's
    # clock; wall time spent at other levels in between does not count)
    clock: float = 0.0
    explore_after: float = 0.0  # and no exploration before this clock (MeasuredModes.explore_budget)
    seen: float | None = None  # when a round last began at the level
    warmed: bool = False  # a warm-up ran at the level (so its first look at the model is done)
    switched_at: float | None = None  # its clock when the level's last switch to the model warmed up
    # the model's goodput over off's from pairs of adjacent epochs of the two modes (see
    # "Pairing"), averaged as the modes' goodputs are, with the yield of their model epochs; and
    # the level's last measured epoch, the first half of the next pair
    lead: float | None = None
    lead_yield: float | None = None
    pairs: int = 0
    last_epoch: _EpochGoodput | None = None
    # mean requests in flight of off's last measured epoch; and whether an epoch of the model
    # measured below off's estimate since (then off is measured next: see "Contradicted")
    off_in_flight: float | None = None
    off_due: bool = False
    decided: str = "off"  # the level's last decision by its lead (MeasuredModes._best: hysteresis)


@dataclass(frozen=True)
class RoundTicket:
    """What `MeasuredModes.begin` gave a round: the mode it runs, the epoch it began in, and
    whether that epoch measures it (it began inside the epoch's window)."""

    mode: str
    epoch: int
    counted: bool


@dataclass
class MeasuredModes:
    """A check on the model that measures instead of predicting: per concurrency level, the
    goodput (tokens per second emitted by every request this router carries) while requests
    speculate as the model chooses ("model"), against while speculation is off ("off").

    Why: the per-round model cannot see every cost of speculating (the draft pool's prompt
    prefills, two pools contending for the same cores, calls queued behind other requests'
    drafts); where those make speculation lose, only a measurement shows it.

    Epochs. Time is cut into epochs, each running one mode for every request the policy steers
    (with a draft pool, "model" drafts the whole configured depth: RequestState.plan_round); a
    request with a fixed setting neither follows the epochs nor counts in them (it would
    credit both modes with the same tokens). An epoch is a window of round starts, at least
    `epoch_s` long and until as many rounds began in it as requests were in flight (and for the
    model, until the rounds that ended pin their mean tokens a round to `max_token_error`, or
    `max_window_epochs` x `epoch_s` passed), then a tail in the same mode until those rounds
    ended. Off's rounds emit one token each; the model's emit 1 to k+1 as drafts are accepted,
    and a window of 8-10 of them is one draw of acceptance: at code 4 streams a first look of 10
    rounds averaged 3.0 tokens a round (standard error 0.44) where always on's 403 rounds
    averaged 3.5, measured the model below off, and the level ran off. An epoch that changes
    the mode opens its window only once every round of the other mode has ended (the tail's
    too): until then its rounds share passes with the other mode's (at chat 8 streams the first
    off rounds after the model shared the target's passes with the model's 4-token verifies and
    its draft pool's work: off measured 8.0 tok/s against the model's 9.0 where always off ran
    9% faster than always on). It measures exactly the rounds that began in its window, each
    whole (at 16 streams here a round outlasts an epoch): their tokens over their seconds x
    requests in flight, into the EMA of the mode at its level (log2 buckets of requests in
    flight; a mode's first epochs there are averaged evenly, so its second measurement weighs
    as much as its first). A round that overlapped an arrival (a prompt's prefill, or a draft
    pool's catch-up: PrefillWatch.clear) or that is a request's first is not counted, so both
    modes are measured between arrivals: where requests come and go during a pass, an epoch at
    a turnover measured its mode low whichever it was (code 4 streams, two requests per stream:
    the model's epoch at the turnover, 1.2-7.0 s rounds for 1-5 tokens while four prompts
    prefilled and their draft pools caught up, measured it 1.05x off where its mid-wave first
    look had 1.24x, and the level ran off where always on ran 1.11x always off; taking only the
    prefills' time out of such rounds left the slower passes they shared and the catch-ups in).
    What arrivals cost the model beyond off (each new request's draft prefill) is priced by
    `model_margin`, with the other costs of whole waves (see "Deciding"). An epoch whose level
    changed, that did not close within `max_epoch_s` (rounds hanging), or that kept under half
    the rounds it counted (the rest failed or overlapped arrivals), measures nothing; the next
    epoch measures that mode again unless the decision moved on.

    Deciding. The model runs only where it measured more than `model_margin` (20%) above off
    (by its lead: see "Pairing");
    closer than that goes to off. Its epochs see a level in the middle of its load and leave out
    costs that whole waves of requests pay (the draft pool's prefill of every new prompt on the
    cores the target uses, a request's first round, the spread ends of a wave, where requests
    that speculated at different acceptance finish apart), and over whole passes always on's
    gain over always off fell short of the epochs' by a factor of 1.07-1.6 at every level
    measured: chat 8 streams, the model 10.5-11.2 tok/s against off's 9.3 (1.13-1.20x) where
    always off ran 1.08x always on; chat 4, 7.6 against 7.7, always off 1.07x; code 4, the
    model 1.36-1.55x off mid-wave, always on 1.10x always off over the passes; code 16, 1.4-1.8x
    against 1.15x. Where speculation wins at a level by less than the margin, off gives up
    little (code at 8 streams: always on 0.98-1.03x always off). (With a 5% margin chat 8 ran
    the model in 75-91% of rounds: 0.93-0.94x the better fixed setting; a level's first decision
    once gave a tie to the model, 0.77x.) Once a level decided for the model it keeps it until
    the lead falls to `keep_margin` (10%): hysteresis, since the lead is an average of noisy pairs
    and a single threshold flaps where it sits near the margin (code 4 streams on an AVX-512
    EPYC: 1.25, 1.23, 1.17 over three pairs, and the third's exploration turned the wave to off
    in its middle, with its draft prompts paid; the two fixed settings tied there, and each
    flip cost adaptive a wave's switches). Below `min_in_flight`
    requests the model alone decides: a lone request has no other requests' costs it cannot
    see, and at 2 a prompt prefill in an epoch swings it more than the modes differ.

    Pairing. The decision compares the modes as the bench compares systems: adjacent in time,
    as a ratio. Each mode's estimate is of when its epochs ran, and the running mode's moves on
    while the other's stays where it was measured: a CPU's pass time drifts (always off's 4-s
    windows at code 8 streams on a 2-core AVX2 EPYC: 0.44-0.69 s a pass at 8 requests, standard
    deviation 10%), and a wave's tail runs fewer requests (off's epochs there sank from 15.7 to
    15.1 tok/s at 8 in flight, the passes 0.489 to 0.509 s, then to 14.2 and 14.6 at 7.4 and 6.2),
    so off's estimate sank in the tail while the model's kept its mid-wave 18.24 tok/s, and
    18.24 > 1.2 x 15.19 ran the model at the next wave where always off ran 1.05x always on. So
    an epoch that measures a mode right after one of the other mode at about the same load (its
    window opened within `pair_gap_s` of the other's close, their mean requests in flight within
    `pair_in_flight_tolerance`) pairs with it, and the level's lead of the model over off is the
    average of its pairs' ratios (`model_lead`; the first pairs evenly, then by `weight`), scaled
    down by the acceptance as the model's estimate is (see "Acceptance"). A switch makes a pair
    where the epochs on both sides of it measured: the first look and off's first epoch, an
    exploration and the epochs before and after it; not where the next epoch measured nothing
    for longer than `pair_gap_s` (at code 16 streams off's first four epochs, while a wave's
    prompts prefilled). Where none paired yet, the lead is the ratio of the modes' estimates.

    Exploring. Now and then an epoch runs the other mode so both estimates stay current: first
    after `explore_every` epochs at a level; one that leaves the decision as it was (ties
    included) doubles the wait, up to `max_explore_every`, one that overturns it resets it, and
    one that measured nothing goes on for up to `explore_retries` more epochs. No exploration
    begins while a prompt prefills, and none begins where the steered requests lack the room
    (tokens left to emit) for it: off while the model runs, for its window and the way back
    (`explore_off_room_epochs`); the model while off runs, for its warm-up and its window
    (`explore_model_room_epochs`). An exploration that runs into its wave's tail measures
    nothing, or measures the tail: at chat 4 streams one of the model began with 51 tokens
    left per request, warmed up on the draft pools' catch-ups as the first requests ended, and
    measured nothing.

    Switching to the model costs: every request's draft pool catches up on all it emitted off,
    a burst of prefills on the cores the target uses. So such a switch opens with a warm-up that
    measures nothing (at least `epoch_s`, and on while catch-ups run, at most
    `max_warm_up_epochs`), and a level's switches to the model keep to `explore_budget` of its
    time, by the last switch's warm-up and by this one's predicted cost (`switch_cost_s`: the
    catch-ups of every steered request past its first round). A wave of new requests costs
    nothing to switch (their draft pools prefill the prompts, as always on's do), so a new
    level looks at the model first; one reached in mid-wave runs off until the switch fits.
    A level's time is its own clock, the seconds it was the running epochs' level: a level
    that a wave's start passed through in a second and its end reaches again has had a
    second, not the wave's length (on wall time, at code 8 streams on an AVX-512 EPYC each
    wave's end opened a first look at 3-5 requests in flight, its warm-up and catch-ups
    included, where off ran at 6-11 and always off ran 1.21x always on). A first look warms
    up too while prompts prefill or catch-ups run or are owed (the new requests' draft
    prefills, which its epoch would measure as the model's; a request of a burst owes its
    prompt's until its second round), but is no switch: it takes nothing from the budget.
    An exploration of the model that measured it below off cost its window too, the share of
    its seconds the model fell short by, and that goes into the budget's wait as the warm-up
    does: at chat 8 streams in a closed loop one such exploration (a 6-s warm-up, then 14 s of
    the model at 0.77x off) cost an 80-s turn ~8%, and the warm-up alone had let the next
    come two minutes of the level's time later.

    Paying back. The requests that catch up are the ones whose rounds must earn the catch-ups
    back, so every switch to the model (a decision, an exploration, a first look) waits, off,
    until it would save more than `switch_cost_s` before they end: the share of their time
    left it saves (by the level's lead for a decision; for an exploration or a first
    look the least the margin lets run, margin / (1 + margin)), times that time left off
    (`room_tokens` at off's goodput per request). A wave's new requests owe nothing, so a
    decision for the model that waits is taken at the next wave. At chat 8 streams on an AVX2
    EPYC, each of adaptive's two passes switched to the model with ~20 s of its 64-token
    requests left (off's estimate had sunk as the wave thinned, to 12.97 tok/s against code's
    model estimate of 15.9): a predicted 12.7 s of catch-ups for at most ~3 s saved, and the
    pass ran 0.82x always off. Without a bound on the room (no max_tokens) every switch pays.

    Acceptance. What comes back to a level need not be what left it: on the bench, chat at 8
    streams after code at 8 inherited code's model estimate of 13.2 tok/s, off went unmeasured
    for two minutes (predicted to lose by more than `off_margin`), and chat's own epochs of the
    model, 6.3-9.5 tok/s, moved the estimate only to 9.9, above off's 8.8, while always off ran
    1.2x always on. The model's goodput at a level scales with the tokens its rounds emit, and
    what differs between workloads at one load is mostly that: so each model epoch also records
    the tokens its rounds were expected to emit (`begin`'s `model_yield`, from the requests'
    acceptance), and the level's estimate of the model is what it measured, scaled by the
    yield expected now over the yield it was measured at (`model_estimate`). Off emits one token
    a round whatever the acceptance. Scaling by tokens alone leaves out that rounds of poorer
    drafts also draft less (a draft model stops where its confidence falls), so it rates the
    model of a workload with poorer drafts a little low: toward off. It scales down, never up:
    the yields are the requests' estimates, which lag behind drafts better than they have seen
    while an epoch measures the real tokens, so a level's first look at a new workload was
    measured at a yield below the drafts' true one, and scaling up by what the estimates learnt
    after counted the better drafts twice (code at 8 streams: a first look at 1.19x off, scaled
    to 1.38x as the estimates rose, past the margin, and the model ran where always off ran
    1.13x always on). Better drafts than measured are found by exploring, as before.

    Contradicted. A lead from pairs moves only when both modes measure, and while the model runs
    off is measured only by explorations, ever more rarely; so an epoch of the model that measured
    below off's estimate at about off's load (mean requests in flight within
    `pair_in_flight_tolerance` of off's last epoch) makes the next epoch measure off at once, an
    exploration that pairs with it. Switching to off costs nothing, and the model's own epochs
    showing it behind off are what a change of workload at the same load looks like: on the
    bench, chat at 8 streams after code at 8 kept code's lead (1.31x, two pairs) while its own
    epoch of the model measured ~10.3 tok/s against off's 12.9, and the model ran the whole pass
    (0.73x always off) until the next exploration was due.

    Forgetting. A level where no round began for `stale_s` (an hour) is measured afresh when
    requests come back to it (the pools may have been rescaled, the machine changed). It was a
    minute before the estimates followed the acceptance, and then every return to a level after
    a minute paid a first look at the model again: at chat 8 streams in a closed loop, a ~15-s
    first look measuring the model at 0.88x off cost such a turn ~10% against always off.

    Bursts. A wave's requests enter one by one within milliseconds, so by their own count its
    first rounds (the prompts' prefills) would pass through every level below the wave's and
    take those levels' modes: at code 16 streams on a 2-core AVX2 EPYC, with the model 1.41x
    off at 12-22 in flight and off the better at 3-11, requests 3 to 11 of a wave began off
    (their draft pools left their prompts for later), and the wave ran 25 s of off epochs
    while its prompts prefilled before the model warmed up on their catch-ups,
    where always on decoded 1.4x faster than always off. So a first round decides at the most
    requests in flight lately (`peak_in_flight`, RecentPeak) where that is more than its own
    count: the load the wave enters into, as its draft catch-ups already do
    (RequestState.draft_sync_due).

    Predicting off. Off's costs are the target's passes and nothing else, which the load model
    sees whole (`LoadModel.off_goodput`): where the model measured above that prediction by
    more than `off_margin`, off is neither measured nor explored.

    First looks. A level's first look at the model runs at once where the switch fits the
    budget, except above a level that runs off: the model's lead falls as load rises, so the
    look is then an exploration, and keeps to `explore_budget` as if it cost the lower
    level's last warm-up (the level runs off meanwhile, and measures it). At 16 streams, above
    8 where off won, the first looks ran the model for 45-76 s of a first pass while the draft
    pool caught up on the wave's prompts: 0.89x always off over that pass, 0.97-0.99x over the
    next, off throughout. As every exploration, such a look does not begin while prompts
    prefill: at chat 16 one opened at a wave's start, the draft pool prefilled the wave's
    prompts beside the target's, the prefills took 64 s against always on's 53 and always
    off's 48, and that pass ran 0.82x always off.

    The measurements behind each rule: docs/bench/adaptive-history.md.

        >>> modes = MeasuredModes(epoch_s=1.0, max_token_error=None)  # windows by time and round starts alone
        >>> first = modes.begin(now=0.0, in_flight=3)   # first epoch at 3 requests: the model
        >>> first.mode, first.counted
        ('model', True)
        >>> modes.end(first, tokens=4, seconds=0.5)
        >>> rounds = [modes.begin(now=t, in_flight=3) for t in (0.5, 1.0, 1.5)]  # 2 more in the window, 1 in the tail
        >>> [r.counted for r in rounds]
        [True, True, False]
        >>> for r in rounds:
        ...     modes.end(r, tokens=4, seconds=0.5)
        >>> modes.begin(now=2.0, in_flight=3).mode   # the window's rounds ended: measure "off" next
        'off'
        >>> modes.levels[MeasuredModes.level(3)].model   # 12 tokens in 1.5 round-seconds x 3 requests
        24.0
    """

    epoch_s: float = 4.0
    max_epoch_s: float = 40.0  # an epoch not closed by then measures nothing
    explore_every: int = 5  # epochs before a level's first exploration (then backing off)
    max_explore_every: int = 40
    # the model runs only where it measured this far above off (see "Deciding"); under it, off
    model_margin: float = 0.2
    # ... and once the model runs by that, off only where it measured at most this far above it
    # (hysteresis: see "Deciding")
    keep_margin: float = 0.1
    weight: float = 0.3  # an epoch's weight in its mode's EMA (once the mode has 1/weight epochs)
    # the model's window stays open until its ended rounds' mean tokens a round has at most this
    # relative standard error (at code 4 streams, ~25 rounds: ~14 s), but no longer than
    # max_window_epochs x epoch_s
    max_token_error: float | None = 0.08  # None: windows by time and round starts alone
    max_window_epochs: float = 5.0
    min_in_flight: int = 3
    explore_retries: int = 2  # epochs an exploration goes on while its epochs measure nothing
    # an exploration begins only where the steered requests may still emit this many epochs of
    # the explored mode's tokens each (see `_room_to_explore`): off, its window and room to come
    # back (the catch-ups of what it emitted); the model, its warm-up and its window
    explore_off_room_epochs: float = 4.0
    explore_model_room_epochs: float = 3.0
    # the longest warm-up after a switch to the model: with the catch-ups in the background
    # (RequestState.draft_sync_due) the target keeps emitting meanwhile, and 16 of them take
    # ~45 s of a 2-core CPU's draft pool
    max_warm_up_epochs: float = 10.0
    explore_budget: float = 0.05  # the share of a level's time its switches to the model may take
    # Off is not measured where the model measured above the predicted off (LoadModel.off_goodput)
    # by more than this. The prediction, from decode passes the target timed at startup, ran
    # 0.87-1.09x what off's first epochs then measured (code and chat, 8 and 16 streams; the
    # timing runs beside the other replicas' starts, which may slow it) until off's own passes set
    # its drift, and the model must lead the true off by model_margin: 1.2 x ~1.1, so 30%; at the
    # lowest seen, off goes unmeasured only where the model measured >= 1.13x it. (At 60%, set for
    # a prediction fitted on the model's own passes that ran up to 45% low, code 8 and 16 streams
    # never measured off.)
    off_margin: float = 0.3
    # two adjacent epochs of the two modes pair (see "Pairing") where the second's window opened
    # within this of the first's close (a switch to the model warms up first: 5-12 s here, at
    # most max_warm_up_epochs x epoch_s) and their mean requests in flight differ by at most this share
    pair_gap_s: float = 45.0
    pair_in_flight_tolerance: float = 0.15
    stale_s: float = 3600.0  # a level where no round began for this long starts afresh
    yield_weight: float = 0.1  # a steered round's weight in the yield expected now (~the last 10 rounds)
    levels: dict[int, _ModeGoodput] = field(default_factory=dict)
    current: str = "model"
    warming_up: bool = False  # the running epoch warms the model up: not measured
    _switching: bool = False  # ... and that warm-up is a switch from off (its length is what one costs)
    epoch: int = 0  # the running epoch's number
    _started: float | None = None  # when the running epoch (its warm-up, then its window) began
    _level: int | None = None
    _window: bool = False  # round starts count now
    _needed: int = 0  # round starts the window waits for
    _starts: int = 0  # rounds that began in the window ...
    _open: int = 0  # ... of which not yet ended
    _kept: int = 0  # ... of which ended counted (not failed, not mostly waiting for prefills)
    _tokens: int = 0  # ... emitted by those
    _tokens_sq: int = 0  # ... and the sum of each one's tokens squared
    _seconds: float = 0.0  # ... in their own time
    _in_flight: int = 0  # summed over the window's round starts
    _yields: float = 0.0  # summed over the window's counted round starts that gave a model_yield ...
    _yielded: int = 0  # ... and their number
    yield_now: float | None = None  # EMA of the steered rounds' model_yield: the acceptance now
    _exploring: bool = False  # the running epoch runs the mode its level measured worse
    _switch_cost_s: float = 0.0  # what a switch to the model would cost now (begin's argument)
    _off_predicted: float | None = None  # the goodput off would have now, predicted (begin's argument)
    _room_tokens: float | None = None  # the tokens the steered requests may still emit, on average (begin's argument)
    _retries: int = 0  # epochs the running exploration went on after ones that measured nothing
    _settling: bool = False  # the running epoch changed the mode: its window waits for the other mode's rounds
    _running: dict[str, int] = field(default_factory=dict)  # rounds running per mode (every ticket's, until its end)

    @staticmethod
    def level(in_flight: int) -> int:
        """log2 of the requests in flight, rounded: 2: 1, 3-5: 2, 6-11: 3, 12-22: 4, ... (below
        2: 0). Rounded, not floored, so that N streams, which keep N-1 or N requests in flight
        (one is often between rounds), stay in one level: floored, 4 streams flipped between
        2-3 and 4-7 and each flip dropped the epoch."""
        return max(0, round(math.log2(in_flight))) if in_flight >= 1 else 0

    @staticmethod
    def deciding_load(in_flight: int, *, first_round: bool = False, peak_in_flight: int | None = None) -> int:
        """The requests in flight a round's mode is decided at: its own count, or for a first
        round the most in flight lately where more (see "Bursts"): `begin`'s `in_flight`.
        `begin`'s `off_predicted` must be off's goodput at this load: at 1 in flight, where a
        wave's first round begins, off was predicted at a quarter of what the 4-stream level's
        model measured, so off "clearly lost", the wave ran the model, and off's first
        measurement waited for the wave's tail (code 4 on an AVX-512 EPYC: two waves of the
        model each ending in off epochs that measured nothing)."""
        if first_round and peak_in_flight is not None:
            return max(in_flight, peak_in_flight)
        return in_flight

    def measures(self, in_flight: int) -> bool:
        """Whether this many requests in flight are a level these epochs measure. There the
        epochs are the exploration, and a request does not also probe from off: on this CPU a
        probe from off (a draft-pool prefill of all the request emitted, its whole prompt for a
        new one, on cores the target shares) cost chat at 4 streams about 2% of goodput per
        percent of rounds it put on (0.99x always off with 2% of rounds speculating, 0.85x with
        8%, when new requests probed their first round)."""
        return in_flight >= self.min_in_flight

    def estimates(self, in_flight: int) -> dict[str, float | None] | None:
        """The goodput measured so far for each mode at this many requests in flight, and the
        model's scaled to the acceptance now (see "Acceptance"); None where the epochs do not
        measure."""
        if not self.measures(in_flight):
            return None
        measured = self.levels.get(self.level(in_flight), _ModeGoodput())
        return {"model": measured.model, "off": measured.off, "off_predicted": self._off_predicted,
                "switch_cost_s": round(self._switch_cost_s, 3), "model_scaled": self.model_estimate(measured),
                "model_yield": measured.model_yield, "yield_now": self.yield_now, "room_tokens": self._room_tokens,
                "lead": self.model_lead(measured), "pairs": measured.pairs}

    def begin(self, now: float, in_flight: int, *, prefilling: bool = False, catching_up: bool = False,
              first_round: bool = False, switch_cost_s: float = 0.0, off_predicted: float | None = None,
              model_yield: float | None = None, room_tokens: float | None = None) -> RoundTicket:
        """A round of a steered request begins now: its mode, "model" (the per-request policy
        decides) or "off". `prefilling`: a prompt prefill runs now (PrefillWatch.active, this
        round's own included); `catching_up`: a draft pool's catch-up runs now
        (PrefillWatch.catching_up) or a request owes one (RequestState.draft_catch_up_owed);
        `first_round`: this round prefills its prompt (never counted); `switch_cost_s`: what
        switching the requests to the model would cost now (the draft pools' catch-ups,
        predicted; 0 without a draft pool); `off_predicted`: the goodput off would have now
        at the load the round decides at (LoadModel.off_goodput at `deciding_load`; None: not
        known, so off is measured); `model_yield`: the tokens
        this request's round would emit on average if it speculated as the model does (its
        acceptance; None: not known), see "Acceptance"; `room_tokens`: the tokens the steered
        requests may still emit, on average (their max_tokens left; None: unbounded), the time a
        switch to the model has to earn its catch-ups back in (see "Paying back"). `in_flight`
        is the load the round decides at, `deciding_load`: for a first round, the most requests
        in flight lately where more (see "Bursts"). Hand the ticket to `end` when the round
        ends, however it ends."""
        self._switch_cost_s, self._off_predicted = switch_cost_s, off_predicted
        self._room_tokens = room_tokens
        if model_yield is not None:
            self.yield_now = (model_yield if self.yield_now is None
                              else self.yield_now + self.yield_weight * (model_yield - self.yield_now))
        level = self.level(in_flight) if self.measures(in_flight) else 0
        self._advance(now, level, in_flight, prefilling, catching_up)
        counted = self._window and not first_round
        self._running[self.current] = self._running.get(self.current, 0) + 1
        if counted:
            self._starts += 1
            self._open += 1
            self._in_flight += in_flight
            if model_yield is not None:
                self._yields += model_yield
                self._yielded += 1
        return RoundTicket(self.current, self.epoch, counted)

    def end(self, ticket: RoundTicket, tokens: int | None, seconds: float = 0.0, overlapped: bool = False) -> None:
        """The round of `ticket` ended, having emitted `tokens` in `seconds` of wall time; tokens
        None: it failed. `overlapped`: a prompt prefill or a draft pool's catch-up ran during it
        (its own included: not PrefillWatch.clear), so it measured an arrival, not its mode, and
        is not counted (see the class docstring)."""
        self._running[ticket.mode] -= 1
        if ticket.counted and ticket.epoch == self.epoch:
            self._open -= 1
            if tokens is not None and seconds > 0 and not overlapped:
                self._kept += 1
                self._tokens += tokens
                self._tokens_sq += tokens * tokens
                self._seconds += seconds

    def _advance(self, now: float, level: int, in_flight: int, prefilling: bool, catching_up: bool) -> None:
        """Move the epochs on to `now`: end a warm-up, close a window, or close the epoch and
        start the next."""
        if level == 0:  # below the measured levels the model decides: no epochs
            if self._level != 0:
                self._start(now, 0, in_flight, "model", False)
            return
        stale = self.levels.get(level)
        if stale is not None and stale.seen is not None and now - stale.seen > self.stale_s:
            del self.levels[level]  # see "Forgetting"
        measured = self._measured(level)
        if measured.seen is not None and self._level == level:  # the level ran since its last round start
            measured.clock += now - measured.seen
        measured.seen = now
        if self._started is None or level != self._level:  # the load moved: the epoch measures nothing
            self._start(now, level, in_flight, *self._next(level, in_flight, prefilling, catching_up), busy=prefilling or catching_up)
            return
        elapsed = now - self._started
        if self.warming_up:
            # done once no catch-up runs (a first look: nor a prompt prefill, whose draft prefill follows)
            settled = not catching_up and (self._switching or not prefilling)
            if elapsed >= self.max_warm_up_epochs * self.epoch_s or (elapsed >= self.epoch_s and settled):
                self._warmed_up(level, elapsed)
                self._start(now, level, in_flight, "model", self._exploring, self._retries)  # now measure it
            return
        if self._settling:
            if not self.settling():  # the window opens now, and the epoch's time with it
                self._settling, self._window, self._started = False, True, now
            elif elapsed < self.max_epoch_s:
                return
            # else rounds hang: the epoch measures nothing (below)
        if (self._window and elapsed >= self.epoch_s and self._starts >= self._needed
                and (self._precise() or elapsed >= self.max_window_epochs * self.epoch_s)):
            self._window = False  # the tail: rounds still begin in this mode, uncounted
        if (self._window or self._open) and elapsed < self.max_epoch_s:
            return
        measured = not self._window and not self._open and self._close(elapsed, now)
        if not measured and self._exploring and self._retries < self.explore_retries:  # the exploration goes on
            self._start(now, level, in_flight, self.current, True, self._retries + 1)
            return
        if not measured and self._exploring:  # given up: wait as after one that left the decision as it was
            self._back_off(self._measured(level), overturned=False)
        self._start(now, level, in_flight, *self._next(level, in_flight, prefilling, catching_up), busy=prefilling or catching_up)

    def _warmed_up(self, level: int, warm_up_s: float) -> None:
        """The model warmed up for `warm_up_s` (what a look at the model costs at the level: a
        first look above it counts for it, `_first_look_s`). If it was a switch from off, the
        level's explorations wait until that is at most `explore_budget` of the time since; a
        first look's catch-ups are the new requests' prompts, which always on prefills too."""
        measured = self._measured(level)
        measured.warmed, measured.warm_up_s = True, warm_up_s
        if not self._switching:
            return
        measured.switched_at = measured.clock
        measured.explore_after = max(measured.explore_after, measured.clock + self._budget_wait(warm_up_s))

    def _switch_fits(self, measured: _ModeGoodput, look_s: float = 0.0) -> bool:
        """Whether a switch to the model now keeps to `explore_budget` by its predicted cost
        (`switch_cost_s`, or `look_s` where more), counted on the level's own clock from its
        last switch to the model (or its start)."""
        last = measured.switched_at if measured.switched_at is not None else 0.0
        return measured.clock - last >= self._budget_wait(max(self._switch_cost_s, look_s))

    def _first_look_s(self, level: int) -> float:
        """What the level's first look at the model counts for in the budget: nothing, unless
        the nearest level below it where both modes measured runs off. The model's lead falls
        as load rises, so the look is then an exploration, and counts for that level's last
        warm-up (see "First looks" in the class docstring)."""
        for lower in range(level - 1, 0, -1):
            measured = self.levels.get(lower)
            if measured is not None and measured.model is not None and measured.off is not None:
                return measured.warm_up_s if self._best(measured) == "off" else 0.0
        return 0.0

    def _budget_wait(self, switch_s: float) -> float:
        """How long a level runs without switching for a switch of `switch_s` to be
        `explore_budget` of the time."""
        return switch_s * (1 / self.explore_budget - 1)

    def _start(self, now: float, level: int, in_flight: int, mode: str, exploring: bool, retries: int = 0,
               busy: bool = False) -> None:
        # a switch to the model warms up first, and so does a level's first look at the model
        # while prompts prefill or catch-ups run (`busy`); a warm-up cut short by a change of
        # level goes on
        carried = self.warming_up and self._level != level
        model = mode == "model" and level > 0
        self._switching = model and (self.current == "off" or (carried and self._switching))
        first_look = model and busy and not self._measured(level).warmed
        self.warming_up = model and (self._switching or carried or first_look)
        self.epoch += 1
        self._started, self._level, self.current = now, level, mode
        self._settling = level > 0 and not self.warming_up and self.settling()
        self._window = level > 0 and not self.warming_up and not self._settling
        self._needed = max(in_flight, self.min_in_flight)
        self._starts = self._open = self._kept = self._tokens = self._tokens_sq = self._in_flight = 0
        self._yielded = 0
        self._seconds = self._yields = 0.0
        self._exploring, self._retries = exploring, retries

    def _precise(self) -> bool:
        """Whether the window's ended rounds pin the mode's mean tokens a round to
        `max_token_error` (relative standard error), from at least two rounds per request the
        window waits for (a handful of equal rounds is no estimate of the spread: at chat 4
        streams a wave's first three kept rounds emitted one token each and closed the window
        with a standard error of 0). Off's rounds emit one token each: always."""
        if self.current == "off" or self.max_token_error is None:
            return True
        n = self._kept
        if n < 2 * self._needed:
            return False
        mean = self._tokens / n
        variance = max(0.0, self._tokens_sq / n - mean * mean) * n / (n - 1)
        return math.sqrt(variance / n) <= self.max_token_error * mean

    def settling(self) -> bool:
        """Whether a switch is settling: rounds of a mode other than the running one have not
        ended yet (a round of off then waits on the model's verifies: its time is not off's)."""
        return any(n > 0 for mode, n in self._running.items() if mode != self.current)

    def _close(self, window_s: float, now: float) -> bool:
        """Measure the epoch whose rounds all ended; returns whether it measured its mode: not
        if most of its rounds failed or overlapped arrivals (the rest are too few to tell the
        mode's goodput from one round's acceptance: at code 16 streams the model's first look,
        its window opened while the wave's last prompts prefilled, kept 1 round of 16, 2 tokens
        in 2.7 s, and measured 11.8 tok/s where always on's steady state ran ~20). `window_s`: the
        seconds the epoch ran, its window and its tail; `now`: when its last round ended was seen."""
        if not self._seconds or 2 * self._kept < self._starts:
            return False
        goodput = self._tokens / self._seconds * self._in_flight / self._starts
        measured = self._measured(self._level)
        last = getattr(measured, self.current)
        count = measured.measurements.get(self.current, int(last is not None)) + 1
        measured.measurements[self.current] = count
        setattr(measured, self.current, _settling_average(last, goodput, count, self.weight))
        epoch_yield = self._yields / self._yielded if self._yielded else None
        in_flight = self._in_flight / self._starts
        if self.current == "model":  # the yield it was measured at, averaged alike
            measured.model_yield = _averaged_yield(measured.model_yield, epoch_yield, count, self.weight)
            measured.off_due |= self._contradicts(measured, goodput, in_flight)
        else:
            measured.off_in_flight, measured.off_due = in_flight, False
        self._pair(measured, _EpochGoodput(self.current, goodput, in_flight,
                                           epoch_yield if self.current == "model" else None, now))
        measured.epochs += 1
        if self._exploring and self.current == "model" and measured.off and goodput < measured.off:
            # what the exploration's window lost against off counts against the budget too
            lost_s = window_s * (1 - goodput / measured.off)
            measured.explore_after = max(measured.explore_after, measured.clock) + self._budget_wait(lost_s)
        if self._exploring:  # it overturned the decision where the mode it explored is now the better
            self._back_off(measured, overturned=self._best(measured) == self.current)
        return True

    def _contradicts(self, measured: _ModeGoodput, model_goodput: float, in_flight: float) -> bool:
        """Whether an epoch of the model that measured `model_goodput` at `in_flight` requests
        (mean) measured it below off's estimate at about off's load (see "Contradicted"); not
        where off was measured at a load more than `pair_in_flight_tolerance` heavier (a wave's
        tail emits less whatever the mode)."""
        if not measured.off or measured.off_in_flight is None:
            return False
        thinner = in_flight < (1 - self.pair_in_flight_tolerance) * measured.off_in_flight
        return not thinner and model_goodput < measured.off

    def _pair(self, measured: _ModeGoodput, epoch: _EpochGoodput) -> None:
        """Pair the epoch that just measured with the level's last measured epoch where that ran
        the other mode just before it (its window opened within `pair_gap_s` of the other's
        close) at about the same load (mean requests in flight within `pair_in_flight_tolerance`),
        into the level's lead of the model over off (see "Pairing"); it is the last one now."""
        last, measured.last_epoch = measured.last_epoch, epoch
        if (last is None or last.mode == epoch.mode or self._started - last.closed_at > self.pair_gap_s
                or abs(epoch.in_flight - last.in_flight) > self.pair_in_flight_tolerance * max(epoch.in_flight, last.in_flight)):
            return
        model, off = (epoch, last) if epoch.mode == "model" else (last, epoch)
        measured.pairs += 1
        measured.lead = _settling_average(measured.lead, model.goodput / off.goodput, measured.pairs, self.weight)
        measured.lead_yield = _averaged_yield(measured.lead_yield, model.model_yield, measured.pairs, self.weight)

    def _back_off(self, measured: _ModeGoodput, overturned: bool) -> None:
        """The wait before a level's next exploration: reset by one that overturned the
        decision, doubled (up to max_explore_every) by one that left it as it was."""
        measured.explore_every = (self.explore_every if overturned
                                  else min(2 * measured.explore_every, self.max_explore_every))
        measured.next_explore = measured.epochs + measured.explore_every

    def _measured(self, level: int) -> _ModeGoodput:
        return self.levels.setdefault(level, _ModeGoodput(explore_every=self.explore_every,
                                                          next_explore=self.explore_every))

    def model_estimate(self, measured: _ModeGoodput) -> float | None:
        """The model's goodput at the level, at the acceptance expected now: what its epochs
        measured, scaled down by the yield expected now over the yield it was measured at where
        that is below 1, never up (see "Acceptance"; unscaled where either is not known)."""
        if measured.model is None:
            return None
        return measured.model * self._yield_scale(measured.model_yield)

    def model_lead(self, measured: _ModeGoodput) -> float | None:
        """The model's goodput over off's at the level, at the acceptance expected now: by its
        pairs of adjacent epochs where any paired (see "Pairing"), else by each mode's estimate;
        scaled as `model_estimate`. None until both modes are measured."""
        if measured.lead is not None:
            return measured.lead * self._yield_scale(measured.lead_yield)
        model = self.model_estimate(measured)
        return model / measured.off if model is not None and measured.off else None

    def _yield_scale(self, measured_yield: float | None) -> float:
        """The yield expected now over `measured_yield`, where that is below 1 (see "Acceptance"); 1
        where either is not known."""
        if not measured_yield or self.yield_now is None:
            return 1.0
        return min(1.0, self.yield_now / measured_yield)

    def _best(self, measured: _ModeGoodput) -> str:
        """The better mode by the level's measurements: the model where it measured more than
        `model_margin` above off, and once decided for, until it measures at most `keep_margin`
        above it (see "Deciding" in the class docstring). The level keeps its decision
        (`decided`), so asking again gives the same answer."""
        if measured.off is None:
            return "model"
        lead = self.model_lead(measured)
        margin = self.keep_margin if measured.decided == "model" else self.model_margin
        measured.decided = "model" if lead is not None and lead > 1 + margin else "off"
        return measured.decided

    def _next(self, level: int, in_flight: int, prefilling: bool, catching_up: bool) -> tuple[str, bool]:
        """The mode of the next epoch at `level`, and whether it explores (due by the epochs
        since the last, and by `explore_budget`). The level's first measurement of the model
        keeps to the budget by what the switch would cost now (`switch_cost_s`), so a wave of
        new requests measures it at once (see the class docstring). Every switch to the model
        also waits until it pays back (`_pays_back`, "Paying back"). While prompts prefill, an
        exploration does not begin: an epoch of the model would make the draft pools catch up
        on requests that ran off exactly while the target prefills; the better mode so far
        runs. While the model runs and a draft pool's catch-up runs or is owed (`catching_up`: a
        wave's prompts, left to the requests' second rounds), off is not measured (its first
        measurement, an exploration) until they caught up: off would leave them owed, and the
        switch back would have to pay for them all (see "Paying back"). At code 16 streams a
        second wave measured off first at its start, 16 prompts owed (17.6 s predicted against
        ~17 s the model's 1.31x lead would save), and the wave ran off (0.89x always on). That
        wait is only for a level expected to decide for the model (`_model_expected_to_win`):
        at chat 8 streams a second wave ran the model 44 s for its catch-ups before off's first
        measurement there, the model's estimate 1.13x off's prediction, and the pass ran 0.87x
        always off."""
        measured = self._measured(level)
        bet = self.model_margin / (1 + self.model_margin)  # the least share of time the model must save to run
        if measured.model is None:  # its first measurement, once the switch fits the budget and pays back
            look_s = self._first_look_s(level)
            if look_s and prefilling:  # a look above a level that runs off explores: not while prompts prefill
                return "off", False
            return ("model" if self._switch_fits(measured, look_s) and self._pays_back(measured, in_flight, bet)
                    else "off"), False
        off_loses = self._off_clearly_loses(measured)
        # off is measured at once (switching to it costs nothing), but not while the model's
        # requests owe catch-ups where the model is expected to win: off would leave them owed,
        # and the switch back would pay them all
        measure_off = not off_loses and not (catching_up and self.current == "model"
                                             and self._model_expected_to_win(measured))
        if measured.off is None and measure_off:
            return "off", False
        best = self._best(measured)
        if best == "model" and measured.off_due and not prefilling and measure_off:
            return "off", True  # its own epoch measured the model behind off: measure off now
        other = "off" if best == "model" else "model"
        # an exploration of the model keeps to the budget by the last switch's measured warm-up
        # (explore_after) and by what this one is predicted to cost: the requests in flight may
        # have far more to catch up now than at the last switch
        if (not prefilling and measured.epochs >= measured.next_explore
                and measured.clock >= measured.explore_after
                and self._room_to_explore(measured, other, in_flight)
                and (self._switch_fits(measured) and self._pays_back(measured, in_flight, bet) if other == "model"
                     else measure_off)):
            return other, True
        if best == "model" and not self._pays_back(measured, in_flight):
            return "off", False  # the estimates favour the model, but not by enough to pay for the switch
        return best, False

    def _room_to_explore(self, measured: _ModeGoodput, mode: str, in_flight: int) -> bool:
        """Whether the steered requests have room left for an exploration of `mode`: they may
        still emit its `explore_*_room_epochs` x `epoch_s` of its tokens per request (`room_tokens`,
        at the mode's goodput per request in flight: off's measured or predicted, the model's
        estimate). Off must come back, and the catch-ups of what off emitted pay back only over
        the time left after it: at code 4 streams on an AVX-512 EPYC (64-token answers) every
        exploration of off in mid-wave turned the rest of its wave to off, the way back not
        paying, and such waves ran ~10% below both fixed settings. The model warms up before its
        window opens: at chat 4 streams an exploration of it began with 51 tokens left per
        request (~2 epochs of its 6.2 tok/s a request) and measured nothing as the wave thinned.
        A first measurement is not held back so (off's then never came at that level: the room
        was short in mid-wave, and the waves' first rounds ran the model, off predicted at their
        own count, see `deciding_load`; chat ran 0.80x always off, never measuring it). True
        where the mode runs already, the room is not known, or the mode's goodput is not."""
        if self.current == mode or self._room_tokens is None:
            return True
        if mode == "off":
            goodput, epochs = measured.off or self._off_predicted, self.explore_off_room_epochs
        else:
            goodput, epochs = self.model_estimate(measured), self.explore_model_room_epochs
        if not goodput:
            return True
        return self._room_tokens >= epochs * self.epoch_s * goodput / max(in_flight, 1)

    def _model_expected_to_win(self, measured: _ModeGoodput) -> bool:
        """Whether the level is expected to decide for the model: by its lead where off measured,
        else by the model's estimate over off's prediction, with `model_margin` (yes where
        either is not known). Where it is not, off's measurement need not wait for catch-ups
        owed: off is the likely decision, and off owes its draft pools nothing."""
        if measured.off is not None:
            return self._best(measured) == "model"
        return self._model_beats_off_predicted(measured, self.model_margin) is not False

    def _model_beats_off_predicted(self, measured: _ModeGoodput, margin: float) -> bool | None:
        """Whether the model's estimate is above off's predicted goodput by more than `margin`
        (None where either is not known)."""
        model = self.model_estimate(measured)
        if model is None or self._off_predicted is None:
            return None
        return model > self._off_predicted * (1 + margin)

    def _pays_back(self, measured: _ModeGoodput, in_flight: int, saving: float | None = None) -> bool:
        """Whether switching the steered requests to the model now saves more than it costs
        (`switch_cost_s`, their catch-ups) before they end, if it saves `saving` of the time off
        would take (None: what the level's estimates say it saves) (see "Paying back"). Their
        time left off is their tokens left (`room_tokens`) at off's goodput per request, with
        `in_flight` requests in rounds. True where nothing is owed, the room is not known, or
        off is not measured."""
        if self._switch_cost_s <= 0 or self._room_tokens is None or not measured.off:
            return True
        if saving is None:
            lead = self.model_lead(measured)
            saving = 1 - 1 / lead if lead else 0.0
        left_off_s = self._room_tokens * in_flight / measured.off
        return self._switch_cost_s <= saving * left_off_s

    def _off_clearly_loses(self, measured: _ModeGoodput) -> bool:
        """Whether the model measured above off's predicted goodput by more than `off_margin`:
        then an epoch of off (a first measurement or an exploration) would only confirm it, at
        the cost of the epoch and of the switch back (at code 4 streams the wave's one off epoch
        was half the gap to always on)."""
        return self._model_beats_off_predicted(measured, self.off_margin) is True
