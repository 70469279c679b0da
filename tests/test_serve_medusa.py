"""Integration: Medusa heads in a co-located pool on the session's Ray cluster, SmolLM2-135M
(fp32) with heads trained in the session, called over HTTP with the official `openai` client.

Two CoLocatedPool replicas (so killing one leaves another) and a router; no draft pool. Hydra
and ReDrafter (heads that read their path) each get an app of one replica with untrained heads:
exactness over HTTP, one pass per round, and a 400 for a request asking for other heads.
"""

import os
import signal

import httpx
import pytest

from conftest import BASE
from test_serve import concurrent_streams, pool_stats, wait_for

pytestmark = [pytest.mark.serve, pytest.mark.slow]

MEDUSA = f"{BASE}/medusa"
PROMPTS = ["def add(a, b):", "The capital of France is", "import numpy as np\n", "Once upon a time"]
# Greedy SmolLM2 counts on, and the session's quick heads follow it (first drafts accepted 0.8)
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8,"
TREE = {"budget": 10, "depth": 3, "width": 3, "min_score": 0.0}


@pytest.fixture(scope="session")
def medusa_app(cluster, smol_medusa_heads):
    from ray import serve

    from specserve.serve import build_app

    pool = {"dtype": "float32", "torch_threads": 1, "ray_actor_options": {"num_cpus": 1},
            "health_check_period_s": 60, "health_check_timeout_s": 30}
    serve.run(build_app({
        "model_name": "smol-medusa",
        "target": {"model": "smollm2-135m-instruct", "heads": str(smol_medusa_heads), "num_replicas": 2, **pool},
        "speculation": {"proposer": "medusa", "shape": "tree", "tree": TREE},
        # Serve counts a request as queued until a replica takes it, so a burst arriving at once can be
        # refused (503) before the router's 8 slots take any: the queue holds the burst test's 12 whole.
        "router": {"max_ongoing_requests": 8, "max_queued_requests": 16, "target_retry_timeout_s": 60},
    }), name="medusa", route_prefix="/medusa")
    return serve.get_deployment_handle("CoLocatedPool", "medusa")


@pytest.fixture(scope="session")
def medusa_client(medusa_app):
    from openai import OpenAI

    return OpenAI(base_url=f"{MEDUSA}/v1", api_key="unused", max_retries=0, timeout=300)


def test_medusa_completions_equal_the_target_alone_streamed_or_not(medusa_client, reference):
    tokenizer, _, greedy_text, _ = reference
    for prompt in PROMPTS[:2]:
        expected = greedy_text(tokenizer.encode(prompt), 40)
        for speculation in ({"policy": "fixed"}, {"shape": "chain", "k": 3},
                            {"tree": {"shape": [[0], [1], [0, 0], [1, 0]]}}):
            r = medusa_client.completions.create(model="smol-medusa", prompt=prompt, max_tokens=40, temperature=0,
                                                 extra_body={"speculation": speculation})
            assert r.choices[0].text == expected
            spec = r.usage.model_extra["speculation"]
            assert spec["proposer"] == "medusa" and spec["acceptance"] == "exact" and spec["lossy"] is False
            assert spec["num_draft_tokens"] > 0 and spec["mean_accepted_length"] > 1
        stream = medusa_client.completions.create(model="smol-medusa", prompt=prompt, max_tokens=40,
                                                  temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream) == expected


def test_medusa_chat_equals_the_target_alone(medusa_client, reference):
    _, _, greedy_text, chat_ids = reference
    question = "Write a Python function that reverses a string."
    r = medusa_client.chat.completions.create(model="smol-medusa", max_tokens=48, temperature=0,
                                              messages=[{"role": "user", "content": question}])
    assert r.choices[0].message.content == greedy_text(chat_ids(question), 48)


def test_a_co_located_round_is_one_forward_pass(medusa_app, medusa_client):
    """Per round one call to the pool and one target pass: passes == target steps."""
    def passes() -> int:
        return sum(s["forward_passes"] for s in pool_stats(medusa_app).values())

    assert wait_for(lambda: sum(s["requests"] for s in pool_stats(medusa_app).values()) == 0)
    before = passes()
    r = medusa_client.completions.create(model="smol-medusa", prompt=PROMPTS[2], max_tokens=32, temperature=0,
                                         extra_body={"speculation": {"policy": "fixed"}})
    spec = r.usage.model_extra["speculation"]
    assert passes() - before == spec["target_steps"]
    assert spec["target_steps"] < r.usage.completion_tokens  # fewer passes than tokens


