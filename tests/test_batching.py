"""The pools' continuous batcher: calls that arrive during a pass all join the next one."""

import asyncio
import threading
import time

import pytest

from specserve.serve import batching
from specserve.serve.batching import RUN_AGAIN, ContinuousBatcher


def test_calls_arriving_during_a_pass_join_the_next_pass():
    batches = []

    def run(items):
        batches.append(list(items))
        time.sleep(0.05)
        return [i * 10 for i in items]

    async def scenario():
        batcher = ContinuousBatcher(run, max_batch_size=8)
        first = asyncio.create_task(batcher.submit(0))
        await asyncio.sleep(0.01)  # the first pass is running now
        rest = [asyncio.create_task(batcher.submit(i)) for i in range(1, 6)]
        return await asyncio.gather(first, *rest)

    assert asyncio.run(scenario()) == [0, 10, 20, 30, 40, 50]
    assert batches == [[0], [1, 2, 3, 4, 5]]


def test_max_batch_size_and_cancelled_calls():
    batches = []
    gate = threading.Event()

    def run(items):
        batches.append(list(items))
        gate.wait(1)
        return items

    async def scenario():
        batcher = ContinuousBatcher(run, max_batch_size=2)
        tasks = [asyncio.create_task(batcher.submit(i)) for i in range(5)]
        await asyncio.sleep(0.01)
        tasks[3].cancel()  # a caller that went away is dropped, not run
        gate.set()
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(scenario())
    assert results[:3] == [0, 1, 2] and results[4] == 4
    assert batches == [[0, 1], [2], [4]]


def test_a_failing_call_does_not_fail_its_batch_mates():
    def run(items):
        if "bad" in items:
            raise ValueError("bad item")
        return [i.upper() for i in items]

    async def scenario():
        batcher = ContinuousBatcher(run, max_batch_size=8, wait_s=0.01)
        return await asyncio.gather(*[batcher.submit(i) for i in ("a", "bad", "c")], return_exceptions=True)

    a, bad, c = asyncio.run(scenario())
    assert (a, c) == ("A", "C")
    assert isinstance(bad, ValueError)


def test_a_call_answered_run_again_rejoins_the_next_pass_first():
    batches = []

    def run(items):
        batches.append(list(items))
        # "long" needs three passes (a prompt cached in chunks); the others finish at once
        return [RUN_AGAIN if item == "long" and len(batches) < 3 else item.upper() for item in items]

    async def scenario():
        batcher = ContinuousBatcher(run, max_batch_size=8)
        long = asyncio.create_task(batcher.submit("long"))
        await asyncio.sleep(0)
        short = asyncio.create_task(batcher.submit("a"))
        return await asyncio.gather(long, short)

    assert asyncio.run(scenario()) == ["LONG", "A"]
    assert batches[0] == ["long"] and batches[1][0] == "long" and batches[-1] == ["long"]
    assert sum(batch.count("a") for batch in batches) == 1  # finished calls are not run again


def test_plan_prefill_chunks_bounds_the_prompt_tokens_of_a_pass():
    from specserve.serve.pools import ALWAYS_READY_TOKENS, plan_prefill_chunks

    assert plan_prefill_chunks([1, 1000, 3, 600, 100], budget=256) == [None, 256, None, 0, 0]
    assert plan_prefill_chunks([200, 200], budget=256) == [None, 56]
    assert plan_prefill_chunks([ALWAYS_READY_TOKENS] * 20, budget=16) == [None] * 20  # decode rounds never wait
    for uncached in ([5000], [300, 300, 300], [17, 900, 2, 255]):
        plan = plan_prefill_chunks(uncached, budget=256)
        computed = sum(u if c is None and u > ALWAYS_READY_TOKENS else (c or 0) for u, c in zip(uncached, plan))
        assert computed <= 256


def _two_phase_streams(join_fraction: float, trips: list[float], second_half_at: float,
                       pass_s: float = 0.04, jitter_s: float = 0.0) -> list[list[int]]:
    """Four streams, the last two started `second_half_at` s after the first two, each making
    one call per entry of `trips` and then waiting that long (the router's round trip) before
    the next, plus `jitter_s` in every other round (streams 0 and 2 in odd rounds, 1 and 3 in
    even ones); passes take `pass_s`. Returns each pass's calls."""
    batches = []

    def run(items):
        batches.append(sorted(items))
        time.sleep(pass_s)
        return items

    async def stream(batcher, name, start):
        await asyncio.sleep(start)
        for i, trip in enumerate(trips):
            await batcher.submit(name)
            await asyncio.sleep(trip + jitter_s * ((i + name) % 2))

    async def scenario():
        batcher = ContinuousBatcher(run, max_batch_size=8, key=lambda item: item, join_fraction=join_fraction)
        await asyncio.gather(*(stream(batcher, n, 0.0 if n < 2 else second_half_at) for n in range(4)))

    asyncio.run(scenario())
    return batches


