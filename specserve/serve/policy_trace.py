"""The load-aware policy's rounds, one JSON line each: what it decided, from what, and what came of it.

Set SPECSERVE_POLICY_TRACE=/path/trace.jsonl where the router replicas run (`serve run` passes
its environment on; on a cluster, the application's runtime_env `env_vars`) and every round
appends a line (`reason` null for a request with a fixed setting, which the policy does not
steer). It shows why adaptive speculation did what it did at some load: the model's goodput per
depth, the fitted step times, the measured mode, and the round's own wall time and pool loads
to check them against. Off by default; a line costs a
write per round (rounds take 100 ms or more), so it is meant for diagnosis, not for always.

    {"t": 1795561141.49, "request": "692715", "in_flight": 8, "mode": "off", "k": 0,
     "reason": "measured", "goodput": {"0": 3.1, "1": 0.6}, "target_step": [0.16, 0.0067], ...}
"""

from __future__ import annotations

import json
import os
import time

from specserve.policy import Decision, LoadModel
from specserve.protocol import PoolLoad, Proposal, VerifyResult
from specserve.request_state import RequestState

TRACE_ENV = "SPECSERVE_POLICY_TRACE"


def _load(load: PoolLoad | None) -> dict | None:
    if load is None:
        return None
    return {"calls": load.batch_size, "tokens_per_pass": round(load.batch_tokens, 2),
            "seconds_per_pass": round(load.step_s, 4), "passes": load.passes, "queued": load.queued}


def trace_line(state: RequestState, decision: Decision | None, *, mode: str, in_flight: int, load: LoadModel,
               catch_up: int, k: int, round_s: float, result: VerifyResult, proposal: Proposal | None,
               warming_up: bool = False, counted: bool = False, overlapped: bool = False, epoch: int | None = None,
               estimates: dict | None = None, drafted_ahead: bool = False,
               ahead_wait_s: float | None = None) -> dict:
    """One round of `state` as the trace records it (`k`: the depth the round asked for, a cap
    the proposer may stop short of; `warming_up`: the round began in the warm-up of a switch to
    the model; `draft_syncing`: the draft pool catches up on the request in the background
    (its rounds run target-only meanwhile); `counted`: it began in its epoch's (`epoch`,
    numbered) window; `overlapped`: a prompt prefill or a draft pool's catch-up ran during it,
    so its epoch leaves it out; `estimates`: each mode's goodput measured so far at this load, the model's scaled to
    the acceptance now (with the yields it scales by), off's predicted from the load model, and
    what a switch to the model would cost now; see MeasuredModes). Where a
    round's time went: `verify_s` and `draft_s`, the pools' own time on its verify and on its
    draft; `drafted_ahead`, its draft came from the last round's verify
    (speculation.draft_ahead); `ahead_wait_s`, how long it waited for the next round's draft
    after its verify replied."""
    def line(coefficients: tuple[float, float]) -> list[float]:
        return [round(c, 5) for c in coefficients]

    acceptance = state.acceptance

    return {
        "t": round(time.time(), 3), "request": state.request_id[:12], "in_flight": in_flight, "mode": mode,
        "epoch": epoch, "warming_up": warming_up, "counted": counted, "overlapped": overlapped,
        "estimates": {m: None if g is None else round(g, 3) for m, g in estimates.items()} if estimates else None,
        "k": k, "reason": decision.reason if decision else None,
        "goodput": {str(d): round(g, 3) for d, g in decision.goodput.items()} if decision else None,
        "target_step": line(load.target.coefficients()),  # [fixed s, s per token]
        "draft_step": line(load.draft.coefficients()) if load.draft.observed else None,
        "batch_ema": round(load.batch_ema, 2), "overhead_s": round(load.overhead_s, 4),
        "draft_overhead_s": None if load.draft_overhead_s is None else round(load.draft_overhead_s, 4),
        "off_overhead_s": None if load.off_overhead_s is None else round(load.off_overhead_s, 4),
        "decode_drift": None if load.decode is None else round(load.decode.drift, 3),
        "off_predicted": None if (off := load.off_goodput()) is None else round(off, 3),
        "catch_up": catch_up, "draft_syncing": state.draft_syncing, "round_s": round(round_s, 4),
        "verify_s": round(result.compute_s, 4),
        "draft_s": round(proposal.compute_s, 4) if proposal is not None else None,
        "drafted_ahead": drafted_ahead, "ahead_wait_s": None if ahead_wait_s is None else round(ahead_wait_s, 4),
        "accepted": result.num_accepted,
        "target_load": _load(result.load), "draft_load": _load(proposal.load if proposal is not None else None),
        "drafted": max(proposal.tree.depths, default=0) if proposal is not None else 0,  # levels
        "acceptance": _rounded(acceptance.rates) if acceptance is not None else None,
        # P(drafts a position | drafted the one above), and | it was also accepted
        "survival": _rounded(acceptance.survival) if acceptance is not None else None,
        "survival_accepted": _rounded(acceptance.survival_accepted) if acceptance is not None else None,
    }


def _rounded(values: list[float]) -> list[float]:
    return [round(v, 3) for v in values]


class PolicyTrace:
    """Appends trace lines to a file (opened on the first line, in the replica that writes)."""

    def __init__(self, path: str):
        self.path = path
        self._file = None

    @classmethod
    def from_env(cls) -> PolicyTrace | None:
        path = os.environ.get(TRACE_ENV)
        return cls(path) if path else None

    def write(self, line: dict) -> None:
        if self._file is None:
            self._file = open(self.path, "a", buffering=1)  # line-buffered: a crash keeps what was written
        self._file.write(json.dumps(line) + "\n")
