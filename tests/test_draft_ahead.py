"""speculation.draft_ahead: the draft pool drafts the next round while a round verifies.

Pure bookkeeping (RequestState.may_draft_ahead / ahead_request / keep_ahead / take_ahead), and
the router's rounds over fake pools: a deterministic "target" whose greedy next token is a
function of the context, a draft that agrees with it except at chosen positions, each call
taking a little time so that the draft ahead really overlaps the verify."""

import asyncio

import pytest

from specserve.protocol import DETERMINISTIC, Proposal, SamplingParams, Speculation, TokenTree, VerifyResult
from specserve.request_state import RequestState
from specserve.sampling import walk_greedy_tree

VOCAB = 97


def target_next(context: list[int]) -> int:
    """The fake target's greedy token after `context`."""
    return (sum(context) * 31 + len(context) * 7) % VOCAB


def target_alone(prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(target_next(ids))
    return ids[len(prompt):]


def state_for(max_tokens: int = 40, greedy: bool = True, shape: str = "chain", k: int = 3) -> RequestState:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0 if greedy else 0.8)
    return RequestState("r", [5, 9, 11], params, Speculation(proposer="draft", shape=shape, k=k))


def chain(tokens) -> Proposal:
    return Proposal("r", TokenTree.chain(tokens), DETERMINISTIC, compute_s=0.01)


# ---- bookkeeping -----------------------------------------------------------------------------

def test_only_greedy_draft_chains_with_room_for_another_round_draft_ahead():
    proposal = chain([1, 2, 3])
    assert state_for().may_draft_ahead(proposal)
    assert not state_for(greedy=False).may_draft_ahead(proposal)  # sampled: not offered
    assert not state_for(shape="tree").may_draft_ahead(proposal)
    assert not state_for(max_tokens=5).may_draft_ahead(proposal)  # this round may end the request
    assert not state_for().may_draft_ahead(None) and not state_for().may_draft_ahead(chain([]))


def test_the_draft_ahead_is_kept_only_when_the_round_emitted_its_chain_and_then_its_guess():
    state = state_for()
    request = state.ahead_request(chain([1, 2, 3]))
    assert request.token_ids == [5, 9, 11, 1, 2, 3] and request.k == 4  # the guess, then k more
    ahead = chain([40, 41, 42, 43])  # 40: the draft's guess of the round's bonus token

    state.commit(VerifyResult("r", 3, [1, 2, 3, 40]), TokenTree.chain([1, 2, 3]))
    state.keep_ahead(request, ahead)
    assert state.draft_synced == len(state.token_ids) - 1
    taken = state.take_ahead()
    assert list(taken.tree.tokens) == [41, 42, 43] and taken.compute_s == 0.0
    assert state.stats.drafts_ahead_used == 1 and state.take_ahead() is None  # taken once

    for emitted in ([1, 2, 3, 39], [1, 2, 7]):  # the guess was wrong / the chain was not accepted
        state = state_for()
        request = state.ahead_request(chain([1, 2, 3]))
        state.commit(VerifyResult("r", len(emitted) - 1, emitted), TokenTree.chain([1, 2, 3]))
        state.keep_ahead(request, ahead)
        assert state.take_ahead() is None and state.stats.drafts_ahead_used == 0


def test_a_kept_draft_is_cut_to_the_round_s_depth():
    state = state_for(k=3)
    request = state.ahead_request(chain([1, 2, 3]))
    state.commit(VerifyResult("r", 3, [1, 2, 3, 40]), TokenTree.chain([1, 2, 3]))
    state.keep_ahead(request, chain([40, 41, 42, 43]))
    state.policy_k = 2  # the load-aware policy chose a shorter draft this round
    assert list(state.take_ahead().tree.tokens) == [41, 42]


# ---- the router's rounds over fake pools -------------------------------------------------------

class FakeResponse:
    def __init__(self, coroutine):
        self.task = asyncio.ensure_future(coroutine)
        self.cancelled = False

    def __await__(self):
        return self.task.__await__()

    def cancel(self):
        self.cancelled = True
        self.task.cancel()


class FakeMethod:
    """A handle's method: `.remote()` sends at once (`on_send` sees the call), the reply comes later."""

    def __init__(self, fn, on_send=lambda *args: None):
        self.fn, self.on_send = fn, on_send

    def remote(self, *args):
        self.on_send(*args)
        return FakeResponse(self.fn(*args))


