"""Waiting on a pool that may be busy or may be down, without taking one for the other.

A draft pool at load is slow, not down: on a 2-core CPU at 16 streams a draft round takes 3-9 s
(queued behind other requests' drafts), and the catch-up prefills after speculation comes back
on take tens of seconds. A fixed 5-s timeout there gave up on ~100 draft calls in an adaptive
pass and ~450 in an always-on pass (code, 16 streams), and each one sent every request to
prompt lookup for a while: the rounds the load-aware policy measured as "speculating" were
mostly rounds of a failed draft, and always on fell to 1.39 tokens a round.
So a call is given up on when its pool is down, not when it is merely slow: when the pool has
answered no call for a while past the call's expected time, and does not answer a ping either
(one pass of 16 background catch-ups kept a draft pool from answering any call for 40 s).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

# A call whose pool answers others (or pings) but not it is given up on after its expected time
# and this many quiet periods (draft_timeout_s): a stuck call, not a busy pool.
DRAFT_MAX_WAIT_QUIET = 12


@dataclass
class PoolLiveness:
    """When a pool last answered a call (any call of this router)."""

    last_reply: float | None = None

    def replied(self, now: float) -> None:
        self.last_reply = now if self.last_reply is None else max(self.last_reply, now)

    def heard_within(self, seconds: float, now: float) -> bool:
        return self.last_reply is not None and now - self.last_reply < seconds


def give_up_at(started: float, *, expected_s: float, quiet_s: float, max_s: float, last_reply: float | None) -> float:
    """When a call made at `started` stops being waited for on replies alone: once its own
    expected time and then `quiet_s` more have passed with no reply from its pool to any call,
    counting from this call or the pool's last reply, whichever is later (then
    `await_while_alive` pings the pool); and in any case at `started + max_s` (a pool that
    answers others but never this call)."""
    heard = started if last_reply is None else max(started, last_reply)
    return min(started + max_s, max(started + expected_s, heard) + quiet_s)


async def await_while_alive(call: Awaitable[T], liveness: PoolLiveness, *, expected_s: float, quiet_s: float,
                            max_s: float, ping: Callable[[], Awaitable] | None = None,
                            clock: Callable[[], float] = time.monotonic) -> T:
    """Await `call` while its pool shows it is alive (see `give_up_at`); when the pool has been
    quiet that long, `ping` it (a cheap call its replica answers between passes): an answer
    within `quiet_s` counts as a reply. TimeoutError (and the call cancelled) when it is given up
    on. Replies are recorded in `liveness`."""
    started = clock()
    task = asyncio.ensure_future(call)

    def deadline() -> float:
        return give_up_at(started, expected_s=expected_s, quiet_s=quiet_s, max_s=max_s,
                          last_reply=liveness.last_reply)

    try:
        while True:
            now, due = clock(), deadline()
            if now >= due:
                # A stalled event loop (GC, a blocking call, a starved process) wakes with this
                # timeout, the call's own reply and other calls' replies all due at once: let
                # what is already due run before taking the silence for the pool's.
                await asyncio.sleep(0)
                if task.done():
                    return _replied(task, liveness, clock)
                now, due = clock(), deadline()
                if now >= due:
                    if ping is not None and now - started < max_s and await _answers(ping, quiet_s):
                        liveness.replied(clock())  # busy, not down
                        continue
                    now = clock()  # after the ping
                    heard = "never" if liveness.last_reply is None else f"{now - liveness.last_reply:.1f} s ago"
                    raise TimeoutError(f"no reply in {now - started:.1f} s (pool last heard {heard})")
            done, _ = await asyncio.wait({task}, timeout=due - now)
            if done:
                return _replied(task, liveness, clock)
    finally:
        if not task.done():
            task.cancel()


def _replied(task: asyncio.Future, liveness: PoolLiveness, clock: Callable[[], float]):
    result = task.result()  # a failed call raises its own error and is not a reply
    liveness.replied(clock())
    return result


async def _answers(ping: Callable[[], Awaitable], timeout_s: float) -> bool:
    try:
        await asyncio.wait_for(ping(), timeout_s)
        return True
    except Exception:
        return False
