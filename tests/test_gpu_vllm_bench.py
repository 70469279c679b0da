"""The GPU comparison's configs (specserve.benchmarks.gpu_vllm): what it starts must be what a user
would deploy, checked by the same validators (specserve's AppArgs, Ray's ServeDeploySchema)."""

import argparse
import doctest
import json

from ray.serve.schema import ServeDeploySchema

from specserve.benchmarks import gpu_vllm
from specserve.serve.config import AppArgs


def bench_args(**overrides):
    values = dict(model="/models/target", draft=None, max_model_len=4096, kv_cache_gib=4.0, load_format="dummy",
                  max_num_seqs=32, systems=list(gpu_vllm.SYSTEMS), work="/tmp/w")
    return argparse.Namespace(**(values | overrides))


def test_the_specserve_systems_are_valid_apps_of_one_valid_serve_config():
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
    # the same pools again, drafting the next round during each verify
    assert apps["aheadpools"].speculation.draft_ahead and not apps["pools"].speculation.draft_ahead
    assert apps["aheadpools"].target == apps["pools"].target and apps["aheadpools"].draft == apps["pools"].draft
    # and that with Serve's default calls between replicas (by reference) instead of gRPC
    assert apps["aheadpools"].fast_replica_calls and not apps["aheadslow"].fast_replica_calls
    assert apps["aheadslow"].speculation == apps["aheadpools"].speculation
    # and pipelined on a streamed draft; the pools taking turns do not pipeline (the default on CUDA would)
    assert apps["pipeline"].speculation.pipeline == gpu_vllm.PIPELINE and not apps["pipeline"].speculation.draft_ahead
    assert apps["pools"].speculation.pipeline == apps["aheadpools"].speculation.pipeline == 0
    # each router traces its rounds into the work directory (round_profile reads them)
    traces = {app.router.ray_actor_options["runtime_env"]["env_vars"]["SPECSERVE_POLICY_TRACE"]
              for app in apps.values()}
    assert traces == {"/tmp/w/trace-specserve_vllm_pools_k4.jsonl",
                      "/tmp/w/trace-specserve_vllm_pools_k4_draft_ahead.jsonl",
                      "/tmp/w/trace-specserve_vllm_pools_k4_draft_ahead_default_calls.jsonl",
                      "/tmp/w/trace-specserve_vllm_pools_k4_pipeline.jsonl",
                      "/tmp/w/trace-specserve_native_k4.jsonl"}
    # Ray's GPU shares of the pools fit the one GPU
    shares = [pool.ray_actor_options["num_gpus"] for app in apps.values() for pool in (app.target, app.draft) if pool]
    assert len(shares) == 9 and sum(shares) <= 1.0


def test_only_the_systems_asked_for_are_deployed():
    config = gpu_vllm.specserve_config(bench_args(systems=["vllm none", "specserve native k=4"]))
    assert [app["name"] for app in config["applications"]] == ["native"]


def test_only_vllm_s_native_server_speculates_and_a_real_draft_is_used_where_named():
    none = gpu_vllm.vllm_command(bench_args(), "vllm none")
    native = gpu_vllm.vllm_command(bench_args(draft="/models/draft"), "vllm native k=4")
    assert "--speculative-config" not in none
    assert json.loads(native[native.index("--speculative-config") + 1])["model"] == "/models/draft"
    assert none[none.index("--port") + 1] != native[native.index("--port") + 1]


def test_the_module_s_examples_hold():
    assert doctest.testmod(gpu_vllm).failed == 0


