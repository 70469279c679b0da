"""Fast tier for access control and request limits, without Ray: the limit checks both
transports share, how their refusals map onto HTTP and gRPC, the builder args, reading API keys,
and the HTTP guard (401 and 413 before FastAPI reads a body). tests/test_serve_access_limits.py
provokes each of them on a real cluster."""

import asyncio

import pytest
from fastapi import FastAPI, Request
from pydantic import ValidationError
from starlette.testclient import TestClient

from specserve.client import chat_request, generate_request
from specserve.protocol import SpecserveError
from specserve.serve.access import INVALID_KEY, MISSING_KEY, ApiKeys, Unauthenticated, bearer_token, load_api_keys
from specserve.serve.config import AppArgs, AuthArgs, LimitsArgs
from specserve.serve.generation import failure
from specserve.serve.grpc_api import chat_body, completion_body
from specserve.serve.http_guard import HttpPolicy, RequestGuard, read_body, route_path
from specserve.serve.limits import (
    DeadlineExceeded, LimitExceeded, check_request, check_request_bytes, check_stops, prompt_token_limit,
    resolve_max_tokens, resolve_timeout,
)

CONTEXT = 8192


def refused(call, *args, **kwargs) -> LimitExceeded:
    with pytest.raises(LimitExceeded) as err:
        call(*args, **kwargs)
    return err.value


# ---- the limits -------------------------------------------------------------------------

def test_request_size_is_refused_with_413():
    check_request_bytes(2048, 2048)
    err = refused(check_request_bytes, 2049, 2048)
    assert err.http_status == 413 and "2049 bytes" in str(err) and "2048" in str(err)


def test_prompt_tokens_default_to_the_context_less_one():
    assert prompt_token_limit(None, CONTEXT) == CONTEXT - 1
    assert prompt_token_limit(100, CONTEXT) == 100
    assert prompt_token_limit(10 ** 6, CONTEXT) == CONTEXT - 1  # never past the context
    limits = LimitsArgs()
    err = refused(check_request, limits, prompt_tokens=9000, prompt_param="prompt", max_tokens=None,
                  default_max_tokens=16, stops=[], timeout_s=None, max_context=CONTEXT)
    assert err.param == "prompt" and err.code == "context_length_exceeded" and "context is 8192" in str(err)
    err = refused(check_request, LimitsArgs(max_prompt_tokens=64), prompt_tokens=65, prompt_param="messages",
                  max_tokens=None, default_max_tokens=16, stops=[], timeout_s=None, max_context=CONTEXT)
    assert err.param == "messages" and str(err) == "the prompt has 65 tokens; at most 64 prompt tokens are accepted"


def test_max_tokens_is_capped_and_must_fit_the_context():
    assert resolve_max_tokens(None, 256, None, prompt_tokens=8000, max_context=CONTEXT) == 192  # default shortened
    assert resolve_max_tokens(None, 256, 100, prompt_tokens=10, max_context=CONTEXT) == 100
    assert resolve_max_tokens(300, 256, None, prompt_tokens=10, max_context=CONTEXT) == 300
    err = refused(resolve_max_tokens, 101, 16, 100, prompt_tokens=10, max_context=CONTEXT)
    assert err.param == "max_tokens" and str(err) == "max_tokens is 101; at most 100 are accepted"
    err = refused(resolve_max_tokens, 200, 16, None, prompt_tokens=8000, max_context=CONTEXT)
    assert err.param == "max_tokens" and err.code == "context_length_exceeded"
    assert "room for 192" in str(err) and "asks for 200" in str(err)


def test_stop_sequences_are_counted_and_measured():
    check_stops(["a"] * 8, 8, 4)
    assert refused(check_stops, ["a"] * 9, 8, 4).param == "stop"
    err = refused(check_stops, ["short", "x" * 5], 8, 4)
    assert err.param == "stop" and "5 characters; at most 4" in str(err)


def test_a_requested_deadline_may_not_exceed_the_cap():
    assert resolve_timeout(None, 600, 3600) == 600
    assert resolve_timeout(5, 600, 3600) == 5
    err = refused(resolve_timeout, 3601, 600, 3600)
    assert err.param == "timeout_s" and "at most 3600 s" in str(err)


def test_check_request_returns_what_the_limits_leave():
    checked = check_request(LimitsArgs(timeout_s=30), prompt_tokens=10, prompt_param="prompt", max_tokens=None,
                            default_max_tokens=64, stops=("\n",), timeout_s=None, max_context=CONTEXT)
    assert (checked.max_tokens, checked.timeout_s) == (64, 30)


