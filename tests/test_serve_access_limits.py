"""Integration: access control and request limits on the shared cluster, over HTTP (httpx and the
official openai client) and gRPC (specserve.client). One small app, `guarded` at /guarded: a
one-replica SmolLM2 target pool behind a router with an API key (from an environment variable
and from a file holding two keys, as while rotating) and small limits; deleted after the module."""

import uuid

import grpc
import httpx
import pytest

from conftest import BASE, GRPC_PORT, SMOL
from specserve.serve.access import INVALID_KEY, MISSING_KEY
from test_serve import pool_stats, wait_for

pytestmark = [pytest.mark.serve, pytest.mark.slow]

APP = "guarded"
URL = f"{BASE}/{APP}"
GRPC_TARGET = f"127.0.0.1:{GRPC_PORT}"
KEY_ENV = "SPECSERVE_TEST_API_KEY"
ENV_KEY = f"env-{uuid.uuid4().hex}"
FILE_KEYS = (f"new-{uuid.uuid4().hex}", f"old-{uuid.uuid4().hex}")
AUTH = {"Authorization": f"Bearer {ENV_KEY}"}
LIMITS = {"max_request_bytes": 4096, "max_prompt_tokens": 200, "max_tokens": 8000, "max_stop_sequences": 2,
          "max_stop_length": 8, "timeout_s": 60, "max_timeout_s": 120}
LONG = "Write a long essay about the sea."


@pytest.fixture(scope="module")
def guarded(cluster, tmp_path_factory, monkeypatch_module):
    """The `guarded` app; returns its target pool's handle."""
    from ray import serve

    from specserve.serve import build_app

    secret = tmp_path_factory.mktemp("secret") / "api-key"
    secret.write_text("\n".join(FILE_KEYS) + "\n")
    monkeypatch_module.setenv(KEY_ENV, ENV_KEY)  # where the app is built; the router gets it below
    pool = {"dtype": "float32", "torch_threads": 1, "ray_actor_options": {"num_cpus": 1},
            "health_check_period_s": 2, "health_check_timeout_s": 30}
    serve.run(build_app({
        "model_name": APP,
        "target": {"model": SMOL, "num_replicas": 1, **pool},
        "speculation": {"proposer": "none"},
        # Ray workers do not see variables set after ray.init: a Secret would set it on the node.
        "router": {"ray_actor_options": {"num_cpus": 0.1, "runtime_env": {"env_vars": {KEY_ENV: ENV_KEY}}}},
        "auth": {"api_key_env": KEY_ENV, "api_key_file": str(secret)},
        "limits": LIMITS,
        "max_tokens_default": 16,
    }), name=APP, route_prefix=f"/{APP}")
    yield serve.get_deployment_handle("TargetPool", APP)
    serve.delete(APP)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def grpc_client(api_key: str | None = ENV_KEY, timeout: float = 120):
    from specserve.client import Client

    return Client(GRPC_TARGET, application=APP, timeout=timeout, api_key=api_key)


def grpc_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


def cached_requests(target) -> int:
    return sum(s["requests"] for s in pool_stats(target, 8).values())


# ---- access control ----------------------------------------------------------------------

def test_health_stays_open_without_a_key(guarded):
    assert httpx.get(f"{URL}/healthz", timeout=30).json() == {"status": "ok"}
    with grpc_client(api_key=None) as client:
        assert client.health() == "ok"


