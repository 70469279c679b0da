"""`specserve bench` end to end on tiny models: files written, systems and machine in the JSON,
table rows, valid PNGs, unavailable systems reported with a reason, and a wrong system flagged."""

from __future__ import annotations

import argparse
import fnmatch
import itertools
import json
import pathlib
import subprocess

import pytest

from conftest import tiny_heads, tiny_hydra_heads, perturbed, tiny_model
from specserve import models
from specserve.benchmarks import library, suite, systems, vllm_runner, workloads
from specserve.protocol import LEGACY_METHODS

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A byte-level BPE tokenizer trained on the prompts, and a tiny random target and draft using it."""
    from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [p.text for w in workloads.load(["code", "chat"], 4) for p in w.prompts]
    tok = Tokenizer(tok_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<eos>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", chat_template=CHAT_TEMPLATE)
    target = tiny_model("qwen2", vocab_size=len(tokenizer) + 16, max_positions=2048)  # rows may exceed tokens
    target.config.eos_token_id = target.generation_config.eos_token_id = tokenizer.eos_token_id
    dirs = {}
    for name, model in (("target", target), ("draft", perturbed(target))):
        dirs[name] = tmp_path_factory.mktemp(name)
        model.save_pretrained(dirs[name])
        tokenizer.save_pretrained(dirs[name])
    dirs["heads"] = tiny_heads(target, noise=0.02).save(tmp_path_factory.mktemp("heads"))
    dirs["hydra"] = tiny_hydra_heads(target, noise=0.02).save(tmp_path_factory.mktemp("hydra"))
    return dirs


def _wrong_when_k2(real):
    """A deliberately wrong system: specserve draft with k=2 whose last token is changed."""
    def run(decoder, system, batch, max_tokens):
        result = real(decoder, system, batch, max_tokens)
        if system.options.get("k") == 2 and result.token_ids[0]:
            result.token_ids[0][-1] = (result.token_ids[0][-1] + 1) % 300
        return result
    return run


def test_bench_library_mode_end_to_end(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setattr(systems, "SPECSERVE_VARIANTS", [*systems.SPECSERVE_VARIANTS, ("draft", {"k": 2}),
                                                        ("tree", {"tree": {"budget": 4, "depth": 2}}),
                                                        ("hydra", {"shape": "tree"}), ("redrafter", {"k": 2}),
                                                        ("no-such-method", {})])
    monkeypatch.setattr(library, "specserve_call", _wrong_when_k2(library.specserve_call))
    out, docs = tmp_path / "out", tmp_path / "docs"
    on_disk_before_service = {}
    real_service_mode = suite._service_mode

    def service_mode_after_checkpoint(*args):
        on_disk_before_service.update(json.loads((out / "results.json").read_text()))
        return real_service_mode(*args)

    monkeypatch.setattr(suite, "_service_mode", service_mode_after_checkpoint)
    code = suite.main(["--target", str(tiny_pair["target"]), "--draft", str(tiny_pair["draft"]),
                       "--heads", str(tiny_pair["heads"]), str(tiny_pair["hydra"]),  # one per method
                       "--dtype", "float32", "--prompts", "2", "--max-tokens", "6", "--modes", "library",
                       "--vllm-python", str(tmp_path / "no-vllm" / "python"), "--out", str(out),
                       "--docs", str(docs), "--no-progress", "--threads", "1"])
    assert code == 0
    doc = json.loads((out / "results.json").read_text())
    md = (out / "results.md").read_text()
    # library mode was saved before the next phase began, so an interrupted run keeps it
    assert on_disk_before_service["partial"] and not doc["partial"]
    assert len(on_disk_before_service["library"]) == len(doc["library"])
    assert "Partial results" not in md

    names = {r["system"] for r in doc["library"]}
    assert {"specserve none", "specserve draft k=4", "specserve draft k=2", "specserve medusa shape=tree",
            "transformers target only",
            "transformers assisted", "transformers prompt lookup", "vllm none", "vllm draft_model k=4",
            "vllm ngram k=4", "specserve no-such-method"} <= names
    assert {r["workload"] for r in doc["library"]} == {"code", "chat"}
    for key in ("cpu", "cores", "torch", "transformers", "ray", "vllm", "dtype", "platform"):
        assert key in doc["machine"]
    assert doc["machine"]["dtype"] == "float32"

    by = {(r["system"], r["workload"]): r for r in doc["library"]}
    for workload in ("code", "chat"):
        none = by["specserve none", workload]
        assert none["status"] == "ok" and none["speedup"] == pytest.approx(1.0) and len(none["prompts"]) == 2
        assert by["specserve draft k=4", workload]["same_as_reference"] == 2  # exact in float32
        assert not by["specserve draft k=4", workload]["mismatch"]
        assert by["specserve draft k=2", workload]["mismatch"]  # the deliberately wrong system is caught
        assert by["specserve medusa shape=tree", workload]["same_as_reference"] == 2  # heads from --heads
        # the same loaded target with the other heads: a decoder holding Medusa heads refuses hydra
        hydra = by["specserve hydra shape=tree", workload]
        assert hydra["status"] == "ok" and hydra["same_as_reference"] == 2, hydra["reason"]
        no_heads = by["specserve redrafter k=2", workload]
        assert no_heads["status"] == "cannot run" and "train-heads --method redrafter" in no_heads["reason"]
        assert by["transformers assisted", workload]["reference"] == "transformers target only"
        for name in ("vllm none", "vllm draft_model k=4", "vllm ngram k=4"):
            assert by[name, workload]["status"] == "cannot run" and "vLLM environment" in by[name, workload]["reason"]
        if "tree" in LEGACY_METHODS:  # tree settings given as JSON reach the decoder as a TreeSpec
            tree = by["specserve tree budget=4 depth=2", workload]
            assert tree["status"] == "ok" and tree["same_as_reference"] == 2, tree["reason"]
        unknown = by["specserve no-such-method", workload]
        assert unknown["status"] == "cannot run" and "not in this specserve" in unknown["reason"]

    rows = {line.split("|")[1].strip(): line for line in md.splitlines() if line.startswith("| ")}
    for name in names:
        assert name in rows
    assert "**✗ 0/2**" in rows["specserve draft k=2"] or "**✗ 1/2**" in rows["specserve draft k=2"]
    assert "✓ 2/2" in rows["specserve draft k=4"]
    assert "cannot run" in rows["vllm none"] and "make vllm-env" in rows["vllm none"]
    assert "**specserve draft k=2** matches specserve none" in md  # listed under Correctness

    for directory in (out, docs / "bench"):
        png = directory / "speedup.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        import matplotlib.image

        assert matplotlib.image.imread(png).shape[0] > 100
    assert "](bench/speedup.png)" in (docs / "BENCHMARKS.md").read_text()

    # a saved run renders again without measuring anything
    assert suite.main(["--render", str(out / "results.json"), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "results.md").read_text() == md


def _run(system, engine, method, seconds, tokens, batch=1, **kwargs):
    return systems.LibraryRun(system, engine, method, "code", batch,
                              calls=[systems.Call(["a"], seconds, [tokens])], **kwargs)


def _fake_vllm(order: list[str], requests: list[dict]):
    """A vLLM runner stand-in: eager is faster at batch 1, compiled at batch 2, and compiled cannot
    start a draft_model engine."""
    def run(request, python, log_path, bar, calls, timeout_s, title):
        order.append(title)
        requests.append(request)
        bar.update(calls)
        settings = request["settings"]
        if settings == "compiled" and (request["speculative_config"] or {}).get("method") == "draft_model":
            return {"status": "failed", "error": "RuntimeError: no compile here\ntraceback ...",
                    "settings": vllm_runner.describe(settings)}
        seconds = {("eager", 1): 1.0, ("compiled", 1): 2.0, ("eager", 2): 2.0, ("compiled", 2): 1.0}
        return {"status": "ok", "settings": vllm_runner.describe(settings), "load_s": 5.0, "cells": [
            {"workload": cell["workload"], "batch": cell["batch"], "spec_decode": {},
             "calls": [{"token_ids": [[7, 8, 9] for _ in batch], "seconds": seconds[settings, cell["batch"]]}
                       for batch in cell["calls"]]}
            for cell in request["cells"]]}
    return run


def test_bench_interleaves_passes_and_keeps_vllms_fastest_settings(tiny_pair, tmp_path, monkeypatch):
    order: list[str] = []
    requests: list[dict] = []
    monkeypatch.setattr(library, "run_vllm_subprocess", _fake_vllm(order, requests))
    real_call = library.specserve_call

    def specserve_call(decoder, system, batch, max_tokens):
        if max_tokens != library.WARM_UP_TOKENS:
            order.append(system.name)
        assert decoder.eos_token_ids == {tokenizer_eos}  # the decoder stops on the bench's stop ids
        return real_call(decoder, system, batch, max_tokens)

    monkeypatch.setattr(library, "specserve_call", specserve_call)
    import specserve.loading

    loads = []
    real_load = specserve.loading.load_pair
    monkeypatch.setattr(specserve.loading, "load_pair", lambda *a, **kw: loads.append(1) or real_load(*a, **kw))
    tokenizer_eos = models.load_tokenizer(str(tiny_pair["target"])).eos_token_id
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 0.32.0\n")
    python.chmod(0o755)
    out = tmp_path / "out"
    assert suite.main(["--target", str(tiny_pair["target"]), "--draft", str(tiny_pair["draft"]), "--heads", "none",
                       "--dtype", "float32", "--workloads", "code", "--prompts", "2", "--max-tokens", "5",
                       "--modes", "library", "--systems", "specserve none", "vllm*", "transformers*",
                       "--batch-sizes", "1", "2",
                       "--repeats", "2", "--vllm-python", str(python), "--out", str(out), "--no-progress",
                       "--threads", "1"]) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["setup"]["stop_token_ids"] == [tokenizer_eos]
    assert all(r["stop_token_ids"] == [tokenizer_eos] for r in requests)  # vLLM stops on the same ids

    # A B C D, then D C B A; in the first pass every vLLM system under both settings, later only the winners
    by = {(r["system"], r["batch"]): r for r in doc["library"]}
    hf = by["transformers target only", 2]
    assert hf["status"] == "ok" and len(hf["prompts"]) == 2
    one = [ids for call in by["transformers target only", 1]["calls"] for ids in call["token_ids"]][:2]
    assert hf["calls"][0]["token_ids"] == one  # left-padded batches decode as one at a time (float32)
    assert by["transformers assisted", 2]["status"] == "cannot run" and "batch 1 only" in by["transformers assisted", 2]["reason"]
    assert by["transformers assisted", 1]["status"] == "ok"
    assert len(loads) == 2  # released while vLLM ran, loaded again for the second pass's in-process systems
    turns = [name for name, _ in itertools.groupby(order)]  # a specserve pass makes several calls
    assert turns == ["specserve none",
                     "vllm none [eager]", "vllm none [compiled]", "vllm draft_model k=4 [eager]",
                     "vllm draft_model k=4 [compiled]", "vllm ngram k=4 [eager]", "vllm ngram k=4 [compiled]",
                     "vllm ngram k=4 [eager]", "vllm ngram k=4 [compiled]", "vllm draft_model k=4 [eager]",
                     "vllm none [eager]", "vllm none [compiled]",
                     "specserve none"]
    assert [c["batch"] for c in requests[6]["cells"]] == [1] and [c["batch"] for c in requests[7]["cells"]] == [2]

    by = {(r["system"], r["batch"]): r for r in doc["library"]}
    assert by["vllm none", 1]["settings"]["name"] == "eager" and by["vllm none", 2]["settings"]["name"] == "compiled"
    assert by["vllm none", 1]["settings"]["enforce_eager"] is True
    assert by["vllm none", 1]["settings"]["env VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert by["vllm none", 1]["tokens_per_second_by_repeat"] == pytest.approx([3.0, 3.0])  # 3 tokens a second
    assert by["vllm none", 2]["tokens_per_second_by_repeat"] == pytest.approx([6.0, 6.0])  # 2 x 3 tokens a second
    assert by["vllm draft_model k=4", 2]["settings"]["name"] == "eager"  # the only one that started
    assert "compiled failed" in by["vllm draft_model k=4", 2]["note"]
    for batch in (1, 2):
        none = by["specserve none", batch]
        assert none["status"] == "ok" and len(none["prompts"]) == 2
        assert none["tokens_per_second_by_repeat"] and len(none["tokens_per_second_by_repeat"]) == 2
        assert none["vs_vllm_system"] == "vllm none" and none["vs_vllm"] > 0
    medusa = by["vllm medusa k=4", 1]  # --heads none: vLLM's Medusa has no heads to run
    assert medusa["status"] == "cannot run" and "Medusa heads" in medusa["reason"]
    failed = [t for t in doc["vllm_settings"] if t["status"] != "ok"]
    assert {t["system"] for t in failed} == {"vllm draft_model k=4"}
    assert "no compile here" in failed[0]["reason"] and "traceback" not in failed[0]["reason"]

    md = (out / "results.md").read_text()
    assert "### vLLM engine settings" in md and "Throughput (tok/s) by batch size" in md
    assert "specserve against vLLM" in md and "RuntimeError: no compile here" in md
    assert (out / "batch_throughput.png").read_bytes()[:4] == b"\x89PNG"


def test_a_run_on_uncommitted_code_says_so(tmp_path):
    """The report names the commit it measured; edits to specserve/ not yet committed mark it
    "+modified" (a policy tried before committing ran as the commit's own in earlier reports).
    Other files (docs, tests, untracked ones) do not."""
    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    assert suite.git_commit(tmp_path) == "unknown"  # not a checkout
    git("init", "-q")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "empty")
    (tmp_path / "specserve").mkdir()
    (tmp_path / "specserve" / "policy.py").write_text("margin = 0.2\n")
    (tmp_path / "README.md").write_text("docs\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "code")
    commit = suite.git_commit(tmp_path)
    assert len(commit) >= 7 and "+" not in commit
    (tmp_path / "README.md").write_text("docs, edited\n")
    (tmp_path / "specserve" / "new.py").write_text("")  # untracked
    assert suite.git_commit(tmp_path) == commit
    (tmp_path / "specserve" / "policy.py").write_text("margin = 0.1\n")
    assert suite.git_commit(tmp_path) == commit + "+modified"


def test_compare_flags_mismatches_and_speedups():
    none = _run("specserve none", "specserve", "none", 2.0, [1, 2, 3])
    fast = _run("specserve draft k=4", "specserve", "draft", 1.0, [1, 2, 3])
    wrong = _run("specserve tree", "specserve", "tree", 0.5, [1, 9, 3])
    hf = _run("transformers target only", "transformers", "none", 2.0, [1, 2, 4])
    systems.compare([none, fast, wrong, hf])
    assert fast.speedup == pytest.approx(2.0) and not fast.mismatch
    assert wrong.speedup == pytest.approx(4.0) and wrong.mismatch and wrong.first_difference == [1]
    assert hf.reference == "" and not hf.mismatch  # its own target-only reference is itself
    assert hf.same_as_specserve_none == 0


def test_compare_gives_specserve_ratios_to_vllm_at_the_same_batch():
    """Target-only against vLLM none, speculative against vLLM's fastest speculative system."""
    runs = [_run("specserve none", "specserve", "none", 3.0, [1, 2, 3]),
            _run("specserve draft k=4", "specserve", "draft", 1.0, [1, 2, 3]),
            _run("vllm none", "vllm", "none", 2.0, [1, 2, 3]),
            _run("vllm draft_model k=4", "vllm", "draft_model", 1.5, [1, 2, 3]),
            _run("vllm ngram k=4", "vllm", "ngram", 1.0, [1, 2, 3]),
            _run("specserve none", "specserve", "none", 1.0, [1, 2, 3, 4], batch=4),  # another batch: its own group
            _run("vllm none", "vllm", "none", 4.0, [1, 2, 3, 4], batch=4)]
    systems.compare(runs)
    by = {(r.system, r.batch): r for r in runs}
    assert by["specserve none", 1].vs_vllm == pytest.approx((3 / 3.0) / (3 / 2.0))
    assert by["specserve draft k=4", 1].vs_vllm == pytest.approx(3 / 3)  # vs ngram, vLLM's fastest speculative
    assert by["specserve draft k=4", 1].vs_vllm_system == "vllm ngram k=4"
    assert by["specserve none", 4].vs_vllm == pytest.approx(4.0) and by["specserve none", 4].speedup == 1.0
    assert by["vllm none", 1].vs_vllm is None


def test_library_run_sums_every_pass_and_compares_the_first():
    run = systems.LibraryRun("s", "specserve", "none", "code", 2, calls=[
        systems.Call(["a", "b"], 1.0, [[1, 2], [3]], repeat=0),
        systems.Call(["a", "b"], 3.0, [[1, 2], [3]], repeat=1)])
    assert run.tokens == 6 and run.tokens_per_second == pytest.approx(1.5)
    assert run.tokens_per_second_by_repeat == pytest.approx([3.0, 1.0])
    assert run.outputs == [[1, 2], [3]] and run.prompts == ["a", "b"]
    assert run.latency_p50_s == pytest.approx(2.0)


def test_cells_are_full_batches_of_the_same_prompts():
    workload = workloads.Workload("code", "x", False, tuple(workloads.Prompt(f"p{i}", "") for i in range(16)))
    ids = [[i] for i in range(16)]
    assert library.prompts_needed(8, [1, 4, 8, 16]) == 16 and library.prompts_needed(3, [2]) == 4
    cells = {c.batch: c for c in library.make_cells([(workload, ids)], [1, 4, 16], 8)}
    assert [len(batch) for _, batch in cells[1].calls] == [1] * 8
    assert [names for names, _ in cells[4].calls] == [["p0", "p1", "p2", "p3"], ["p4", "p5", "p6", "p7"]]
    assert cells[16].calls[0][1] == ids
    with pytest.raises(ValueError, match="batch 16 needs 16"):
        library.make_cells([(workload, ids[:8])], [16], 8)


def test_presets_fill_what_the_command_line_leaves_out():
    parse = suite.build_parser().parse_args

    args = parse(["--preset", "batch"])
    suite.resolve_defaults(args)
    assert args.batch_sizes == [1, 4, 8, 16] and args.modes == ["library"] and args.repeats == 2
    assert args.vllm_settings == "auto" and args.prompts == 8 and args.max_tokens == 128
    assert "vllm draft_model k=4" in args.systems

    args = parse(["--preset", "batch", "--quick", "--max-tokens", "4"])  # quick's sizes, the preset's systems
    suite.resolve_defaults(args)
    assert args.batch_sizes == [1, 4, 8, 16] and args.prompts == 1 and args.max_tokens == 4 and args.repeats == 1
    assert args.vllm_settings == "eager"

    args = parse(["--preset", "http"])
    suite.resolve_defaults(args)
    assert args.modes == ["service"] and args.manifest == "manifests/local.yaml" and args.concurrency == [1, 4]
    assert args.service_requests == 4 and args.service_max_tokens == 128

    args = parse([])
    suite.resolve_defaults(args)
    assert args.modes == ["library", "service"] and args.batch_sizes == [1] and args.systems is None
    assert args.service_max_tokens == 64 and args.workloads == ["code", "chat"]


@pytest.mark.parametrize("module, preset", [("engine", "engine"), ("trees", "trees"), ("medusa", "medusa"),
                                            ("http", "http")])
def test_older_benchmark_scripts_are_presets(module, preset, monkeypatch):
    import importlib

    seen = []
    monkeypatch.setattr(suite, "main", lambda argv: seen.append(argv) or 0)
    assert importlib.import_module(f"specserve.benchmarks.{module}").main(["--prompts", "2"]) == 0
    assert seen == [["--preset", preset, "--prompts", "2"]]


def test_memory_per_token_reads_the_worker_when_it_reports(monkeypatch):
    from types import SimpleNamespace

    from transformers import Qwen2Config

    config = Qwen2Config(num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, hidden_size=1536)
    plain = SimpleNamespace(model=SimpleNamespace(config=config))
    reporting = SimpleNamespace(model=SimpleNamespace(config=config), kv_bytes_per_token=lambda: 30000)
    memory = suite.memory_per_token(SimpleNamespace(target=reporting, draft=plain), "bfloat16")
    assert memory["target"] == {"specserve_kv_bytes_per_token": 30000, "k_and_v_bytes_per_token": 28672}
    assert memory["draft"]["specserve_kv_bytes_per_token"] is None  # before the worker reports it


def test_stop_ids_are_the_registry_the_config_and_the_tokenizer(tmp_path):
    from types import SimpleNamespace

    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [5, 7]}')
    assert suite.stop_token_ids(str(tmp_path), SimpleNamespace(eos_token_id=9)) == [5, 7, 9]
    ids = models.REGISTRY["qwen2.5-coder-1.5b-instruct"].eos_token_ids
    assert set(ids) <= set(suite.stop_token_ids("qwen2.5-coder-1.5b-instruct", SimpleNamespace(eos_token_id=None)))


