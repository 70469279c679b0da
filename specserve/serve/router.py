"""The Router deployment: the HTTP and gRPC ingress that owns every request and drives its rounds.

`start` validates a request and `generate` streams its deltas; the OpenAI HTTP routes below and
the gRPC methods (GrpcApi) only format them. Metrics are recorded per round (RouterMetrics).

Each request runs its own round loop (propose -> verify -> commit -> stream); the pools batch
the calls of concurrent requests into shared forward passes. The router is torch-free.

Failure handling, all exact:
- draft pool down, failing, or silent (no reply to any call for `draft_timeout_s` beyond a
  call's expected time, and no answer to a ping): the round drafts by prompt lookup, and the
  draft pool is left alone for `draft_retry_after_s`. A busy pool is waited for (serve/liveness.py);
- target replica died mid-call: the same VerifyRequest is retried on another replica. It is
  deterministic (same token ids, same draft, same seed), so no token is lost or repeated;
- client gone (stream closed, request cancelled): the request's caches are released in both pools.
"""


import asyncio
import contextvars
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, replace

import anyio
import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve.engine import adapt_speculation, sampling_refusal
from specserve.pipeline import StreamedDraft
from specserve.policy import (
    CallsInFlight, DecodeCurve, LoadModel, MeasuredModes, PrefillWatch, RecentPeak, SpeculationPolicy, draft_catches_up,
)
from specserve.protocol import (
    DETERMINISTIC, DRAFT_POOL_PROPOSERS, LOCAL_PROPOSERS, Proposal, ProposeRequest, SpecserveError, TokenTree,
    VerifyRequest, VerifyResult,
)
from specserve.proposers.ngram import NgramProposer
from specserve.request_state import RequestState, catch_up_owed, room_tokens, switch_cost_s
from specserve.serve.access import ApiKeys
from specserve.serve.config import AppArgs
from specserve.serve.generation import (
    Delta, ModelNotFound, NotReady, OutputCursor, TextStream, failure, validation_message,
)
from specserve.serve.grpc_api import GrpcApi
from specserve.serve.http_guard import HttpPolicy, RequestGuard
from specserve.serve.limits import DeadlineExceeded, check_request, deadline_message
from specserve.serve.liveness import DRAFT_MAX_WAIT_QUIET, PoolLiveness, await_while_alive
from specserve.serve.metrics import RouterMetrics, SpecCounts
from specserve.serve.policy_trace import PolicyTrace, trace_line
from specserve.serve.openai_api import (
    ChatCompletionRequest, CompletionRequest, error_body, new_id, now, usage,
)
from specserve.text import TextCodec

logger = logging.getLogger("ray.serve")
RETRYABLE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
READY_TIMEOUT_S = 2.0  # /healthz: how long the pools may take to answer before it says 503

app = FastAPI(title="specserve", description="Exact speculative decoding, OpenAI-compatible API")


def _replica_http_policy() -> HttpPolicy:
    """The API key and body limit of the Router this replica process runs."""
    return serve.get_replica_context().servable_object.http_policy


# The key and the body size are checked before FastAPI reads a body (401 and 413 unread).
app.add_middleware(RequestGuard, policy=_replica_http_policy)


def _error(status: int, message: str, **kw) -> JSONResponse:
    return JSONResponse(error_body(message, **kw), status_code=status)


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError):
    return _error(400, validation_message(exc.errors()))


@app.exception_handler(SpecserveError)
@app.exception_handler(ModelNotFound)
@app.exception_handler(NotReady)
@app.exception_handler(DeadlineExceeded)
async def _refused(request: Request, exc: Exception):
    f = failure(exc)
    return _error(f.http_status, f.message, type_=f.type_, code=f.code, param=f.param)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException):
    return _error(exc.status_code, str(exc.detail), type_="invalid_request_error" if exc.status_code < 500 else "server_error")


class ClosingStreamingResponse(StreamingResponse):
    """Runs `on_close`, then closes the body iterator, when the response ends for any reason.
    Starlette does neither when the client goes away, so cleanup inside the generator (the
    request's rounds: the policy's count of requests in flight) would wait for garbage
    collection. `on_close` runs synchronously, even inside a cancelled scope; the close is
    shielded from that scope's cancellation."""

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


async def _free(pool: DeploymentHandle, request_id: str) -> None:
    """Release a request's caches in a pool."""
    try:
        await pool.release.remote(request_id)
    except Exception:  # the replica is gone: its caches went with it
        pass


