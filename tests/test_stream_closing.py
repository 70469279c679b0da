"""A stream the client abandons ends its request's rounds at once, not when the garbage collector
gets to them. Serve ends a cancelled gRPC stream by throwing CancelledError into the RPC's
generator at its yield, and Starlette stops iterating an HTTP body without closing it; neither
closes the generators below (`generate`, the rounds), whose `finally` frees the request's caches
and takes it out of the policy's count of requests in flight. Reference cycles (an exception's
traceback holds the frames) can keep them alive until the collector runs; the closing tests run
with the collector off, so only an explicit close passes. The last two cover a reader that
stops without any cancellation reaching the router (Serve's gRPC proxy drops some: grpc_api)."""

import asyncio
import gc
from contextlib import aclosing, contextmanager

import pytest

from specserve.grpc import specserve_pb2 as pb
from specserve.serve.generation import Delta
from specserve.serve.grpc_api import GrpcApi
from specserve.serve.router import ClosingStreamingResponse, Router


@contextmanager
def collector_off():
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class Rounds:
    """An endless request: what its rounds' cleanup saw."""

    def __init__(self):
        self.closed = False
        self.released = 0

    async def deltas(self):
        try:
            while True:
                await asyncio.sleep(0)
                yield Delta([1], "x")
        finally:
            self.closed = True

    async def emitted(self):  # the router's `_rounds`: each round's tokens
        async with aclosing(self.deltas()) as deltas:
            async for delta in deltas:
                yield delta.token_ids


class FakeGrpcRouter(GrpcApi):
    def __init__(self, rounds: Rounds):
        self.rounds = rounds

    def _release(self, state) -> None:
        self.rounds.released += 1

    def _admit(self, request, grpc_context) -> None:
        pass

    def prompt_ids(self, body) -> list[int]:
        return [1, 2]

    async def start(self, body, prompt_ids):
        return object()

    def generate(self, state):
        return self.rounds.deltas()


@pytest.mark.parametrize("rpc", ["GenerateStream", "ChatStream"])
def test_a_cancelled_grpc_stream_closes_its_rounds_at_once(rpc):
    rounds = Rounds()
    router = FakeGrpcRouter(rounds)
    request = (pb.GenerateRequest(model="m", prompt="p") if rpc == "GenerateStream"
               else pb.ChatRequest(model="m", messages=[pb.ChatMessage(role="user", content="p")]))

    async def cancel_like_serve():
        stream = getattr(router, rpc)(request)
        for _ in range(3):
            await stream.__anext__()
        with pytest.raises((asyncio.CancelledError, StopAsyncIteration)):
            await stream.athrow(asyncio.CancelledError())  # what Serve does to a cancelled call
        return rounds.closed  # before the loop runs anything else

    with collector_off():
        assert asyncio.run(cancel_like_serve())


class FakeRouter:
    """The Router's `generate` over fake rounds (no pools, no Ray)."""

    generate = Router.func_or_class.generate

    def __init__(self, rounds: Rounds):
        self.rounds = rounds

    def _rounds(self, state, deadline=None):
        return self.rounds.emitted()

    def _release(self, state) -> None:
        self.rounds.released += 1

    def _delta(self, state, cursor, timer) -> Delta:
        return Delta([1], "x")

    class codec:
        decode = staticmethod(lambda ids: "")

    class metrics:
        timer = staticmethod(lambda: None)


class State:
    output_ids: list[int] = []
    finished = False
    timeout_s = None

    class params:
        stop: list[str] = []


def test_closing_generate_closes_the_rounds_and_releases():
    rounds = Rounds()
    router = FakeRouter(rounds)

    async def abandon():
        deltas = router.generate(State())
        await deltas.__anext__()
        await deltas.aclose()
        return rounds.closed, rounds.released

    with collector_off():
        assert asyncio.run(abandon()) == (True, 1)


def test_an_http_stream_the_client_leaves_closes_its_body():
    """Starlette's pre-2.4 ASGI path cancels the body's task on a disconnect while it waits to
    send, leaving the body generator suspended at a yield."""
    rounds = Rounds()
    closed_by_on_close = []

    async def body():  # as the router's `_sse` does: it closes the deltas it iterates
        async with aclosing(rounds.deltas()) as deltas:
            async for delta in deltas:
                yield delta.text

    async def serve_then_disconnect():
        sent = asyncio.Event()

        async def send(message):
            if message["type"] == "http.response.body":
                sent.set()
                await asyncio.sleep(3600)  # a slow client: the body waits here, at a yield

        async def receive():
            await sent.wait()
            return {"type": "http.disconnect"}

        response = ClosingStreamingResponse(body(), on_close=lambda: closed_by_on_close.append(True),
                                            media_type="text/event-stream")
        await response({"type": "http", "asgi": {"spec_version": "2.0"}}, receive, send)
        return rounds.closed

    with collector_off():
        assert asyncio.run(serve_then_disconnect())
    assert closed_by_on_close == [True]


def test_a_grpc_stream_whose_reader_stops_reading_frees_its_caches():
    """Serve's gRPC proxy may drop a cancelled call without cancelling it: the stream then
    waits at a yield for a reader that never comes. After `consumer_stall_s` its caches are
    freed; a reader that was only slow still gets the rest (the pools recompute the caches)."""
    rounds = Rounds()
    router = FakeGrpcRouter(rounds)
    router.consumer_stall_s = 0.05

    async def stall():
        stream = router.GenerateStream(pb.GenerateRequest(model="m", prompt="p"))
        for _ in range(3):
            await stream.__anext__()
        read_promptly = rounds.released
        await asyncio.sleep(0.3)  # the reader takes nothing
        stalled = rounds.released
        await stream.__anext__()  # a slow reader, not a gone one: the stream goes on
        await stream.aclose()
        return read_promptly, stalled

    assert asyncio.run(stall()) == (0, 1)


def test_a_finished_request_frees_its_caches_before_its_last_delta():
    """A reader that stops taking messages (and is never cancelled) must not hold a finished
    request's caches."""
    rounds = Rounds()
    router = FakeRouter(rounds)
    state = State()
    state.finished = False

    async def finishing_rounds(state_, deadline=None):
        for i in range(3):
            state_.finished = i == 2
            yield [1]

    router._rounds = finishing_rounds

    async def read_all():
        released_at = []
        deltas = router.generate(state)
        async for _ in deltas:
            released_at.append(rounds.released)
        return released_at

    assert asyncio.run(read_all()) == [0, 0, 1]