def test_workload_subsets_are_fixed_by_the_seed():
    a, b = workloads.mtbench(8, seed=0), workloads.mtbench(8, seed=0)
    assert a == b
    assert len({p.id.split("/")[2] for p in a.prompts}) == 8  # one question per category
    assert workloads.humaneval(3, seed=1) != workloads.humaneval(3, seed=0)
    assert workloads.humaneval(3, seed=0).prompts == workloads.humaneval(5, seed=0).prompts[:3]


SMOL = "smollm2-135m-instruct"


@pytest.mark.slow
@pytest.mark.serve
def test_bench_service_mode_on_smollm2(tmp_path, monkeypatch):
    if not models.is_cached(SMOL):
        pytest.skip(f"run `specserve models pull {SMOL}` first (make test does)")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # its own `serve run`, never a test session's cluster
    out = tmp_path / "out"
    assert suite.main(["--target", SMOL, "--draft", SMOL, "--dtype", "float32", "--modes", "service",
                       "--workloads", "code", "--prompts", "1", "--max-tokens", "4", "--concurrency", "1", "2",
                       "--service-requests", "2", "--service-repeats", "2",
                       "--systems", "specserve none", "specserve draft*", "--port", "8391",
                       "--out", str(out), "--no-progress"]) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["setup"]["service_max_tokens"] == 4  # capped by --max-tokens
    runs = {(r["system"], r["concurrency"]): r for r in doc["service"]}
    assert set(runs) == {(s, c) for s in ("specserve none", "specserve draft k=4") for c in (1, 2)}
    for run in runs.values():
        assert run["status"] == "ok", run["reason"]
        assert run["requests"] == 2 and run["tokens"] > 0 and run["ttft_p50_s"] > 0
        assert len(run["pass_throughputs"]) == 2 and len(run["texts"]) == 2  # two passes, outputs of the first
    assert runs["specserve draft k=4", 1]["same_as_reference"] == 2
    md = (out / "results.md").read_text()
    assert "## Service mode" in md and "| specserve draft k=4 | 2 |" in md
    for name in ("service_throughput.png", "service_latency.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"


def test_trees_preset_derives_static_trees_and_runs_them_with_their_own_baseline(tiny_pair, tmp_path, monkeypatch):
    # the tiny random draft is never confident: grow its trees whatever their scores
    trees = {**suite.presets.PRESETS["trees"],
             "variants": [("none", {}), ("draft", {"k": 4}),
                          *[("tree", {"tree": {"budget": b, "min_score": 0.0}}) for b in (8, 16, 32)]],
             "derive": {"from": "specserve tree budget=32 min_score=0.0", "budgets": [4, 8]}}
    monkeypatch.setitem(suite.presets.PRESETS, "trees", trees)
    out = tmp_path / "out"
    assert suite.main(["--preset", "trees", "--target", str(tiny_pair["target"]), "--draft", str(tiny_pair["draft"]),
                       "--dtype", "float32", "--prompts", "1", "--max-tokens", "6", "--repeats", "1",
                       "--out", str(out), "--no-progress", "--threads", "1"]) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["derived"]["from"] == "specserve tree budget=32 min_score=0.0" and doc["derived"]["rank_acceptance"]
    later = {r["system"]: r for r in doc["library"] if r["phase"] == 1}
    assert "specserve none (again)" in later and len(later) >= 2
    for name, run in later.items():
        assert run["status"] == "ok", run["reason"]
        if name != "specserve none (again)":
            assert name.startswith("specserve tree static from acceptance")
            assert run["reference"] == "specserve none (again)" and run["same_as_reference"] == 1  # exact in float32
    assert {r["system"] for r in doc["library"] if r["phase"] == 0} == {
        "specserve none", "specserve draft k=4", *(f"specserve tree budget={b} min_score=0.0" for b in (8, 16, 32))}
    assert "Static trees derived from **specserve tree budget=32 min_score=0.0**" in (out / "results.md").read_text()


def test_service_passes_take_turns_and_add_up(monkeypatch, tmp_path):
    """--service-repeats: at each concurrency and workload the systems run A B .. B A, and each
    system's tokens and wall time add up over its passes."""
    from types import SimpleNamespace

    order = []

    async def warm_up(*args, **kwargs):
        return 0.0, []

    def measure(run, url, model, prompt_ids, max_tokens, spec, pass_index=0):
        order.append((run.concurrency, run.system))
        run.wall_s += 2.0
        run.tokens += 10 * len(order)
        run.add_to_pass(pass_index, 10 * len(order), 2.0)

    monkeypatch.setattr(suite.service, "wait_healthy", lambda *args: None)
    monkeypatch.setattr(suite.service, "run_level", warm_up)
    monkeypatch.setattr(suite.service, "measure", measure)
    monkeypatch.setattr("httpx.get", lambda *a, **k: SimpleNamespace(json=lambda: {"data": [{"id": "m"}]}))
    bar = SimpleNamespace(set_description=lambda text: None, update=lambda n: None)
    a, b = systems.specserve_system("none", {}), systems.specserve_system("draft", {"k": 4})
    workload = SimpleNamespace(name="code")
    saved = []  # what a long sweep keeps after each level
    runs = suite.service.run_service([a, b], [(workload, [[1, 2, 3]])], manifest=None, url="http://x", max_tokens=4,
                                     requests=1, concurrency=[1, 4], log_path=tmp_path / "log", bar=bar, repeats=3,
                                     level_done=lambda finished: saved.append([(r.concurrency, r.system)
                                                                               for r in finished]))
    assert [name for c, name in order if c == 1] == [a.name, b.name, b.name, a.name, a.name, b.name]
    assert saved == [[(1, a.name), (1, b.name)], [(1, a.name), (1, b.name), (4, a.name), (4, b.name)]]
    assert len(order) == 12  # every level's passes ran before its level_done
    # as `specserve bench` keeps them: the finished levels' rows, compared, in a partial page
    doc = {**json.loads((pathlib.Path(__file__).parents[1] / "docs" / "bench" / "adaptive-1-xeon"
                         / "results.json").read_text()), "partial": True}
    suite.write_outputs({**doc, "service": suite._compared(runs[:2])}, tmp_path / "partial", None)
    assert "Partial results" in (tmp_path / "partial" / "results.md").read_text()
    assert json.loads((tmp_path / "partial" / "results.json").read_text())["service"][1]["speedup"] > 0
    by_cell = {(r.concurrency, r.system): r for r in runs}
    none_at_1 = by_cell[1, a.name]
    assert none_at_1.wall_s == 6.0 and none_at_1.tokens == 10 * (1 + 4 + 5)
    assert none_at_1.pass_throughputs == [5.0, 20.0, 25.0]
    assert "passes 5.00, 20.00, 25.00 tok/s" in suite.report._service_notes(none_at_1.as_dict())


def test_turns_go_wave_by_wave_rotated():
    """Each wave of as many prompts as streams gets its own A B C C B A turns, rotated from wave
    to wave (at 1 stream a wave is one prompt; a pass adds up its turns), so no system holds the
    level's middle in every wave, and linear drift still lands on each alike."""
    from specserve.benchmarks.service import measuring_turns

    a, b, c = (systems.specserve_system(m, {}) for m in ("none", "draft", "ngram"))
    lone = measuring_turns([a, b, c], 2, 3, 1)
    assert [(s.name, p, prompts) for s, p, prompts in lone[:6]] == [
        (a.name, 0, [0]), (b.name, 0, [0]), (c.name, 0, [0]), (c.name, 1, [0]), (b.name, 1, [0]), (a.name, 1, [0])]
    assert [s.name for s, _, _ in lone[6:9]] == [b.name, c.name, a.name]  # rotated for prompt 1
    for streams, prompts in ((1, 3), (4, 8), (4, 10), (8, 8)):
        turns = measuring_turns([a, b, c], 2, prompts, streams)
        for system in (a, b, c):  # every system sends every prompt once per pass, a wave at a time
            for p in (0, 1):
                sent = [wave for s, q, wave in turns if s is system and q == p]
                assert sorted(i for wave in sent for i in wave) == list(range(prompts))
                assert all(len(wave) <= streams for wave in sent)
    waves = measuring_turns([a, b, c], 2, 8, 4)
    assert [(s.name, p, prompts) for s, p, prompts in waves] == [
        (a.name, 0, [0, 1, 2, 3]), (b.name, 0, [0, 1, 2, 3]), (c.name, 0, [0, 1, 2, 3]),
        (c.name, 1, [0, 1, 2, 3]), (b.name, 1, [0, 1, 2, 3]), (a.name, 1, [0, 1, 2, 3]),
        (b.name, 0, [4, 5, 6, 7]), (c.name, 0, [4, 5, 6, 7]), (a.name, 0, [4, 5, 6, 7]),
        (a.name, 1, [4, 5, 6, 7]), (c.name, 1, [4, 5, 6, 7]), (b.name, 1, [4, 5, 6, 7])]
    positions = {s.name: sum(i for i, (t, _, _) in enumerate(waves) if t is s) for s in (a, b, c)}
    assert len(set(positions.values())) == 1  # each system's mean position is the level's middle
    middles = {waves[2][0].name, waves[8][0].name}  # the third turn of each wave: its middle
    assert len(middles) == 2
    one_wave = measuring_turns([a, b, c], 2, 8, 8)
    assert [(s.name, p) for s, p, _ in one_wave] == [(a.name, 0), (b.name, 0), (c.name, 0),
                                                     (c.name, 1), (b.name, 1), (a.name, 1)]
    run = systems.ServiceRun("x", "none", "code", 1)
    for p, tokens in ((0, 10), (1, 30), (0, 20)):
        run.add_to_pass(p, tokens, 2.0)
    assert run.pass_throughputs == [7.5, 15.0]


def test_closed_loop_turns_send_each_pass_as_one_turn_and_measure_the_steady_state():
    """--service-turns streams: one turn per system and pass, A B C C B A, holding every prompt;
    the steady state counts only requests that ended while every stream was busy."""
    from specserve.benchmarks.http import StreamResult, steady_state
    from specserve.benchmarks.service import measuring_turns

    a, b, c = (systems.specserve_system(m, {}) for m in ("none", "draft", "ngram"))
    turns = measuring_turns([a, b, c], 2, 10, 4, "streams")
    assert [(s.name, p) for s, p, _ in turns] == [(a.name, 0), (b.name, 0), (c.name, 0),
                                                   (c.name, 1), (b.name, 1), (a.name, 1)]
    assert all(prompts == list(range(10)) for _, _, prompts in turns)
    four = measuring_turns([a, b, c], 4, 10, 4, "streams")  # each pair of passes rotated
    assert [s.name for s, _, _ in four] == [x.name for x in (a, b, c, c, b, a, b, c, a, a, c, b)]
    assert len({sum(i for i, (s, _, _) in enumerate(four) if s is x) for x in (a, b, c)}) == 1
    with pytest.raises(ValueError, match="waves, streams"):
        measuring_turns([a], 1, 4, 2, "passes")

    def result(started, seconds, tokens):
        return StreamResult(tokens=tokens, seconds=seconds, started_s=started)

    # 2 streams, 4 requests: stream 1 sends r0 (0-2 s), r2 (2-3 s), r3 (3-6 s); stream 2 sends
    # r1 (0-4 s), whose end finds the queue empty: that stream idles from then, so r3 (ended
    # later) ran partly alone and is left out.
    results = [result(0, 2, 10), result(0, 4, 16), result(2, 1, 8), result(3, 3, 9)]
    assert steady_state(results, 2) == (10 + 16 + 8, 2 + 4 + 1)
    assert steady_state(results[:2], 2) is None  # one wave: no moment with every stream busy and more to send
    run = systems.ServiceRun("x", "draft", "code", 2)
    assert run.steady_throughput is None and run.as_dict()["steady_tok_s"] is None
    run.add_steady_state(18, 3.0)
    run.add_steady_state(12, 3.0)
    assert run.steady_throughput == 2 * 30 / 6.0
    assert "steady state 10.00 tok/s" in suite.report._service_notes(run.as_dict())


def test_the_bench_takes_its_turns_from_the_command_line():
    args = suite.build_parser().parse_args(["--preset", "adaptive"])
    suite.resolve_defaults(args)
    assert args.service_turns == "waves"
    args = suite.build_parser().parse_args(["--preset", "adaptive", "--service-turns", "streams"])
    suite.resolve_defaults(args)
    assert args.service_turns == "streams"
    with pytest.raises(SystemExit):
        suite.build_parser().parse_args(["--service-turns", "passes"])


def test_service_mode_measures_a_running_server_with_url(monkeypatch, tmp_path):
    from types import SimpleNamespace

    seen = {}
    monkeypatch.setattr(suite.service, "run_service", lambda systems_, encoded, **kw: seen.update(kw) or [])
    args = suite.build_parser().parse_args(["--preset", "http", "--url", "http://127.0.0.1:9999/"])
    suite.resolve_defaults(args)
    suite._service_mode(args, [systems.specserve_system("none", {})], [], tmp_path, SimpleNamespace(), {},
                        lambda **fields: None)
    assert seen["manifest"] is None and seen["url"] == "http://127.0.0.1:9999"  # no `serve run`
    served = next(s for s in systems.specserve_systems(suite.presets.PRESETS["http"]["variants"])
                  if s.method == systems.SERVED)
    assert suite.service.speculation(served) is None  # the deployment's own speculation, no override
    assert not served.needs_draft


def test_presets_derive_from_a_system_they_run():
    for name, preset in suite.presets.PRESETS.items():
        names = {s.name for s in systems.all_systems(preset.get("variants"), preset.get("vllm_ks"))}
        if "derive" in preset:
            assert preset["derive"]["from"] in names, name
        for pattern in preset.get("systems") or []:
            assert any(fnmatch.fnmatchcase(n, pattern) for n in names), (name, pattern)


def test_profile_section_is_written_once_and_kept_when_the_page_is_rewritten(tmp_path):
    from specserve.benchmarks import profile

    row = {"ms": 80.0, "matmuls": 60.0, "output layer": 10.0, "attention": 5.0, "other": 5.0}
    run = {"target": "t", "dtype": "bfloat16", "threads": 2, "context": 256, "passes": {"decode, batch 1": row}}
    profile.write_docs(str(tmp_path), profile.docs_section(run, {**run, "label": "old"}, "cmd"))
    profile.write_docs(str(tmp_path), profile.docs_section(run, None, "cmd"))  # replaced, not appended
    page = (tmp_path / "BENCHMARKS.md").read_text()
    assert page.count(profile.BEGIN) == 1 and "| decode, batch 1 | 80.0 | 60.0 (75%)" in page
    assert "Before (old)" not in page
    section = profile.marked_section(page)
    assert section.startswith(profile.BEGIN) and section.endswith(profile.END)


def test_benchmarks_page_keeps_every_marked_section_when_a_run_rewrites_it(tmp_path):
    from specserve.benchmarks import profile, report, suite

    row = {"ms": 80.0, "matmuls": 60.0, "output layer": 10.0, "attention": 5.0, "other": 5.0}
    run = {"target": "t", "dtype": "bfloat16", "threads": 2, "context": 256, "passes": {"decode, batch 1": row}}
    profile.write_docs(str(tmp_path), profile.docs_section(run, None, "cmd"))
    sweep = "<!-- load-aware: from docs/bench/sweep -->\n## Load-aware\n\n| a |\n<!-- /load-aware -->"
    page = tmp_path / "BENCHMARKS.md"
    page.write_text(page.read_text() + "\n" + sweep + "\n")
    saved = pathlib.Path(__file__).parents[1] / "docs" / "bench" / "adaptive-1-xeon" / "results.json"
    suite.write_outputs(json.loads(saved.read_text()), tmp_path / "out", str(tmp_path))
    rewritten = page.read_text()
    assert report.kept_sections(rewritten) == [profile.marked_section(rewritten), sweep]
    assert rewritten.count("<!-- /profile -->") == 1 and rewritten.count("<!-- /load-aware -->") == 1
    # that run's own load-aware table: adaptive 4.89 tok/s against always on 4.82 on code at 1 stream
    assert "| code | 1 | 3.80 | 4.82 | 4.89 | 1.01x | 1.01x |" in rewritten


def test_load_aware_table_compares_adaptive_with_the_better_fixed_setting():
    from specserve.benchmarks.report import load_aware_rows

    def level(system, method, workload, streams, tok_s, off_share=None):
        return {"system": system, "method": method, "workload": workload, "concurrency": streams,
                "status": "ok", "throughput_tok_s": tok_s, "speculation_off_share": off_share}

    runs = [level("specserve none", "none", "code", 1, 4.0),
            level("specserve draft k=4", "draft", "code", 1, 5.0, 0.1),
            level("specserve draft k=4 policy=adaptive", "draft", "code", 1, 5.1, 0.25),
            level("specserve none", "none", "code", 8, 10.0),
            level("specserve draft k=4", "draft", "code", 8, 8.0),
            level("specserve draft k=4 policy=adaptive", "draft", "code", 8, 9.6, 0.99),
            level("specserve none", "none", "chat", 1, 4.0),  # no adaptive run: no row
            level("specserve draft k=4", "draft", "chat", 1, 5.0)]
    [head, _, one, eight] = load_aware_rows(runs)
    assert "adaptive / better fixed" in head
    assert one == "| code | 1 | 4.00 | 5.00 | 5.10 | 1.02x | 1.02x | 75% |"
    assert eight == "| code | 8 | 10.00 | 8.00 | 9.60 | 0.96x | 1.20x | 1% |"
    assert load_aware_rows(runs[-2:]) == []
    # closed-loop turns add the steady state's ratio, where all three settings have one
    for run, steady in zip(runs[3:6], (9.0, 7.0, 8.1)):
        run["steady_tok_s"] = steady
    [head, _, one, eight] = load_aware_rows(runs)
    assert head.endswith("| the same ratio, steady state |")
    assert one.endswith("| 75% | - |") and eight.endswith("| 1% | 0.90x |")


def test_the_runs_noise_comes_from_the_fixed_settings_ratio_pass_by_pass():
    import math
    import random

    from specserve.benchmarks.noise import chance_at_goal, pass_noise

    # log(on / off) per pass: 0.1, 0.1 + 2s at one level and -0.2, -0.2 - 2s at another: the
    # within-level variance of that log ratio is 2 s^2 per level, twice one setting's variance
    s = 0.03
    levels = [([math.exp(0.1), math.exp(0.1 + 2 * s)], [1.0, 1.0]),
              ([2.0, 2.0 * math.exp(-2 * s)], [2.0 * math.exp(0.2), 2.0 * math.exp(0.2)]),
              ([5.0], [4.0])]  # one pass: nothing to learn from
    sigma, freedom = pass_noise(levels)
    assert (round(sigma, 6), freedom) == (s, 2)
    assert pass_noise([([5.0], [4.0])]) is None

    # a clear winner: adaptive against that setting alone, a ratio of two noisy means
    clear = chance_at_goal(10.0, 5.0, 0.03)
    z = math.log(0.95) / (0.03 * math.sqrt(2))
    assert abs(clear - 0.5 * (1 - math.erf(z / math.sqrt(2)))) < 1e-3
    # a tie is harder: the better of two noisy settings is measured high
    tie = chance_at_goal(10.0, 10.0, 0.03)
    rng = random.Random(0)
    draws = [rng.gauss(0, 0.03) - max(rng.gauss(0, 0.03), rng.gauss(0, 0.03)) for _ in range(40000)]
    assert abs(tie - sum(d >= math.log(0.95) for d in draws) / len(draws)) < 0.01
    assert tie < clear - 0.05
    assert chance_at_goal(10.0, 5.0, 0.0) == 1.0 and chance_at_goal(10.0, 5.0, 0.5) < 0.6


def test_load_aware_table_gives_an_oracles_chance_where_the_passes_give_the_noise():
    from specserve.benchmarks.report import load_aware_noise, load_aware_rows

    def level(system, method, streams, passes):
        return {"system": system, "method": method, "workload": "code", "concurrency": streams, "status": "ok",
                "throughput_tok_s": sum(passes) / len(passes), "pass_throughputs": passes,
                "speculation_off_share": None}

    runs = [level("specserve none", "none", 1, [4.0, 4.0]),
            level("specserve draft k=4", "draft", 1, [5.0, 5.2]),
            level("specserve draft k=4 policy=adaptive", "draft", 1, [5.1, 5.1]),
            level("specserve none", "none", 8, [10.0, 9.6]),
            level("specserve draft k=4", "draft", 8, [8.0, 8.0]),
            level("specserve draft k=4 policy=adaptive", "draft", 8, [9.0, 9.2])]
    [head, rule, one, eight] = load_aware_rows(runs)
    assert head.endswith("| an oracle's chance of ≥ 0.95x |") and rule.count("---") == 9
    chances = [int(row.split("|")[-2].strip().rstrip("%")) for row in (one, eight)]
    assert all(50 < c < 100 for c in chances)
    [note, blank] = load_aware_noise(runs)
    assert "±2.0%" in note and "2 degrees of freedom" in note and blank == ""
    # one pass each: no noise, no column, no note
    one_pass = [{**r, "pass_throughputs": r["pass_throughputs"][:1]} for r in runs]
    assert load_aware_rows(one_pass)[0].endswith("| adaptive's rounds that speculate |")
    assert load_aware_noise(one_pass) == []


def test_load_aware_plot_shows_adaptives_ratios_per_level(tmp_path):
    import matplotlib.image

    from specserve.benchmarks.plots import write_plots
    from specserve.benchmarks.report import load_aware_levels, markdown

    saved = json.loads((pathlib.Path(__file__).parents[1] / "docs" / "bench" / "adaptive-1-xeon"
                        / "results.json").read_text())
    [level] = [lv for lv in load_aware_levels(saved["service"]) if lv["workload"] == "code"]
    assert (level["streams"], round(level["vs_better_fixed"], 2), round(level["vs_on"], 2)) == (1, 1.01, 1.01)
    written = write_plots(saved, tmp_path)
    assert written["load_aware"] == "load_aware.png"
    assert matplotlib.image.imread(tmp_path / "load_aware.png").shape[0] > 100
    assert "](load_aware.png)" in markdown({**saved, "plots": written})
    # the list of kept runs is linked only from docs/BENCHMARKS.md, where the link resolves
    assert "](bench/README.md)" not in markdown(saved) and "`docs/bench/README.md`" in markdown(saved)
    assert "[docs/bench/README.md](bench/README.md)" in markdown(saved, runs_index="bench/README.md")
    no_adaptive = {**saved, "service": [r for r in saved["service"] if "adaptive" not in r["system"]]}
    (tmp_path / "none").mkdir()
    assert "load_aware" not in write_plots(no_adaptive, tmp_path / "none")
    # a closed-loop run (--service-turns streams) also has the steady state's ratio, plotted beside
    closed = json.loads((pathlib.Path(__file__).parents[1] / "docs" / "bench" / "adaptive-streams-epyc" / "chat8"
                         / "results.json").read_text())
    [level] = load_aware_levels(closed["service"])
    assert (round(level["vs_better_fixed"], 2), round(level["steady_vs_better_fixed"], 2)) == (0.90, 0.95)
    (tmp_path / "closed").mkdir()
    assert write_plots(closed, tmp_path / "closed")["load_aware"] == "load_aware.png"


def _saved_run(workload: str, **changes) -> dict:
    """A saved one-workload run of the adaptive preset, renamed to `workload` and changed."""
    doc = json.loads((pathlib.Path(__file__).parents[1] / "docs" / "bench" / "adaptive-8-avx2-code"
                      / "results.json").read_text())
    doc["command"] = doc["command"].replace("--workloads code", f"--workloads {workload}")
    doc["service"] = [{**r, "workload": workload} for r in doc["service"]]
    doc["setup"]["service_workloads"] = [{**w, "name": workload} for w in doc["setup"]["service_workloads"]]
    for key, value in changes.items():
        section, _, name = key.partition("__")
        if name:
            doc[section][name] = value
        else:
            doc[key] = value
    return doc


def test_pieces_of_one_sweep_split_by_workload_or_level_render_as_one_page(tmp_path):
    from specserve.benchmarks.report import JoinError, join_runs, load_aware_rows

    code, chat = _saved_run("code"), _saved_run("chat", machine__load_average_at_start=2.5)
    joined = join_runs([code, chat])
    assert [r["workload"] for r in joined["service"]] == ["code"] * 3 + ["chat"] * 3
    assert [w["name"] for w in joined["setup"]["service_workloads"]] == ["code", "chat"]
    assert [r["load_average_at_start"] for r in joined["runs"]] == [code["machine"]["load_average_at_start"], 2.5]
    assert "load_average_at_start" not in joined["machine"]
    assert joined["duration_s"] == pytest.approx(code["duration_s"] + chat["duration_s"])
    assert [row.split("|")[1].strip() for row in load_aware_rows(joined["service"])[2:]] == ["code", "chat"]
    for path, doc in (("code.json", code), ("chat.json", chat)):
        (tmp_path / path).write_text(json.dumps(doc))
    assert suite.main(["--render", str(tmp_path / "code.json"), str(tmp_path / "chat.json"),
                       "--out", str(tmp_path / "both")]) == 0
    page = (tmp_path / "both" / "results.md").read_text()
    assert "Joined from 2 runs of one setup on one machine type (one commit)" in page
    assert "--workloads chat" in page and "load average 2.5" in page
    assert (tmp_path / "both" / "load_aware.png").exists()
    with pytest.raises(suite.SpecserveError, match="give --out"):
        suite.main(["--render", str(tmp_path / "code.json"), str(tmp_path / "chat.json")])

    # what would make the ratios side by side misleading is refused, with what differs
    other_commit = _saved_run("chat", machine__git_commit="f0a3bec")
    with pytest.raises(JoinError, match="machine git_commit"):
        join_runs([code, other_commit])
    with pytest.raises(JoinError, match="machine git_commit"):
        join_runs([code, other_commit], same_code=lambda a, b: False)
    later = join_runs([code, other_commit], same_code=lambda a, b: True)  # e.g. only the harness changed
    assert [r["git_commit"] for r in later["runs"]] == ["c37ef8f", "f0a3bec"]
    with pytest.raises(JoinError, match="setup service_max_tokens"):
        join_runs([code, _saved_run("chat", setup__service_max_tokens=96)])
    with pytest.raises(JoinError, match="service code at 8 is in"):
        join_runs([code, _saved_run("code")])

    # or split by level: a run cut short keeps its finished levels, another run measures the rest
    at_16 = _saved_run("code", setup__concurrency=[16], partial=True)
    at_16["service"] = [{**r, "concurrency": 16} for r in at_16["service"]]
    by_level = join_runs([code, at_16])
    assert by_level["setup"]["concurrency"] == [8, 16] and not by_level["partial"]
    assert [w["name"] for w in by_level["setup"]["service_workloads"]] == ["code"]
    assert [row.split("|")[2].strip() for row in load_aware_rows(by_level["service"])[2:]] == ["8", "16"]
    assert "cut short, its finished levels only" in suite.report.markdown(by_level)
    assert join_runs([code]) is code


def test_commits_that_differ_only_in_the_bench_harness_measured_the_same_code():
    import subprocess

    root = pathlib.Path(__file__).parents[1]
    if subprocess.run(["git", "-C", str(root), "cat-file", "-e", "c37ef8f^{commit}"], capture_output=True).returncode:
        pytest.skip("this checkout has no history to compare")
    assert suite.same_measured_code("f0a3bec", "76b4933")  # the harness keeps partial levels: nothing measured
    assert not suite.same_measured_code("c37ef8f", "f0a3bec")  # the router and pools changed
    assert not suite.same_measured_code("c37ef8f", "no-such-commit")


def test_service_runs_sum_the_policys_decisions_and_report_the_off_share():
    from specserve.benchmarks.report import _service_rows

    run = systems.ServiceRun("specserve draft k=4 policy=adaptive", "draft", "code", 4)
    run.add_k_histogram({"0": 3, "4": 5})  # two requests' usage.speculation.k_histogram
    run.add_k_histogram({"0": 1, "2": 1})
    assert run.k_histogram == [4, 0, 1, 0, 5] and run.speculation_off_share == 0.4
    run.add_policy_decisions({"warmup": 2, "model": 5})  # and their usage.speculation.policy_decisions
    run.add_policy_decisions({"model": 1, "measured": 2})
    assert run.policy_decisions == {"warmup": 2, "model": 6, "measured": 2}
    run.wall_s, run.tokens, run.requests, run.target_steps = 1.0, 20, 2, 10
    [_, _, row] = _service_rows([run.as_dict()])
    assert row.endswith("| speculation off in 40% of rounds; policy rounds: model 60%, warmup 20%, measured 20% |")
    off = systems.ServiceRun("specserve none", "none", "code", 4)
    off.add_k_histogram({"0": 9})
    assert off.speculation_off_share is None  # not a decision: nothing to decide


def test_transport_overhead_is_grpc_minus_http_per_level():
    from specserve.benchmarks.http import StreamResult
    from specserve.benchmarks.transport import inter_token_s, overhead

    # 5 tokens, first at 0.2 s, last at 1.0 s: 4 gaps of 0.2 s.
    assert inter_token_s([StreamResult(tokens=5, ttft_s=0.2, seconds=1.0), StreamResult(tokens=1, seconds=9)]) == \
        pytest.approx(0.2)
    row = {"wall_s": 1.0, "tokens": 10, "ttft_ms": 5.0}
    rows = [{**row, "streams": 1, "round": r, "transport": t, "tok_s": tok_s, "inter_token_ms": ms}
            for r, (t, tok_s, ms) in enumerate([("http", 10.0, 100.0), ("grpc", 9.0, 110.0),
                                                 ("grpc", 11.0, 90.0), ("http", 10.0, 104.0)])]
    [level] = overhead(rows)
    assert level["grpc_minus_http_ms_per_token"] == pytest.approx(100.0 - 102.0)
    assert level["grpc_over_http_tok_s"] == pytest.approx(1.0)


def test_metrics_cost_per_round_times_real_and_no_op_metrics():
    from specserve.benchmarks.transport import _time_rounds

    timings = _time_rounds(50)
    assert set(timings) == {"ray.serve.metrics", "no-op"} and all(t > 0 for t in timings.values())


def test_vllm_rows_get_the_draft_and_the_medusa_heads_directories(tmp_path):
    """A vLLM system's options are its speculative_config, with placeholders for the draft's
    directory and for the Medusa heads exported to vLLM's layout; without heads it cannot run."""
    by_name = {s.name: s for s in systems.vllm_systems()}
    common = dict(python="python", target_dir=str(tmp_path), dtype="float32", max_tokens=4, stop_ids=[0],
                  max_model_len=512, settings=["eager"], log_path=tmp_path / "log")
    vllm = library.Vllm(draft_dir="/models/draft", medusa_dir="/heads/vllm", **common)
    assert vllm.speculative_config(by_name["vllm medusa k=4"]) == {
        "method": "medusa", "model": "/heads/vllm", "num_speculative_tokens": 4}
    assert vllm.speculative_config(by_name["vllm draft_model k=4"])["model"] == "/models/draft"
    assert vllm.speculative_config(by_name["vllm none"]) is None
    assert vllm.cannot_run(by_name["vllm medusa k=4"]) is None
    without = library.Vllm(draft_dir=None, **common)
    assert "Medusa heads" in without.cannot_run(by_name["vllm medusa k=4"])
    assert without.cannot_run(by_name["vllm ngram k=4"]) is None


def test_pass_times_compare_worker_settings_by_row_count():
    from specserve.benchmarks import passes
    from specserve.engine.torch_worker import TorchWorker

    assert passes.parse_setting("linear_layout=both,quantize=int8") == {"linear_layout": "both", "quantize": "int8"}
    with pytest.raises(argparse.ArgumentTypeError):
        passes.parse_setting("both")
    worker = TorchWorker(tiny_model(), linear_layout="many_rows")
    times = passes.pass_times(worker, [1, 3], context=12, repeats=2)
    assert sorted(times) == [1, 3] and all(len(ts) == 2 and min(ts) > 0 for ts in times.values())
    assert worker.forward_passes == 1 + 2 * 3  # the context once, then a warm pass and 2 timed per count
    report = {"rows": [1, 3], "results": [{"setting": {"linear_layout": "one_row"}, "ms": {"1": [3.0, 5.0], "3": [7.0, 9.0, 8.0]}},
                                          {"setting": {}, "ms": {"1": [2.0], "3": [4.0]}}]}
    table = passes.markdown(report)
    assert "| linear_layout=one_row | 4 (3-5) | 8 (7-9) |" in table and "| defaults | 2 (2-2) | 4 (4-4) |" in table


def test_a_static_tree_is_named_by_its_shape_name_or_node_count():
    from specserve.benchmarks.presets import PRESETS
    from specserve.benchmarks.systems import variant_name

    assert variant_name("medusa", {"shape": "tree", "tree": {"shape": "mc_sim_7b_63"}}) == \
        "specserve medusa shape=tree shape=mc_sim_7b_63"
    assert variant_name("draft", {"tree": {"shape": [[0], [1], [0, 0]]}}) == "specserve draft shape=3-node"
    hydra = [variant_name(m, o) for m, o in PRESETS["hydra"]["variants"]]
    assert {"specserve medusa shape=tree shape=mc_sim_7b_63", "specserve hydra shape=tree shape=mc_sim_7b_63"} <= set(hydra)


def test_the_cluster_tax_bench_pauses_the_processes_only_in_its_paused_turns_and_always_resumes_them(tiny_pair):
    """`make bench-cluster-tax`: decodes alternate between the given processes running and
    paused (A B, B A, ...), the processes run again after each paused decode, also one that
    raised, and the table reports each turn's ratio and their median."""
    import subprocess

    import psutil

    from specserve.benchmarks import cluster_tax

    child = subprocess.Popen(["sleep", "60"])
    try:
        process = psutil.Process(child.pid)
        decode_tiny = cluster_tax.decoder_of(str(tiny_pair["target"]), "float32", 1, 4)
        seen = []

        def decode() -> float:
            seen.append(process.status())
            assert decode_tiny() > 0  # the real decoder runs
            return 4.0 if seen[-1] == psutil.STATUS_STOPPED else 3.0

        lines = []
        pairs = cluster_tax.measure(decode, [child.pid], 3, report=lines.append)
        assert pairs == [(3.0, 4.0)] * 3
        assert [s == psutil.STATUS_STOPPED for s in seen] == [False, True, True, False, False, True]
        assert len(lines) == 6 and lines[1] == "turn 1/3: cluster paused: 4.000 tok/s"
        assert process.status() != psutil.STATUS_STOPPED
        with pytest.raises(RuntimeError), cluster_tax.paused([child.pid]):
            assert process.status() == psutil.STATUS_STOPPED
            raise RuntimeError("a decode that failed")
        assert process.status() != psutil.STATUS_STOPPED
        assert "median paused / running: 1.333x" in cluster_tax.summary(pairs)
        assert child.pid not in cluster_tax.ray_processes()  # `sleep` is not one of Ray's
    finally:
        child.kill()
        child.wait()


def test_the_cluster_tax_module_s_examples_hold():
    import doctest

    from specserve.benchmarks import cluster_tax

    assert doctest.testmod(cluster_tax).failed == 0
