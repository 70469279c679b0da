"""The GPU comparison's configs (specserve.benchmarks.gpu_vllm): what it starts must be what a user
would deploy, checked by the same validators (specserve's AppArgs, Ray's ServeDeploySchema)."""

import argparse
import doctest
import json

from ray.serve.schema import ServeDeploySchema

from specserve.benchmarks import gpu_vllm
from specserve.serve.config import AppArgs


def bench_args(**overrides):
    values = dict(model="/models/target", draft=None, max_model_len=4096, kv_cache_gib=4.0, load_format="dummy")
    return argparse.Namespace(**(values | overrides))


def test_both_specserve_systems_are_valid_apps_of_one_valid_serve_config():
    config = gpu_vllm.specserve_config(bench_args())
    ServeDeploySchema.model_validate(config)
    apps = {app["name"]: AppArgs.model_validate(app["args"]) for app in config["applications"]}
    assert apps["pools"].target.engine == apps["pools"].draft.engine == "vllm"
    assert apps["pools"].speculation.policy == "fixed" and apps["pools"].speculation.k == gpu_vllm.K
    assert apps["native"].speculation.proposer == "native" and apps["native"].draft is None
    native = apps["native"].target.engine_kwargs["speculative_config"]
    assert native == {"method": "draft_model", "model": "/models/target", "num_speculative_tokens": gpu_vllm.K}
    # every engine on the GPU gets a fixed KV budget, so none profiles memory against the others
    assert apps["pools"].draft.engine_kwargs["kv_cache_memory_bytes"] == 4 * 2**30


def test_only_vllm_s_native_server_speculates_and_a_real_draft_is_used_where_named():
    none = gpu_vllm.vllm_command(bench_args(), "vllm none")
    native = gpu_vllm.vllm_command(bench_args(draft="/models/draft"), "vllm native k=4")
    assert "--speculative-config" not in none
    assert json.loads(native[native.index("--speculative-config") + 1])["model"] == "/models/draft"
    assert none[none.index("--port") + 1] != native[native.index("--port") + 1]


def test_the_module_s_examples_hold():
    assert doctest.testmod(gpu_vllm).failed == 0