def _phase_split_streams(join_fraction: float) -> list[list[int]]:
    """Round trips of 20 ms, two streams arriving during the first pass: without joining,
    passes alternate between the two halves for good."""
    return _two_phase_streams(join_fraction, [0.02] * 8, second_half_at=0.01)


def test_streams_in_alternating_phases_are_joined_into_full_passes():
    split = _phase_split_streams(0.0)
    assert max(len(b) for b in split[2:]) == 2  # halves, pass after pass
    joined = _phase_split_streams(0.75)
    assert len(joined) < len(split) * 0.75
    assert sum(len(b) == 4 for b in joined) >= 5


def test_calls_a_little_later_than_usual_still_join_a_long_pass(monkeypatch):
    """A router's round trip jitters (on a loaded 2-core machine by some 10 ms): a call 15 ms
    past its usual return still joins a 0.4 s pass (the grace is 5% of a pass, 20 ms), where a
    flat 5 ms grace starts the pass without it and the stream waits a whole pass."""
    def passes(late_fraction: float) -> list[list[int]]:
        monkeypatch.setattr(batching, "LATE_FRACTION", late_fraction)
        return _two_phase_streams(0.5, [0.01] * 7, second_half_at=0.0, pass_s=0.4, jitter_s=0.015)

    graced, flat = passes(batching.LATE_FRACTION), passes(0.0)
    # full passes once return times are known (a stream's first return has none: one split)
    assert sum(len(b) < 4 for b in graced) <= 2
    assert len(flat) > len(graced)  # the same calls in more, partial passes


def test_a_finished_request_is_not_waited_for():
    waits = []  # passes that waited for a due call

    def run(items):
        time.sleep(0.03)
        return items

    async def scenario():
        batcher = ContinuousBatcher(run, max_batch_size=8, key=lambda item: item, join_fraction=1.0)
        for _ in range(3):  # "a" learns a return time of ~0
            await batcher.submit("a")
        before = batcher.joined_waits
        batcher.forget("a")  # released
        await batcher.submit("b")
        waits.append(batcher.joined_waits - before)

    asyncio.run(scenario())
    assert waits == [0]  # b's pass did not wait for "a"


def _streams_after_drafting_rounds() -> list[list[int]]:
    """Two halves whose first 3 round trips went to a draft pool (0.3 s away), then come
    straight back (10 ms), as adaptive speculation turning off does."""
    return _two_phase_streams(0.75, [0.3] * 3 + [0.01] * 11, second_half_at=0.02)


def test_streams_that_stop_drafting_rejoin_one_pass_at_once():
    """Their usual (EMA) return time still says 0.3 s for several rounds; their last return says
    10 ms, so the next pass waits for them and the two halves run as one."""
    batches = _streams_after_drafting_rounds()
    assert sum(len(b) == 4 for b in batches[-8:]) >= 6


def test_a_lone_stream_does_not_wait_for_calls_nobody_is_sending():
    """wait_s lets calls already on their way join a pass; a keyed batcher knows when none can
    be (no other request answered and not back), so a lone stream's calls run at once, and the
    wait comes back while another request is out."""
    def run(items):
        return items

    async def timed(batcher, item) -> float:
        started = time.perf_counter()
        await batcher.submit(item)
        return time.perf_counter() - started

    async def scenario():
        batcher = ContinuousBatcher(run, max_batch_size=8, wait_s=0.2, key=lambda item: item)
        lone = [await timed(batcher, "a") for _ in range(3)]
        await batcher.submit("b")  # b answered and not back: its next call may be on its way
        beside_b = await timed(batcher, "a")
        unkeyed = await timed(ContinuousBatcher(run, max_batch_size=8, wait_s=0.2), "a")
        return lone, beside_b, unkeyed

    lone, beside_b, unkeyed = asyncio.run(scenario())
    assert max(lone) < 0.1
    assert beside_b >= 0.2 and unkeyed >= 0.2