def test_a_burst_turns_speculation_off_and_it_comes_back(medusa_client, reference):
    """The deployment's policy is adaptive: alone, a request speculates; in a burst of 12
    concurrent requests the target's passes are full and the policy turns speculation off for
    many rounds, the same prompt's included; alone again, speculation comes back. Outputs stay
    exact throughout.

    After the burst the lone requests continue a count (COUNTING), where the session's quick
    heads accept 0.8 of their first drafts (mean accepted length ~2): speculating clearly pays
    alone. On PROMPTS[0] they accept ~0.3 (about 1.4 tokens a round; the model put the gain at
    8-16%), and its first drafts after the prompt are rejected: starting from the deployment's
    estimate, which the burst's prompts had lowered to ~0.24, near break-even, those rejections
    turned it off, and in 48 tokens its probes brought it back in 2 of 3 runs. A marginal gain
    lost to an unlucky start, not the recovery this test is about."""
    from concurrent.futures import ThreadPoolExecutor

    tokenizer, _, greedy_text, _ = reference

    def run(prompt: str) -> tuple[str, dict]:
        r = medusa_client.completions.create(model="smol-medusa", prompt=prompt, max_tokens=48, temperature=0)
        return r.choices[0].text, r.usage.model_extra["speculation"]

    alone = [run(PROMPTS[0]) for _ in range(2)][-1]  # the second: the load model has seen the first
    with ThreadPoolExecutor(12) as pool:  # the router takes 8 at once and queues the rest
        burst = list(pool.map(run, PROMPTS * 3))
    again = [run(COUNTING) for _ in range(3)]
    expected = {p: greedy_text(tokenizer.encode(p), 48) for p in [*PROMPTS, COUNTING]}
    assert [text for text, _ in burst] == [expected[p] for p in PROMPTS * 3]
    assert alone[0] == expected[PROMPTS[0]] and all(text == expected[COUNTING] for text, _ in again)
    alone_off = alone[1]["speculation_off_share"]
    burst_off = sum(spec["speculation_off_share"] for _, spec in burst) / len(burst)
    # PROMPTS[0]'s three (the last of them, queued, runs as the burst drains: 0.24-0.73 off)
    same_prompt_off = sum(spec["speculation_off_share"] for _, spec in burst[::len(PROMPTS)]) / 3
    again_off = min(spec["speculation_off_share"] for _, spec in again)  # back on within three requests
    assert alone[1]["policy"] == "adaptive" and alone_off < 0.3, alone[1]
    assert burst_off > max(0.3, alone_off + 0.15), [spec["policy_decisions"] for _, spec in burst]
    assert same_prompt_off > alone_off + 0.15, [spec for _, spec in burst[::len(PROMPTS)]]
    assert again_off < min(0.3, burst_off - 0.15), [(spec["policy_decisions"], spec["k_histogram"]) for _, spec in again]


def test_typical_acceptance_is_labelled_lossy_over_http(medusa_client):
    r = medusa_client.completions.create(model="smol-medusa", prompt=PROMPTS[3], max_tokens=16, temperature=0.8,
                                         seed=3, extra_body={"speculation": {"acceptance": "typical"}})
    spec = r.usage.model_extra["speculation"]
    assert spec["acceptance"] == "typical (lossy)" and spec["lossy"] is True


def test_sampled_medusa_requests_are_reproducible(medusa_client):
    runs = [medusa_client.completions.create(model="smol-medusa", prompt="Tell me a story:", max_tokens=24,
                                             temperature=0.9, seed=5).choices[0].text for _ in range(2)]
    assert runs[0] == runs[1] and runs[0]


def test_killing_a_co_located_replica_mid_stream_fails_over_exactly(medusa_app, reference):
    tokenizer, _, greedy_text, _ = reference
    killed = []

    def kill_busy_replica(n):
        if n == 4 and not killed:
            killed.append(True)
            busy = [s for s in pool_stats(medusa_app).values() if s["requests"] > 0]
            os.kill(busy[0]["pid"], signal.SIGKILL)

    texts = concurrent_streams(PROMPTS, 48, kill_busy_replica, base=MEDUSA, model="smol-medusa")
    assert killed
    assert texts == [greedy_text(tokenizer.encode(p), 48) for p in PROMPTS]
    assert wait_for(lambda: len(pool_stats(medusa_app)) == 2, timeout=120)  # Serve replaces the replica


def test_client_disconnect_frees_the_co_located_cache(medusa_app):
    def cached() -> int:
        return sum(s["requests"] for s in pool_stats(medusa_app).values())

    assert wait_for(lambda: cached() == 0)
    with httpx.stream("POST", f"{MEDUSA}/v1/completions", timeout=120, json={
            "model": "smol-medusa", "prompt": "Write a long essay about the sea.", "max_tokens": 400,
            "temperature": 0, "stream": True}) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert cached() >= 1
        r.close()
    assert wait_for(lambda: cached() == 0, timeout=60)


