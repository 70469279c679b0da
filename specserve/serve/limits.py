"""Request limits, checked once for both transports: the router's `start` calls `check_request`,
the HTTP body guard and the gRPC adapter call `check_request_bytes`, and `generate` stops a
request at its deadline (`DeadlineExceeded`). Pure functions; torch-free and Serve-free.

A refusal is a `LimitExceeded`: a SpecserveError that also names the request field it concerns
(`param`, as OpenAI's error bodies do) and its HTTP status (400, or 413 for the body's size);
gRPC reports it as INVALID_ARGUMENT with the same message.
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.protocol import SpecserveError


class LimitExceeded(SpecserveError):
    """A request over one of the deployment's limits (`limits:` in the app args)."""

    # Pickled across Ray (the gRPC proxy gets the replica's exception): BaseException's pickling
    # calls cls(message) and then restores the attributes, so every one of them needs a default.
    def __init__(self, message: str, *, param: str | None = None, http_status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.http_status = http_status
        self.code = code


class DeadlineExceeded(Exception):
    """The request ran past its deadline while generating; it was stopped and its caches freed."""


@dataclass(frozen=True)
class Checked:
    """What the limits leave of a request: its max_tokens and its deadline in seconds."""

    max_tokens: int
    timeout_s: float


def check_request_bytes(size: int, limit: int) -> None:
    """Refuse a request body (HTTP) or message (gRPC) of `size` bytes over `limit` (413)."""
    if size > limit:
        raise LimitExceeded(f"the request is {size} bytes; at most {limit} bytes are accepted",
                            param=None, http_status=413, code="request_too_large")


def prompt_token_limit(configured: int | None, max_context: int) -> int:
    """The most prompt tokens a request may have: the configured limit, and always one fewer
    than the context so that at least one token can be generated."""
    room = max_context - 1
    return room if configured is None else min(configured, room)


def check_prompt_tokens(count: int, limit: int, max_context: int, param: str) -> None:
    if count > limit:
        why = (f"this model's context is {max_context} tokens, so a prompt may have at most {limit}"
               if limit == max_context - 1 else f"at most {limit} prompt tokens are accepted")
        raise LimitExceeded(f"the prompt has {count} tokens; {why}", param=param, code="context_length_exceeded")


def resolve_max_tokens(requested: int | None, default: int, cap: int | None, prompt_tokens: int,
                       max_context: int) -> int:
    """The request's max_tokens: the one it asked for, refused over `cap` or past the context;
    or the deployment's default, shortened to the room the context leaves (never refused).

    >>> resolve_max_tokens(None, 256, None, prompt_tokens=8000, max_context=8192)
    192
    """
    room = max_context - prompt_tokens
    if requested is None:
        return max(1, min(default, room, cap if cap is not None else default))
    if cap is not None and requested > cap:
        raise LimitExceeded(f"max_tokens is {requested}; at most {cap} are accepted", param="max_tokens")
    if requested > room:
        raise LimitExceeded(
            f"this model's context is {max_context} tokens: the prompt has {prompt_tokens}, which leaves room for "
            f"{room} more, but max_tokens asks for {requested}", param="max_tokens", code="context_length_exceeded")
    return requested


def check_stops(stops: tuple[str, ...] | list[str], max_count: int, max_length: int) -> None:
    if len(stops) > max_count:
        raise LimitExceeded(f"{len(stops)} stop sequences given; at most {max_count} are accepted", param="stop")
    longest = max((len(s) for s in stops), default=0)
    if longest > max_length:
        raise LimitExceeded(f"a stop sequence has {longest} characters; at most {max_length} are accepted",
                            param="stop")


def resolve_timeout(requested: float | None, default: float, cap: float) -> float:
    """The request's deadline in seconds: its own `timeout_s` (at most `cap`), else the default."""
    if requested is None:
        return default
    if requested > cap:
        raise LimitExceeded(f"timeout_s is {requested:g} s; at most {cap:g} s are accepted", param="timeout_s")
    return requested


def check_request(limits, *, prompt_tokens: int, prompt_param: str, max_tokens: int | None,
                  default_max_tokens: int, stops, timeout_s: float | None, max_context: int) -> Checked:
    """Every per-request limit of `limits` (LimitsArgs) in one place, for both transports."""
    check_prompt_tokens(prompt_tokens, prompt_token_limit(limits.max_prompt_tokens, max_context), max_context,
                        prompt_param)
    check_stops(tuple(stops or ()), limits.max_stop_sequences, limits.max_stop_length)
    return Checked(
        max_tokens=resolve_max_tokens(max_tokens, default_max_tokens, limits.max_tokens, prompt_tokens, max_context),
        timeout_s=resolve_timeout(timeout_s, limits.timeout_s, limits.max_timeout_s),
    )


def deadline_message(timeout_s: float, emitted: int) -> str:
    return (f"the request ran past its deadline of {timeout_s:g} s after {emitted} generated tokens and was "
            "stopped; ask for fewer tokens or a longer timeout_s")
