"""Fuzzing in CI, bounded: the HTTP API with schemathesis from its own OpenAPI schema and the
gRPC API with hypothesis-built messages, against the tier's main app (conftest's `app`). No
generated input may get a server error (HTTP 5xx; gRPC INTERNAL, UNKNOWN or any status the API
does not document) or go unanswered for a minute. `python -m specserve.benchmarks.fuzz
--minutes N` is the long run of the same checks.
"""

import httpx
import pytest

from conftest import BASE, GRPC_PORT
from specserve.benchmarks import fuzz

pytestmark = [pytest.mark.serve, pytest.mark.slow]

EXAMPLES = 60  # per API: about half a minute each on 2 cores


def test_http_api_fuzzed_from_its_openapi_schema(app):
    tally = fuzz.fuzz_http(BASE, "smol", EXAMPLES, timeout_s=60)
    print(tally.as_dict())
    assert tally.sent >= EXAMPLES
    assert tally.server_errors == [] and tally.hangs == []
    assert any(status == 200 for status in tally.statuses)  # some inputs got through to generation
    assert any(isinstance(status, int) and 400 <= status < 500 for status in tally.statuses)


def test_grpc_api_fuzzed_with_generated_messages(app):
    tally = fuzz.fuzz_grpc(f"127.0.0.1:{GRPC_PORT}", "smol", EXAMPLES, application="specserve", timeout_s=60)
    print(tally.as_dict())
    assert tally.sent >= EXAMPLES
    assert tally.server_errors == [] and tally.hangs == []
    assert tally.statuses["OK"] > 0 and tally.statuses["INVALID_ARGUMENT"] > 0


def test_the_fuzzers_own_bound_on_generation():
    """The one thing the fuzzer changes in a generated input: how much the served model may
    generate (a valid long generation is not a hang)."""
    assert fuzz.bound_generation({"model": "smol", "max_tokens": 10 ** 9}, "smol") == {"model": "smol", "max_tokens": 8}
    assert fuzz.bound_generation({"model": "smol"}, "smol") == {"model": "smol", "max_tokens": 8}
    assert fuzz.bound_generation({"model": "smol", "max_tokens": -3}, "smol")["max_tokens"] == -3
    assert fuzz.bound_generation({"model": "other", "max_tokens": 10 ** 9}, "smol")["max_tokens"] == 10 ** 9
    assert fuzz.bound_generation(b"\x00", "smol") == b"\x00"


@pytest.mark.parametrize("content", [[{"type": "image_url", "image_url": {"url": "x"}}], [{}], [{"type": "text", "text": 5}]])
def test_chat_content_parts_other_than_text_are_a_400(app, content):
    """Found by the HTTP fuzzer: such a part got past validation and failed in the route (500)."""
    r = httpx.post(f"{BASE}/v1/chat/completions", timeout=60,
                   json={"model": "smol", "messages": [{"role": "user", "content": content}], "max_tokens": 2})
    assert r.status_code == 400 and "content" in r.json()["error"]["message"]