@pytest.mark.parametrize("base,model,speculation,fragment", [
    (MEDUSA, "smol-medusa", {"proposer": "draft"}, "no draft pool"),
    (MEDUSA, "smol-medusa", {"acceptance": "fast"}, "acceptance"),
    (MEDUSA, "smol-medusa", {"proposer": "medusa", "method": "tree"}, "not both"),
    (MEDUSA, "smol-medusa", {"tree": {"shape": [[1]]}}, "sibling"),
])
def test_bad_speculation_gets_a_400(medusa_app, base, model, speculation, fragment):
    r = httpx.post(f"{base}/v1/completions", timeout=60,
                   json={"model": model, "prompt": "x", "max_tokens": 4, "speculation": speculation})
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]


# ---- heads that read their path (Hydra, ReDrafter): one co-located replica each -------------


@pytest.fixture(scope="session", params=["hydra", "redrafter"])
def path_heads_app(request, cluster, reference, tmp_path_factory):
    """An app serving SmolLM2 with untrained `request.param` heads built here (greedy output is
    the target's whatever the heads propose): (method, its pool's handle, its base URL),
    deleted after its tests."""
    from ray import serve

    from conftest import tiny_hydra_heads, tiny_redrafter
    from specserve.serve import build_app

    method = request.param
    heads = tmp_path_factory.mktemp(f"smol-{method}")
    (tiny_hydra_heads if method == "hydra" else tiny_redrafter)(reference[1], num_heads=3).save(heads)
    pool = {"dtype": "float32", "torch_threads": 1, "ray_actor_options": {"num_cpus": 0.5},
            "health_check_period_s": 60, "health_check_timeout_s": 30}
    serve.run(build_app({
        "model_name": f"smol-{method}",
        "target": {"model": "smollm2-135m-instruct", "heads": str(heads), "num_replicas": 1, **pool},
        "speculation": {"proposer": method, "shape": "tree", "tree": TREE, "policy": "fixed"},
        "router": {"max_ongoing_requests": 8, "max_queued_requests": 8},
    }), name=method, route_prefix=f"/{method}")
    yield method, serve.get_deployment_handle("CoLocatedPool", method), f"{BASE}/{method}"
    # The session cluster's CPUs hold one such app at a time: the next method's pool would wait
    # for this one's CPUs forever.
    serve.delete(method)


def test_path_heads_completions_and_chat_equal_the_target_alone(path_heads_app, reference):
    from openai import OpenAI

    method, _, base = path_heads_app
    tokenizer, _, greedy_text, chat_ids = reference
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
    prompt = PROMPTS[0]
    expected = greedy_text(tokenizer.encode(prompt), 32)
    for speculation in ({}, {"shape": "chain", "k": 3}, {"tree": {"shape": [[0], [1], [0, 0], [1, 0]]}}):
        r = client.completions.create(model=f"smol-{method}", prompt=prompt, max_tokens=32, temperature=0,
                                      extra_body={"speculation": speculation})
        assert r.choices[0].text == expected, speculation
        spec = r.usage.model_extra["speculation"]
        assert spec["proposer"] == method and spec["lossy"] is False and spec["num_draft_tokens"] > 0
    stream = client.completions.create(model=f"smol-{method}", prompt=prompt, max_tokens=32, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream) == expected
    question = "Write a Python function that reverses a string."
    r = client.chat.completions.create(model=f"smol-{method}", max_tokens=24, temperature=0,
                                       messages=[{"role": "user", "content": question}])
    assert r.choices[0].message.content == greedy_text(chat_ids(question), 24)


def test_a_path_heads_round_is_one_forward_pass(path_heads_app):
    method, handle, base = path_heads_app
    assert wait_for(lambda: sum(s["requests"] for s in pool_stats(handle).values()) == 0)
    before = sum(s["forward_passes"] for s in pool_stats(handle).values())
    r = httpx.post(f"{base}/v1/completions", timeout=300, json={
        "model": f"smol-{method}", "prompt": PROMPTS[2], "max_tokens": 24, "temperature": 0})
    spec = r.json()["usage"]["speculation"]
    assert sum(s["forward_passes"] for s in pool_stats(handle).values()) - before == spec["target_steps"]


def test_asking_path_heads_for_another_method_gets_a_400(path_heads_app):
    method, _, base = path_heads_app
    other = "redrafter" if method == "hydra" else "hydra"
    r = httpx.post(f"{base}/v1/completions", timeout=60, json={
        "model": f"smol-{method}", "prompt": "x", "max_tokens": 4, "speculation": {"proposer": other}})
    assert r.status_code == 400, r.text
    assert method in r.json()["error"]["message"]