class FakeTargetPool:
    def __init__(self, delay_s: float):
        self.delay_s = delay_s
        self.verify = FakeMethod(self._verify)

    async def _verify(self, request):
        await asyncio.sleep(self.delay_s)
        context = list(request.token_ids)
        predictions = []
        for token in [*request.draft.tokens, None]:  # the target's token after each draft prefix
            predictions.append(target_next(context))
            context.append(token)
        out = walk_greedy_tree(request.draft, predictions)
        return VerifyResult(request.request_id, len(out) - 1, out, compute_s=self.delay_s / 2)


class FakeDraftPool:
    """Agrees with the target except where `wrong(context)`; records every propose call."""

    def __init__(self, delay_s: float, wrong=lambda context: False):
        self.delay_s, self.wrong, self.calls = delay_s, wrong, []
        self.propose = FakeMethod(self._propose)
        self.info = FakeMethod(self._info)

    async def _propose(self, request):
        self.calls.append((len(request.token_ids), request.k))
        await asyncio.sleep(self.delay_s)
        context, tokens = list(request.token_ids), []
        for _ in range(request.k):
            token = target_next(context)
            token = (token + 1) % VOCAB if self.wrong(context) else token
            tokens.append(token)
            context.append(token)
        return Proposal(request.request_id, TokenTree.chain(tokens), DETERMINISTIC, compute_s=self.delay_s / 2)

    async def _info(self):
        return {}


class FakeMetric:
    def __init__(self, *_, **__):
        pass

    def inc(self, *_, **__):
        pass

    set = observe = inc


def make_router(monkeypatch, draft, target, draft_ahead: bool):
    from specserve.serve import router as router_module
    from specserve.serve.metrics import RouterMetrics

    codec = type("Codec", (), {"decode": staticmethod(lambda ids: " ".join(map(str, ids)))})()
    monkeypatch.setattr(router_module.TextCodec, "for_model", classmethod(lambda cls, ref, **_: codec))
    monkeypatch.setattr(router_module, "RouterMetrics", lambda: RouterMetrics(make=FakeMetric))
    # fast_replica_calls off: the fakes are called directly, not through Serve handles
    args = {"target": {"model": "fake"}, "draft": {"model": "fake-draft"}, "check_vocabulary_at_build": False,
            "speculation": {"k": 3, "policy": "fixed", "draft_ahead": draft_ahead}, "fast_replica_calls": False}
    router_class = router_module.Router.func_or_class.__bases__[0]  # under Serve's ingress wrapper
    return router_class(target, draft, args)


async def generate(router, max_tokens: int) -> RequestState:
    state = RequestState("r", [5, 9, 11], SamplingParams(max_tokens=max_tokens), Speculation(proposer="draft", k=3))
    async for _ in router._rounds(state):
        pass
    return state


@pytest.mark.parametrize("wrong_every", [0, 5, 2])
def test_rounds_with_draft_ahead_emit_the_target_s_own_greedy_tokens(monkeypatch, wrong_every):
    """Exact whatever the draft (always right, wrong now and then, wrong often), and a draft
    drafted ahead is used exactly when its round emitted the chain and then its guess."""
    wrong = (lambda context: len(context) % wrong_every == 0) if wrong_every else (lambda context: False)
    draft = FakeDraftPool(0.004, wrong)
    router = make_router(monkeypatch, draft, FakeTargetPool(0.006), draft_ahead=True)
    state = asyncio.run(generate(router, 40))
    assert state.output_ids == target_alone([5, 9, 11], 40)
    stats = state.stats
    assert stats.drafts_ahead > 0 and stats.drafts_ahead_used <= stats.drafts_ahead
    ahead_calls = [k for _, k in draft.calls if k == 4]
    assert len(ahead_calls) == stats.drafts_ahead
    # every round used a kept draft or asked the pool for one: never both, never neither
    assert stats.drafts_ahead_used + (len(draft.calls) - len(ahead_calls)) == stats.target_steps
    if wrong_every == 0:  # always right: every round after the first drafts ahead and keeps it
        assert stats.drafts_ahead_used >= stats.target_steps - 2
        assert stats.mean_accepted_length == pytest.approx(4.0, abs=0.5)


def test_without_draft_ahead_each_round_proposes_once(monkeypatch):
    draft = FakeDraftPool(0.002)
    router = make_router(monkeypatch, draft, FakeTargetPool(0.002), draft_ahead=False)
    state = asyncio.run(generate(router, 24))
    assert state.output_ids == target_alone([5, 9, 11], 24)
    assert state.stats.drafts_ahead == 0 and {k for _, k in draft.calls} == {3}
    assert len(draft.calls) == state.stats.target_steps


