"""Fast tier for the serving layer: manifests, builder args, text codec, streaming deltas."""

from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from specserve import models
from specserve.protocol import SpecserveError
from specserve.serve.affinity import request_id_of
from specserve.serve.config import AppArgs
from specserve.serve.router import TextStream

MANIFESTS = sorted((Path(__file__).parent.parent / "manifests").glob("*.yaml"))


def test_there_are_manifests():
    assert {m.name for m in MANIFESTS} >= {"local.yaml", "local-medusa.yaml", "local-redrafter.yaml", "local-ngram.yaml",
                                           "llama70b.yaml"}


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_manifest_validates_with_ray_and_specserve(path):
    config = yaml.safe_load(path.read_text())
    schema = ServeDeploySchema.model_validate(config)
    for app in schema.applications:
        assert app.import_path == "specserve.serve:build_app"
        AppArgs.model_validate(app.args)


@pytest.mark.parametrize("name", ["local.yaml", "llama70b.yaml"])
def test_manifests_scale_their_pools_with_specserves_policy(name):
    import importlib

    config = yaml.safe_load((MANIFESTS[0].parent / name).read_text())
    [app] = ServeDeploySchema.model_validate(config).applications
    policy = app.autoscaling_policy
    module, function = policy["policy_function"].split(":")
    autoscaler = getattr(importlib.import_module(module), function)(**policy.get("policy_kwargs", {}))
    assert autoscaler.target_tokens_per_replica > 0
    for pool in ("target", "draft"):  # the policy scales only deployments with an autoscaling_config
        assert app.args[pool]["autoscaling_config"]["max_replicas"] >= 1
    assert app.args["speculation"]["policy"] == "adaptive"


def test_ray_schema_and_args_reject_broken_manifests():
    config = yaml.safe_load(next(m for m in MANIFESTS if m.name == "local.yaml").read_text())
    broken = {**config, "applications": [{**config["applications"][0], "import_path": "specserve-serve-build-app"}]}
    with pytest.raises(ValidationError):
        ServeDeploySchema.model_validate(broken)
    args = config["applications"][0]["args"]
    with pytest.raises(ValidationError, match="needs a draft pool"):
        AppArgs.model_validate({**args, "draft": None})
    with pytest.raises(ValidationError, match="less than or equal to 64"):
        AppArgs.model_validate({**args, "speculation": {"k": 65}})
    with pytest.raises(ValidationError, match="method"):
        AppArgs.model_validate({**args, "speculation": {"method": "medusa-typo"}})
    with pytest.raises(ValidationError, match="needs a draft pool"):
        AppArgs.model_validate({**args, "draft": None, "speculation": {"proposer": "draft", "shape": "tree"}})
    with pytest.raises(ValidationError, match="extra"):
        AppArgs.model_validate({**args, "targte": {}})
    with pytest.raises(ValidationError, match="needs a draft pool"):
        AppArgs.model_validate({**args, "draft": None, "speculation": {"method": "tree"}})
    with pytest.raises(ValidationError, match="elder sibling"):
        AppArgs.model_validate({**args, "speculation": {"method": "tree", "tree": {"shape": [[0], [2]]}}})
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        AppArgs.model_validate({**args, "speculation": {"tree": {"budget": 0}}})
    with pytest.raises(ValidationError, match="not both"):
        AppArgs.model_validate({**args, "target": {**args["target"], "num_replicas": 2}})
    with pytest.raises(ValidationError, match="must not exceed"):
        AppArgs.model_validate({**args, "speculation": {"proposer": "ngram", "ngram": {"max_n": 2, "min_n": 3}}})
    ngram = AppArgs.model_validate({**args, "draft": None, "speculation": {"proposer": "ngram"}})
    assert ngram.speculation.spec().draft_cost == "free"  # no draft pool needed


def test_kv_cache_is_a_memory_budget():
    args = yaml.safe_load(next(m for m in MANIFESTS if m.name == "local.yaml").read_text())["applications"][0]["args"]
    parsed = AppArgs.model_validate({**args, "target": {**args["target"], "kv_cache_memory": "2GiB"}})
    assert parsed.target.kv_cache_memory == 2 << 30
    assert AppArgs.model_validate(args).target.kv_cache_memory == 1 << 30  # the default
    with pytest.raises(ValidationError, match="replaced by kv_cache_memory"):
        AppArgs.model_validate({**args, "target": {**args["target"], "max_cached_tokens": 4096}})
    with pytest.raises(ValidationError, match="kv_cache_memory"):
        AppArgs.model_validate({**args, "target": {**args["target"], "kv_cache_memory": "lots"}})


