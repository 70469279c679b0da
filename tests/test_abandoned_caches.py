"""A pool releases the caches of requests whose router died: nothing else ever would."""

import asyncio
import time

from specserve.serve.pools import _Pool


class FakeEngine:
    """Holds a 'cache' per request id touched by a call."""

    def __init__(self):
        self.cached: set[str] = set()

    def info(self):
        return None

    async def verify(self, request_id):
        self.cached.add(request_id)
        return request_id

    async def release(self, request_id):
        return self.cached.discard(request_id) is None

    async def check_health(self):
        pass


def pool(abandoned_cache_s: float) -> _Pool:
    return _Pool({"model": "fake", "engine": "fake", "abandoned_cache_s": abandoned_cache_s}, lambda _: FakeEngine())


def test_untouched_caches_are_released_at_the_health_check_and_live_ones_kept():
    async def scenario():
        p = pool(abandoned_cache_s=0.2)
        await p._call("dead-router", p.engine.verify("dead-router"))
        await p._call("finished", p.engine.verify("finished"))
        await p.release("finished")
        await asyncio.sleep(0.3)
        await p._call("live", p.engine.verify("live"))  # touched just now
        await p.check_health()
        return p

    p = asyncio.run(scenario())
    assert p.engine.cached == {"live"}
    assert set(p._last_call) == {"live"}  # nothing is tracked for released requests


def test_a_call_that_outlives_its_release_is_tracked_again():
    """A release that overtakes the request's last call (a client gone mid-pass) must not leave
    that call's cache behind for good."""
    async def scenario():
        p = pool(abandoned_cache_s=0.1)
        slow = asyncio.ensure_future(p._call("r", asyncio.sleep(0.2)))
        await asyncio.sleep(0.05)
        await p.release("r")
        await slow
        p.engine.cached.add("r")  # what the slow pass stored after the release
        assert "r" in p._last_call
        await asyncio.sleep(0.15)
        await p.check_health()
        return p

    assert asyncio.run(scenario()).engine.cached == set()


def test_the_default_keeps_caches_five_minutes():
    from specserve.serve.config import PoolArgs

    p = pool(abandoned_cache_s=PoolArgs.model_fields["abandoned_cache_s"].default)
    p._last_call["r"] = time.monotonic() - 299
    assert asyncio.run(p.release_abandoned()) == 0
    p._last_call["r"] = time.monotonic() - 301
    assert asyncio.run(p.release_abandoned()) == 1