def test_a_load_reads_tokens_ttft_and_passes_from_the_openai_stream():
    """run_load against a server that streams like specserve's completions API (chunks, then a
    usage chunk with the speculation extension, then [DONE]), four prompts on two streams."""
    import asyncio

    import httpx

    seen = []

    def server(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        chunks = [{"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]},
                  {"choices": [], "usage": {"completion_tokens": 8, "speculation": {
                      "target_steps": 2, "round_trip_overhead_ms_per_round": 4.0 + len(seen)}}}]
        lines = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, content=lines.encode(), headers={"content-type": "text/event-stream"})

    row = asyncio.run(gpu_vllm.run_load("specserve native k=4", ["p1", "p2", "p3", "p4"], 2, 8,
                                        transport=httpx.MockTransport(server)))
    assert row["tokens"] == 32 and row["tokens_per_round"] == 4.0 and row["ttft_s"] >= 0
    assert row["overhead_ms_per_round"] == 6.5  # the median of 5, 6, 7, 8 ms
    assert len(seen) == 4 and all(b["ignore_eos"] and b["temperature"] == 0.0 and b["stream"] for b in seen)
    assert {b["prompt"] for b in seen} == {"p1", "p2", "p3", "p4"}


def test_a_refused_request_stops_the_load_with_the_server_s_answer():
    import asyncio

    import httpx
    import pytest

    transport = httpx.MockTransport(lambda request: httpx.Response(400, json={"error": {"message": "no"}}))
    with pytest.raises(RuntimeError, match="HTTP 400"):
        asyncio.run(gpu_vllm.run_load("vllm none", ["p"], 1, 8, transport=transport))


def test_the_table_compares_each_system_with_vllm_s_own_speculation_at_the_same_streams():
    rows = [{"system": s, "streams": n, "tok_s": tok_s, "ttft_s": 0.05, "tokens_per_round": per_round,
             "overhead_ms_per_round": overhead}
            for s, n, tok_s, per_round, overhead in (
                ("vllm native k=4", 1, 200.0, 4.5, None), ("vllm native k=4", 1, 220.0, 4.7, None),
                ("specserve native k=4", 1, 105.0, 4.6, 7.25), ("vllm none", 4, 400.0, None, None))]
    summary = {(r["system"], r["streams"]): r for r in gpu_vllm.summarize(rows)}
    assert summary[("vllm native k=4", 1)]["tok_s"] == 210.0
    assert summary[("vllm native k=4", 1)]["tokens_per_round"] == 4.6
    assert summary[("specserve native k=4", 1)]["vs_vllm_native"] == 0.5
    assert summary[("vllm none", 4)]["vs_vllm_native"] is None  # no peer at 4 streams in this run
    table = gpu_vllm.markdown({"summary": gpu_vllm.summarize(rows)})
    assert "| specserve native k=4 | 1 | 105.0 (105.0) | 50 | 4.60 | 7.2 | 0.5x |" in table
    assert "| vllm none | 4 | 400.0 (400.0) | 50 | - | - | - |" in table


def test_each_router_s_trace_says_where_its_rounds_went(tmp_path):
    """round_profiles reads the traces the routers wrote: rounds of one stream that had a draft."""
    system = "specserve vllm pools k=4 draft ahead"
    lines = [{"in_flight": 1, "round_s": 0.032, "verify_s": 0.014, "draft_s": 0.016, "drafted_ahead": True,
              "ahead_wait_s": 0.003},
             {"in_flight": 1, "round_s": 0.048, "verify_s": 0.014, "draft_s": 0.016, "drafted_ahead": False,
              "ahead_wait_s": 0.002},
             {"in_flight": 1, "round_s": 0.020, "verify_s": 0.014, "draft_s": None},  # the first round: no draft
             {"in_flight": 4, "round_s": 0.090, "verify_s": 0.030, "draft_s": 0.030, "drafted_ahead": True}]
    gpu_vllm.trace_path(tmp_path, system).write_text("".join(json.dumps(line) + "\n" for line in lines))
    profiles = gpu_vllm.round_profiles(tmp_path, [system, "vllm native k=4"])
    assert profiles == {system: {"rounds": 2, "drafted_ahead": 0.5, "round_ms": 40.0, "verify_ms": 14.0,
                                 "draft_ms": 16.0, "ahead_wait_ms": 2.5, "rest_ms": 18.0}}
    table = gpu_vllm.markdown({"summary": [], "rounds": profiles})
    assert f"| {system} | 2 | 50% | 40.0 | 14.0 | 16.0 | 2.5 | 18.0 |" in table


def test_a_failed_start_shows_the_error_lines_of_the_logs(tmp_path):
    log = tmp_path / "engine.log"
    log.write_text("INFO starting\n  File \"x.py\", line 1, in <module>\nValueError: Free memory on device (50/80 GiB)\n"
                   "RuntimeError: Engine core initialization failed.\nValueError: Free memory on device (50/80 GiB)\n")
    stdout = tmp_path / "worker.out"  # vLLM's engine core logs to stdout
    stdout.write_text("(EngineCore pid=7) ERROR 11-26 EngineCore failed to start.\nINFO fine\n")
    assert gpu_vllm.error_lines([log, tmp_path / "missing.log", stdout]) == [
        "ValueError: Free memory on device (50/80 GiB)", "RuntimeError: Engine core initialization failed.",
        "(EngineCore pid=7) ERROR 11-26 EngineCore failed to start."]


def test_every_engine_gets_the_same_small_batch_limit():
    """CUDA graphs are captured up to 2 x max_num_seqs tokens: the same limit for every engine."""
    native_args = gpu_vllm.vllm_command(bench_args(max_num_seqs=16), "vllm native k=4")
    assert native_args[native_args.index("--max-num-seqs") + 1] == "16"
    config = gpu_vllm.specserve_config(bench_args(max_num_seqs=16))
    pools = [app["args"][role] for app in config["applications"] for role in ("target", "draft") if role in app["args"]]
    assert len(pools) == 9 and all(p["engine_kwargs"]["max_num_seqs"] == 16 for p in pools)


def test_a_bench_past_its_budget_keeps_what_it_measured(tmp_path, monkeypatch):
    """Past --bench-budget-s no new row starts; the rows so far are in results.json already."""
    calls = []

    async def fake_load(system, prompts, streams, max_tokens, transport=None):
        calls.append((system, streams, max_tokens))
        return {"tokens": 8, "wall_s": 1.0, "tok_s": 8.0, "ttft_s": 0.01, "tokens_per_round": None}

    clock = iter(range(0, 1000, 10))
    monkeypatch.setattr(gpu_vllm, "run_load", fake_load)
    args = bench_args(systems=["vllm none", "specserve native k=4"], max_tokens=8, streams=[1, 4], passes=2,
                      single_stream_prompts=1, bench_budget_s=25)
    results = gpu_vllm.bench(args, tmp_path, clock=lambda: next(clock))
    assert results["cut_short"] and len(results["passes"]) == 2  # rows at t=10 and t=20, then past 25 s
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [r["system"] for r in saved["passes"]] == ["vllm none", "specserve native k=4"]
    assert "Cut short" in gpu_vllm.markdown(results)


def test_a_system_that_fails_is_reported_and_the_others_still_measured(tmp_path, monkeypatch):
    async def load(system, prompts, streams, max_tokens, transport=None):
        if system == "specserve vllm pools k=4":
            raise RuntimeError("HTTP 500: IndexError")
        return {"tokens": 8, "wall_s": 1.0, "tok_s": 8.0, "ttft_s": 0.01, "tokens_per_round": None}

    monkeypatch.setattr(gpu_vllm, "run_load", load)
    args = bench_args(systems=["vllm none", "specserve vllm pools k=4"], max_tokens=8, streams=[1], passes=1,
                      single_stream_prompts=1, bench_budget_s=600)
    results = gpu_vllm.bench(args)
    assert [r["system"] for r in results["passes"]] == ["vllm none"]
    assert "HTTP 500" in results["failed"]["specserve vllm pools k=4"]
    assert "FAILED specserve vllm pools k=4: RuntimeError('HTTP 500: IndexError')" in gpu_vllm.markdown(results)


def test_the_logs_travel_back_as_one_archive(tmp_path, monkeypatch):
    import tarfile

    work, ray_logs = tmp_path / "work", tmp_path / "ray"
    (ray_logs / "serve").mkdir(parents=True)
    work.mkdir()
    (work / "vllm_none.log").write_text("x" * 100)
    (ray_logs / "worker-1.out").write_text("head" + "y" * 50)
    (ray_logs / "serve" / "replica_pools.log").write_text("z")
    monkeypatch.setattr(gpu_vllm, "RAY_LOGS", str(ray_logs))
    path = gpu_vllm.save_logs(work, tmp_path / "out", max_file_bytes=50)
    with tarfile.open(path) as tar:
        names = tar.getnames()
        assert sorted(names) == ["ray/worker-1.out", "serve/replica_pools.log", "work/vllm_none.log"]
        assert tar.extractfile("ray/worker-1.out").read() == b"y" * 50  # the file's end


def test_the_calls_benchmark_runs_rounds_as_the_router_does(monkeypatch):
    """time_calls: a bare draft generation, propose, three bare vLLM extends of the same lengths
    (top-20, top-1, no logprobs), verify; the context grows by what verify accepted; every call
    of every round after the warm-up is timed."""
    import asyncio
    from types import SimpleNamespace

    from specserve.protocol import DETERMINISTIC, Proposal, TokenTree, VerifyResult

    prompts = []
    monkeypatch.setattr(gpu_vllm, "greedy_params",
                        lambda max_tokens, logprobs=None: SimpleNamespace(max_tokens=max_tokens, logprobs=logprobs))

    class FakeLLM:
        def __init__(self, name):
            self.name = name

        async def generate(self, prompt, params, request_id):
            prompts.append((self.name, request_id, list(prompt["prompt_token_ids"]), params.max_tokens,
                            params.logprobs))
            yield SimpleNamespace(num_cached_tokens=len(prompt["prompt_token_ids"]) - 3)

    class Draft:
        llm = FakeLLM("draft")

        async def propose(self, request):
            assert request.k == gpu_vllm.K
            return Proposal(request.request_id, TokenTree((7, 8, 9, 10), (-1, 0, 1, 2)), DETERMINISTIC)

    class Target:
        llm, last_computed = FakeLLM("target"), 6

        async def verify(self, request):
            assert list(request.draft.tokens) == [7, 8, 9, 10]
            return VerifyResult(request.request_id, 1, [7, 42])

    times, computed = asyncio.run(gpu_vllm.time_calls(Target(), Draft(), [1, 2, 3], rounds=2, decode_tokens=4))
    assert [len(times[row]) for row in gpu_vllm.CALL_ROWS] == [2, 2, 2, 2, 2, 2, 1]
    assert computed == {"verify": [6, 6], "extend": [3, 3]}
    generations = [(ids, n) for llm, rid, ids, n, _ in prompts if llm == "draft"]
    assert generations == [([1, 2, 4], gpu_vllm.K), ([1, 2, 3, 7, 43], gpu_vllm.K),
                           ([1, 2, 3, 7, 42, 7, 43], gpu_vllm.K)]
    extends = [(ids, logprobs) for _, rid, ids, _, logprobs in prompts if rid.startswith("extend")]
    assert extends[:3] == [([1, 2, 3, 8, 9, 10, 11], 20), ([1, 2, 3, 9, 10, 11, 12], 1),
                           ([1, 2, 3, 10, 11, 12, 13], None)]
    assert [ids for ids, _ in extends[3::3]] == [[1, 2, 3, 7, 42, 8, 9, 10, 11], [1, 2, 3, 7, 42, 7, 42, 8, 9, 10, 11]]
    assert [n for _, rid, _, n, _ in prompts if rid.startswith("decode")] == [1, 5]


def test_eager_applies_to_every_engine_alike():
    """--enforce-eager: vLLM's servers and every specserve pool, so the comparison stays like for like."""
    args = bench_args(enforce_eager=True)
    assert "--enforce-eager" in gpu_vllm.vllm_command(args, "vllm native k=4")
    pools = [app["args"][role] for app in gpu_vllm.specserve_config(args)["applications"]
             for role in ("target", "draft") if role in app["args"]]
    assert all(p["engine_kwargs"]["enforce_eager"] for p in pools)
    assert "--enforce-eager" not in gpu_vllm.vllm_command(bench_args(), "vllm none")