def test_speculation_args_separate_proposer_and_shape():
    from specserve.protocol import Speculation, TreeSpec
    from specserve.serve.config import SpeculationArgs
    from specserve.serve.openai_api import SpeculationOverride

    assert SpeculationArgs().spec() == Speculation(proposer="draft", shape="chain", k=4, policy="adaptive")
    # the older spelling
    assert SpeculationArgs(method="tree").spec() == Speculation(proposer="draft", shape="tree", policy="adaptive")
    assert SpeculationArgs(method="none").spec().proposer == "none"
    with pytest.raises(ValidationError, match="not both"):
        SpeculationArgs(method="tree", proposer="draft")
    with pytest.raises(ValidationError, match="write `proposer`"):
        SpeculationArgs(method="medusa-typo")
    with pytest.raises(ValidationError, match="typical"):
        SpeculationArgs(acceptance="fast")
    base = SpeculationArgs(proposer="medusa", shape="tree").spec()
    override = SpeculationOverride(shape="chain", k=2, acceptance="typical", typical={"posterior_alpha": 0.5})
    got = override.apply_to(base)
    assert (got.proposer, got.shape, got.k, got.acceptance, got.typical.posterior_alpha) == ("medusa", "chain", 2,
                                                                                          "typical", 0.5)
    # an explicit proposer/shape wins over the load-aware policy
    assert SpeculationOverride(method="tree").apply_to(base) == replace(base, proposer="draft", shape="tree",
                                                                        policy="fixed")
    assert SpeculationOverride(tree={"depth": 3}).apply_to(base).tree == TreeSpec(depth=3)
    with pytest.raises(SpecserveError, match="not both"):
        SpeculationOverride(method="none", proposer="medusa").apply_to(base)


def test_medusa_args_need_heads_on_the_target():
    args = {"target": {"model": "m"}, "speculation": {"proposer": "medusa"}}
    with pytest.raises(ValidationError, match="needs heads on the target"):
        AppArgs.model_validate(args)
    ok = AppArgs.model_validate({**args, "target": {"model": "m", "heads": "default"}})
    assert ok.draft is None and ok.speculation.spec().co_located
    with pytest.raises(ValidationError, match="belong to the target pool"):
        AppArgs.model_validate({**args, "target": {"model": "m", "heads": "h"}, "draft": {"model": "d", "heads": "h"}})


def test_builder_refuses_missing_heads_and_heads_of_another_model(tmp_path):
    import torch

    from specserve.heads.medusa import MedusaConfig, MedusaHeads
    from specserve.serve import build_app

    name = "smollm2-135m-instruct"
    if not models.is_cached(name):
        pytest.skip(f"{name} not pulled")
    args = {"target": {"model": name, "heads": str(tmp_path / "none")}, "speculation": {"proposer": "medusa"}}
    with pytest.raises(SpecserveError, match="make heads.*specserve train-heads --method medusa"):
        build_app(args)
    MedusaHeads(MedusaConfig(64, 97), torch.zeros(97, 64)).save(tmp_path / "tiny")
    with pytest.raises(SpecserveError, match="trained for a model with hidden size 64"):
        build_app({**args, "target": {"model": name, "heads": str(tmp_path / "tiny")}})


def test_tree_args_become_a_tree_spec():
    from specserve.protocol import NAMED_TREE_SHAPES, TreeSpec
    from specserve.serve.config import TreeArgs
    from specserve.serve.openai_api import TreeOverride

    assert TreeArgs().spec() == TreeSpec()
    static = TreeArgs(shape=[[0], [0, 0], [1]]).spec()
    assert static.shape == ((0,), (1,), (0, 0)) and static.budget == 3 and static.depth == 2
    base = TreeArgs(budget=32, depth=6).spec()
    assert TreeOverride(depth=3).apply_to(base) == TreeSpec(budget=32, depth=3)
    assert TreeOverride(shape=[[0]]).apply_to(base).shape == ((0,),)
    with pytest.raises(SpecserveError, match="budget"):
        TreeOverride(budget=1000).apply_to(base)
    # a known shape by name, in the builder's args and in a request
    papers = TreeArgs(shape="mc_sim_7b_63").spec()
    assert (papers.budget, papers.depth, papers.shape) == (63, 4, TreeSpec(shape=NAMED_TREE_SHAPES["mc_sim_7b_63"]).shape)
    assert TreeOverride(shape="mc_sim_7b_63").apply_to(base) == papers
    with pytest.raises(ValidationError, match="unknown tree shape 'mc_sim'.*mc_sim_7b_63"):
        TreeArgs(shape="mc_sim")
    with pytest.raises(SpecserveError, match="unknown tree shape"):
        TreeOverride(shape="mc_sim").apply_to(base)
    # reranking: dynamic trees only, refused when the app is built; a request's shape asks for that shape
    reranked = TreeArgs(budget=16, depth=4, width=8, rerank=True).spec()
    assert reranked.rerank and TreeOverride(budget=8).apply_to(reranked).rerank
    assert TreeOverride(shape=[[0], [1]]).apply_to(reranked) == TreeSpec(shape=[[0], [1]], width=8, min_score=0.2)
    assert TreeOverride(rerank=True).apply_to(base).rerank
    with pytest.raises(ValidationError, match="rerank applies to dynamic trees"):
        TreeArgs(shape="mc_sim_7b_63", rerank=True)
    with pytest.raises(SpecserveError, match="rerank applies to dynamic trees"):
        TreeOverride(rerank=True).apply_to(papers)


