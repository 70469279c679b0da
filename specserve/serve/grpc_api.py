"""The gRPC adapter: specserve.proto's RPCs on the Router, served by Ray Serve's gRPC proxy
(which calls the deployment method named like the RPC, streaming ones as async generators).

A gRPC request becomes the same pydantic body an HTTP request is parsed into, so validation,
limits, defaults and error messages are HTTP's; the API key (metadata `authorization: Bearer
<key>`) and the message size are checked before it is parsed; the router's `generate` deltas
become GenerateResponse messages; `failure` maps refusals onto status codes. Backpressure (RESOURCE_EXHAUSTED), client
deadlines (DEADLINE_EXCEEDED) and cancellation (CANCELLED) come from the proxy. Serve ends a
cancelled stream by throwing CancelledError into the RPC's generator where it waits (at a
yield), which does not close a generator it iterates: each one here closes what it iterates
(`aclosing`), so `generate` and its rounds end then and free the request's caches, not when
the garbage collector gets to them.

Ray Serve's gRPC proxy does not always pass a client's cancellation on (seen in CI: the router
generated all 400 tokens of a cancelled stream, then waited at its last message for a reader
that never came). As we read the proxy, it cancels the router's call only when the cancellation
lands while it waits for the next message; landing anywhere else, it drops the call uncancelled. So a stream also frees its caches once its reader has
not taken a message for CONSUMER_STALL_S (exact either way: pools recompute a released
request's cache from the token ids every call carries), and `generate` frees them before the
last message.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing, contextmanager

import grpc

from specserve.grpc import specserve_pb2 as pb
from specserve.serve.access import metadata_value
from specserve.serve.generation import Delta, failure
from specserve.serve.limits import check_request_bytes
from specserve.serve.openai_api import ChatCompletionRequest, CompletionRequest, new_id

_SAMPLING_OPTIONAL = ("temperature", "top_p", "top_k", "max_tokens", "seed")
_SPECULATION_OPTIONAL = ("proposer", "shape", "k", "acceptance", "policy", "pipeline", "solo_k")
_TREE_OPTIONAL = ("budget", "depth", "width", "min_score", "rerank")


def _set_fields(message, names: tuple[str, ...]) -> dict:
    return {name: getattr(message, name) for name in names if message.HasField(name)}


def _body_fields(request) -> dict:
    """The HTTP body fields a GenerateRequest or ChatRequest carries (unset ones left out, so
    HTTP's defaults apply)."""
    sampling = request.sampling
    fields = {"model": request.model, **_set_fields(sampling, _SAMPLING_OPTIONAL)}
    if sampling.stop:
        fields["stop"] = list(sampling.stop)
    if sampling.ignore_eos:
        fields["ignore_eos"] = True
    if request.HasField("speculation"):
        spec = request.speculation
        override = _set_fields(spec, _SPECULATION_OPTIONAL)
        if spec.HasField("tree"):
            override["tree"] = _set_fields(spec.tree, _TREE_OPTIONAL)
            if spec.tree.shape:
                override["tree"]["shape"] = [list(path.ranks) for path in spec.tree.shape]
        fields["speculation"] = override
    if request.HasField("timeout_s"):
        fields["timeout_s"] = request.timeout_s
    if request.resume_token_ids:
        fields["resume_token_ids"] = list(request.resume_token_ids)
    return fields


def completion_body(request: pb.GenerateRequest) -> CompletionRequest:
    """Raises pydantic's ValidationError exactly as the HTTP API would for the same body."""
    prompt = list(request.prompt_token_ids) or request.prompt
    return CompletionRequest.model_validate({**_body_fields(request), "prompt": prompt})


def chat_body(request: pb.ChatRequest) -> ChatCompletionRequest:
    messages = [{"role": m.role, "content": m.content} for m in request.messages]
    return ChatCompletionRequest.model_validate({**_body_fields(request), "messages": messages})


def usage_message(usage: dict) -> pb.Usage:
    stats = usage["speculation"]
    names = {f.name for f in pb.SpeculationStats.DESCRIPTOR.fields} - {"k_histogram"}
    speculation = pb.SpeculationStats(**{n: stats[n] for n in names if n in stats},
                                      k_histogram={int(k): n for k, n in stats["k_histogram"].items()})
    return pb.Usage(prompt_tokens=usage["prompt_tokens"], completion_tokens=usage["completion_tokens"],
                    total_tokens=usage["total_tokens"], speculation=speculation)


def response_message(rid: str, delta: Delta) -> pb.GenerateResponse:
    message = pb.GenerateResponse(id=rid, text=delta.text, token_ids=delta.token_ids,
                                  finish_reason=delta.finish_reason or "")
    if delta.usage is not None:
        message.usage.CopyFrom(usage_message(delta.usage))
    return message


# A stream whose reader has not taken a message for this long frees its caches (see above).
CONSUMER_STALL_S = 30.0


@contextmanager
def released_if_unread(release, stall_s: float):
    """Around a stream's yield: `release()` if the reader has not taken the message (resumed
    the stream) within `stall_s`."""
    timer = asyncio.get_running_loop().call_later(stall_s, release)
    try:
        yield
    finally:
        timer.cancel()


@contextmanager
def reported(grpc_context):
    """Set the status a refusal maps to before it propagates (the proxy keeps a code set on the
    context); unexpected errors stay INTERNAL. Cancellation is no Exception: it passes."""
    try:
        yield
    except Exception as exc:
        f = failure(exc)
        if f is not None and grpc_context is not None:
            grpc_context.set_code(getattr(grpc.StatusCode, f.grpc_code))
            grpc_context.set_details(f.message)
        raise


class GrpcApi:
    """The Router's gRPC methods (mixed into the Router deployment class)."""

    consumer_stall_s = CONSUMER_STALL_S

    def _admit(self, request, grpc_context) -> None:
        """The API key (Unauthenticated) and the message's size (LimitExceeded), checked before
        the request is parsed. Serve's proxy takes messages up to RAY_SERVE_GRPC_MAX_MESSAGE_SIZE."""
        if self.api_keys is not None:
            metadata = grpc_context.invocation_metadata() if grpc_context is not None else ()
            self.api_keys.check(metadata_value(metadata, "authorization"))
        check_request_bytes(request.ByteSize(), int(self.args.limits.max_request_bytes))

    async def _unary(self, body_of, prefix: str, request, grpc_context) -> pb.GenerateResponse:
        with reported(grpc_context):
            self._admit(request, grpc_context)
            body = body_of(request)
            state = await self.start(body, self.prompt_ids(body))
            async with aclosing(self.generate(state)) as deltas:
                async for _ in deltas:
                    pass
        whole = Delta(list(state.output_ids), self._text(state), state.finish_reason, self._usage(state))
        return response_message(new_id(prefix), whole)

    async def _stream(self, body_of, prefix: str, request, grpc_context) -> AsyncIterator[pb.GenerateResponse]:
        rid = new_id(prefix)
        with reported(grpc_context):
            self._admit(request, grpc_context)
            body = body_of(request)
            state = await self.start(body, self.prompt_ids(body))
            async with aclosing(self.generate(state)) as deltas:
                async for delta in deltas:
                    with released_if_unread(lambda: self._release(state), self.consumer_stall_s):
                        yield response_message(rid, delta)

    async def Generate(self, request: pb.GenerateRequest, grpc_context=None) -> pb.GenerateResponse:
        return await self._unary(completion_body, "cmpl", request, grpc_context)

    async def GenerateStream(self, request: pb.GenerateRequest, grpc_context=None):
        async with aclosing(self._stream(completion_body, "cmpl", request, grpc_context)) as messages:
            async for message in messages:
                yield message

    async def Chat(self, request: pb.ChatRequest, grpc_context=None) -> pb.GenerateResponse:
        return await self._unary(chat_body, "chatcmpl", request, grpc_context)

    async def ChatStream(self, request: pb.ChatRequest, grpc_context=None):
        async with aclosing(self._stream(chat_body, "chatcmpl", request, grpc_context)) as messages:
            async for message in messages:
                yield message

    async def Models(self, request: pb.ModelsRequest, grpc_context=None) -> pb.ModelsResponse:
        with reported(grpc_context):
            self._admit(request, grpc_context)
        return pb.ModelsResponse(models=[self.args.served_name])

    async def Health(self, request: pb.HealthRequest, grpc_context=None) -> pb.HealthResponse:
        """Open without an API key, like /healthz (probes carry none)."""
        with reported(grpc_context):
            await self.ready()
        return pb.HealthResponse(status="ok")