@pytest.mark.parametrize("exc,http,code,param", [
    (LimitExceeded("too long", param="max_tokens"), 400, "INVALID_ARGUMENT", "max_tokens"),
    (LimitExceeded("too big", param=None, http_status=413, code="request_too_large"), 413, "INVALID_ARGUMENT", None),
    (Unauthenticated(INVALID_KEY), 401, "UNAUTHENTICATED", None),
    (DeadlineExceeded("late"), 408, "DEADLINE_EXCEEDED", "timeout_s"),
])
def test_refusals_map_to_one_status_per_transport(exc, http, code, param):
    import pickle

    exc = pickle.loads(pickle.dumps(exc))  # as Ray carries it from the router to the gRPC proxy
    f = failure(exc)
    assert (f.http_status, f.grpc_code, f.param, f.message) == (http, code, param, str(exc))
    if isinstance(exc, Unauthenticated):
        assert f.code == "invalid_api_key" and f.type_ == "invalid_request_error"


# ---- the builder args --------------------------------------------------------------------

def test_limits_and_auth_args_are_validated_when_the_app_is_built():
    args = AppArgs.model_validate({"target": {"model": "m"}, "speculation": {"proposer": "none"},
                                   "limits": {"max_request_bytes": "1MiB", "max_tokens": 512},
                                   "auth": {"api_key_file": "/etc/specserve/api-key"}})
    assert args.limits.max_request_bytes == 1 << 20 and args.auth.api_key_env is None
    assert AppArgs.model_validate({"target": {"model": "m"}, "speculation": {"proposer": "none"}}).auth is None
    bad = [({"limits": {"timeout_s": 100, "max_timeout_s": 10}}, "must not exceed limits.max_timeout_s"),
           ({"limits": {"max_tokens": 100}, "max_tokens_default": 256}, "must not exceed limits.max_tokens"),
           ({"limits": {"max_request_bytes": 10}}, "max_request_bytes"),
           ({"limits": {"max_prompt_tokens": 0}}, "max_prompt_tokens"),
           ({"limits": {"max_tokns": 5}}, "max_tokns"),
           ({"auth": {}}, "api_key_env or api_key_file"),
           ({"auth": {"api_key": "secret"}}, "api_key")]
    for extra, fragment in bad:
        with pytest.raises(ValidationError, match=fragment):
            AppArgs.model_validate({"target": {"model": "m"}, "speculation": {"proposer": "none"}, **extra})


def test_the_builder_refuses_an_api_key_source_that_is_not_there(tmp_path, monkeypatch):
    from specserve.serve import build_app

    monkeypatch.delenv("SPECSERVE_TEST_UNSET_KEY", raising=False)
    base = {"target": {"model": "m"}, "speculation": {"proposer": "none"}}
    with pytest.raises(SpecserveError, match="SPECSERVE_TEST_UNSET_KEY, which is unset or empty"):
        build_app({**base, "auth": {"api_key_env": "SPECSERVE_TEST_UNSET_KEY"}})
    with pytest.raises(SpecserveError, match="cannot be read"):
        build_app({**base, "auth": {"api_key_file": str(tmp_path / "missing")}})


# ---- API keys ----------------------------------------------------------------------------

def test_keys_come_from_an_env_var_and_a_secret_file(tmp_path):
    secret = tmp_path / "api-key"
    secret.write_text("new-key\nold-key\n")  # rotating: both accepted
    keys = load_api_keys(AuthArgs(api_key_env="KEY", api_key_file=str(secret)), environ={"KEY": " env-key "})
    assert keys == (b"env-key", b"new-key", b"old-key")
    with pytest.raises(SpecserveError, match="unset or empty"):
        load_api_keys(AuthArgs(api_key_env="KEY"), environ={"KEY": "  "})
    secret.write_text("\n")
    with pytest.raises(SpecserveError, match="holds no key"):
        load_api_keys(AuthArgs(api_key_file=str(secret)), environ={})


def test_bearer_tokens_are_checked_in_constant_time():
    assert bearer_token("Bearer abc") == bearer_token("bearer  abc ") == "abc"
    assert bearer_token(None) is bearer_token("") is bearer_token("Basic abc") is bearer_token("Bearer ") is None
    keys = ApiKeys([b"first", b"second"])
    keys.check("Bearer first")
    keys.check("Bearer second")
    for header, message in [(None, MISSING_KEY), ("Basic first", MISSING_KEY), ("Bearer firs", INVALID_KEY),
                            ("Bearer first ", None), ("Bearer FIRST", INVALID_KEY)]:
        if message is None:
            keys.check(header)
            continue
        with pytest.raises(Unauthenticated) as err:
            keys.check(header)
        assert str(err.value) == message


