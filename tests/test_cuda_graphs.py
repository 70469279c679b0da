"""The static-shape passes that CUDA graphs replay, run eagerly on the CPU: the same logits and
hidden states as the ragged pass (decode steps, chains, trees, a draft's tree extensions),
greedy speculation still exact, and the passes that cannot take a static shape (prefill
chunks, too many rows) left to the ragged pass."""

from __future__ import annotations

import pytest
import torch

from conftest import hf_greedy, perturbed, tiny_model
from specserve.engine.cuda_graphs import (MAX_ROWS, MIN_CONTEXT, Shape, StaticPasses, bucket, context_bucket,
                                          static_shape)
from specserve.engine.torch_worker import ForwardItem, TorchWorker
from specserve.protocol import SpecserveError, TokenTree

ATOL = 1e-5


def static_worker(model, **kwargs) -> TorchWorker:
    """A worker whose fitting passes run the static-shape pass, uncaptured. A small KV cache:
    the static passes zero its free blocks, which for the default 1 GiB takes ~0.3 s."""
    kwargs.setdefault("max_cached_tokens", 8192)
    worker = TorchWorker(model, **kwargs)
    worker.static_passes = StaticPasses(worker, capture=False, max_context=512)
    return worker


def random_sequences(lengths, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model(request):
    return tiny_model(request.param, seed=5)


def assert_same_rows(static_rows, ragged_rows):
    assert len(static_rows) == len(ragged_rows)
    for s, r in zip(static_rows, ragged_rows):
        assert s.logits.shape == r.logits.shape and s.hidden.shape == r.hidden.shape
        assert torch.allclose(s.logits, r.logits, atol=ATOL), float((s.logits - r.logits).abs().max())
        assert torch.allclose(s.hidden, r.hidden, atol=ATOL), float((s.hidden - r.hidden).abs().max())


@pytest.mark.parametrize("batch", [1, 3, 5])
def test_decode_steps_equal_the_ragged_pass(model, batch):
    sequences = random_sequences([70 + 37 * i for i in range(batch)], seed=batch)  # prefills past 64 tokens
    names = [f"r{i}" for i in range(batch)]
    static, ragged = static_worker(model), TorchWorker(model)
    for step in range(4):  # a prefill (ragged in both), then decode steps (static in one)
        items = [ForwardItem(n, list(s)) for n, s in zip(names, sequences)]
        static_rows, ragged_rows = static.run(items), ragged.run(items)
        assert_same_rows(static_rows, ragged_rows)
        for s, rows in zip(sequences, ragged_rows):
            s.append(int(rows.logits[-1].argmax()))
    assert static.static_passes.eager_passes == 3


def test_contexts_past_the_first_bucket_and_past_the_limit(model):
    [sequence] = random_sequences([MIN_CONTEXT - 2], seed=7)
    static, ragged = static_worker(model), TorchWorker(model)
    for _ in range(4):  # crosses from the 256-position bucket into the 512 one
        item = [ForwardItem("r", list(sequence))]
        assert_same_rows(static.run(item), ragged.run(item))
        sequence.append(3)
    assert static.static_passes.eager_passes == 3
    long = random_sequences([520], seed=8)[0]  # past max_context (512): ragged
    static.run([ForwardItem("long", long)])
    passes = static.static_passes.eager_passes
    assert_same_rows(static.run([ForwardItem("long", long + [5])]), ragged.run([ForwardItem("long", long + [5])]))
    assert static.static_passes.eager_passes == passes


def test_chain_verify_passes_of_mixed_lengths_equal_the_ragged_pass(model):
    sequences = random_sequences([69, 90, 77], seed=11)  # prefills past 64 tokens: ragged
    names = ["a", "b", "c"]
    static, ragged = static_worker(model), TorchWorker(model)
    for worker in (static, ragged):
        worker.run([ForwardItem(n, s) for n, s in zip(names, sequences)])
    # chains of 4, 1 and no drafts: 5, 2 and 1 new tokens per request, padded to 8
    chains = [TokenTree.chain([1, 2, 3, 4]), TokenTree.chain([7]), TokenTree()]
    items = [ForwardItem(n, s, c) for n, s, c in zip(names, sequences, chains)]
    assert_same_rows(static.run(items), ragged.run(items))
    assert static.static_passes.eager_passes == 1
    # next round: part of each chain accepted plus a bonus token (several uncached tokens)
    accepted = [sequences[0] + [1, 2, 9], sequences[1] + [7, 8], sequences[2] + [4]]
    items = [ForwardItem(n, s, TokenTree.chain([5, 6])) for n, s in zip(names, accepted)]
    assert_same_rows(static.run(items), ragged.run(items))
    assert static.static_passes.eager_passes == 2


def test_a_drafts_chain_extensions_equal_the_ragged_pass(model):
    """A draft grows its chain one node per pass (logits_from): the nodes already fed stay
    cached, and each pass feeds one new node."""
    [sequence] = random_sequences([80], seed=12)
    static, ragged = static_worker(model), TorchWorker(model)
    for worker in (static, ragged):
        worker.run([ForwardItem("d", sequence)])
    for depth in range(1, 4):
        item = [ForwardItem("d", sequence, TokenTree.chain(list(range(10, 10 + depth))), logits_from=depth - 1)]
        assert_same_rows(static.run(item), ragged.run(item))
    assert static.static_passes.eager_passes == 3
    assert set(static.static_passes._buffers) == {Shape(1, 1, 256, 1)}  # the shape of a decode step


def test_tree_verify_passes_equal_the_ragged_pass(model):
    """Trees beside a chain and a decode step in one pass, then the next round after each
    request's accepted path (the pending tree compacted)."""
    sequences = random_sequences([72, 100, 67], seed=13)
    names = ["a", "b", "c"]
    static, ragged = static_worker(model), TorchWorker(model)
    for worker in (static, ragged):
        worker.run([ForwardItem(n, s) for n, s in zip(names, sequences)])
    trees = [TokenTree((11, 12, 13, 14, 15), (-1, -1, 0, 0, 2)), TokenTree.chain([7, 8]), TokenTree()]
    items = [ForwardItem(n, s, t) for n, s, t in zip(names, sequences, trees)]
    assert_same_rows(static.run(items), ragged.run(items))
    accepted = [sequences[0] + [11, 13, 15, 9], sequences[1] + [7, 2], sequences[2] + [4]]
    wide = TokenTree(tuple(range(20, 52)), tuple([-1] * 4 + [i // 4 - 1 for i in range(4, 32)]))  # 32 nodes
    items = [ForwardItem(n, s, t) for n, s, t in zip(names, accepted, [wide, TokenTree((5, 6), (-1, -1)), wide])]
    assert_same_rows(static.run(items), ragged.run(items))
    assert static.static_passes.eager_passes == 2
    assert static.cached_tokens("a") == ragged.cached_tokens("a")


def test_a_drafts_tree_extensions_equal_the_ragged_pass(model):
    """A draft grows a tree level by level (logits_from): each pass feeds one level, which sees
    its ancestors among the cached nodes and not their siblings."""
    [sequence] = random_sequences([80], seed=12)
    static, ragged = static_worker(model), TorchWorker(model)
    for worker in (static, ragged):
        worker.run([ForwardItem("d", sequence)])
    levels = [TokenTree((10, 11), (-1, -1)), TokenTree((10, 11, 12, 13, 14), (-1, -1, 0, 0, 1)),
              TokenTree((10, 11, 12, 13, 14, 15, 16), (-1, -1, 0, 0, 1, 2, 4))]
    logits_from = [0, 2, 5]
    for tree, first in zip(levels, logits_from):
        item = [ForwardItem("d", sequence, tree, logits_from=first)]
        assert_same_rows(static.run(item), ragged.run(item))
    assert static.static_passes.eager_passes == 3


def test_prefill_chunks_and_passes_over_the_row_limit_run_the_ragged_pass(model):
    sequences = random_sequences([72, 40], seed=13)
    static, ragged = static_worker(model), TorchWorker(model)
    for worker in (static, ragged):
        worker.run([ForwardItem("a", sequences[0])])
        worker.queue_prefill("b", sequences[1])
    items = [ForwardItem("a", sequences[0] + [5])]
    assert_same_rows(static.run(items), ragged.run(items))  # a decode step beside a prefill chunk
    assert static.static_passes.eager_passes == 0
    assert static.cached_tokens("b") == sequences[1]
    big = TokenTree(tuple(i % 90 for i in range(100)), tuple(range(-1, 99)))  # 101 new tokens: past the largest bucket
    items = [ForwardItem("a", sequences[0] + [5, 6], big)]
    assert_same_rows(static.run(items), ragged.run(items))
    assert static.static_passes.eager_passes == 0


def test_greedy_speculation_over_static_passes_equals_target_only_output(model):
    from specserve.decoder import SpeculativeDecoder
    from specserve.proposers.draft_model import DraftModelProposer
    from specserve.protocol import SamplingParams
    from specserve.verifier import Verifier

    draft = perturbed(model, scale=0.05)
    target_worker, draft_worker = static_worker(model), static_worker(draft)
    decoder = SpeculativeDecoder(Verifier(target_worker), DraftModelProposer(draft_worker, min_confidence=0.0),
                                 k=3, method="draft", max_context=model.config.max_position_embeddings)
    prompts = random_sequences([6, 15, 9], seed=14)
    outputs = [g.token_ids for g in decoder.generate(prompts, SamplingParams(max_tokens=20))]
    assert outputs == [hf_greedy(model, p, 20) for p in prompts]
    assert decoder.last_report.stats.mean_accepted_length > 1  # drafts were accepted
    assert target_worker.static_passes.eager_passes > 0 and draft_worker.static_passes.eager_passes > 0


def test_greedy_tree_speculation_over_static_passes_equals_target_only_output(model):
    from specserve.decoder import SpeculativeDecoder
    from specserve.proposers.draft_model import DraftModelProposer
    from specserve.protocol import SamplingParams, Speculation, TreeSpec
    from specserve.verifier import Verifier

    draft = perturbed(model, scale=0.05)
    target_worker, draft_worker = static_worker(model), static_worker(draft)
    speculation = Speculation(proposer="draft", shape="tree", tree=TreeSpec(shape=((0,), (1,), (0, 0), (0, 1), (1, 0),
                                                                                    (0, 0, 0))))
    decoder = SpeculativeDecoder(Verifier(target_worker), DraftModelProposer(draft_worker, min_confidence=0.0),
                                 speculation=speculation, max_context=model.config.max_position_embeddings)
    prompts = random_sequences([6, 15, 9], seed=15)
    outputs = [g.token_ids for g in decoder.generate(prompts, SamplingParams(max_tokens=20))]
    assert outputs == [hf_greedy(model, p, 20) for p in prompts]
    assert decoder.last_report.stats.mean_accepted_length > 1
    # every pass ran static, the short prompts' prefills too (trees used to run ragged)
    for worker in (target_worker, draft_worker):
        assert worker.static_passes.eager_passes == worker.forward_passes > 0


def test_shapes_are_bucketed():
    assert [bucket(n, (1, 2, 4, 8, 16)) for n in (1, 3, 5, 16, 17)] == [1, 4, 8, 16, None]
    assert [context_bucket(n, 8192) for n in (1, 256, 257, 8192, 8193)] == [256, 256, 512, 8192, None]


def test_shape_of_a_pass():
    worker = TorchWorker(tiny_model(seed=1))
    plans = [worker._plan(ForwardItem(f"r{i}", [1] * (3 + i))) for i in range(3)]
    assert static_shape(plans, max_context=512) == Shape(batch=4, tokens=8, context=256, span=8)  # short prompts
    assert static_shape(plans + [worker._plan(ForwardItem("long", [1] * 9))], max_context=512).tokens == 16
    assert static_shape(plans + [worker._plan(ForwardItem("long", [1] * 65))], max_context=512) is None
    many = [worker._plan(ForwardItem(f"m{i}", [1] * 20)) for i in range(9)]  # 16 requests of 32 rows
    assert 16 * 32 > MAX_ROWS and static_shape(many, max_context=512) is None
    worker._reserve(plans, {"r0", "r1", "r2"})
    for i, plan in enumerate(plans):
        plan.entry.tokens = [1] * (3 + i)
    plans = [worker._plan(ForwardItem(f"r{i}", [1] * (4 + i))) for i in range(3)]
    assert static_shape(plans, max_context=512) == Shape(batch=4, tokens=1, context=256, span=1)
    tree = worker._plan(ForwardItem("r0", [1] * 4, TokenTree((5, 6), (-1, -1))))
    assert static_shape([tree], max_context=512) == Shape(batch=1, tokens=4, context=256, span=4)  # last token + 2
    assert Shape(4, 2, 256, 2).rows == 8


def test_cuda_graphs_are_off_on_cpu_and_refused_there():
    model = tiny_model(seed=2)
    assert TorchWorker(model).static_passes is None
    with pytest.raises(SpecserveError, match="CUDA device"):
        TorchWorker(model, cuda_graphs=True)


def test_scratch_slots_belong_to_no_request():
    model = tiny_model(seed=2)
    worker = TorchWorker(model, max_cached_tokens=16 * 24)
    free = worker.kv.free_blocks
    passes = StaticPasses(worker, capture=False)
    assert worker.kv.free_blocks == free - 16  # MAX_ROWS (256) rows of padding, 16 a block
    with pytest.raises(SpecserveError, match="too small for CUDA graphs"):
        StaticPasses(TorchWorker(model, max_cached_tokens=16 * 16), capture=False)
    passes.release()
    assert worker.kv.free_blocks == free


def test_the_pool_option_is_cuda_only_and_reaches_the_worker(monkeypatch):
    from pydantic import ValidationError

    from specserve.serve import pools
    from specserve.serve.config import PoolArgs

    assert PoolArgs(model="tiny").cuda_graphs is None  # the engine's default: on for CUDA devices
    assert PoolArgs(model="tiny", device="cuda:0", cuda_graphs=True).cuda_graphs
    with pytest.raises(ValidationError, match="cuda_graphs needs a CUDA device"):
        PoolArgs(model="tiny", cuda_graphs=True)
    seen = {}
    monkeypatch.setattr("specserve.models.load_causal_lm", lambda *a, **k: tiny_model(seed=2))
    monkeypatch.setattr("specserve.engine.torch_worker.TorchWorker.__init__",
                        lambda self, model, **kwargs: seen.update(kwargs))
    threads = torch.get_num_threads()  # given, so the test process keeps its thread count
    # the stub worker runs no passes: none are timed
    pools.default_engine(PoolArgs(model="tiny", cuda_graphs=False, torch_threads=threads,
                                  time_decode_passes=False).model_dump())
    assert seen["cuda_graphs"] is False


@pytest.mark.parametrize("method", ["medusa", "hydra"])
def test_greedy_head_trees_over_static_passes_equal_target_only_output(model, method):
    """Heads read the hidden rows of the static pass (Hydra also its path's embeddings): their
    trees verified there still give the target's own greedy output."""
    from conftest import tiny_heads, tiny_hydra_heads
    from specserve.decoder import SpeculativeDecoder
    from specserve.proposers.hydra import HydraProposer
    from specserve.proposers.medusa import MedusaProposer
    from specserve.protocol import SamplingParams, Speculation, TreeSpec
    from specserve.verifier import Verifier

    proposer = (MedusaProposer(tiny_heads(model)) if method == "medusa"
                else HydraProposer(tiny_hydra_heads(model, noise=0.01)))
    worker = static_worker(model)
    tree = TreeSpec(shape=((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))
    decoder = SpeculativeDecoder(Verifier(worker, proposer), speculation=Speculation(proposer=method, shape="tree",
                                                                                     tree=tree),
                                 max_context=model.config.max_position_embeddings)
    prompts = random_sequences([70, 80], seed=16)
    outputs = [g.token_ids for g in decoder.generate(prompts, SamplingParams(max_tokens=16))]
    assert outputs == [hf_greedy(model, p, 16) for p in prompts]
    assert worker.static_passes.eager_passes == worker.forward_passes - 1  # all but the prompts' prefill
