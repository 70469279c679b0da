"""Continuous batching for a pool replica.

Calls wait in a queue; whenever the worker is free, everything queued (up to max_batch_size)
becomes the next forward pass. Unlike `serve.batch`, which closes each batch when its wait
window ends and then queues finished batches behind the running one, a batch here is formed
only when it can run, so every call that arrived during the previous pass joins the next.

Each request's router sends its next call a little after the previous one is answered, so
streams drift into phases: half of them in one pass, half in the next, each pass half full and
every request waiting a whole extra pass. Given `key` (a call's request id), the batcher learns
each request's return time (answer to next call) and, when a pass is about to start, waits for
calls due within `join_fraction` of a pass, so a pass runs full instead of split in two.
A request's return time has two modes when it speculates only in some rounds (straight back
after a round without a draft, back after a draft pass otherwise), so it is due at the sooner
of its usual return and its last one: after an epoch of drafting rounds under the adaptive
policy, an EMA alone still said "not due" for several rounds of straight returns, and 8
streams kept running as two waves of 4 (0.53 s passes where one of 8 took 0.62 s). Waiting
for a call that then does not come costs its grace: LATE_FRACTION of a pass, at least LATE_S.
A router's return time jitters by some 10 ms on a loaded 2-core machine (chat at 8 streams:
answer to next call 9-27 ms, p10-p90); with a flat 5 ms grace 18% of calls came 2-16 ms past
it, found their pass started without them and waited a whole 0.65 s pass. Waiting a few more
ms for a call is cheap next to a pass, so the grace scales with the pass.

A batch may answer RUN_AGAIN for a call it only advanced (a chunk of a long prompt): that call
goes back to the front of the queue and joins the next pass with whatever arrived meanwhile.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Hashable

RUN_AGAIN = object()  # a batch result: not finished, run this call again in the next pass
EMA = 0.3  # weight of a new measurement of a pass's duration or a request's return time
FORGET_S = 60.0  # a request not heard from for this long has ended
LATE_S = 0.005  # the least grace: a call this much later than its usual return is not waited for
LATE_FRACTION = 0.05  # the grace as a share of a pass (33 ms of a 0.65 s pass)


class ContinuousBatcher:
    def __init__(self, run_batch: Callable[[list], list], *, max_batch_size: int, wait_s: float = 0.0,
                 key: Callable[[object], Hashable] | None = None, join_fraction: float = 0.0):
        self.run_batch = run_batch  # blocking: runs in a thread, returns one result per item
        self.max_batch_size = max_batch_size
        self.wait_s = wait_s
        self.key = key
        self.join_fraction = join_fraction
        self._queue: list[tuple[object, asyncio.Future]] = []
        self._worker: asyncio.Task | None = None
        self._arrived = asyncio.Event()
        self._pass_s = 0.0  # EMA of a pass's duration
        self._answered_at: dict[Hashable, float] = {}  # request -> when its last call was answered
        self._return_s: dict[Hashable, float] = {}  # request -> EMA of answer-to-next-call time
        self._last_return_s: dict[Hashable, float] = {}  # request -> its last answer-to-next-call time
        self.joined_waits = 0  # passes that waited for a due call (stats)

    @property
    def queued(self) -> int:
        return len(self._queue)

    def forget(self, key: Hashable) -> None:
        """The request is finished: expect no more calls from it."""
        self._answered_at.pop(key, None)
        self._return_s.pop(key, None)
        self._last_return_s.pop(key, None)

    async def submit(self, item):
        future = asyncio.get_running_loop().create_future()
        if self.key is not None:
            key = self.key(item)
            answered = self._answered_at.pop(key, None)
            if answered is not None:
                gap = time.monotonic() - answered
                last = self._return_s.get(key)
                self._return_s[key] = gap if last is None else last + EMA * (gap - last)
                self._last_return_s[key] = gap
        self._queue.append((item, future))
        self._arrived.set()
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._queue:
            if self.wait_s and len(self._queue) < self.max_batch_size and self._others_out():
                await asyncio.sleep(self.wait_s)  # let calls that are already on their way join
            await self._wait_for_due_calls()
            batch = [(i, f) for i, f in self._queue[: self.max_batch_size] if not f.cancelled()]
            del self._queue[: self.max_batch_size]
            if batch:
                await self._run(batch)

    def _others_out(self) -> bool:
        """Whether a call from a request not queued here may be on its way: some request was
        answered and has not come back (or calls are not keyed, so nobody knows). A lone stream
        then skips wait_s before each of its passes (2 ms a call, two calls a round)."""
        return self.key is None or bool(self._answered_at)

    def _due(self, now: float, limit: float) -> list[float]:
        """When the calls expected before `limit` should arrive (requests answered earlier and
        not back yet, less those already later than their usual return by the grace)."""
        due, gone = [], []
        grace = self._grace_s()
        for key, answered in self._answered_at.items():
            expected = answered + min(self._return_s.get(key, 0.0), self._last_return_s.get(key, 0.0))
            if key in self._return_s and expected <= limit and now <= expected + grace:
                due.append(expected)
            elif now - answered > FORGET_S:
                gone.append(key)
        for key in gone:  # a request that ended without a release (its router went away)
            self.forget(key)
        return due

    def _grace_s(self) -> float:
        return max(LATE_S, LATE_FRACTION * self._pass_s)

    async def _wait_for_due_calls(self) -> None:
        """Hold the pass (at most join_fraction of a pass) while calls are due to arrive."""
        if not self.join_fraction or not self._pass_s:
            return
        limit = time.monotonic() + self.join_fraction * self._pass_s
        waited = False
        while len(self._queue) < self.max_batch_size:
            now = time.monotonic()
            due = self._due(now, limit)
            if not due or now >= limit:
                break
            waited = True
            self._arrived.clear()
            wake = min(limit, max(due) + self._grace_s())
            try:
                await asyncio.wait_for(self._arrived.wait(), timeout=max(0.0, wake - now))
            except asyncio.TimeoutError:
                pass
        self.joined_waits += waited

    async def _run(self, batch) -> None:
        started = time.monotonic()
        try:
            results = await asyncio.to_thread(self.run_batch, [item for item, _ in batch])
        except Exception as exc:
            if len(batch) > 1:  # isolate the failing call: the others must not fail with it
                for one in batch:
                    await self._run([one])
            elif not batch[0][1].done():
                batch[0][1].set_exception(exc)
            return
        answered = time.monotonic()
        seconds = answered - started
        self._pass_s = seconds if not self._pass_s else self._pass_s + EMA * (seconds - self._pass_s)
        again = [(item, future) for (item, future), result in zip(batch, results)
                 if result is RUN_AGAIN and not future.done()]
        self._queue[:0] = again  # ahead of later arrivals, in their order
        for (item, future), result in zip(batch, results):
            if result is not RUN_AGAIN and not future.done():
                future.set_result(result)
                if self.key is not None:
                    self._answered_at[self.key(item)] = answered
