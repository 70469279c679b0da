"""speculation.pipeline: the draft pool streams its greedy draft and the router verifies it in
chunks, several at once.

Pure bookkeeping (specserve.pipeline.StreamedDraft), the engines' streamed drafts
(chunked_propose_stream), and the router's rounds over the fake pools of test_draft_ahead (a
deterministic target, a draft that agrees with it except at chosen positions), here with a
streaming draft whose tokens come one decode step apart."""

import asyncio

import pytest

from specserve.engine import chunked_propose_stream
from specserve.pipeline import StreamedDraft
from specserve.protocol import DETERMINISTIC, Proposal, ProposeRequest, SamplingParams, Speculation, SpecserveError
from specserve.protocol import TokenTree, VerifyResult
from specserve.request_state import RequestState
from tests.test_draft_ahead import (
    FakeDraftPool, FakeMetric, FakeTargetPool, target_alone, target_next, VOCAB,
)

PROMPT = [5, 9, 11]


# ---- bookkeeping -----------------------------------------------------------------------------

def test_chunks_are_sent_whole_and_no_more_than_max_in_flight_at_once():
    pipe = StreamedDraft([1], k=3, max_in_flight=2)
    pipe.add([10, 11])
    assert pipe.chunks_to_verify() == []  # not a whole chunk yet
    pipe.add([12, 13, 14, 15, 16, 17, 18])
    sent = pipe.chunks_to_verify()
    assert [(context, chunk.tokens) for context, chunk in sent] == [([1], (10, 11, 12)),
                                                                    ([1, 10, 11, 12], (13, 14, 15))]
    assert pipe.chunks_to_verify() == []  # two in flight
    pipe.settle(VerifyResult("r", 3, [10, 11, 12, 13]))
    assert [chunk.tokens for _, chunk in pipe.chunks_to_verify()] == [(16, 17, 18)]


def test_the_rest_of_an_ended_stream_is_verified_and_its_last_chunk_keeps_its_bonus():
    pipe = StreamedDraft([1], k=3, max_in_flight=4)
    pipe.add([10, 11, 12, 13])
    pipe.ended = True
    assert [chunk.tokens for _, chunk in pipe.chunks_to_verify()] == [(10, 11, 12), (13,)]
    result, goes_on = pipe.settle(VerifyResult("r", 3, [10, 11, 12, 13]))
    assert result.tokens == [10, 11, 12] and goes_on  # the bonus is the next chunk's to verify
    result, goes_on = pipe.settle(VerifyResult("r", 1, [13, 20]))
    assert result.tokens == [13, 20] and not goes_on and pipe.done  # the stream's end: bonus kept


def test_a_rejected_token_ends_the_stream_with_the_target_s_token():
    pipe = StreamedDraft([1], k=2, max_in_flight=3)
    pipe.add([10, 11, 12, 13, 14, 15])
    assert len(pipe.chunks_to_verify()) == 3
    result, goes_on = pipe.settle(VerifyResult("r", 1, [10, 30]))
    assert result.tokens == [10, 30] and not goes_on


# ---- streamed drafts from engines that draft round by round ------------------------------------

class RoundByRoundEngine:
    """Proposes the fake target's greedy tokens, `k` per call, recording each call."""

    def __init__(self):
        self.calls = []

    async def propose(self, request: ProposeRequest) -> Proposal:
        self.calls.append((len(request.token_ids), request.k, request.tree))
        context, tokens = list(request.token_ids), []
        for _ in range(request.k):
            tokens.append(target_next(context))
            context.append(tokens[-1])
        return Proposal(request.request_id, TokenTree.chain(tokens), DETERMINISTIC)


async def drain(stream) -> list[list[int]]:
    return [list(p.tree.tokens) async for p in stream]


def test_chunked_propose_stream_continues_after_what_it_streamed():
    engine = RoundByRoundEngine()
    request = ProposeRequest("r", PROMPT, 10, SamplingParams(), 0)
    pieces = asyncio.run(drain(chunked_propose_stream(engine, request, chunk=4)))
    assert [len(p) for p in pieces] == [4, 4, 2]
    assert sum(pieces, []) == target_alone(PROMPT, 10)
    assert [(n, k) for n, k, _ in engine.calls] == [(3, 4), (7, 4), (11, 2)]


def test_a_streamed_draft_is_greedy_only():
    request = ProposeRequest("r", PROMPT, 4, SamplingParams(temperature=0.7), 0)
    with pytest.raises(SpecserveError, match="greedy"):
        asyncio.run(drain(chunked_propose_stream(RoundByRoundEngine(), request)))


# ---- the router's pipelined rounds over fake pools ----------------------------------------------