def test_http_refuses_a_missing_or_wrong_key_and_accepts_each_configured_one(guarded):
    body = {"model": APP, "prompt": "Hi", "max_tokens": 2, "temperature": 0}
    for headers, message in [({}, MISSING_KEY), ({"Authorization": "Bearer nope"}, INVALID_KEY),
                             ({"Authorization": f"Basic {ENV_KEY}"}, MISSING_KEY)]:
        r = httpx.post(f"{URL}/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json() == {"error": {"message": message, "type": "invalid_request_error", "param": None,
                                      "code": "invalid_api_key"}}
    assert httpx.get(f"{URL}/v1/models", timeout=30).status_code == 401
    for key in (ENV_KEY, *FILE_KEYS):
        r = httpx.post(f"{URL}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_the_openai_client_sends_its_api_key(guarded):
    import openai

    client = openai.OpenAI(base_url=f"{URL}/v1", api_key=FILE_KEYS[1], max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [APP]
    stream = client.chat.completions.create(model=APP, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=4, temperature=0, stream=True)
    assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == "length"
    wrong = openai.OpenAI(base_url=f"{URL}/v1", api_key="wrong", max_retries=0, timeout=120)
    with pytest.raises(openai.AuthenticationError) as err:
        wrong.completions.create(model=APP, prompt="Hi", max_tokens=2)
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"


def test_grpc_refuses_a_missing_or_wrong_key_and_accepts_the_right_one(guarded):
    for api_key, message in [(None, MISSING_KEY), ("nope", INVALID_KEY)]:
        with grpc_client(api_key) as client:
            for call in (lambda: client.generate(APP, "Hi", max_tokens=2),
                         lambda: list(client.chat_stream(APP, [{"role": "user", "content": "Hi"}], max_tokens=2)),
                         client.models):
                err = grpc_error(call)
                assert (err.code(), err.details()) == (grpc.StatusCode.UNAUTHENTICATED, message)
    with grpc_client(FILE_KEYS[0]) as client:
        assert client.models() == [APP]
        assert client.generate(APP, "Hi", max_tokens=2, temperature=0).usage.completion_tokens == 2


def test_specserve_chat_sends_the_key_from_the_environment(guarded, monkeypatch, capsys):
    from specserve.cli import main

    turn = ["--model", APP, "--message", "Hi", "--max-tokens", "3"]
    monkeypatch.setenv("SPECSERVE_API_KEY", FILE_KEYS[0])
    assert main(["chat", "--grpc", GRPC_TARGET, "--application", APP, *turn]) == 0
    assert main(["chat", "--http", URL, *turn]) == 0
    monkeypatch.delenv("SPECSERVE_API_KEY")
    capsys.readouterr()
    assert main(["chat", "--grpc", GRPC_TARGET, "--application", APP, *turn]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err


# ---- limits: each provoked on both transports ---------------------------------------------

@pytest.mark.parametrize("prompt,fields,status,param,fragment", [
    ("x" * 5000, {}, 413, None, "at most 4096 bytes"),
    ([42] * 201, {}, 400, "prompt", "at most 200 prompt tokens"),
    ("Hi", {"max_tokens": 8001}, 400, "max_tokens", "at most 8000"),
    ([42] * 199, {"max_tokens": 8000}, 400, "max_tokens", "context is 8192 tokens"),
    ("Hi", {"stop": ["a", "b", "c"]}, 400, "stop", "at most 2"),
    ("Hi", {"stop": ["x" * 9]}, 400, "stop", "9 characters; at most 8"),
    ("Hi", {"timeout_s": 121}, 400, "timeout_s", "at most 120 s"),
], ids=["body", "prompt", "max_tokens", "context", "stop-count", "stop-length", "timeout"])
def test_each_limit_is_a_clear_refusal_on_both_transports(guarded, prompt, fields, status, param, fragment):
    r = httpx.post(f"{URL}/v1/completions", headers=AUTH, timeout=60,
                   json={"model": APP, "prompt": prompt, **fields})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and fragment in error["message"] and error["type"] == "invalid_request_error"
    with grpc_client() as client:
        for call in (lambda: client.generate(APP, prompt, **fields),
                     lambda: list(client.generate_stream(APP, prompt, **fields))):
            err = grpc_error(call)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and fragment in err.details()
            if status == 400:
                assert err.details() == error["message"]


def test_a_chunked_body_is_refused_once_it_passes_the_limit(guarded):
    def chunks():  # no Content-Length: the router counts what arrives
        yield b'{"model": "guarded", "prompt": "'
        for _ in range(64):
            yield b"x" * 1024
        yield b'"}'

    r = httpx.post(f"{URL}/v1/completions", headers={**AUTH, "content-type": "application/json"}, content=chunks(),
                   timeout=60)
    assert r.status_code == 413 and "at most 4096 bytes" in r.json()["error"]["message"]


def test_chat_prompt_limit_names_messages(guarded):
    messages = [{"role": "user", "content": " hello" * 250}]
    r = httpx.post(f"{URL}/v1/chat/completions", headers=AUTH, timeout=60,
                   json={"model": APP, "messages": messages})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    with grpc_client() as client:
        err = grpc_error(lambda: client.chat(APP, messages))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details() == r.json()["error"]["message"]


def test_a_request_without_max_tokens_gets_the_default(guarded):
    r = httpx.post(f"{URL}/v1/completions", headers=AUTH, timeout=120,
                   json={"model": APP, "prompt": "Hi", "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16  # max_tokens_default


# ---- the deadline ------------------------------------------------------------------------

def test_a_request_past_its_deadline_stops_and_frees_its_caches(guarded):
    import openai

    body = {"model": APP, "prompt": LONG, "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "timeout_s": 1}
    assert wait_for(lambda: cached_requests(guarded) == 0)

    r = httpx.post(f"{URL}/v1/completions", headers=AUTH, json=body, timeout=60)
    assert r.status_code == 408, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"], error["type"]) == ("deadline_exceeded", "timeout_s", "timeout_error")
    assert "deadline of 1 s" in error["message"]
    assert wait_for(lambda: cached_requests(guarded) == 0, timeout=30)

    with httpx.stream("POST", f"{URL}/v1/completions", headers=AUTH, json={**body, "stream": True}, timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "[DONE]" and '"deadline_exceeded"' in events[-2]
    assert len(events) > 3  # tokens streamed before the deadline
    client = openai.OpenAI(base_url=f"{URL}/v1", api_key=ENV_KEY, max_retries=0, timeout=60)
    with pytest.raises(openai.APIError, match="deadline"):
        for _ in client.completions.create(model=APP, prompt=LONG, max_tokens=4000, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True, "timeout_s": 1}):
            pass
    assert wait_for(lambda: cached_requests(guarded) == 0, timeout=30)

    with grpc_client() as grpc_api:
        kwargs = {"max_tokens": 4000, "temperature": 0, "ignore_eos": True, "timeout_s": 1}
        for call in (lambda: grpc_api.generate(APP, LONG, **kwargs),
                     lambda: list(grpc_api.generate_stream(APP, LONG, **kwargs))):
            err = grpc_error(call)
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "deadline of 1 s" in err.details()
    assert wait_for(lambda: cached_requests(guarded) == 0, timeout=30)


def test_the_deadline_frees_the_caches_in_both_pools(app):
    """On the tier's main app (default limits, a draft pool): a stream's own timeout_s."""
    def cached() -> int:
        return sum(s["requests"] for pool in app for s in pool_stats(pool).values())

    assert wait_for(lambda: cached() == 0)
    # 8 s: the app drafts ahead (conftest), which on two shared cores slows its rounds
    body = {"model": "smol", "prompt": LONG, "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
            "stream": True, "timeout_s": 8}
    # The first rounds run target-only while the draft pool catches up on the prompt in the
    # background (RequestState.prefill_without_draft), so the draft pool's cache appears a few
    # events in, however fast those rounds are: look at each event until both pools hold it.
    held_in_both = False
    with httpx.stream("POST", f"{BASE}/v1/completions", json=body, timeout=60) as r:
        events = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if not held_in_both and events[-1] != "[DONE]":
                    held_in_both = cached() >= 2  # the request's caches in the target pool and the draft pool
    assert held_in_both
    assert events[-1] == "[DONE]" and '"deadline_exceeded"' in events[-2]
    assert wait_for(lambda: cached() == 0, timeout=30)
