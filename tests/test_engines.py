"""Fast tier for the engine interface: EngineInfo, how the router adapts to it, build-time
refusal of engines that are not installed, and the vLLM engine's pure parts (no vLLM needed)."""

import asyncio
import dataclasses

import pytest
import torch
from pydantic import ValidationError

from conftest import tiny_model
from specserve.engine import (
    EngineInfo, adapt_speculation, build_engine, engine_installed, require_engine, sampling_refusal,
)
from specserve.protocol import SamplingParams, Speculation, SpecserveError, TokenTree, TreeSpec, VerifyRequest
from specserve.serve.config import AppArgs, PoolArgs

VLLM_INFO = EngineInfo("vllm", 1024, (2,), "fingerprint", trees=False, hidden_states=False, proposes=False,
                       sampled_top_k_max=20)
TORCH_INFO = EngineInfo("torch", 512, (2,), "fingerprint", trees=True, hidden_states=True, proposes=True)
APP = {"target": {"model": "smollm2-135m-instruct"}, "speculation": {"proposer": "none"},
       "check_vocabulary_at_build": False}


def test_greedy_is_exact_everywhere_and_sampling_only_where_the_distribution_is_rebuilt():
    assert sampling_refusal(VLLM_INFO, SamplingParams()) is None
    assert sampling_refusal(VLLM_INFO, SamplingParams(temperature=0.7, top_k=20, top_p=0.9)) is None
    assert sampling_refusal(TORCH_INFO, SamplingParams(temperature=0.7)) is None
    for refused in (SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=21)):
        assert "top_k <= 20" in sampling_refusal(VLLM_INFO, refused)
    no_sampling = dataclasses.replace(VLLM_INFO, sampled_top_k_max=0)
    assert "does not sample exactly" in sampling_refusal(no_sampling, SamplingParams(temperature=1.0, top_k=1))


def test_a_tree_goes_as_a_chain_to_an_engine_without_trees():
    tree = Speculation(proposer="draft", shape="tree", k=4, tree=TreeSpec(budget=8, depth=3, width=2))
    assert adapt_speculation(tree, TORCH_INFO) == tree
    chain = adapt_speculation(tree, VLLM_INFO)
    assert (chain.shape, chain.k, chain.proposer) == ("chain", 3, "draft")
    assert adapt_speculation(Speculation(proposer="draft", k=4), VLLM_INFO).k == 4
    with pytest.raises(SpecserveError, match="needs heads"):
        adapt_speculation(Speculation(proposer="medusa"), VLLM_INFO)


def test_unknown_or_missing_engines_are_refused_when_the_app_is_built(monkeypatch):
    from specserve.serve import build_app

    with pytest.raises(SpecserveError, match="unknown engine 'tensorrt'"):
        require_engine("tensorrt", "target")
    with pytest.raises(ValidationError, match="engine"):  # the schema lists the engines
        build_app({**APP, "target": {**APP["target"], "engine": "tensorrt"}})
    real_find_spec = __import__("importlib.util").util.find_spec
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "vllm" else real_find_spec(name, *a))
    assert not engine_installed("vllm") and engine_installed("torch")
    with pytest.raises(SpecserveError, match="engine 'vllm' is not installed in this Python.*make vllm-env"):
        build_app({**APP, "target": {**APP["target"], "engine": "vllm"}})
    with pytest.raises(SpecserveError, match="not installed"):
        build_engine(PoolArgs(model="x", engine="vllm").model_dump(), "target")


def test_vllm_pools_build_where_vllm_is_installed_and_heads_stay_on_torch(monkeypatch):
    from specserve.serve import build_app

    monkeypatch.setattr("specserve.engine.engine_installed", lambda name: True)
    build_app({**APP, "target": {**APP["target"], "engine": "vllm"}})  # a vLLM target pool builds
    build_app({**APP, "draft": {"model": "smollm2-135m-instruct", "engine": "vllm"}, "speculation": {"proposer": "draft"}})
    monkeypatch.setattr("specserve.serve.check_heads", lambda args: "/heads")
    with pytest.raises(SpecserveError, match="engine vllm does not run specserve's heads"):
        build_app({**APP, "target": {**APP["target"], "engine": "vllm", "heads": "default"},
                   "speculation": {"proposer": "medusa"}})