def test_a_rotated_key_file_is_read_again_without_a_restart(tmp_path):
    secret = tmp_path / "api-key"
    secret.write_text("old\n")
    now = [0.0]
    keys = ApiKeys.from_args(AuthArgs(api_key_file=str(secret)), environ={}, recheck_s=10, clock=lambda: now[0])
    keys.check("Bearer old")
    replacement = tmp_path / "api-key.new"  # as a Secret volume does it: a new file swapped in
    replacement.write_text("new\nold\n")
    replacement.replace(secret)
    with pytest.raises(Unauthenticated):
        keys.check("Bearer new")  # not looked at again yet
    now[0] = 10.0
    keys.check("Bearer new")
    keys.check("Bearer old")
    secret.write_text("new\n")  # the old key retired
    now[0] = 20.0
    with pytest.raises(Unauthenticated):
        keys.check("Bearer old")
    secret.write_text("")  # a broken update keeps the keys it had
    now[0] = 30.0
    keys.check("Bearer new")
    assert keys.keys == (b"new",)


# ---- the HTTP guard ----------------------------------------------------------------------

@pytest.fixture()
def guarded():
    app = FastAPI()
    app.add_middleware(RequestGuard, policy=lambda: HttpPolicy(ApiKeys([b"sesame"]), 1024))

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.post("/v1/echo")
    async def echo(request: Request):
        return {"bytes": len(await request.body())}

    return TestClient(app)


KEY = {"Authorization": "Bearer sesame"}


def test_the_guard_refuses_a_missing_or_wrong_key_with_openai_s_401(guarded):
    for headers in ({}, {"Authorization": "Bearer nope"}):
        r = guarded.post("/v1/echo", content=b"x" * 10, headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json() == {"error": {"message": INVALID_KEY if headers else MISSING_KEY,
                                      "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
    assert guarded.get("/healthz").json() == {"status": "ok"}  # health stays open
    assert guarded.post("/v1/echo", content=b"x" * 1024, headers=KEY).json() == {"bytes": 1024}


def test_the_guard_refuses_an_oversized_body_declared_or_streamed(guarded):
    r = guarded.post("/v1/echo", content=b"x" * 1025, headers=KEY)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large" and "1025 bytes" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: chunked
        for _ in range(3):
            yield b"x" * 400

    r = guarded.post("/v1/echo", content=chunks(), headers=KEY)
    assert r.status_code == 413 and "at most 1024 bytes" in r.json()["error"]["message"]


def test_reading_a_body_stops_at_the_limit():
    received = []

    async def endless():  # a client that never stops sending
        received.append(1)
        return {"type": "http.request", "body": b"x" * 100, "more_body": True}

    with pytest.raises(LimitExceeded):
        asyncio.run(read_body(endless, None, 1000))
    assert len(received) == 11
    with pytest.raises(LimitExceeded):  # the declared size alone: nothing read
        asyncio.run(read_body(endless, "5000", 1000))
    assert len(received) == 11


def test_route_paths_are_relative_to_the_app_s_prefix():
    assert route_path({"path": "/guarded/healthz", "root_path": "/guarded"}) == "/healthz"
    assert route_path({"path": "/healthz", "root_path": "/guarded"}) == "/healthz"
    assert route_path({"path": "/healthz", "root_path": ""}) == "/healthz"


# ---- gRPC --------------------------------------------------------------------------------

def test_a_grpc_request_s_deadline_becomes_the_body_s():
    assert completion_body(generate_request("smol", "Hi", timeout_s=2.5)).timeout_s == 2.5
    assert completion_body(generate_request("smol", "Hi")).timeout_s is None
    assert chat_body(chat_request("smol", [{"role": "user", "content": "Hi"}], timeout_s=4)).timeout_s == 4
    with pytest.raises(ValidationError, match="timeout_s"):
        completion_body(generate_request("smol", "Hi", timeout_s=-1))


def test_grpc_calls_check_the_key_in_the_metadata_and_the_message_size():
    from types import SimpleNamespace

    from specserve.serve.grpc_api import GrpcApi

    class Context:
        def __init__(self, metadata):
            self.metadata = metadata

        def invocation_metadata(self):
            return self.metadata

    api = GrpcApi()
    api.api_keys = ApiKeys([b"sesame"])
    api.args = SimpleNamespace(limits=LimitsArgs(max_request_bytes=1024))
    small, large = generate_request("smol", "Hi"), generate_request("smol", "x" * 2000)
    api._admit(small, Context([("application", "a"), ("authorization", "Bearer sesame")]))
    for metadata, message in [([], MISSING_KEY), ([("authorization", "Bearer nope")], INVALID_KEY)]:
        with pytest.raises(Unauthenticated) as err:
            api._admit(small, Context(metadata))
        assert str(err.value) == message
    with pytest.raises(LimitExceeded, match="at most 1024 bytes"):
        api._admit(large, Context([("authorization", "Bearer sesame")]))