def pool_handle(handle: DeploymentHandle | None, fast_replica_calls: bool) -> DeploymentHandle | None:
    """The handle the router calls a pool through. In Ray Serve's throughput-optimized mode
    (`fast_replica_calls`) a call goes over gRPC straight to the replica only from a handle
    whose options say so, and the handles passed to the router were made where the app was
    built, outside the replicas' runtime_env: they carry that process's default, by reference
    through Ray's object store. Between two replicas on the 2-core EPYC a bare call took 5.1 ms
    that way against 2.8 ms over gRPC (5.6 ms without the mode; `replica_calls --bare`)."""
    return handle.options(_by_reference=False) if fast_replica_calls and handle is not None else handle


@dataclass
class DraftAhead:
    """A draft pool call for the next round's draft, made while this round verifies."""

    request: ProposeRequest
    pool: DeploymentHandle
    timeout_s: float  # waited for this long after the verify returns, then given up
    calls: CallsInFlight  # the router's calls to the draft pool

    def __post_init__(self) -> None:
        self.response: DeploymentResponse | None = None
        # a task: the call is sent once the round's verify (sent first) is on its way
        self.call = asyncio.ensure_future(self._send())

    async def _send(self) -> Proposal:
        self.calls.start()
        try:
            self.response = self.pool.propose.remote(self.request)
            return await self.response
        finally:
            self.calls.end(time.monotonic())

    async def result(self) -> Proposal | None:
        """The draft, or None when the call failed or outlasted timeout_s (the next round then
        proposes as usual: drafting ahead only ever saves time)."""
        try:
            return await asyncio.wait_for(asyncio.shield(self.call), self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - a lost draft ahead costs nothing but its time
            if not self.call.done():  # outlasted timeout_s: stop it (the pool drops it too)
                self.call.cancel()
                if self.response is not None:
                    self.response.cancel()
            logger.info("draft ahead not used (%s: %s)", type(exc).__name__, exc)
            return None


@serve.deployment
@serve.ingress(app)
class Router(GrpcApi):
    def __init__(self, target: DeploymentHandle, draft: DeploymentHandle | None, args: dict):
        self.args = AppArgs.model_validate(args)
        # Read where this replica runs (the build checked them where the app was built).
        self.api_keys = ApiKeys.from_args(self.args.auth) if self.args.auth is not None else None
        self.http_policy = HttpPolicy(self.api_keys, int(self.args.limits.max_request_bytes))
        self.spec = self.args.speculation  # pool settings: draft timeouts
        self.speculation = self.spec.spec()  # the deployment's default Speculation
        self.target = pool_handle(target, self.args.fast_replica_calls)
        self.draft = pool_handle(draft, self.args.fast_replica_calls)
        self.codec = TextCodec.for_model(self.args.target.model)
        self._info: dict | None = None
        self._info_lock = asyncio.Lock()
        self._draft_down_until = 0.0
        self.draft_liveness = PoolLiveness()
        self.draft_calls = CallsInFlight()  # whether the draft pool was idle through a round
        # Load-aware speculation: the policy, and the pools' load as their replies report it.
        self.policy = SpeculationPolicy()
        self.load = LoadModel()
        self.modes = MeasuredModes()  # the model, checked against measured goodput at each load
        self.in_rounds = 0  # requests running rounds here
        self.peak_in_rounds = RecentPeak()  # the load a wave's first requests enter into
        self.steered: dict[str, RequestState] = {}  # those the policy steers: a switch to the model catches them up
        self.prefills = PrefillWatch()  # rounds that waited for a prefill (prompt, draft catch-up): not overhead
        # Prompt lookup runs here, on the token ids the router holds: proposer `ngram`, and the
        # fallback while the draft pool is down.
        self.ngram = NgramProposer(max_n=self.spec.ngram.max_n, min_n=self.spec.ngram.min_n)
        self._background: set[asyncio.Task] = set()  # asyncio keeps only weak references to tasks
        self.metrics = RouterMetrics()
        self.trace = PolicyTrace.from_env()  # SPECSERVE_POLICY_TRACE: the policy's rounds, for diagnosis

    # ---- pool plumbing -------------------------------------------------------------------

    async def _model_info(self) -> dict:
        """Asked of the pools once: context length, EOS ids, the target engine's capabilities
        (EngineInfo), and whether the draft pool's vocabulary matches the target's (refused
        otherwise)."""
        async with self._info_lock:
            if self._info is None:
                info = await self.target.model_info.remote()
                if self.draft is not None:
                    theirs, ours = await asyncio.gather(self.draft.vocabulary_signature.remote(),
                                                        self.target.vocabulary_signature.remote())
                    if theirs != ours:
                        raise SpecserveError("the draft pool's vocabulary differs from the target pool's")
                if info["engine"].decode_pass_s:  # what off's rounds cost (LoadModel.off_goodput)
                    self.load.decode = DecodeCurve(info["engine"].decode_pass_s)
                self._info = info
        return self._info

    async def _propose(self, request: ProposeRequest, proposer: str, expected_s: float = 0.0) -> Proposal:
        """The round's draft: from prompt lookup (by choice, or while the draft pool is down) or
        from the draft pool, which is waited for while it is alive (serve/liveness.py):
        `expected_s`, the call's own expected time, plus `draft_timeout_s` of silence from the
        pool, which must then answer a ping (`info`) within `draft_timeout_s`; a call given up on
        while the pool answers drafts this round by prompt lookup, a pool that failed or went
        silent is left alone for `draft_retry_after_s`."""
        draft_down = self.draft is None or time.monotonic() < self._draft_down_until
        if proposer in LOCAL_PROPOSERS or draft_down:  # prompt lookup, by choice or as the fallback
            return self.ngram.propose_one(request)
        quiet_s = self.spec.draft_timeout_s
        self.draft_calls.start()
        try:
            return await await_while_alive(self.draft.propose.remote(request), self.draft_liveness,
                                           expected_s=expected_s, quiet_s=quiet_s,
                                           max_s=expected_s + DRAFT_MAX_WAIT_QUIET * quiet_s,
                                           ping=self.draft.info.remote)
        except Exception as exc:  # any draft failure only costs speed: prompt lookup
            if isinstance(exc, TimeoutError) and self.draft_liveness.heard_within(quiet_s, time.monotonic()):
                logger.warning("draft call given up on (%s) while the pool answers others; this round drafts "
                               "by prompt lookup (ngram)", exc)
                return self.ngram.propose_one(request)
            self._draft_down(exc)
            return self.ngram.propose_one(request)
        finally:
            self.draft_calls.end(time.monotonic())

    def _draft_down(self, exc: BaseException) -> None:
        """The draft pool failed or went silent: draft by prompt lookup for draft_retry_after_s."""
        self._draft_down_until = time.monotonic() + self.spec.draft_retry_after_s
        logger.warning("draft pool unavailable (%s: %s); drafting by prompt lookup (ngram) for %.1f s",
                       type(exc).__name__, exc, self.spec.draft_retry_after_s)

    def _sync_draft(self, state: RequestState) -> None:
        """Start the draft pool's catch-up on `state` in the background (RequestState.draft_sync_due)."""
        expected_s = self._expected_draft_s(state.draft_unseen, 1)
        request = state.sync_request()
        mark = self.prefills.start(False, catch_up=True)

        async def sync():
            try:
                await self._propose(request, state.speculation.proposer, expected_s)
            finally:
                self.prefills.end(mark)
                state.draft_syncing = False
                await self._free_draft_if_released(state)

        self._in_background(sync())

    def _draft_ahead(self, state: RequestState, proposal: Proposal | None) -> DraftAhead | None:
        """speculation.draft_ahead: ask the draft pool for the next round's draft now, while
        this round's verify runs (RequestState.may_draft_ahead, ahead_request); None where it
        does not apply, or while the draft pool is down."""
        if (not self.spec.draft_ahead or self.draft is None or time.monotonic() < self._draft_down_until
                or not state.may_draft_ahead(proposal)):
            return None
        state.stats.drafts_ahead += 1
        request = state.ahead_request(proposal)
        return DraftAhead(request, self.draft, self.spec.draft_timeout_s, self.draft_calls)

    async def _settle(self, state: RequestState, ahead: DraftAhead) -> None:
        """A draft ahead whose round failed: wait for it (or give it up), then free the draft
        pool's cache again if the request was released meanwhile (the call may have made it)."""
        await ahead.result()
        await self._free_draft_if_released(state)

    async def _free_draft_if_released(self, state: RequestState) -> None:
        """After a draft call that may have ended after the request's release (and so cached
        it again in the draft pool): free it there again."""
        if state.released and self.draft is not None:
            await _free(self.draft, state.request_id)

    def _in_background(self, coroutine, context: contextvars.Context | None = None) -> None:
        """Run `coroutine` as a task this router keeps a reference to until it ends (asyncio
        keeps only weak ones)."""
        task = asyncio.get_running_loop().create_task(coroutine, context=context)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _catching_up(self) -> bool:
        """Whether a draft pool's catch-up runs, or a steered request owes one that its next
        drafting round starts (RequestState.draft_catch_up_owed). Owed ones count: a request
        of a burst leaves its prompt's catch-up to its second round, and at code 4 streams on
        a 2-core CPU the model's first look ended its warm-up between the last prompt's first
        and second rounds, and measured the other requests' draft calls queued behind that
        catch-up (rounds of 3.3 s against ~1.5): 5.6 tok/s against off's 6.3, where always on
        ran 12% faster than always off; off then held most of the run."""
        return self.prefills.catching_up > 0 or catch_up_owed(self.steered.values())

    def _expected_draft_s(self, catch_up: int, k: int) -> float:
        """What a draft call should take: its catch-up prefill and k steps at the draft pool's
        fitted step time (0 before the pool's first reply)."""
        if not self.load.draft.observed:
            return 0.0
        return self.load.draft.predict(catch_up) + k * self.load.draft.predict(self.load.batch_ema)

    async def _verify(self, request: VerifyRequest) -> VerifyResult:
        deadline = time.monotonic() + self.args.router.target_retry_timeout_s
        attempt = 0
        while True:
            try:
                return await self.target.verify.remote(request)
            except RETRYABLE as exc:
                attempt += 1
                await self._after_lost_target(exc, attempt, deadline, "retrying round")

    @staticmethod
    async def _after_lost_target(exc: BaseException, attempt: int, retry_until: float, what: str) -> None:
        """A target replica was lost: re-raise once retry_until has passed, else wait (longer at
        each attempt) before the caller tries again."""
        if time.monotonic() > retry_until:
            raise exc
        logger.warning("target replica lost (%s); %s, attempt %d", type(exc).__name__, what, attempt)
        await asyncio.sleep(min(0.2 * attempt, 2.0))

    def _release(self, state: RequestState) -> None:
        """Free the request's caches in both pools (once; later calls do nothing)."""
        if state.released:
            return
        state.released = True
        request_id = state.request_id
        self.ngram.release(request_id)
        for pool in (self.target, self.draft):
            if pool is not None:
                # A fresh context: calls made in the request's own context are its children, and
                # Serve cancels children still waiting for a replica when the request is
                # cancelled, which is exactly when a disconnect releases.
                self._in_background(_free(pool, request_id), context=contextvars.Context())

    async def _before(self, deadline: float | None, state: RequestState, call):
        """`call`'s result, or DeadlineExceeded once the request's deadline passes (the call is
        cancelled; a pool call's cancellation reaches its replica)."""
        if deadline is None:
            return await call
        remaining = deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise TimeoutError
            return await asyncio.wait_for(call, remaining)
        except TimeoutError:
            if asyncio.iscoroutine(call):
                call.close()  # never awaited when the deadline had already passed
            raise DeadlineExceeded(deadline_message(state.timeout_s, len(state.output_ids))) from None

    async def _rounds(self, state: RequestState, deadline: float | None = None) -> AsyncIterator[list[int]]:
        self.in_rounds += 1
        if state.adaptive:
            self.steered[state.request_id] = state
        prefill = True  # the first round prefills the prompt: its wait is not a round's overhead
        mark = ticket = None
        try:
            if state.speculation.proposer == "native":  # the target speculates itself: its results stream
                # closed now, not when collected: it closes the pool's stream
                async with aclosing(self._native_rounds(state, deadline)) as native:
                    async for emitted in native:
                        yield emitted
                return
            while not state.finished:
                if self._may_pipeline(state):  # speculation.pipeline: verify a streamed draft
                    async with aclosing(self._pipelined_rounds(state, deadline)) as pipelined:
                        async for emitted in pipelined:
                            yield emitted
                    continue
                started = time.perf_counter()
                round_start = time.monotonic()
                self.load.in_flight = self.in_rounds
                self.peak_in_rounds.observe(round_start, self.in_rounds)
                peak = self.peak_in_rounds.value(round_start)  # the load a wave's first rounds enter into
                deciding = self.modes.deciding_load(self.in_rounds, first_round=prefill, peak_in_flight=peak)
                # only requests the policy steers take part in (and are measured by) its epochs
                ticket = (self.modes.begin(round_start, deciding, prefilling=self.prefills.active > 0 or prefill,
                                           catching_up=self._catching_up(), first_round=prefill,
                                           switch_cost_s=switch_cost_s(self.load, self.steered.values()),
                                           off_predicted=self.load.off_goodput(deciding), model_yield=state.model_yield,
                                           room_tokens=room_tokens(self.steered.values()))
                          if state.adaptive else None)
                mode = ticket.mode if ticket is not None else "model"
                warming_up = ticket is not None and self.modes.warming_up
                catch_up = state.draft_unseen
                measured_level = self.modes.measures(self.in_rounds)
                decision = state.plan_round(self.policy, self.load, measured_off=mode == "off",
                                            measured_level=measured_level, alone=self.in_rounds == 1)
                # the draft pool catches up meanwhile: this round runs target-only
                peak_measured = self.modes.measures(peak)
                if state.draft_sync_due(others_prefilling=self.prefills.active > 0, measured_level=measured_level,
                                        peak_measured=peak_measured):
                    self._sync_draft(state)
                ahead = state.take_ahead()  # drafted during the last verify (speculation.draft_ahead)
                draft_call = state.needs_proposer and state.speculation.draft_cost == "pool" and ahead is None
                mark = self.prefills.start(prefill, catch_up=draft_call and draft_catches_up(
                    catch_up, state.speculation.depth))
                if ahead is not None:
                    proposal = ahead
                elif state.needs_proposer:  # a draft pool's round, or prompt lookup
                    proposal = await self._before(deadline, state, self._propose(
                        state.propose_request(), state.speculation.proposer,
                        self._expected_draft_s(catch_up, state.round_k()) if draft_call else 0.0))
                else:  # co-located heads proposed it in the previous verify pass (or no speculation)
                    proposal = state.proposal_in_hand()
                verify = state.verify_request(proposal)
                drafting_ahead = self._draft_ahead(state, proposal)  # sent once the verify below is
                try:
                    result = await self._before(deadline, state, self._verify(verify))
                    verified = time.perf_counter()
                    next_draft = await drafting_ahead.result() if drafting_ahead is not None else None
                except BaseException:  # an error, a deadline, a disconnect
                    if drafting_ahead is not None:  # let it end; free what it cached once released
                        self._in_background(self._settle(state, drafting_ahead), context=contextvars.Context())
                    raise
                round_end = time.monotonic()
                self.prefills.end(mark)
                round_mark, mark = mark, None
                compute = result.compute_s + (proposal.compute_s if proposal is not None else 0.0)
                wall = time.perf_counter() - started
                state.stats.round_trip_overhead_s += max(0.0, wall - compute)
                # the policy's overhead: outside every pass the round spanned (this request's, and
                # the other requests' passes it waited for), in rounds no prompt prefill overlapped
                overhead = wall - compute * self.load.passes(self.load.batch_ema)
                clear = self.prefills.clear(round_mark)
                self._observe_load(result, proposal, draft_call, overhead if clear else None,
                                   off=mode == "off" and ticket is not None and not self.modes.settling(),
                                   alone=self.in_rounds == 1, draft_idle=self.draft_calls.idle_since(round_start))
                prefill = False
                if self.trace is not None:
                    self.trace.write(trace_line(state, decision, mode=mode, in_flight=self.in_rounds, load=self.load,
                                                catch_up=catch_up, k=state.round_k(), result=result, proposal=proposal,
                                                round_s=wall, warming_up=warming_up,
                                                counted=ticket is not None and ticket.counted,
                                                overlapped=not clear,
                                                epoch=ticket.epoch if ticket is not None else None,
                                                estimates=self.modes.estimates(self.in_rounds),
                                                drafted_ahead=ahead is not None,
                                                ahead_wait_s=time.perf_counter() - verified
                                                if drafting_ahead is not None else None))
                counts = SpecCounts.of(state.stats)
                emitted = state.commit(result, verify.draft)
                if drafting_ahead is not None:
                    state.keep_ahead(drafting_ahead.request, next_draft)
                if ticket is not None:
                    self.modes.end(ticket, len(emitted), round_end - round_start, overlapped=not clear)
                    ticket = None
                self.metrics.round(state.speculation.proposer, counts, SpecCounts.of(state.stats))
                state.finish_at_stop_string(self.codec.decode)
                yield emitted
        finally:
            if mark is not None:  # the round ended early (an error, a deadline, a disconnect)
                self.prefills.end(mark)
            if ticket is not None:
                self.modes.end(ticket, None)
            self.in_rounds -= 1
            self.steered.pop(state.request_id, None)
            self._release(state)

    def _may_pipeline(self, state: RequestState) -> bool:
        """speculation.pipeline applies: to the request (RequestState.may_pipeline), with a draft
        pool that is up."""
        return self.draft is not None and time.monotonic() >= self._draft_down_until and state.may_pipeline()

    async def _pipelined_rounds(self, state: RequestState, deadline: float | None) -> AsyncIterator[list[int]]:
        """speculation.pipeline (specserve.pipeline): one draft stream, its k-token chunks
        verified as they come, up to `pipeline` at once, each settled result a round. Returns
        when a token is rejected or the stream ends (the caller starts the next stream), and
        when the draft pool fails or goes silent (the caller's rounds then draft by prompt
        lookup)."""
        pipe = StreamedDraft(list(state.token_ids), state.speculation.k, state.speculation.pipeline)
        quiet_s = self.spec.draft_timeout_s + self._expected_draft_s(state.draft_unseen, 1)
        state.draft_synced = len(pipe.base)
        state.ahead = None  # a draft ahead of the round before: drafted after tokens the stream goes past
        state.stats.draft_streams += 1
        stream = self.draft.options(stream=True).propose_stream.remote(
            ProposeRequest(state.request_id, pipe.base, state.room() - 1, state.params, 0))
        reading: asyncio.Future | None = asyncio.ensure_future(stream.__anext__())
        verifies: deque[tuple[TokenTree, asyncio.Future]] = deque()
        self.draft_calls.start()
        try:
            while not state.finished:
                for context, chunk in pipe.chunks_to_verify():
                    verify = VerifyRequest(state.request_id, context, state.params, 0, chunk, DETERMINISTIC)
                    verifies.append((chunk, asyncio.ensure_future(self._verify(verify))))
                if pipe.done:
                    if not pipe.drafted:  # a stream with no draft at all: not worth another try now
                        self._draft_down(SpecserveError("the draft pool's stream ended without a draft"))
                    return
                waiting = [task for task in (reading, verifies[0][1] if verifies else None) if task is not None]
                done, _ = await self._before(deadline, state, asyncio.wait(
                    waiting, timeout=None if verifies else quiet_s, return_when=asyncio.FIRST_COMPLETED))
                if not done:  # nothing to verify, and the draft pool silent
                    self._draft_down(TimeoutError(f"no draft token in {quiet_s:.1f} s"))
                    return
                if reading in done:
                    try:
                        pipe.add(reading.result().tree.tokens)
                        reading = asyncio.ensure_future(stream.__anext__())
                    except StopAsyncIteration:
                        pipe.ended, reading = True, None
                    except Exception as exc:  # noqa: BLE001 - verify what was drafted, then draft by prompt lookup
                        self._draft_down(exc)
                        pipe.ended, reading = True, None
                if verifies and verifies[0][1].done():
                    chunk, task = verifies.popleft()
                    result, goes_on = pipe.settle(task.result())
                    yield self._commit(state, result, chunk)
                    if not goes_on:
                        return
        finally:  # a rejection, the end, an error, a deadline, a disconnect: stop the draft and the verifies
            for task in (reading, *(task for _, task in verifies)):
                if task is not None:
                    task.cancel()
            stream.cancel()
            self.draft_calls.end(time.monotonic())

    async def _native_rounds(self, state: RequestState, deadline: float | None) -> AsyncIterator[list[int]]:
        """Native mode: one streaming call for the rest of the generation, each of the target's
        results (a vLLM step's tokens) a round. A replica lost mid-stream is retried as a round
        is: a new stream from the tokens committed so far."""
        retry_until, attempt = None, 0
        while not state.finished:
            stream = self.target.options(stream=True).verify_stream.remote(state.stream_request())
            try:
                while not state.finished:
                    try:
                        result = await self._before(deadline, state, stream.__anext__())
                    except StopAsyncIteration:
                        raise SpecserveError("the target pool's stream ended before the generation did") from None
                    retry_until, attempt = None, 0
                    yield self._commit(state, result, TokenTree())
            except RETRYABLE as exc:
                retry_until = retry_until or time.monotonic() + self.args.router.target_retry_timeout_s
                attempt += 1
                await self._after_lost_target(exc, attempt, retry_until, "restarting the stream")
            finally:
                stream.cancel()  # finished early (a stop string), a deadline, a disconnect: vLLM stops too

    def _commit(self, state: RequestState, result: VerifyResult, draft: TokenTree) -> list[int]:
        """Commit a streamed round's result (native mode, a pipeline's settled chunk): the
        tokens it emitted, counted in the metrics, and the output cut at a stop string."""
        counts = SpecCounts.of(state.stats)
        emitted = state.commit(result, draft)
        self.metrics.round(state.speculation.proposer, counts, SpecCounts.of(state.stats))
        if result.load is not None:
            self.metrics.pool_load("target", result.load)
        state.finish_at_stop_string(self.codec.decode)
        return emitted

    def _observe_load(self, result: VerifyResult, proposal: Proposal | None, draft_call: bool,
                      overhead_s: float | None, *, off: bool, alone: bool, draft_idle: bool) -> None:
        """The pools' load signals, and the round's wall time outside the passes it spanned
        (None: not a round's overhead, e.g. a prompt's prefill queued behind others'). `off`: a
        round of the policy's off epochs; `alone`: the only request in rounds (what off's round
        costs is measured in those: LoadModel.off_goodput); `draft_idle`: no draft call was in
        flight through the round (its decode passes ran as off's do: CallsInFlight)."""
        if result.load is not None:
            self.load.observe_target(result.load.batch_size, result.load.batch_tokens, result.load.step_s,
                                     off=off or draft_idle)
            self.metrics.pool_load("target", result.load)
        if proposal is not None and proposal.load is not None:
            self.load.observe_draft(proposal.load.batch_tokens, proposal.load.step_s)
            self.metrics.pool_load("draft", proposal.load)
        if overhead_s is not None:
            self.load.observe_overhead(overhead_s, draft_call=draft_call, off=off or alone)

    # ---- the transport-agnostic core: start a request, then stream its deltas -------------

    async def generate(self, state: RequestState) -> AsyncIterator[Delta]:
        """Run the request's rounds; each yields the tokens it emitted and the text they make
        safe to show (stop strings held back, then cut). The caches are freed however it ends
        (once it is finished, before its last delta is handed on: a consumer that stopped
        reading without cancelling must not keep them), and DeadlineExceeded ends it once
        `state.timeout_s` has passed. A resumed request streams on from where its interrupted
        stream stopped."""
        cursor = OutputCursor(TextStream(state.params.stop))
        if state.output_ids:  # resumed: what the interrupted stream had sent with these tokens
            cursor.advance(state.output_ids, self.codec.decode(state.output_ids), final=False)
        timer = self.metrics.timer()
        deadline = time.monotonic() + state.timeout_s if state.timeout_s is not None else None
        try:
            if state.finished:  # resumed with tokens that already end it: only the last delta
                yield self._delta(state, cursor, timer)
            async with aclosing(self._rounds(state, deadline)) as rounds:
                async for _ in rounds:
                    if state.finished:  # no pool call follows
                        self._release(state)
                    yield self._delta(state, cursor, timer)
        finally:
            self._release(state)

    def _delta(self, state: RequestState, cursor: OutputCursor, timer) -> Delta:
        ids, text = cursor.advance(state.output_ids, self._text(state), final=state.finished)
        timer.emitted(len(ids), final=state.finished)
        if not state.finished:
            return Delta(ids, text)
        self.metrics.finished(len(state.prompt_ids), len(state.output_ids), state.finish_reason)
        return Delta(ids, text, state.finish_reason, self._usage(state))

    def _usage(self, state: RequestState) -> dict:
        return usage(len(state.prompt_ids), len(state.output_ids), state.usage_stats())

    async def start(self, body, prompt_ids: list[int]) -> RequestState:
        """A validated request: `body` (an OpenAI request body, or one a gRPC request became)
        gives the model, the sampling params, the speculation override and the deadline. Raises
        what `failure` maps: ModelNotFound, SpecserveError (LimitExceeded: over `limits`)."""
        if body.model != self.args.served_name:
            raise ModelNotFound(f"model {body.model!r} is not served here; this server serves {self.args.served_name!r}")
        info = await self._model_info()
        checked = check_request(
            self.args.limits, prompt_tokens=len(prompt_ids),
            prompt_param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
            max_tokens=body.max_tokens, default_max_tokens=self.args.max_tokens_default, stops=body.stop,
            timeout_s=body.timeout_s, max_context=info["max_context"])
        speculation = self.speculation
        if body.speculation is not None:
            speculation = body.speculation.apply_to(speculation)
        engine = info["engine"]  # the target engine's EngineInfo: adapt to what it can verify
        speculation = adapt_speculation(speculation, engine)
        if speculation.proposer in DRAFT_POOL_PROPOSERS and self.draft is None:
            raise SpecserveError(f"this deployment has no draft pool for proposer {speculation.proposer!r}: "
                                 f"use {', '.join(repr(p) for p in self._proposers())}")
        params = replace(body.sampling_params(checked.max_tokens), max_tokens=checked.max_tokens)
        refusal = sampling_refusal(engine, params)
        if refusal is not None:
            raise SpecserveError(refusal)
        if speculation.co_located and speculation.proposer != info.get("heads_method"):
            raise SpecserveError(f"this deployment's target has no heads for proposer {speculation.proposer!r}: "
                                 f"use {', '.join(repr(p) for p in self._proposers())}")
        vocab = self.codec.tokenizer.get_vocab_size(with_added_tokens=True)
        for what, ids in (("the prompt", prompt_ids), ("resume_token_ids", body.resume_token_ids or ())):
            if any(t < 0 or t >= vocab for t in ids):
                raise SpecserveError(f"{what} contains token ids outside the vocabulary")
        state = RequestState(
            uuid.uuid4().hex, prompt_ids, params, speculation,
            frozenset(info["eos_token_ids"]), info["max_context"], prefill_without_draft=True,
            timeout_s=checked.timeout_s,
        )
        if body.resume_token_ids:
            state.resume(body.resume_token_ids, self.codec.decode)
        return state

    def _proposers(self) -> list[str]:
        """The proposers this deployment can serve."""
        heads = (self._info or {}).get("heads_method")  # the co-located pool says which heads it holds
        engine = (self._info or {}).get("engine")
        if engine is not None and engine.native is not None:
            return ["native"]  # the target speculates itself, for every request
        return ["none", "ngram"] + (["draft"] if self.draft is not None else []) + ([heads] if heads else [])

    def _text(self, state: RequestState) -> str:
        return state.stop_text if state.stop_text is not None else self.codec.decode(state.output_ids)

    async def ready(self) -> None:
        """Returns once the pools answer (their model is loaded); raises NotReady while they start."""
        if self._info is None:
            try:
                await asyncio.wait_for(self._model_info(), timeout=READY_TIMEOUT_S)
            except TimeoutError:
                raise NotReady(f"not ready: the pools did not answer within {READY_TIMEOUT_S:g} s") from None
            except Exception as exc:  # refused (e.g. a vocabulary mismatch)
                raise NotReady(f"not ready: {type(exc).__name__}: {exc}") from None

    def prompt_ids(self, body) -> list[int]:
        """The prompt's token ids: a chat's messages through the chat template, or a completion's
        text (or the ids it gave)."""
        if isinstance(body, ChatCompletionRequest):
            return self.codec.encode_chat(body.template_messages())
        return body.prompt if isinstance(body.prompt, list) else self.codec.encode(body.prompt)

    @app.get("/healthz")
    async def healthz(self):
        """200 once the pools answer (their model is loaded), 503 while they start."""
        await self.ready()
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(self) -> dict:
        return {"object": "list", "data": [
            {"id": self.args.served_name, "object": "model", "created": 0, "owned_by": "specserve"}]}

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest):
        state = await self.start(body, self.prompt_ids(body))
        return await self._respond(body, state, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest):
        state = await self.start(body, self.prompt_ids(body))
        return await self._respond(body, state, chat=True)

    async def _respond(self, body, state: RequestState, *, chat: bool):
        rid = new_id("chatcmpl" if chat else "cmpl")
        created = now()
        if body.stream:
            return ClosingStreamingResponse(self._sse(body, state, chat, rid, created),
                                            on_close=lambda: self._release(state), media_type="text/event-stream")
        async with aclosing(self.generate(state)) as deltas:
            async for _ in deltas:
                pass
        text = self._text(state)
        choice = {"index": 0, "finish_reason": state.finish_reason, "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        if body.return_token_ids:
            choice["token_ids"] = list(state.output_ids)
        return {
            "id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": self.args.served_name, "choices": [choice],
            "usage": self._usage(state),
        }

    async def _sse(self, body, state: RequestState, chat: bool, rid: str, created: int) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, finish: str | None, first: bool = False, token_ids: list[int] | None = None) -> str:
            if chat:
                d = {"role": "assistant", "content": ""} if first else ({"content": delta} if delta else {})
                choice = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
            if token_ids is not None:
                choice["token_ids"] = token_ids
            return "data: " + json.dumps({"id": rid, "object": obj, "created": created,
                                          "model": self.args.served_name, "choices": [choice]}) + "\n\n"

        if chat:
            yield chunk(None, None, first=True)
        try:
            async with aclosing(self.generate(state)) as deltas:
                async for delta in deltas:
                    ids = delta.token_ids if body.return_token_ids else None
                    if delta.text or ids:  # with token ids, a round whose text is held back still sends them
                        yield chunk(delta.text, None, token_ids=ids)
                    if delta.finish_reason is not None:
                        yield chunk(None, delta.finish_reason)
        except (SpecserveError, DeadlineExceeded) as exc:  # headers are sent: report in-band, as OpenAI does
            f = failure(exc)
            yield "data: " + json.dumps(error_body(f.message, type_=f.type_, param=f.param, code=f.code)) + "\n\n"
        if body.stream_options is not None and body.stream_options.include_usage:
            yield "data: " + json.dumps({
                "id": rid, "object": obj, "created": created, "model": self.args.served_name, "choices": [],
                "usage": self._usage(state),
            }) + "\n\n"
        yield "data: [DONE]\n\n"
