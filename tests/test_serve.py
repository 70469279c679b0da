"""Integration: a real Ray cluster serving SmolLM2-135M (fp32) through specserve's pools and router,
called with the official `openai` client and raw HTTP. One cluster and one app for the session
(conftest's `app`, which tests/test_grpc.py calls over gRPC too).

The target pool has two replicas so that killing one leaves another; the draft is SmolLM2's
first 27 layers (same vocabulary, agrees often but not always).
"""

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import pytest

from conftest import BASE

pytestmark = [pytest.mark.serve, pytest.mark.slow]


@pytest.fixture(scope="session")
def client(app):
    from openai import OpenAI

    return OpenAI(base_url=f"{BASE}/v1", api_key="unused", max_retries=0, timeout=300)


def pool_stats(handle, calls: int = 16) -> dict[str, dict]:
    """Stats of every replica of a pool (stats calls land on uniformly random replicas)."""
    seen = {}
    for _ in range(calls):
        try:
            s = handle.stats.remote().result(timeout_s=10)
        except Exception:  # a replica that just died, before this handle heard of it
            continue
        seen[s["replica"]] = s
    return seen


def wait_for(condition, timeout=60, interval=0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return False


PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "1, 2, 3, 4,"]


def test_models_and_health(client):
    assert [m.id for m in client.models.list().data] == ["smol"]
    assert httpx.get(f"{BASE}/healthz").json() == {"status": "ok"}


def test_completions_greedy_equal_the_target_alone(client, reference):
    tokenizer, _, greedy_text, _ = reference
    for prompt in PROMPTS[:2]:
        r = client.completions.create(model="smol", prompt=prompt, max_tokens=40, temperature=0)
        expected = greedy_text.ids(tokenizer.encode(prompt), 40)
        assert r.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
        assert r.usage.completion_tokens == len(expected)
        assert r.choices[0].finish_reason == ("length" if len(expected) == 40 else "stop")
        spec = r.usage.model_extra["speculation"]
        assert spec["num_draft_tokens"] > 0 and spec["mean_accepted_length"] > 1
        # the app drafts ahead (conftest): greedy rounds whose chain and guess held started with a draft in hand
        assert 0 < spec["drafts_ahead_used"] <= spec["drafts_ahead"]


def test_chat_completions_greedy_stream_and_not(client, reference):
    _, _, greedy_text, chat_ids = reference
    question = "Name three colors."
    expected = greedy_text(chat_ids(question), 48)
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": question}],
                                       max_tokens=48, temperature=0)
    assert r.choices[0].message.content == expected
    stream = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": question}],
                                            max_tokens=48, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason


def test_raw_sse_ends_with_done(app):
    with httpx.stream("POST", f"{BASE}/v1/completions", timeout=120, json={
            "model": "smol", "prompt": "Hello", "max_tokens": 8, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_per_request_speculation_override(client, reference):
    tokenizer, _, greedy_text, _ = reference
    r = client.completions.create(model="smol", prompt=PROMPTS[2], max_tokens=24, temperature=0,
                                  extra_body={"speculation": {"method": "none"}})
    assert r.choices[0].text == greedy_text(tokenizer.encode(PROMPTS[2]), 24)
    assert r.usage.model_extra["speculation"]["num_draft_tokens"] == 0


def test_pipelined_requests_equal_the_target_alone(client, reference):
    """speculation.pipeline per request: the draft pool streams its greedy draft (a Serve
    streaming call; the torch engine drafts it 4 tokens a call) and the router verifies up to 3
    chunks at once; a rejected token starts a new stream. Streaming and not."""
    tokenizer, _, greedy_text, _ = reference
    for prompt in PROMPTS[:2]:
        expected = greedy_text(tokenizer.encode(prompt), 48)
        r = client.completions.create(model="smol", prompt=prompt, max_tokens=48, temperature=0,
                                      extra_body={"speculation": {"pipeline": 3}})
        assert r.choices[0].text == expected
        spec = r.usage.model_extra["speculation"]
        assert spec["draft_streams"] >= 1 and spec["num_accepted_tokens"] > 0 and spec["policy"] == "fixed"
        stream = client.completions.create(model="smol", prompt=prompt, max_tokens=48, temperature=0, stream=True,
                                           extra_body={"speculation": {"pipeline": 3}})
        assert "".join(c.choices[0].text for c in stream) == expected


def test_tree_speculation_per_request_equals_the_target_alone(client, reference):
    """method "tree" through the router and the pools, streaming and not, with the
    deployment's tree settings and with a request's own (a static shape)."""
    tokenizer, _, greedy_text, _ = reference
    expected = greedy_text(tokenizer.encode(PROMPTS[1]), 40)
    for tree in ({}, {"budget": 6, "depth": 3}, {"shape": [[0], [1], [0, 0], [1, 0], [0, 0, 0]]}):
        speculation = {"method": "tree", **({"tree": tree} if tree else {})}
        r = client.completions.create(model="smol", prompt=PROMPTS[1], max_tokens=40, temperature=0,
                                      extra_body={"speculation": speculation})
        assert r.choices[0].text == expected
        spec = r.usage.model_extra["speculation"]
        assert spec["num_draft_tokens"] > 0 and spec["mean_accepted_length"] > 1
        assert sum(spec["num_reached_tokens_per_rank"][1:]) > 0  # real trees: second-ranked drafts
        stream = client.completions.create(model="smol", prompt=PROMPTS[1], max_tokens=40, temperature=0,
                                           stream=True, extra_body={"speculation": speculation})
        assert "".join(c.choices[0].text for c in stream) == expected


def test_ngram_prompt_lookup_equals_the_target_alone(client, reference):
    """Proposer `ngram`: drafted in the router from the request's own tokens (no pool call),
    chain and tree, streaming and not."""
    tokenizer, _, greedy_text, _ = reference
    prompt = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
    expected = greedy_text(tokenizer.encode(prompt), 40)
    for speculation in ({"proposer": "ngram", "k": 4}, {"proposer": "ngram", "shape": "tree",
                                                         "tree": {"budget": 8, "depth": 4, "width": 2}}):
        r = client.completions.create(model="smol", prompt=prompt, max_tokens=40, temperature=0,
                                      extra_body={"speculation": speculation})
        assert r.choices[0].text == expected
        spec = r.usage.model_extra["speculation"]
        assert spec["proposer"] == "ngram" and spec["num_accepted_tokens"] > 0
        stream = client.completions.create(model="smol", prompt=prompt, max_tokens=40, temperature=0,
                                           stream=True, extra_body={"speculation": speculation})
        assert "".join(c.choices[0].text for c in stream) == expected


def test_sampled_tree_requests_are_reproducible(client):
    runs = [client.completions.create(model="smol", prompt="Tell me a story:", max_tokens=24, temperature=0.9,
                                      seed=77, extra_body={"speculation": {"method": "tree"}}).choices[0].text
            for _ in range(2)]
    assert runs[0] == runs[1] and runs[0]


def test_sampling_with_a_seed_is_reproducible(client):
    runs = [client.completions.create(model="smol", prompt="Tell me a story:", max_tokens=24, temperature=0.9,
                                      top_p=0.95, seed=1234).choices[0].text for _ in range(2)]
    assert runs[0] == runs[1]


def _stream_text(prompt: str, max_tokens: int, on_chunk=None, *, base: str = BASE, model: str = "smol") -> str:
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
    parts = []
    for i, chunk in enumerate(client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                         temperature=0, stream=True)):
        parts.append(chunk.choices[0].text)
        if on_chunk is not None:
            on_chunk(i)
    return "".join(parts)


def concurrent_streams(prompts, max_tokens, on_chunk=None, **where) -> list[str]:
    """Greedy streams of every prompt at once (one thread each); `on_chunk(i)` after chunk i of
    each. `where`: base and model of another application."""
    results: list[str | BaseException] = [""] * len(prompts)

    def run(i, p):
        try:
            results[i] = _stream_text(p, max_tokens, on_chunk, **where)
        except BaseException as exc:  # reported below
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def test_concurrent_streams_are_all_exact(app, reference):
    tokenizer, _, greedy_text, _ = reference
    texts = concurrent_streams(PROMPTS, 32)
    assert texts == [greedy_text(tokenizer.encode(p), 32) for p in PROMPTS]


def test_concurrent_adaptive_requests_through_the_draft_pool_are_exact(client, reference):
    """The load-aware policy steering requests that draft from the draft pool, 4 at once (a
    level its measured epochs decide, with a switch's cost summed over the requests in rounds):
    every output equals the target alone, and each request reports the policy."""
    from concurrent.futures import ThreadPoolExecutor

    tokenizer, _, greedy_text, _ = reference

    def run(prompt: str) -> tuple[str, dict]:
        r = client.completions.create(model="smol", prompt=prompt, max_tokens=32, temperature=0,
                                      extra_body={"speculation": {"policy": "adaptive"}})
        return r.choices[0].text, r.usage.model_extra["speculation"]

    with ThreadPoolExecutor(4) as pool:  # 3-5 in flight: a level the epochs measure
        results = list(pool.map(run, PROMPTS * 2))
    assert [text for text, _ in results] == [greedy_text(tokenizer.encode(p), 32) for p in PROMPTS * 2]
    assert all(spec["policy"] == "adaptive" for _, spec in results)


def test_the_target_pool_reports_the_decode_passes_it_timed_at_startup(app):
    """What a round of every request costs with speculation off, timed before the pool took
    calls: the router predicts off from it (LoadModel.off_goodput)."""
    target, _ = app
    info = target.model_info.remote().result()
    timed = info["engine"].decode_pass_s
    calls = [n for n, _ in timed]
    assert calls[0] == 1 and calls == sorted(calls) and all(b == 2 * a for a, b in zip(calls, calls[1:-1]))
    assert all(seconds > 0 for _, seconds in timed)
    assert [s for _, s in timed] == sorted(s for _, s in timed)  # more calls never time shorter


def test_pool_batches_concurrent_calls_into_shared_forward_passes(app, reference):
    from specserve.protocol import SamplingParams, TokenTree, VerifyRequest

    tokenizer = reference[0]
    target, _ = app
    ids = [tokenizer.encode(p) for p in PROMPTS]
    requests = [VerifyRequest(f"batch-{i}", ids[i % 4], SamplingParams(), 0, TokenTree.chain([11, 12]))
                for i in range(16)]
    alone = [target.verify.remote(r).result() for r in requests[:4]]
    before = sum(s["batched_calls"] - s["batches"] for s in pool_stats(target).values())
    together = [resp.result() for resp in [target.verify.remote(r) for r in requests]]
    after = sum(s["batched_calls"] - s["batches"] for s in pool_stats(target).values())
    assert after > before  # several calls shared one forward pass
    assert [r.tokens for r in together[:4]] == [r.tokens for r in alone]
    for r in requests:
        target.release.remote(r.request_id).result()


def test_killing_the_draft_replica_mid_stream_keeps_streams_exact(app, reference):
    tokenizer, _, greedy_text, _ = reference
    _, draft = app
    [draft_pid] = {s["pid"] for s in pool_stats(draft, 3).values()}
    killed = threading.Event()

    def kill_once(i):
        if i == 5 and not killed.is_set():
            killed.set()
            os.kill(draft_pid, signal.SIGKILL)

    prompts = PROMPTS[:2]
    texts = concurrent_streams(prompts, 64, on_chunk=kill_once)
    assert killed.is_set()
    assert texts == [greedy_text(tokenizer.encode(p), 64) for p in prompts]
    assert wait_for(lambda: len(pool_stats(draft)) == 1, timeout=120)  # Serve brings the draft back


def test_killing_a_target_replica_mid_stream_fails_over_exactly(app, reference):
    tokenizer, _, greedy_text, _ = reference
    target, _ = app
    killed = []

    def kill_busy_replica(i):
        if i == 5 and not killed:
            killed.append(True)
            busy = [s for s in pool_stats(target).values() if s["requests"] > 0]
            os.kill(busy[0]["pid"], signal.SIGKILL)

    texts = concurrent_streams(PROMPTS, 64, on_chunk=kill_busy_replica)
    assert killed
    assert texts == [greedy_text(tokenizer.encode(p), 64) for p in PROMPTS]
    assert wait_for(lambda: len(pool_stats(target)) == 2, timeout=120)  # Serve replaces the replica


def test_client_disconnect_frees_caches_in_both_pools(app, client):
    target, draft = app

    def cached_requests() -> int:
        return sum(s["requests"] for pool in (target, draft) for s in pool_stats(pool).values())

    assert wait_for(lambda: cached_requests() == 0)
    with httpx.stream("POST", f"{BASE}/v1/completions", timeout=120, json={
            "model": "smol", "prompt": "Write a long essay about the sea.", "max_tokens": 400,
            "temperature": 0, "stream": True}) as r:
        lines = r.iter_lines()  # keep the iterator: dropping it would close the connection now
        for _ in range(6):
            next(lines)
        assert cached_requests() >= 2  # the request's caches in the target pool and the draft pool
        r.close()  # disconnect mid-stream
    # the client is gone: the router's stream is cancelled and both pools drop the caches
    assert wait_for(lambda: cached_requests() == 0, timeout=60)
    r = client.completions.create(model="smol", prompt="Hi", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4


@pytest.mark.parametrize("body,status,fragment", [
    ({"model": "nope", "prompt": "x"}, 404, "not served"),
    ({"model": "smol", "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": "smol", "prompt": "x", "temperature": 3}, 400, "temperature"),
    ({"model": "smol", "prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ({"model": "smol", "prompt": ""}, 400, "empty"),
    ({"model": "smol", "prompt": [1] * 9000}, 400, "context"),
    ({"model": "smol", "prompt": [10 ** 7]}, 400, "vocabulary"),
    ({"model": "smol", "prompt": "x", "n": 2}, 400, "n"),
    ({"model": "smol", "prompt": "x", "logprobs": 2}, 400, "logprobs"),
    ({"model": "smol", "prompt": "x", "speculation": {"method": "medusa-typo"}}, 400, "speculation"),
    ({"model": "smol", "prompt": "x", "speculation": {"k": -1}}, 400, "speculation"),
    ({"model": "smol", "prompt": "x", "speculation": {"method": "tree", "tree": {"budget": 0}}}, 400, "budget"),
    ({"model": "smol", "prompt": "x", "speculation": {"method": "tree", "tree": {"shape": [[1]]}}}, 400, "sibling"),
    ({"model": "smol", "prompt": "x", "speculation": {"tree": {"breadth": 3}}}, 400, "breadth"),
    ({"model": "smol", "prompt": "x", "speculation": {"proposer": "medusa"}}, 400, "no heads"),
    ({"model": "smol", "prompt": "x", "speculation": {"proposer": "draft", "shape": "cube"}}, 400, "shape"),
    ({"model": "smol"}, 400, "prompt"),
])
def test_bad_requests_get_openai_style_errors(app, body, status, fragment):
    r = httpx.post(f"{BASE}/v1/completions", json=body, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert fragment in error["message"] and error["type"] == "invalid_request_error"


def test_malformed_json_and_bad_chat_bodies(app):
    r = httpx.post(f"{BASE}/v1/completions", content=b'{"model": "smol", "prompt": ', timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(f"{BASE}/v1/chat/completions", json={"model": "smol", "messages": []}, timeout=60)
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = httpx.post(f"{BASE}/v1/chat/completions", json={"model": "smol", "messages": [{"role": "wizard", "content": "x"}]},
                   timeout=60)
    assert r.status_code == 400


def test_overload_gets_503_not_a_hang(app):
    """8 live streams fill the router's 8 slots; then 4 calls wait in its queue of 4 and the rest
    are refused with 503 at once; when the streams end, the queued calls are served. Calls go
    one at a time: Serve counts a call as queued until a router replica takes it, so a burst
    arriving all at once is refused before the slots fill (the README says so)."""
    body = {"model": "smol", "max_tokens": 4, "temperature": 0}

    async def scenario():
        async with httpx.AsyncClient(timeout=300) as http:
            stop_streams = asyncio.Event()

            async def stream(i: int, opened: asyncio.Future) -> None:
                async with http.stream("POST", f"{BASE}/v1/completions", json={
                        "model": "smol", "prompt": f"Count to {i}:", "max_tokens": 3000, "temperature": 0,
                        "ignore_eos": True, "stream": True}) as r:
                    opened.set_result(r.status_code)
                    async for _ in r.aiter_lines():
                        if stop_streams.is_set():
                            return  # leaving the block disconnects: the router releases the request

            loop = asyncio.get_running_loop()
            streams, opened = [], []
            for i in range(8):  # one at a time, so that each takes a slot before the next arrives
                opened.append(loop.create_future())
                streams.append(asyncio.create_task(stream(i, opened[-1])))
                assert await opened[-1] == 200

            async def call(i: int) -> tuple[int, float]:
                r = await http.post(f"{BASE}/v1/completions", json={**body, "prompt": f"Call {i}:"})
                return r.status_code, loop.time()

            calls = []
            for i in range(8):
                calls.append(asyncio.create_task(call(i)))
                await asyncio.sleep(0.5)
            refused_at_once = sum(c.done() for c in calls[4:])
            waiting = sum(not c.done() for c in calls[:4])
            released = loop.time()
            stop_streams.set()
            await asyncio.gather(*streams)
            return [await c for c in calls], refused_at_once, waiting, released

    results, refused_at_once, waiting, released = asyncio.run(scenario())
    assert [status for status, _ in results] == [200] * 4 + [503] * 4, results
    assert refused_at_once == 4  # answered while the streams still held every slot: no hang
    assert waiting == 4  # the first 4 waited for a slot, and ran once the streams ended
    assert all(done > released for _, done in results[:4])