class FakeEngine:
    """A minimal Engine: answers every verify with its draft accepted plus token 0."""

    def __init__(self):
        self.released = []

    def info(self):
        return VLLM_INFO

    async def verify(self, request):
        from specserve.protocol import VerifyResult

        return VerifyResult(request.request_id, len(request.draft), list(request.draft.tokens) + [0])

    async def release(self, request_id):
        self.released.append(request_id)
        return True

    async def stats(self):
        return {"requests": 0}

    def load(self):
        from specserve.protocol import PoolLoad

        return PoolLoad(0, 0.0, 0, 0.0)

    async def check_health(self):
        return None


def test_pools_talk_to_an_injected_engine_through_the_protocol():
    from specserve.serve.pools import TargetPool

    engine = FakeEngine()
    pool = TargetPool.func_or_class(PoolArgs(model="fake", engine="vllm").model_dump(), build_engine=lambda args: engine)

    async def scenario():
        result = await pool.verify(VerifyRequest("r", [1, 2], SamplingParams(), 0, TokenTree.chain([5, 6])))
        info = await pool.model_info()
        await pool.release("r")
        return result, info

    result, info = asyncio.run(scenario())
    assert result.tokens == [5, 6, 0]
    assert info["engine"] == VLLM_INFO and info["max_context"] == 1024 and info["eos_token_ids"] == [2]
    assert engine.released == ["r"]
    assert pool.record_autoscaling_stats()["batch_size"] == 0.0


def test_the_torch_engine_reports_what_it_can_do():
    from specserve.engine.torch_engine import TorchEngine
    from specserve.engine.torch_worker import TorchWorker

    model = tiny_model("qwen2", seed=0)
    engine = TorchEngine(TorchWorker(model), PoolArgs(model="tiny").model_dump(), "target")
    info = engine.info()
    assert (info.engine, info.trees, info.hidden_states, info.sampled_top_k_max) == ("torch", True, True, None)
    assert info.max_context == model.config.max_position_embeddings
    result = asyncio.run(engine.verify(VerifyRequest("r", [1, 2, 3], SamplingParams(), 0)))
    assert result.tokens == [int(model(torch.tensor([[1, 2, 3]])).logits[0, -1].argmax())]
    # decode passes of 1 to max_batch_size calls were timed at startup, and left nothing behind
    assert [calls for calls, _ in info.decode_pass_s] == [1, 2, 4, 8, 16]
    assert all(seconds > 0 for _, seconds in info.decode_pass_s)
    assert engine.cached_requests == 1 and engine.batches == 1  # request r's
    untimed = TorchEngine(TorchWorker(model), PoolArgs(model="tiny", time_decode_passes=False).model_dump(), "target")
    assert untimed.info().decode_pass_s == ()
    draft = TorchEngine(TorchWorker(model), PoolArgs(model="tiny").model_dump(), "draft")
    assert draft.info().decode_pass_s == ()  # draft pools only propose


def test_native_mode_needs_a_vllm_target_that_speculates_and_takes_every_request():
    native = dataclasses.replace(VLLM_INFO, native="ngram", sampled_top_k_max=0)
    for asked in (Speculation(proposer="draft", shape="tree"), Speculation(proposer="none")):
        assert adapt_speculation(asked, native).proposer == "native"
    assert adapt_speculation(Speculation(proposer="native"), native).depth == 0  # no draft reaches the router
    with pytest.raises(SpecserveError, match="needs a target pool that speculates itself"):
        adapt_speculation(Speculation(proposer="native"), VLLM_INFO)
    assert "native" in sampling_refusal(native, SamplingParams(temperature=0.5, top_k=5))
    assert sampling_refusal(native, SamplingParams()) is None
    with pytest.raises(ValidationError, match="speculative_config"):
        AppArgs.model_validate({**APP, "speculation": {"proposer": "native"}})
    args = AppArgs.model_validate({**APP, "speculation": {"proposer": "native"}, "target": {
        **APP["target"], "engine": "vllm", "engine_kwargs": {"speculative_config": {"method": "ngram"}}}})
    assert args.speculation.spec().describe().startswith("native")


def test_the_library_decoder_refuses_native_mode(qwen_pair):
    from conftest import make_decoder

    target, _ = qwen_pair
    with pytest.raises(SpecserveError, match="native"):
        make_decoder(target, method="none").generate([[1, 2, 3]], proposer="native")