def test_draft_ahead_runs_while_the_verify_does(monkeypatch):
    """Each draft ahead is sent right after its round's verify, and before that verify returns."""
    events = []
    target, draft = FakeTargetPool(0.01), FakeDraftPool(0.005)
    verify, propose = target._verify, draft._propose

    async def logged_verify(request):
        try:
            return await verify(request)
        finally:
            events.append("verify returned")

    target.verify = FakeMethod(logged_verify, lambda request: events.append("verify sent"))
    draft.propose = FakeMethod(propose, lambda request: events.append(f"propose k={request.k} sent"))
    state = asyncio.run(generate(make_router(monkeypatch, draft, target, draft_ahead=True), 40))
    assert state.stats.drafts_ahead > 0
    for i, event in enumerate(events):
        if event == "propose k=4 sent":
            assert events[i - 1] == "verify sent" and events[i + 1] == "verify returned", events


def test_a_failed_draft_ahead_only_costs_its_time(monkeypatch):
    """A draft pool that fails every call made ahead: the rounds go on, exact, proposing as usual."""
    draft = FakeDraftPool(0.002)
    plain = draft._propose

    async def failing_ahead(request):
        if request.k == 4:
            raise RuntimeError("draft replica lost")
        return await plain(request)

    draft.propose = FakeMethod(failing_ahead)
    router = make_router(monkeypatch, draft, FakeTargetPool(0.002), draft_ahead=True)
    state = asyncio.run(generate(router, 24))
    assert state.output_ids == target_alone([5, 9, 11], 24)
    assert state.stats.drafts_ahead > 0 and state.stats.drafts_ahead_used == 0


def test_draft_ahead_without_a_draft_pool_is_refused_when_the_app_is_built():
    from specserve.serve.config import AppArgs

    with pytest.raises(ValueError, match="draft_ahead .* needs a draft pool"):
        AppArgs.model_validate({"target": {"model": "fake"}, "speculation": {"proposer": "ngram", "draft_ahead": True}})


@pytest.mark.parametrize(("target_device", "draft_device", "expected"), [
    ("cuda", "cuda:1", True), ("cpu", "cpu", False), ("cuda", "cpu", False), ("cuda", None, False)])
def test_by_default_only_pools_on_cuda_devices_draft_ahead(target_device, draft_device, expected):
    from specserve.serve.config import AppArgs

    args = {"target": {"model": "fake", "device": target_device}, "speculation": {"proposer": "ngram"}}
    if draft_device is not None:
        args |= {"draft": {"model": "fake", "device": draft_device}, "speculation": {"proposer": "draft"}}
    assert AppArgs.model_validate(args).speculation.draft_ahead is expected
    if draft_device is not None:  # an explicit setting wins
        forced = args | {"speculation": {"proposer": "draft", "draft_ahead": not expected}}
        assert AppArgs.model_validate(forced).speculation.draft_ahead is (not expected)


def test_decode_passes_tell_off_s_drift_only_while_no_draft_call_is_in_flight(monkeypatch):
    """Off's prediction rests on the target's timed decode passes times a drift measured in
    service. Any decode pass that ran while the draft pool was idle tells that drift (a request
    with speculation off, not just the policy's off rounds); one run beside a draft call (a
    catch-up, another request's draft) does not, and the router's count of draft calls in
    flight comes back to zero however the calls ended."""
    from specserve.policy import DecodeCurve
    from specserve.protocol import PoolLoad

    class TimedTarget(FakeTargetPool):
        async def _verify(self, request):
            result = await super()._verify(request)
            tokens = 1 + len(request.draft.tokens)
            result.load = PoolLoad(1, float(tokens), 0, 0.02 if tokens == 1 else 0.05)
            return result

    async def off_request(router):
        state = RequestState("off", [5, 9, 11], SamplingParams(max_tokens=12), Speculation(proposer="none"))
        async for _ in router._rounds(state):
            pass
        return state

    router = make_router(monkeypatch, FakeDraftPool(0.002), TimedTarget(0.002), draft_ahead=True)
    router.load.decode = DecodeCurve(((1, 0.01),))  # timed at startup: 0.01 s; in service 0.02
    router.draft_calls.start()  # another request's draft call, in flight throughout
    state = asyncio.run(off_request(router))
    assert state.output_ids == target_alone([5, 9, 11], 12)
    assert router.load.decode.drift == 1.0
    router.draft_calls.end(0.0)
    asyncio.run(off_request(router))
    assert router.load.decode.drift > 1.5  # 12 decode passes at twice the timed pass, 0.1 each
    drift = router.load.decode.drift
    asyncio.run(generate(router, 30))  # speculating, drafting ahead: its verifies are not decode passes
    assert router.load.decode.drift == drift and router.draft_calls.in_flight == 0