def test_builder_refuses_a_draft_with_another_vocabulary(tmp_path):
    from specserve.serve import build_app

    for name in ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"):
        if not models.is_cached(name):
            pytest.skip(f"{name} not pulled")
    with pytest.raises(SpecserveError, match="do not share a vocabulary"):
        build_app({"target": {"model": "smollm2-135m-instruct"}, "draft": {"model": "qwen2.5-coder-0.5b-instruct"}})


def test_builder_wants_registry_models_pulled_first(tmp_path, monkeypatch):
    from specserve.serve import build_app

    monkeypatch.setenv("SPECSERVE_HOME", str(tmp_path))
    with pytest.raises(Exception, match="specserve models pull"):
        build_app({"target": {"model": "smollm2-135m-instruct"}, "draft": {"model": "smollm2-135m-instruct"}})


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
def test_text_codec_matches_transformers(name):
    if not models.is_cached(name):
        pytest.skip(f"{name} not pulled")
    from specserve.text import TextCodec

    hf = models.load_tokenizer(name)
    codec = TextCodec.for_model(name)
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Write `def f(x):` — with ünïcode & <tags>."}]
    assert codec.chat_prompt(messages) == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    text = "def fib(n):\n    return n if n < 2 else fib(n-1) + fib(n-2)  # ünï 😀"
    assert codec.encode(text) == hf.encode(text)
    ids = hf.encode(text) + [hf.eos_token_id]
    assert codec.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_text_stream_holds_back_partial_characters_and_stop_prefixes():
    stream = TextStream(stops=("STOP",))
    assert stream.delta("hello wo", final=False) == "hello"  # 3 chars held: could start "STOP"
    assert stream.delta("hello world\ufffd", final=False) == " wo"
    assert stream.delta("hello world!", final=True) == "rld!"
    plain = TextStream(stops=())
    assert plain.delta("abc", final=False) == "abc"
    assert plain.delta("abc\ufffd", final=False) == ""


def test_affinity_router_reads_request_ids():
    from types import SimpleNamespace

    from specserve.protocol import SamplingParams, VerifyRequest

    verify = VerifyRequest("r1", [1, 2], SamplingParams(), 0)
    assert request_id_of(SimpleNamespace(args=[verify])) == "r1"
    assert request_id_of(SimpleNamespace(args=["r2"])) == "r2"
    assert request_id_of(SimpleNamespace(args=[])) is None


def test_the_builder_runs_every_replica_in_serves_throughput_optimized_mode_when_told_to():
    """fast_replica_calls (the default) puts RAY_SERVE_THROUGHPUT_OPTIMIZED=1 (direct ingress off,
    logs to stderr) into the router's and both pools' runtime_env; a pool's own env_vars win; off
    leaves Serve's defaults."""
    from specserve.serve import FAST_REPLICA_CALLS_ENV, build_app

    mine = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "0", "OTHER": "x"}
    args = {"target": {"model": "smollm2-135m-instruct",
                       "ray_actor_options": {"num_cpus": 1, "runtime_env": {"env_vars": mine}}},
            "draft": {"model": "smollm2-135m-instruct"}, "speculation": {"proposer": "draft"},
            "check_vocabulary_at_build": False}

    def actor_options(app):
        router = app._bound_deployment
        target, draft = router.init_args[:2]
        return {d.name: d.ray_actor_options for d in (router, target._bound_deployment, draft._bound_deployment)}

    assert AppArgs.model_validate(args).fast_replica_calls is True
    options = actor_options(build_app(args))
    assert options["Router"]["runtime_env"]["env_vars"] == FAST_REPLICA_CALLS_ENV
    assert options["DraftPool"]["runtime_env"]["env_vars"] == FAST_REPLICA_CALLS_ENV
    assert options["TargetPool"]["runtime_env"]["env_vars"] == FAST_REPLICA_CALLS_ENV | mine
    assert options["TargetPool"]["num_cpus"] == 1
    assert FAST_REPLICA_CALLS_ENV == {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
                                      "RAY_SERVE_LOG_TO_STDERR": "1"}
    options = actor_options(build_app({**args, "fast_replica_calls": False}))
    assert "runtime_env" not in options["Router"] and "runtime_env" not in options["DraftPool"]
    assert options["TargetPool"]["runtime_env"]["env_vars"] == mine


