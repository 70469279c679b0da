"""The transport-agnostic core of a request: the deltas HTTP SSE and gRPC both stream, the
text that is safe to show so far, and how each failure maps onto each transport's status.

Torch-free and grpc-free: the router drives `Router.generate(state)` and the HTTP and gRPC
adapters only format its deltas and map its failures with `failure(exc)`.
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.protocol import SpecserveError
from specserve.serve.access import Unauthenticated
from specserve.serve.limits import DeadlineExceeded, LimitExceeded


class ModelNotFound(Exception):
    """The request names a model this deployment does not serve."""


class NotReady(Exception):
    """The pools have not answered yet (their models are loading)."""


@dataclass(frozen=True)
class Delta:
    """One step of a generation: the tokens a round emitted and the text they make visible.
    The last delta has `finish_reason` and `usage` (token counts and speculation stats)."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    usage: dict | None = None


class TextStream:
    """Turns the growing output into text deltas that never end inside a multi-byte character
    and never show the beginning of a stop sequence that may still complete."""

    def __init__(self, stops: tuple[str, ...]):
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.sent = 0

    def delta(self, text: str, final: bool) -> str:
        end = len(text)
        if not final:
            end = len(text.rstrip("\ufffd")) - self.hold
        if end <= self.sent:
            return ""
        out = text[self.sent:end]
        self.sent = end
        return out


@dataclass(frozen=True)
class Failure:
    """A refused request as both transports report it: the same message under an HTTP status
    (OpenAI error body fields) and a gRPC status code name (grpc.StatusCode member)."""

    http_status: int
    grpc_code: str
    message: str
    type_: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None


def validation_message(errors: list[dict]) -> str:
    """pydantic's errors as one line: 'max_tokens: Input should be greater than or equal to 1'."""
    problems = []
    for err in errors:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        problems.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "; ".join(problems) or "invalid request"


def failure(exc: BaseException) -> Failure | None:
    """How a transport reports `exc`, or None for an unexpected error (a server error)."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        return Failure(400, "INVALID_ARGUMENT", validation_message(exc.errors()))
    if isinstance(exc, LimitExceeded):  # before SpecserveError, which it is
        return Failure(exc.http_status, "INVALID_ARGUMENT", str(exc), code=exc.code, param=exc.param)
    if isinstance(exc, Unauthenticated):
        return Failure(401, "UNAUTHENTICATED", str(exc), code="invalid_api_key")
    if isinstance(exc, DeadlineExceeded):
        return Failure(408, "DEADLINE_EXCEEDED", str(exc), type_="timeout_error", code="deadline_exceeded",
                       param="timeout_s")
    if isinstance(exc, SpecserveError):
        return Failure(400, "INVALID_ARGUMENT", str(exc))
    if isinstance(exc, ModelNotFound):
        return Failure(404, "NOT_FOUND", str(exc), code="model_not_found", param="model")
    if isinstance(exc, NotReady):
        return Failure(503, "UNAVAILABLE", str(exc), type_="server_error")
    return None


@dataclass
class OutputCursor:
    """What of a request's output the client has been sent: token ids and text."""

    text: TextStream
    ids_sent: int = 0

    def advance(self, output_ids: list[int], text: str, final: bool) -> tuple[list[int], str]:
        """The new token ids and text delta. A matched stop string cuts `output_ids` only in the
        round that completes it, after every earlier id was sent, so ids never go back."""
        new_ids = output_ids[self.ids_sent:]
        self.ids_sent = len(output_ids)
        return new_ids, self.text.delta(text, final)
