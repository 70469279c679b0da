"""specserve's gRPC client, sync and async: a thin layer over the generated stub that builds
requests from keyword arguments and names the Serve application in the call metadata.

    from specserve.client import Client
    with Client("localhost:9000") as client:
        reply = client.generate("smol", "The capital of France is", max_tokens=16, temperature=0)
        for delta in client.chat_stream("smol", [{"role": "user", "content": "Hi"}]):
            print(delta.text, end="")

`api_key` sends `authorization: Bearer <key>` with every call (deployments with `auth:`), and
`timeout_s=` asks the server for a deadline of its own (up to the deployment's cap).
`resumes=N` on a stream survives the loss of the router replica that carried it: when the stream
breaks (UNAVAILABLE, UNKNOWN or INTERNAL) the request is sent again with the token ids already
received (`resume_token_ids`), up to N times, and the caller sees one unbroken stream; greedy, it
is the stream an unbroken call would have given.
Errors arrive as grpc.RpcError with the server's status code (INVALID_ARGUMENT, NOT_FOUND,
RESOURCE_EXHAUSTED, UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED, UNAUTHENTICATED).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator

import grpc

from specserve.grpc import specserve_pb2 as pb
from specserve.grpc import specserve_pb2_grpc as pb_grpc

_SAMPLING = ("temperature", "top_p", "top_k", "max_tokens", "seed", "stop", "ignore_eos")
_TREE_SHAPE = "shape"


def sampling(**kwargs) -> pb.SamplingParams:
    """SamplingParams from keyword arguments; None leaves a field unset (the server's default)."""
    unknown = set(kwargs) - set(_SAMPLING)
    if unknown:
        raise TypeError(f"unknown sampling parameters: {sorted(unknown)}")
    fields = {k: v for k, v in kwargs.items() if v is not None}
    if isinstance(fields.get("stop"), str):
        fields["stop"] = [fields["stop"]]
    return pb.SamplingParams(**fields)


def speculation(override: dict | None) -> pb.SpeculationOverride | None:
    """The HTTP API's `speculation` object as a SpeculationOverride, e.g. {"proposer": "none"}
    or {"shape": "tree", "tree": {"budget": 8, "shape": [[0], [1]]}}."""
    if override is None:
        return None
    fields = dict(override)
    tree = fields.pop("tree", None)
    message = pb.SpeculationOverride(**fields)
    if tree is not None:
        tree = dict(tree)
        paths = [pb.TreePath(ranks=p) for p in tree.pop(_TREE_SHAPE, None) or []]
        message.tree.CopyFrom(pb.TreeOverride(shape=paths, **tree))
    return message


def generate_request(model: str, prompt: str | list[int], spec: dict | None = None, timeout_s: float | None = None,
                     **params) -> pb.GenerateRequest:
    request = pb.GenerateRequest(model=model, sampling=sampling(**params), speculation=speculation(spec),
                                 timeout_s=timeout_s)
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.prompt_token_ids.extend(prompt)
    return request


def chat_request(model: str, messages: list[dict], spec: dict | None = None, timeout_s: float | None = None,
                 **params) -> pb.ChatRequest:
    return pb.ChatRequest(model=model, messages=[pb.ChatMessage(**m) for m in messages],
                          sampling=sampling(**params), speculation=speculation(spec), timeout_s=timeout_s)


# How a stream breaks when the router replica carrying it dies (or the proxy cannot reach one
# yet); refusals (INVALID_ARGUMENT, NOT_FOUND, ...) and the caller's own deadline or
# cancellation are never resumed.
RESUMABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL})


class ResumingStream:
    """A server stream that resumes where it broke: see the module's `resumes=`. Iterate it for
    the deltas; `cancel()` ends it; `resumed` counts the resumptions so far."""

    def __init__(self, start: Callable, request, resumes: int, wait_s: float = 1.0):
        self._start, self.request, self.resumes, self.wait_s = start, request, resumes, wait_s
        self.resumed = 0
        self._call = None
        self._cancelled = False

    def _resume_or_raise(self, err: grpc.RpcError, received: list[int]) -> None:
        if self._cancelled or err.code() not in RESUMABLE or self.resumed >= self.resumes:
            raise err
        self.resumed += 1
        del self.request.resume_token_ids[:]
        self.request.resume_token_ids.extend(received)

    def __iter__(self) -> Iterator[pb.GenerateResponse]:
        received: list[int] = []
        while True:
            self._call = self._start(self.request)
            try:
                for message in self._call:
                    received.extend(message.token_ids)
                    yield message
                return
            except grpc.RpcError as err:
                self._resume_or_raise(err, received)
            time.sleep(self.wait_s)  # Serve notices the dead replica and routes to another

    def __aiter__(self) -> AsyncIterator[pb.GenerateResponse]:
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[pb.GenerateResponse]:
        received: list[int] = []
        while True:
            self._call = self._start(self.request)
            try:
                async for message in self._call:
                    received.extend(message.token_ids)
                    yield message
                return
            except grpc.RpcError as err:
                self._resume_or_raise(err, received)
            await asyncio.sleep(self.wait_s)

    def cancel(self) -> None:
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()


