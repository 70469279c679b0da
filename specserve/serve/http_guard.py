"""The HTTP side of access control and the body-size limit: an ASGI middleware in front of the
OpenAI routes. It runs before FastAPI reads the body, so a request without a valid API key is
refused unread (401) and an oversized one after at most `max_request_bytes` (413), whether it
declares its size (Content-Length) or streams it (chunked). Health checks stay open.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from specserve.serve.access import ApiKeys, Unauthenticated
from specserve.serve.generation import failure
from specserve.serve.limits import LimitExceeded, check_request_bytes
from specserve.serve.openai_api import error_body

OPEN_PATHS = frozenset({"/healthz"})  # load balancers and Kubernetes probes carry no key
BODYLESS_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


@dataclass(frozen=True)
class HttpPolicy:
    api_keys: ApiKeys | None  # None: no key needed
    max_request_bytes: int


class ClientGone(Exception):
    """The client disconnected before sending its whole body."""


def route_path(scope: dict) -> str:
    """The path below the app's route prefix ("/healthz" for "/starting/healthz" at "/starting")."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] or "/" if root and path.startswith(root) else path


async def read_body(receive, declared: str | None, limit: int) -> bytes:
    """The request body, refused (LimitExceeded) as soon as it is known to be over `limit`:
    from its Content-Length before reading, or while it streams in."""
    if declared is not None and declared.strip().isdigit():
        check_request_bytes(int(declared), limit)
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        check_request_bytes(size, limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def replaying(body: bytes, receive):
    """A `receive` that hands the app the body already read, then the client's later messages
    (a streaming response listens for the disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive_again():
        return pending.pop() if pending else await receive()

    return receive_again


def refusal(exc: Exception) -> JSONResponse:
    f = failure(exc)
    headers = {"WWW-Authenticate": "Bearer"} if f.http_status == 401 else None
    return JSONResponse(error_body(f.message, type_=f.type_, param=f.param, code=f.code),
                        status_code=f.http_status, headers=headers)


class RequestGuard:
    """ASGI middleware; `policy()` gives the serving replica's HttpPolicy (None: let all in)."""

    def __init__(self, app, policy: Callable[[], HttpPolicy | None]):
        self.app = app
        self.policy = policy

    async def __call__(self, scope, receive, send) -> None:
        policy = self.policy() if scope["type"] == "http" else None
        if policy is None:
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        try:
            if policy.api_keys is not None and route_path(scope) not in OPEN_PATHS:
                policy.api_keys.check(headers.get("authorization"))
            if scope["method"] not in BODYLESS_METHODS:
                body = await read_body(receive, headers.get("content-length"), policy.max_request_bytes)
                receive = replaying(body, receive)
        except (Unauthenticated, LimitExceeded) as exc:
            return await refusal(exc)(scope, receive, send)
        except ClientGone:
            return None
        await self.app(scope, receive, send)
