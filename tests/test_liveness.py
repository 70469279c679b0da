"""Waiting on a draft pool: busy is waited for, silent is given up on (specserve/serve/liveness.py)."""

import asyncio
import time

import pytest

from specserve.serve.liveness import PoolLiveness, await_while_alive, give_up_at


def test_give_up_at_counts_quiet_time_from_the_later_of_the_call_and_the_pools_last_reply():
    # never heard from: the call's expected time, then the quiet period
    assert give_up_at(10.0, expected_s=3.0, quiet_s=5.0, max_s=60.0, last_reply=None) == 18.0
    # heard from before the call: the same
    assert give_up_at(10.0, expected_s=3.0, quiet_s=5.0, max_s=60.0, last_reply=2.0) == 18.0
    # the pool answered another call after this one's expected time: quiet counts from that reply
    assert give_up_at(10.0, expected_s=3.0, quiet_s=5.0, max_s=60.0, last_reply=20.0) == 25.0
    # ... but never past the cap
    assert give_up_at(10.0, expected_s=3.0, quiet_s=5.0, max_s=12.0, last_reply=20.0) == 22.0


async def _slow(seconds: float, value="draft"):
    await asyncio.sleep(seconds)
    return value


def test_a_busy_pool_that_answers_other_calls_is_waited_for():
    async def run():
        liveness = PoolLiveness()

        async def others():  # other requests' calls keep coming back
            for _ in range(12):
                await asyncio.sleep(0.05)
                liveness.replied(time.monotonic())

        chatter = asyncio.create_task(others())
        started = time.monotonic()
        value = await await_while_alive(_slow(0.5), liveness, expected_s=0.0, quiet_s=0.15, max_s=5.0)
        await chatter
        return value, time.monotonic() - started, liveness.last_reply

    value, waited, last_reply = asyncio.run(run())
    assert value == "draft" and waited >= 0.5  # 3x the quiet period, yet not given up on
    assert last_reply is not None


def test_a_silent_pool_is_given_up_on_after_the_calls_expected_time_and_the_quiet_period():
    async def run():
        liveness = PoolLiveness()
        call = asyncio.ensure_future(_slow(5.0))
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await await_while_alive(call, liveness, expected_s=0.2, quiet_s=0.1, max_s=5.0)
        waited = time.monotonic() - started
        await asyncio.sleep(0)  # let the cancellation land
        return waited, call.cancelled(), liveness

    waited, cancelled, liveness = asyncio.run(run())
    assert 0.3 <= waited < 1.0
    assert cancelled  # the abandoned call does not run on
    assert liveness.last_reply is None and not liveness.heard_within(10.0, time.monotonic())


def test_a_call_the_pool_never_answers_is_capped_even_while_others_are_answered():
    async def run():
        liveness = PoolLiveness()

        async def others():
            while True:
                await asyncio.sleep(0.05)
                liveness.replied(time.monotonic())

        chatter = asyncio.create_task(others())
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await await_while_alive(_slow(5.0), liveness, expected_s=0.0, quiet_s=0.1, max_s=0.4)
        waited = time.monotonic() - started
        chatter.cancel()
        return waited, liveness.heard_within(0.1, time.monotonic())

    waited, alive = asyncio.run(run())
    assert 0.4 <= waited < 1.0
    assert alive  # the router tells this apart from a pool that is down


def test_a_failing_call_raises_its_own_error_and_is_not_a_reply():
    async def failing():
        await asyncio.sleep(0.01)
        raise RuntimeError("replica died")

    async def run():
        liveness = PoolLiveness()
        with pytest.raises(RuntimeError, match="replica died"):
            await await_while_alive(failing(), liveness, expected_s=0.0, quiet_s=1.0, max_s=5.0)
        return liveness.last_reply

    assert asyncio.run(run()) is None


def test_a_pool_busy_in_one_long_pass_answers_a_ping_and_is_waited_for():
    """No call comes back while one long pass runs (a burst of catch-ups), but the replica
    answers a ping between its passes: busy, not down."""
    pings = []

    async def ping():
        pings.append(time.monotonic())
        return "info"

    async def run():
        liveness = PoolLiveness()
        return await await_while_alive(_slow(0.6), liveness, expected_s=0.0, quiet_s=0.1, max_s=5.0, ping=ping)

    assert asyncio.run(run()) == "draft"
    assert len(pings) >= 3


def test_a_pool_that_answers_no_ping_is_given_up_on():
    async def hung_ping():
        await asyncio.sleep(10)

    async def run():
        liveness = PoolLiveness()
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await await_while_alive(_slow(5.0), liveness, expected_s=0.1, quiet_s=0.1, max_s=5.0, ping=hung_ping)
        return time.monotonic() - started, liveness.last_reply

    waited, last_reply = asyncio.run(run())
    assert 0.3 <= waited < 1.0 and last_reply is None  # expected + quiet, then the ping's own quiet period


def test_a_stall_of_the_routers_own_event_loop_is_not_the_pools_silence():
    """The loop blocks past the quiet period (a GC pause, a blocking call, a starved process).
    When it wakes, the give-up timeout, another call's reply and this call's own reply are all
    due; the timeout comes first in the loop's order, and must not win (CI once gave up on a
    call this way, 0.3 s after its reply was due)."""
    async def run():
        liveness = PoolLiveness()

        async def others():  # another request's calls come back at 0.08 s, then every 0.1 s
            await asyncio.sleep(0.08)
            while True:
                liveness.replied(time.monotonic())
                await asyncio.sleep(0.1)  # due at 0.18: after the give-up timeout at 0.15

        async def stall():
            await asyncio.sleep(0.1)
            time.sleep(0.6)  # blocks the loop past the timeout, the reply and the call's end

        chatter, staller = asyncio.create_task(others()), asyncio.create_task(stall())
        await asyncio.sleep(0)  # both started before the call
        try:
            return await await_while_alive(_slow(0.3), liveness, expected_s=0.0, quiet_s=0.15, max_s=5.0)
        finally:
            chatter.cancel()
            await staller

    assert asyncio.run(run()) == "draft"
