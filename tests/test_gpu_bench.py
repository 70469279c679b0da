"""The GPU benchmark's logic on tiny models on the CPU (`--tiny`): the same code paths the GPU
run takes, except CUDA graphs and the profiler, which need a GPU."""

from __future__ import annotations

import json

from specserve.benchmarks import gpu


def test_gpu_benchmark_runs_tiny_on_cpu_and_speculation_is_exact_in_float32(tmp_path):
    assert gpu.main(["--tiny", "--device", "cpu", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    float32 = [r for r in results["exactness"] if r["dtype"] == "float32"]
    assert {r["case"] for r in float32} == {case for case, _, _ in gpu.speculations()}
    for row in float32:
        assert row["vs_engine_target_only"]["identical"] == row["vs_engine_target_only"]["of"], row
        assert row["vs_transformers_generate"]["identical"] == row["vs_transformers_generate"]["of"], row
    self_draft = {r["case"]: r for r in float32}["self chain k=4"]
    assert self_draft["acceptance_rate"] == 1.0  # the draft is the target: every token accepted
    timing = results["timing"]
    assert set(timing["engine"]["decode"]) == {"1", "4"}
    assert timing["bare_step_vs_engine"]["same_argmax"]
    assert [r["case"] for r in results["end_to_end"]][:1] == ["target only"]
    assert "Random weights" in (tmp_path / "results.md").read_text()
    graphs = results["graphs"]  # on a CPU: the static-shape passes, uncaptured
    for row in graphs["exactness"]["decode_steps"]:
        assert row["same_argmax"] and row["max_abs_logit_diff"] < 1e-4, row
        # the decode steps and the prefill: its short prompts fit a static shape too
        assert row["graph_worker"]["uncaptured_static_passes"] == row["steps"] + 1, row
    for row in graphs["exactness"]["greedy"]:
        assert row["vs_eager_target_only"]["identical"] == row["vs_eager_target_only"]["of"], row
    assert set(graphs["timing"]["decode"]) == {"1", "4"}
    assert set(graphs["timing"]["verify_trees"]) == {str(n) for n in gpu.GRAPH_TREE_NODES}
    assert [(r["case"], r["mode"]) for r in graphs["end_to_end"]][:2] == [("target only", "eager"),
                                                                          ("target only", "graph")]
    assert "CUDA graphs" in (tmp_path / "results.md").read_text()


def test_trees_the_benchmark_verifies_are_what_their_names_say():
    chain, tree = gpu.chain_tree(4), gpu.balanced_tree(8)
    assert chain.parents == (-1, 0, 1, 2)
    assert tree.parents == (-1, -1, 0, 0, 1, 1, 2, 2)  # two children per node, breadth first
    assert gpu.first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert gpu.first_mismatch([1, 2, 3], [1, 5, 3]) == 1
    assert gpu.first_mismatch([1, 2], [1, 2, 3]) == 2


def test_the_engine_leaves_the_attention_backend_to_pytorch_on_cpu():
    from conftest import tiny_model
    from specserve.engine.torch_worker import TorchWorker

    assert TorchWorker(tiny_model()).attention_backends is None  # CPU passes are unchanged