class FakeStream:
    """A Serve streaming call's generator: __anext__ and cancel()."""

    def __init__(self, agen):
        self.agen, self.cancelled = agen, False

    def __anext__(self):
        return self.agen.__anext__()

    def cancel(self):
        self.cancelled = True


class StreamingDraftPool(FakeDraftPool):
    """A draft pool whose propose_stream yields one token per `step_s`, agreeing with the
    target except where `wrong(context)`; fails after `fail_after` tokens, or goes silent."""

    def __init__(self, step_s: float, wrong=lambda context: False, fail_after: int | None = None,
                 silent: bool = False):
        super().__init__(step_s, wrong)
        self.step_s, self.fail_after, self.silent = step_s, fail_after, silent
        self.streams: list[FakeStream] = []
        self.propose_stream = self

    def options(self, stream: bool = False):
        assert stream
        return self

    def remote(self, request):  # propose_stream.remote
        stream = FakeStream(self._stream(request))
        self.streams.append(stream)
        return stream

    async def _stream(self, request):
        context = list(request.token_ids)
        for n in range(request.k):
            if self.silent:
                await asyncio.sleep(3600)
            if self.fail_after is not None and n == self.fail_after:
                raise RuntimeError("draft replica lost")
            await asyncio.sleep(self.step_s)
            token = target_next(context)
            token = (token + 1) % VOCAB if self.wrong(context) else token
            context.append(token)
            yield Proposal(request.request_id, TokenTree.chain([token]), DETERMINISTIC)


class CountingTargetPool(FakeTargetPool):
    """Counts verifies in flight at once."""

    def __init__(self, delay_s: float):
        super().__init__(delay_s)
        self.in_flight = self.most_in_flight = 0
        verify = self._verify

        async def counted(request):
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            try:
                return await verify(request)
            finally:
                self.in_flight -= 1

        self.verify.fn = counted


def make_router(monkeypatch, draft, target, pipeline: int, **speculation):
    from specserve.serve import router as router_module
    from specserve.serve.metrics import RouterMetrics

    codec = type("Codec", (), {"decode": staticmethod(lambda ids: " ".join(map(str, ids)))})()
    monkeypatch.setattr(router_module.TextCodec, "for_model", classmethod(lambda cls, ref, **_: codec))
    monkeypatch.setattr(router_module, "RouterMetrics", lambda: RouterMetrics(make=FakeMetric))
    args = {"target": {"model": "fake"}, "draft": {"model": "fake-draft"}, "check_vocabulary_at_build": False,
            "speculation": {"k": 3, "policy": "fixed", "draft_ahead": False, "pipeline": pipeline,
                            "draft_timeout_s": 0.2, "draft_retry_after_s": 60, **speculation},
            "fast_replica_calls": False}
    router_class = router_module.Router.func_or_class.__bases__[0]  # under Serve's ingress wrapper
    return router_class(target, draft, args)


async def generate(router, max_tokens: int, temperature: float = 0.0) -> RequestState:
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=1)
    state = RequestState("r", list(PROMPT), params, router.speculation)  # the deployment's: k 3, pipeline
    async for _ in router._rounds(state):
        pass
    return state


@pytest.mark.parametrize("wrong_every", [0, 7, 3])
@pytest.mark.parametrize("max_tokens", [40, 17])
def test_pipelined_rounds_emit_the_target_s_own_greedy_tokens(monkeypatch, wrong_every, max_tokens):
    wrong = (lambda context: len(context) % wrong_every == 0) if wrong_every else (lambda context: False)
    draft, target = StreamingDraftPool(0.002, wrong), CountingTargetPool(0.012)
    state = asyncio.run(generate(make_router(monkeypatch, draft, target, pipeline=3), max_tokens))
    assert state.output_ids == target_alone(PROMPT, max_tokens)
    assert state.stats.draft_streams == len(draft.streams) >= 1
    assert all(stream.cancelled for stream in draft.streams)  # every stream stopped once done with
    assert target.most_in_flight <= 3
    if wrong_every == 0:  # one stream, verified several chunks at a time
        assert state.stats.draft_streams == 1 and target.most_in_flight >= 2
        assert draft.calls == [(3, 3)]  # the first round took turns (its prompt), then one stream
    else:  # a new stream after each rejected token
        assert state.stats.draft_streams > 1


def test_pipelining_is_faster_than_taking_turns_when_verifies_take_longer_than_a_draft_step(monkeypatch):
    """The point of it: with a 12 ms verify and a 2 ms draft step, k = 3, taking turns costs
    ~18 ms per 4 tokens; pipelined, three verifies overlap and the draft stream sets the pace."""
    async def timed(pipeline: int) -> float:
        router = make_router(monkeypatch, StreamingDraftPool(0.002), FakeTargetPool(0.012), pipeline=pipeline)
        loop = asyncio.get_running_loop()
        started = loop.time()
        state = await generate(router, 60)
        assert state.output_ids == target_alone(PROMPT, 60)
        return loop.time() - started

    async def both():
        return await timed(0), await timed(3)

    turns, pipelined = asyncio.run(both())
    assert pipelined < turns


