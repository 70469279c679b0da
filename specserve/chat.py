"""`specserve chat`: talk to a running server over gRPC (default) or HTTP, streaming the reply.

Both transports take the same conversation and sampling parameters and yield text deltas, so
the chat loop does not care which one carries them. With SPECSERVE_API_KEY set, both send it
(`Authorization: Bearer <key>`) for deployments with an API key.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

StreamReply = Callable[[str, list[dict], dict], Iterator[str]]  # (model, messages, params) -> text deltas
API_KEY_ENV = "SPECSERVE_API_KEY"


def api_key() -> str | None:
    return os.environ.get(API_KEY_ENV) or None


def grpc_stream(target: str, application: str | None) -> tuple[StreamReply, Callable[[], list[str]]]:
    from specserve.client import Client

    client = Client(target, application=application, api_key=api_key())

    def reply(model: str, messages: list[dict], params: dict) -> Iterator[str]:
        for delta in client.chat_stream(model, messages, resumes=3, **params):  # survives a lost router
            yield delta.text

    return reply, client.models


def http_stream(base: str) -> tuple[StreamReply, Callable[[], list[str]]]:
    """The OpenAI-compatible API with the standard library (SSE lines `data: {...}`)."""
    base = base.rstrip("/")
    key = api_key()
    auth = {"authorization": f"Bearer {key}"} if key else {}

    def reply(model: str, messages: list[dict], params: dict) -> Iterator[str]:
        body = json.dumps({"model": model, "messages": messages, "stream": True, **params}).encode()
        request = urllib.request.Request(f"{base}/v1/chat/completions", body,
                                         {"content-type": "application/json", **auth})
        with urllib.request.urlopen(request) as response:
            for line in response:
                data = line.decode().strip().removeprefix("data: ")
                if not data or data == "[DONE]":
                    continue
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(event["error"]["message"])
                for choice in event["choices"]:
                    yield choice["delta"].get("content") or ""

    def models() -> list[str]:
        with urllib.request.urlopen(urllib.request.Request(f"{base}/v1/models", headers=auth)) as response:
            return [m["id"] for m in json.load(response)["data"]]

    return reply, models


def chat(reply: StreamReply, model: str, params: dict, turns: Iterator[str], out=None) -> list[dict]:
    """Each user turn is answered in the conversation so far; returns the conversation."""
    out = out if out is not None else sys.stdout  # looked up per call: sys.stdout may be swapped
    messages: list[dict] = []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        parts = []
        for text in reply(model, messages, params):
            parts.append(text)
            out.write(text)
            out.flush()
        out.write("\n")
        messages.append({"role": "assistant", "content": "".join(parts)})
    return messages


def prompts(stdin=sys.stdin) -> Iterator[str]:
    """Interactive turns until an empty line or end of input."""
    while True:
        if stdin.isatty():
            print("> ", end="", flush=True)
        line = stdin.readline()
        if not line.strip():
            return
        yield line.strip()


def http_error_message(exc: urllib.error.HTTPError) -> str:
    try:
        return json.load(exc)["error"]["message"]
    except Exception:
        return str(exc)
