"""`specserve bench` end to end on tiny models: files written, systems and machine in the JSON,
table rows, valid PNGs, unavailable systems reported with a reason, and a wrong system flagged."""

from __future__ import annotations

import json

import pytest

from conftest import tiny_heads, perturbed, tiny_model
from specserve import models
from specserve.benchmarks import library, suite, systems, workloads
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
    return dirs


def _wrong_when_k2(real):
    """A deliberately wrong system: specserve draft with k=2 whose last token is changed."""
    def run(decoder, name, prompt_ids, max_tokens, method, k, **kwargs):
        result = real(decoder, name, prompt_ids, max_tokens, method, k, **kwargs)
        if k == 2 and result.outputs[0]:
            result.outputs[0][-1] = (result.outputs[0][-1] + 1) % 300
        return result
    return run


def test_bench_library_mode_end_to_end(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setattr(systems, "SPECSERVE_VARIANTS", [*systems.SPECSERVE_VARIANTS, ("draft", {"k": 2}),
                                                        ("tree", {"tree": {"budget": 4, "depth": 2}}),
                                                        ("no-such-method", {})])
    monkeypatch.setattr(library, "run_specserve", _wrong_when_k2(library.run_specserve))
    out, docs = tmp_path / "out", tmp_path / "docs"
    on_disk_before_service = {}
    real_service_mode = suite._service_mode

    def service_mode_after_checkpoint(*args):
        on_disk_before_service.update(json.loads((out / "results.json").read_text()))
        return real_service_mode(*args)

    monkeypatch.setattr(suite, "_service_mode", service_mode_after_checkpoint)
    code = suite.main(["--target", str(tiny_pair["target"]), "--draft", str(tiny_pair["draft"]),
                       "--heads", str(tiny_pair["heads"]),
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


def test_compare_flags_mismatches_and_speedups():
    run = systems.LibraryRun
    prompt = systems.PromptRun
    none = run("specserve none", "specserve", "none", "code", prompts=[prompt("a", 2.0, [1, 2, 3])])
    fast = run("specserve draft k=4", "specserve", "draft", "code", prompts=[prompt("a", 1.0, [1, 2, 3])])
    wrong = run("specserve tree", "specserve", "tree", "code", prompts=[prompt("a", 0.5, [1, 9, 3])])
    hf = run("transformers target only", "transformers", "none", "code", prompts=[prompt("a", 2.0, [1, 2, 4])])
    systems.compare([none, fast, wrong, hf])
    assert fast.speedup == pytest.approx(2.0) and not fast.mismatch
    assert wrong.speedup == pytest.approx(4.0) and wrong.mismatch and wrong.first_difference == [1]
    assert hf.reference == "" and not hf.mismatch  # its own target-only reference is itself
    assert hf.same_as_specserve_none == 0


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
                       "--service-requests", "2",
                       "--systems", "specserve none", "specserve draft*", "--port", "8391",
                       "--out", str(out), "--no-progress"]) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["setup"]["service_max_tokens"] == 4  # capped by --max-tokens
    runs = {(r["system"], r["concurrency"]): r for r in doc["service"]}
    assert set(runs) == {(s, c) for s in ("specserve none", "specserve draft k=4") for c in (1, 2)}
    for run in runs.values():
        assert run["status"] == "ok", run["reason"]
        assert run["requests"] == 2 and run["tokens"] > 0 and run["ttft_p50_s"] > 0
    assert runs["specserve draft k=4", 1]["same_as_reference"] == 2
    md = (out / "results.md").read_text()
    assert "## Service mode" in md and "| specserve draft k=4 | 2 |" in md
    for name in ("service_throughput.png", "service_latency.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