def test_the_replica_calls_benchmark_config_is_a_valid_app_with_the_setting_it_compares():
    from specserve.benchmarks import replica_calls

    for fast in (True, False):
        config = replica_calls.config(fast)
        [app] = ServeDeploySchema.model_validate(config).applications
        args = AppArgs.model_validate(app.args)
        assert args.fast_replica_calls is fast and args.speculation.k == 4 and args.draft is not None
    table = replica_calls.markdown([{"fast_replica_calls": True, "tok_s": 10.0, "overhead_ms_per_round": 12.0},
                                    {"fast_replica_calls": False, "tok_s": 8.0, "overhead_ms_per_round": 21.0}])
    assert "| 0 | on | 10.00 | 12.0 |" in table and "off: mean 8.00 tok/s, 21.0 ms" in table


def test_the_router_calls_the_pools_over_grpc_in_throughput_optimized_mode():
    """The pools' handles reach the router made where the app was built, by reference; with
    fast_replica_calls the router asks for gRPC (without it, or without a pool, as they come)."""
    from specserve.serve.router import pool_handle

    class Handle:
        def options(self, **kwargs):
            return ("options", kwargs)

    handle = Handle()
    assert pool_handle(handle, True) == ("options", {"_by_reference": False})
    assert pool_handle(handle, False) is handle and pool_handle(None, True) is None


def test_a_pools_linear_layout_and_quantization_reach_its_worker_and_bad_ones_are_refused(tmp_path):
    from conftest import tiny_model
    from specserve.engine.torch_engine import load_worker
    from specserve.serve.config import PoolArgs

    tiny_model("qwen2", seed=0).save_pretrained(tmp_path)
    for layout, expected in (("auto", "both"), ("many_rows", "many_rows"), ("one_row", "one_row")):
        args = PoolArgs(model=str(tmp_path), dtype="float32", linear_layout=layout).model_dump()
        assert load_worker(args).linear_layout == expected
    with pytest.raises(ValidationError, match="linear_layout"):
        PoolArgs(model=str(tmp_path), linear_layout="diagonal")
    assert load_worker(PoolArgs(model=str(tmp_path), quantize="int8").model_dump()).quantize == "int8"


def test_only_a_cpu_torch_draft_pool_may_be_quantized():
    args = yaml.safe_load(next(m for m in MANIFESTS if m.name == "local.yaml").read_text())["applications"][0]["args"]
    assert AppArgs.model_validate(args).draft.quantize == "int8"  # the local pair's draft runs in int8
    with pytest.raises(ValidationError, match="target.quantize: int8 would change the output"):
        AppArgs.model_validate({**args, "target": {**args["target"], "quantize": "int8"}})
    with pytest.raises(ValidationError, match="torch engine's on CPU"):
        AppArgs.model_validate({**args, "draft": {**args["draft"], "device": "cuda"}})
    with pytest.raises(ValidationError, match="quantize"):
        AppArgs.model_validate({**args, "draft": {**args["draft"], "quantize": "int4"}})


def test_the_greedy_screen_is_a_cpu_target_pools_and_reaches_its_worker(tmp_path):
    from conftest import tiny_model
    from specserve.engine.torch_engine import load_worker
    from specserve.serve.config import PoolArgs

    tiny_model("qwen2", seed=0).save_pretrained(tmp_path)
    assert load_worker(PoolArgs(model=str(tmp_path), dtype="float32").model_dump()).greedy_screen is not None  # default
    assert load_worker(PoolArgs(model=str(tmp_path), dtype="float32", greedy_screen=False).model_dump()).greedy_screen is None
    assert load_worker(PoolArgs(model=str(tmp_path), dtype="float32").model_dump(), "draft").greedy_screen is None
    args = yaml.safe_load(next(m for m in MANIFESTS if m.name == "local.yaml").read_text())["applications"][0]["args"]
    with pytest.raises(ValidationError, match="draft.greedy_screen"):
        AppArgs.model_validate({**args, "draft": {**args["draft"], "greedy_screen": True}})
    with pytest.raises(ValidationError, match="greedy_screen is the torch engine's on CPU"):
        AppArgs.model_validate({**args, "target": {**args["target"], "device": "cuda", "greedy_screen": True}})