@pytest.mark.parametrize("failure", ["fails", "silent"])
def test_a_draft_stream_that_fails_or_goes_silent_falls_back_to_rounds(monkeypatch, failure):
    draft = StreamingDraftPool(0.002, fail_after=5) if failure == "fails" else StreamingDraftPool(0.002, silent=True)
    router = make_router(monkeypatch, draft, FakeTargetPool(0.004), pipeline=2)
    state = asyncio.run(generate(router, 30))
    assert state.output_ids == target_alone(PROMPT, 30)
    assert state.stats.draft_streams == 1 and router._draft_down_until > 0  # then prompt lookup, for a while


def test_sampled_requests_take_turns(monkeypatch):
    draft = StreamingDraftPool(0.002)
    state = asyncio.run(generate(make_router(monkeypatch, draft, FakeTargetPool(0.002), pipeline=2), 12,
                                 temperature=0.8))
    assert state.stats.draft_streams == 0 and not draft.streams and len(state.output_ids) == 12


@pytest.mark.parametrize(("args", "message"), [
    ({"speculation": {"proposer": "ngram", "pipeline": 2}}, "pipeline .* needs a draft pool"),
    ({"draft": {"model": "fake"}, "speculation": {"pipeline": 2, "policy": "adaptive"}}, "policy: fixed"),
])
def test_a_pipeline_the_app_cannot_run_is_refused_when_it_is_built(args, message):
    from specserve.serve.config import AppArgs

    with pytest.raises(ValueError, match=message):
        AppArgs.model_validate({"target": {"model": "fake"}, **args})


def test_a_request_may_ask_for_a_pipeline_and_that_pins_its_k():
    from specserve.serve.openai_api import SpeculationOverride

    deployment = Speculation(proposer="draft", k=4, policy="adaptive")
    mine = SpeculationOverride(pipeline=3).apply_to(deployment)
    assert mine.pipeline == 3 and mine.policy == "fixed" and mine.k == 4
    assert SpeculationOverride(pipeline=0).apply_to(deployment).policy == "adaptive"
    with pytest.raises(SpecserveError, match="pipeline"):
        Speculation(pipeline=99)


@pytest.mark.parametrize(("device", "policy", "expected"), [
    ("cuda", "fixed", 4), ("cuda", "adaptive", 0), ("cpu", "fixed", 0)])
def test_by_default_only_fixed_chains_on_cuda_pools_pipeline(device, policy, expected):
    from specserve.serve.config import AppArgs

    args = {"target": {"model": "fake", "device": device}, "draft": {"model": "fake", "device": device},
            "speculation": {"policy": policy}}
    app = AppArgs.model_validate(args)
    assert app.speculation.pipeline == expected and app.speculation.spec().pipeline == expected
    if policy == "fixed":  # an explicit setting wins
        args["speculation"]["pipeline"] = 2
        assert AppArgs.model_validate(args).speculation.pipeline == 2


# ---- native mode's streamed rounds commit through the same path (Router._commit) ---------------

class NativeTargetPool(FakeTargetPool):
    """A target that speculates itself: verify_stream yields its greedy tokens 3 at a time."""

    def __init__(self):
        super().__init__(0.001)
        self.verify_stream = self

    def options(self, stream: bool = False):
        assert stream
        return self

    def remote(self, request):
        return FakeStream(self._stream(request))

    async def _stream(self, request):
        context = list(request.token_ids)
        for _ in range(0, request.params.max_tokens, 3):
            tokens = []
            for _ in range(3):
                tokens.append(target_next(context))
                context.append(tokens[-1])
            await asyncio.sleep(0.001)
            yield VerifyResult(request.request_id, 2, tokens)


def test_native_rounds_emit_the_target_s_stream_cut_at_max_tokens(monkeypatch):
    router = make_router(monkeypatch, None, NativeTargetPool(), pipeline=0)
    params = SamplingParams(max_tokens=20)
    state = RequestState("r", list(PROMPT), params, Speculation(proposer="native", policy="fixed"))
    asyncio.run(drain_rounds(router, state))
    assert state.output_ids == target_alone(PROMPT, 20) and state.finish_reason == "length"
    assert state.stats.target_steps == 7 and state.stats.num_drafts == 0


async def drain_rounds(router, state):
    async for _ in router._rounds(state):
        pass
