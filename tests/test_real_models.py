"""End-to-end on real pretrained weights (SmolLM2-135M, fp32). Slow tier: `-m slow`."""

import copy
import json
import subprocess
import sys

import pytest

from specserve import models

pytestmark = pytest.mark.slow

SMOL = "smollm2-135m-instruct"
QUESTIONS = [
    "Say hi.",
    "Write a Python function that returns the square of a number.",
    "List three colors.",
]


@pytest.fixture(scope="module")
def smol():
    if not models.is_cached(SMOL):
        pytest.skip(f"run `specserve models pull {SMOL}` first (make test does)")
    from specserve.loading import load_pair

    return load_pair(SMOL, SMOL, dtype="float32")


@pytest.fixture(scope="module")
def target_greedy(smol, reference):
    """transformers' greedy decoding of the target alone, 40 tokens or to its one EOS (the
    session's reference decodes each prompt once: five tests here share three)."""
    _, _, greedy_text, _ = reference
    assert sorted(smol.eos_token_ids) == [reference[0].eos_token_id]
    return lambda prompt: greedy_text.ids(prompt, 40)


def first_layers(model, n: int):
    """A different, weaker draft that shares the vocabulary: the target's first n layers."""
    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:n]
    draft.config.num_hidden_layers = n
    return draft


def chat_prompt(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text)


@pytest.mark.parametrize("draft_kind,k", [("itself", 4), ("first-27-layers", 3), ("first-27-layers", 6)])
def test_greedy_equals_transformers_with_real_weights(smol, target_greedy, draft_kind, k):
    from specserve.decoder import SpeculativeDecoder
    from specserve.engine.torch_worker import TorchWorker
    from specserve.proposers.draft_model import DraftModelProposer
    from specserve.protocol import SamplingParams

    target = smol.target.model
    draft_model = target if draft_kind == "itself" else first_layers(target, 27)
    decoder = SpeculativeDecoder(smol.verifier(), DraftModelProposer(TorchWorker(draft_model)), k=k,
                                 tokenizer=smol.tokenizer, eos_token_ids=smol.eos_token_ids)
    prompts = [chat_prompt(smol.tokenizer, q) for q in QUESTIONS]
    outs = decoder.generate(prompts, SamplingParams(max_tokens=40))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == target_greedy(prompt)
    assert {o.finish_reason for o in outs} == {"stop", "length"}  # EOS and max_tokens both hit
    stats = decoder.last_report.stats
    if draft_kind == "itself":
        assert stats.acceptance_rate > 0.97
    else:
        assert 0.1 < stats.acceptance_rate < 0.97


def test_sampling_with_an_identical_real_draft_accepts_nearly_everything(smol):
    from specserve.decoder import SpeculativeDecoder
    from specserve.protocol import SamplingParams

    decoder = SpeculativeDecoder(smol.verifier(), smol.proposer(), k=4, tokenizer=smol.tokenizer,
                                 eos_token_ids=smol.eos_token_ids)
    prompt = chat_prompt(smol.tokenizer, QUESTIONS[1])
    runs = [decoder.generate([prompt], SamplingParams(temperature=0.8, top_p=0.95, max_tokens=40, seed=s))[0]
            for s in (1, 1)]
    assert runs[0].token_ids == runs[1].token_ids
    # the draft samples from a top-256 truncation of the same distribution: a little mass is lost
    assert decoder.last_report.stats.acceptance_rate > 0.9


def test_mismatched_vocabularies_are_refused_before_loading_weights(smol):
    from specserve.loading import load_pair

    other = "qwen2.5-coder-0.5b-instruct"
    if not models.is_cached(other):
        pytest.skip(f"{other} not pulled")
    with pytest.raises(models.IncompatibleModelsError, match="vocabular"):
        load_pair(SMOL, other)