def _metadata(application: str | None, api_key: str | None = None) -> tuple:
    return ((("application", application),) if application else ()) + (
        (("authorization", f"Bearer {api_key}"),) if api_key else ())


class Client:
    """Blocking client. `application`: the Serve app's name, needed when a cluster runs several.
    `timeout`: seconds per call (the gRPC deadline), None for none. `api_key`: the deployment's
    API key, if it has one."""

    def __init__(self, target: str = "localhost:9000", *, application: str | None = None,
                 timeout: float | None = None, api_key: str | None = None):
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.SpecserveStub(self.channel)
        self.call = {"metadata": _metadata(application, api_key), "timeout": timeout}

    def generate(self, model: str, prompt: str | list[int], *, speculation: dict | None = None,
                 **params) -> pb.GenerateResponse:
        return self.stub.Generate(generate_request(model, prompt, speculation, **params), **self.call)

    def generate_stream(self, model: str, prompt: str | list[int], *, speculation: dict | None = None,
                        resumes: int = 0, **params) -> Iterator[pb.GenerateResponse]:
        """The deltas; the returned iterator is also the call (`.cancel()` ends it)."""
        return self._stream(self.stub.GenerateStream, generate_request(model, prompt, speculation, **params), resumes)

    def chat(self, model: str, messages: list[dict], *, speculation: dict | None = None,
             **params) -> pb.GenerateResponse:
        return self.stub.Chat(chat_request(model, messages, speculation, **params), **self.call)

    def chat_stream(self, model: str, messages: list[dict], *, speculation: dict | None = None,
                    resumes: int = 0, **params) -> Iterator[pb.GenerateResponse]:
        return self._stream(self.stub.ChatStream, chat_request(model, messages, speculation, **params), resumes)

    def _stream(self, method, request, resumes: int):
        if not resumes:
            return method(request, **self.call)
        return ResumingStream(lambda r: method(r, **self.call), request, resumes)

    def models(self) -> list[str]:
        return list(self.stub.Models(pb.ModelsRequest(), **self.call).models)

    def health(self) -> str:
        return self.stub.Health(pb.HealthRequest(), **self.call).status

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """The same calls for asyncio (grpc.aio); streams are async iterators."""

    def __init__(self, target: str = "localhost:9000", *, application: str | None = None,
                 timeout: float | None = None, api_key: str | None = None):
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = pb_grpc.SpecserveStub(self.channel)
        self.call = {"metadata": _metadata(application, api_key), "timeout": timeout}

    async def generate(self, model: str, prompt: str | list[int], *, speculation: dict | None = None,
                       **params) -> pb.GenerateResponse:
        return await self.stub.Generate(generate_request(model, prompt, speculation, **params), **self.call)

    def generate_stream(self, model: str, prompt: str | list[int], *, speculation: dict | None = None,
                        resumes: int = 0, **params) -> AsyncIterator[pb.GenerateResponse]:
        return self._stream(self.stub.GenerateStream, generate_request(model, prompt, speculation, **params), resumes)

    async def chat(self, model: str, messages: list[dict], *, speculation: dict | None = None,
                   **params) -> pb.GenerateResponse:
        return await self.stub.Chat(chat_request(model, messages, speculation, **params), **self.call)

    def chat_stream(self, model: str, messages: list[dict], *, speculation: dict | None = None,
                    resumes: int = 0, **params) -> AsyncIterator[pb.GenerateResponse]:
        return self._stream(self.stub.ChatStream, chat_request(model, messages, speculation, **params), resumes)

    _stream = Client._stream

    async def models(self) -> list[str]:
        return list((await self.stub.Models(pb.ModelsRequest(), **self.call)).models)

    async def health(self) -> str:
        return (await self.stub.Health(pb.HealthRequest(), **self.call)).status

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