def test_cli_generate_prints_text_and_statistics(smol):
    cmd = [sys.executable, "-m", "specserve.cli", "generate", "--target", SMOL, "--draft", SMOL,
           "--prompt", "What is the capital of France?", "--chat", "--max-tokens", "24", "-k", "3",
           "--dtype", "float32", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    [out] = result["outputs"]
    assert "Paris" in out["text"]
    assert result["tokens_per_second"] > 0
    assert result["stats"]["acceptance_rate"] > 0.9 and result["stats"]["mean_accepted_length"] > 2


@pytest.mark.parametrize("tree", [dict(budget=16, depth=6, width=4, min_score=0.05),
                                  dict(shape=[[0], [1], [0, 0], [1, 0], [0, 0, 0], [0, 1], [0, 0, 0, 0]])],
                         ids=["dynamic", "static"])
def test_greedy_trees_equal_transformers_with_real_weights(smol, target_greedy, tree):
    from specserve.decoder import SpeculativeDecoder
    from specserve.engine.torch_worker import TorchWorker
    from specserve.proposers.draft_model import DraftModelProposer
    from specserve.protocol import SamplingParams, TreeSpec

    target = smol.target.model
    decoder = SpeculativeDecoder(smol.verifier(), DraftModelProposer(TorchWorker(first_layers(target, 27))),
                                 method="tree", tree=TreeSpec(**tree), tokenizer=smol.tokenizer,
                                 eos_token_ids=smol.eos_token_ids)
    prompts = [chat_prompt(smol.tokenizer, q) for q in QUESTIONS]
    outs = decoder.generate(prompts, SamplingParams(max_tokens=40))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == target_greedy(prompt)
    stats = decoder.last_report.stats
    assert stats.mean_accepted_length > 1.5 and sum(stats.num_accepted_tokens_per_rank[1:]) > 0


def test_cli_generate_with_a_tree_and_a_bad_shape(smol):
    base = [sys.executable, "-m", "specserve.cli", "generate", "--target", SMOL, "--draft", SMOL,
            "--prompt", "What is the capital of France?", "--chat", "--max-tokens", "16", "--dtype", "float32",
            "--method", "tree"]
    done = subprocess.run(base + ["--tree-budget", "8", "--tree-depth", "4", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["stats"]["mean_accepted_length"] > 2
    bad = subprocess.run(base + ["--tree-shape", "[[1]]"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "elder sibling" in bad.stderr


@pytest.mark.parametrize("speculation", [
    {"shape": "chain", "k": 3},
    {"shape": "tree", "tree": {"budget": 10, "depth": 3, "width": 3, "min_score": 0.0}},
    {"shape": "tree", "tree": {"shape": ((0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0))}},
], ids=["chain", "dynamic", "static"])
def test_medusa_heads_trained_here_decode_exactly_like_the_target(smol, target_greedy, smol_medusa_heads, speculation):
    """Heads trained in the session by the trainer, loaded from their files: batched greedy
    output equals transformers' target alone, and the heads really propose accepted tokens."""
    from dataclasses import replace

    from specserve.decoder import SpeculativeDecoder
    from specserve.loading import load_medusa
    from specserve.protocol import SamplingParams, Speculation, TreeSpec
    from specserve.verifier import Verifier

    heads = load_medusa(smol_medusa_heads, smol.target)
    tree = speculation.get("tree")
    spec = Speculation(proposer="medusa", shape=speculation["shape"], k=speculation.get("k", 4))
    spec = replace(spec, tree=TreeSpec(**tree)) if tree else spec
    decoder = SpeculativeDecoder(Verifier(smol.target, heads), tokenizer=smol.tokenizer, speculation=spec,
                                 eos_token_ids=smol.eos_token_ids)
    prompts = [chat_prompt(smol.tokenizer, q) for q in QUESTIONS]
    outs = decoder.generate(prompts, SamplingParams(max_tokens=40))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == target_greedy(prompt)
    stats = decoder.last_report.stats  # quick heads (about a minute of training) on chat: modest acceptance
    assert stats.num_accepted_tokens > 0 and stats.mean_accepted_length > 1.0, stats
