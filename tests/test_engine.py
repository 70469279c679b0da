"""The torch worker: batched forward, tree attention, rollback, compaction, cache misses."""

import pytest
import torch

from conftest import tiny_model
from specserve.engine.torch_worker import BLOCK_TOKENS, BOTH, LAYOUTS, MANY_ROWS, ONE_ROW, ForwardItem, TorchWorker
from specserve.protocol import SpecserveError, TokenTree

ATOL = 1e-5


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    """Plain causal forward of the whole sequence with transformers: [len(ids), V]."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def fresh_kv(model, ids: list[int]) -> torch.Tensor:
    worker = TorchWorker(model)
    worker.forward([ForwardItem("r", ids)])
    return worker.cached_kv("r")


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model(request):
    return tiny_model(request.param, seed=3)


def test_batched_prefill_and_chain_match_causal_forward(model):
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (3, 11, 7)]
    worker = TorchWorker(model)
    first = worker.forward([ForwardItem(f"r{i}", s[:-2]) for i, s in enumerate(seqs)])
    for s, out in zip(seqs, first):
        assert torch.allclose(out[0], reference_logits(model, s[:-2])[-1], atol=ATOL)
    # second call: requests extend by a chain of 2 draft tokens, one request is new
    items = [ForwardItem(f"r{i}", s[:-2], TokenTree.chain(s[-2:])) for i, s in enumerate(seqs)]
    items.append(ForwardItem("new", seqs[1]))
    second = worker.forward(items)
    for s, out in zip(seqs, second):
        assert torch.allclose(out, reference_logits(model, s)[-3:], atol=ATOL)
    assert torch.allclose(second[3][0], reference_logits(model, seqs[1])[-1], atol=ATOL)


TREES = {
    "chain": TokenTree((11, 12, 13), (-1, 0, 1)),
    "2x2": TokenTree((11, 12, 13, 14, 15, 16), (-1, -1, 0, 0, 1, 1)),
    "unbalanced": TokenTree((11, 12, 13, 14, 15), (-1, 0, 1, -1, 0)),
}


def branch(tree: TokenTree, node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(tree.tokens[node])
        node = tree.parents[node]
    return path[::-1]


@pytest.mark.parametrize("shape", sorted(TREES))
def test_tree_attention_equals_causal_decoding_of_each_branch(model, shape):
    tree = TREES[shape]
    prefix = [5, 9, 2, 7, 1]
    worker = TorchWorker(model)
    worker.forward([ForwardItem("warm", prefix[:3])])  # a cached part and an uncached part
    for rid, start in (("cold", prefix), ("warm", prefix)):
        [logits] = worker.forward([ForwardItem(rid, start, tree)])
        assert torch.allclose(logits[0], reference_logits(model, prefix)[-1], atol=ATOL)
        for node in range(len(tree)):
            expected = reference_logits(model, prefix + branch(tree, node))[-1]
            assert torch.allclose(logits[node + 1], expected, atol=ATOL), (shape, node)


def test_trees_of_different_shapes_batch_together(model):
    worker = TorchWorker(model)
    items = [ForwardItem(name, [3 + i] * (2 + 3 * i), tree) for i, (name, tree) in enumerate(sorted(TREES.items()))]
    for item, logits in zip(items, worker.forward(items)):
        for node in range(len(item.tree)):
            expected = reference_logits(model, item.token_ids + branch(item.tree, node))[-1]
            assert torch.allclose(logits[node + 1], expected, atol=ATOL)


def test_rollback_after_rejection_equals_cache_of_accepted_tokens(model):
    worker = TorchWorker(model)
    prompt = [4, 8, 15, 16]
    worker.forward([ForwardItem("r", prompt, TokenTree.chain([23, 42, 7, 7]))])
    # the target accepted 23 and 42 then emitted its own token 9: the next call says so
    accepted = prompt + [23, 42, 9]
    [logits] = worker.forward([ForwardItem("r", accepted)])
    assert worker.cached_tokens("r") == accepted
    assert torch.allclose(worker.cached_kv("r"), fresh_kv(model, accepted), atol=ATOL)
    assert torch.allclose(logits[0], reference_logits(model, accepted)[-1], atol=ATOL)


def test_tree_compaction_keeps_only_the_accepted_path(model):
    tree = TREES["2x2"]  # paths 11->13, 11->14, 12->15, 12->16
    worker = TorchWorker(model)
    prompt = [1, 2, 3]
    worker.forward([ForwardItem("r", prompt, tree)])
    accepted = prompt + [12, 16, 30]  # nodes 1 and 5 accepted, 30 from the target
    assert tree.path_of(accepted[3:]) == [1, 5]
    [logits] = worker.forward([ForwardItem("r", accepted)])
    assert worker.forward_passes == 2
    assert torch.allclose(worker.cached_kv("r"), fresh_kv(model, accepted), atol=ATOL)
    assert torch.allclose(logits[0], reference_logits(model, accepted)[-1], atol=ATOL)


def test_cache_miss_and_stale_cache_give_the_same_logits(model):
    ids = [7, 3, 9, 1, 1, 4]
    tree = TREES["unbalanced"]
    [expected] = TorchWorker(model).forward([ForwardItem("r", ids, tree)])
    stale = TorchWorker(model)
    stale.forward([ForwardItem("r", [7, 3, 50, 60, 70, 80, 90])])  # diverges after two tokens
    [got] = stale.forward([ForwardItem("r", ids, tree)])
    assert torch.allclose(got, expected, atol=ATOL)
    assert stale.release("r") and not stale.release("r")
    [again] = stale.forward([ForwardItem("r", ids, tree)])  # after release: recompute
    assert torch.allclose(again, expected, atol=ATOL)
    # the same call twice: the last token is fed again, not served from nowhere
    [twice] = stale.forward([ForwardItem("r", ids)])
    assert torch.allclose(twice[0], expected[0], atol=ATOL)


def test_least_recently_used_caches_are_evicted_under_budget(model):
    worker = TorchWorker(model, max_cached_tokens=2 * BLOCK_TOKENS)
    for rid in ("a", "b", "c"):
        worker.forward([ForwardItem(rid, [1, 2, 3])])  # each takes one block
    assert worker.cache_stats()["requests"] == 2
    assert worker.cached_tokens("a") == []
    assert worker.cache_stats()["evictions"] == 1


def test_kv_budget_holds_under_many_requests_and_eviction_recomputes_exactly(model):
    """40 requests take turns on a slab that holds a few of them: the slab never grows, the
    least recently used caches go, and every evicted request's next call recomputes exactly."""
    budget_blocks = 10  # one batch of 4 needs at most 8
    worker = TorchWorker(model, max_cached_tokens=budget_blocks * BLOCK_TOKENS)
    gen = torch.Generator().manual_seed(5)
    seqs = {f"r{i}": torch.randint(0, 97, (int(torch.randint(5, 30, (1,), generator=gen)),), generator=gen).tolist()
            for i in range(40)}
    rids = list(seqs)
    for round_ in range(3):
        for i in range(0, len(rids), 4):  # batches of 4 requests, each one token longer per round
            batch = rids[i:i + 4]
            items = [ForwardItem(rid, seqs[rid] + list(range(round_))) for rid in batch]
            for item, logits in zip(items, worker.forward(items)):
                assert torch.allclose(logits[0], reference_logits(model, item.token_ids)[-1], atol=ATOL)
            stats = worker.cache_stats()
            assert stats["kv_capacity_tokens"] == budget_blocks * BLOCK_TOKENS
            used = stats["kv_capacity_tokens"] - stats["kv_free_tokens"]
            assert used <= budget_blocks * BLOCK_TOKENS
    assert worker.cache_stats()["evictions"] > 0
    with pytest.raises(SpecserveError, match="cannot hold this pass"):
        worker.forward([ForwardItem("long", list(range(97)) * 2)])  # 194 tokens > 160 slots


def test_ragged_batch_equals_one_at_a_time(model):
    """Requests of very different lengths in one pass (prefill, decode, a tree, a tree
    extension) give the rows each gives alone: nothing is padded to the widest."""
    gen = torch.Generator().manual_seed(9)
    seqs = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (2, 40, 9, 17)]
    alone, together = TorchWorker(model), TorchWorker(model)
    for w in (alone, together):
        for i in (1, 2):
            w.forward([ForwardItem(f"r{i}", seqs[i][:-3])])
    items = [
        ForwardItem("r0", seqs[0]),  # new: a prefill of 2
        ForwardItem("r1", seqs[1][:-2]),  # decode after a 1-token gap
        ForwardItem("r2", seqs[2][:-3], TREES["2x2"]),  # a tree
        ForwardItem("r3", seqs[3], TREES["unbalanced"]),  # prefill and a tree
    ]
    expected = [alone.forward([item])[0] for item in items]
    for got, want in zip(together.forward(items), expected):
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=ATOL)


def test_chunked_prefill_equals_one_prefill(model):
    """A prompt cached chunk by chunk (queued prefill riding along with other requests'
    passes) gives the same logits and the same keys and values as one prefill."""
    ids = torch.randint(0, 97, (45,), generator=torch.Generator().manual_seed(2)).tolist()
    [expected] = TorchWorker(model).forward([ForwardItem("r", ids)])
    worker = TorchWorker(model)
    worker.forward([ForwardItem("other", [1, 2])])
    for end in (16, 32):
        worker.queue_prefill("r", ids[:end])
        worker.forward([ForwardItem("other", [1, 2, end])])  # the chunk rides along
        assert worker.cached_tokens("r") == ids[:end]
        assert worker.uncached_tokens("r", ids) == len(ids) - end
    [logits] = worker.forward([ForwardItem("r", ids)])
    assert torch.allclose(logits, expected, atol=ATOL)
    assert torch.allclose(worker.cached_kv("r"), fresh_kv(model, ids), atol=ATOL)
    worker.queue_prefill("r", ids[:16])  # a stale chunk: already cached, it changes nothing
    worker.forward([ForwardItem("other", [1, 2, 3, 4])])
    assert worker.cached_tokens("r") == ids
    worker.queue_prefill("r", ids)  # a queued chunk and a call for the same request: the call wins
    worker.forward([ForwardItem("r", ids)])
    assert worker.cached_tokens("r") == ids


def test_bad_calls_are_refused(model):
    worker = TorchWorker(model)
    with pytest.raises(SpecserveError, match="no tokens"):
        worker.forward([ForwardItem("r", [])])
    with pytest.raises(SpecserveError, match="only once"):
        worker.forward([ForwardItem("r", [1]), ForwardItem("r", [2])])
    with pytest.raises(SpecserveError, match="parents must precede"):
        TokenTree((1, 2), (1, -1))


def test_unsupported_architecture_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(SpecserveError, match="not 'gpt2'"):
        TorchWorker(gpt2)


def test_growing_a_tree_level_by_level_computes_only_the_new_nodes(model):
    """A draft extends the tree of its previous call: the cached nodes keep their keys and
    values, the new ones see only their own ancestors, and the rows equal a one-shot pass."""
    full = TokenTree((11, 12, 13, 14, 15, 16, 17), (-1, -1, 0, 0, 1, 2, 4))
    prefix = [5, 9, 2, 7, 1]
    [expected] = TorchWorker(model).forward([ForwardItem("r", prefix, full)])
    worker = TorchWorker(model)
    [root] = worker.forward([ForwardItem("r", prefix)])
    assert torch.allclose(root[0], expected[0], atol=ATOL)
    for start, end in ((0, 2), (2, 5), (5, 7)):
        level = TokenTree(full.tokens[:end], full.parents[:end])
        before = worker.forward_passes
        [rows] = worker.forward([ForwardItem("r", prefix, level, logits_from=start)])
        assert rows.shape[0] == end - start
        assert torch.allclose(rows, expected[1 + start : 1 + end], atol=ATOL), (start, end)
        assert worker.forward_passes == before + 1
    # the next round compacts the accepted path (12 -> 15 -> 17) as usual
    accepted = prefix + [12, 15, 17, 40]
    [logits] = worker.forward([ForwardItem("r", accepted)])
    assert torch.allclose(worker.cached_kv("r"), fresh_kv(model, accepted), atol=ATOL)
    assert torch.allclose(logits[0], reference_logits(model, accepted)[-1], atol=ATOL)


def test_tree_extension_falls_back_to_recompute_when_the_cache_does_not_match(model):
    tree = TREES["2x2"]
    prefix = [3, 1, 4]
    [expected] = TorchWorker(model).forward([ForwardItem("r", prefix, tree)])
    worker = TorchWorker(model)
    worker.forward([ForwardItem("r", prefix, TokenTree((50,), (-1,)))])  # a different first node
    [rows] = worker.forward([ForwardItem("r", prefix, tree, logits_from=2)])
    assert torch.allclose(rows, expected[3:], atol=ATOL)
    fresh = TorchWorker(model)  # nothing cached at all
    [rows] = fresh.forward([ForwardItem("r", prefix, tree, logits_from=4)])
    assert torch.allclose(rows, expected[5:], atol=ATOL)
    with pytest.raises(SpecserveError, match="logits_from"):
        fresh.forward([ForwardItem("r", prefix, tree, logits_from=6)])


def test_a_long_prompt_does_not_stall_other_requests_rounds():
    """Through a target pool's batcher: a 300-token prompt is cached 64 tokens per pass while
    another request keeps decoding, one round per pass, and its result equals one prefill's."""
    import asyncio

    from specserve.protocol import SamplingParams, VerifyRequest
    from specserve.serve.config import PoolArgs
    from specserve.serve.pools import ALWAYS_READY_TOKENS, TargetPool

    model = tiny_model("qwen2", seed=3)
    worker = TorchWorker(model)
    passes = []  # tokens computed per pass
    forward = worker._forward
    worker._forward = lambda plans: passes.append(sum(len(p.input_ids) for p in plans)) or forward(plans)
    pool = TargetPool.func_or_class(PoolArgs(model="tiny", prefill_chunk_tokens=64).model_dump(),
                                    build_engine=lambda args: worker)
    long_ids = torch.randint(0, 97, (300,), generator=torch.Generator().manual_seed(4)).tolist()
    greedy = SamplingParams()

    async def scenario():
        long = asyncio.create_task(pool.verify(VerifyRequest("long", long_ids, greedy, 0)))
        await asyncio.sleep(0)
        ids, rounds_before_long = [1, 2, 3], 0
        for _ in range(4):
            result = await pool.verify(VerifyRequest("short", ids, greedy, 0))
            ids = ids + result.tokens
            rounds_before_long += not long.done()
        return await long, rounds_before_long

    long_result, rounds_before_long = asyncio.run(scenario())
    assert rounds_before_long == 4  # the short request was never stuck behind the whole prompt
    assert max(passes) <= 64 + ALWAYS_READY_TOKENS
    expected = int(reference_logits(model, long_ids)[-1].argmax())
    assert long_result.tokens == [expected]


def test_decode_rows_of_many_requests_of_different_lengths_equal_one_at_a_time(model):
    """Five requests of different lengths each decode one token in one pass: every row equals
    the request decoded alone, and transformers' own forward."""
    gen = torch.Generator().manual_seed(12)
    seqs = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (3, 50, 17, 8, 33)]
    alone, together = TorchWorker(model), TorchWorker(model)
    for w in (alone, together):
        for i, s in enumerate(seqs):
            w.forward([ForwardItem(f"r{i}", s[:-1])])
    items = [ForwardItem(f"r{i}", s) for i, s in enumerate(seqs)]
    expected = [alone.forward([item])[0] for item in items]
    for got, want, s in zip(together.forward(items), expected, seqs):
        assert torch.allclose(got, want, atol=ATOL)
        assert torch.allclose(got[0], reference_logits(model, s)[-1], atol=ATOL)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_linear_layout_computes_the_same_map_for_one_row_and_many(layout):
    from specserve.engine.torch_worker import Linear, can_prepack

    pack = can_prepack(torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(48, 32, generator=gen), torch.randn(48, generator=gen)
    linear = Linear(weight, bias, pack=pack, layout=layout)
    for rows in (1, 2, 5, 33):
        x = torch.randn(rows, 32, generator=gen)
        assert torch.allclose(linear(x), torch.nn.functional.linear(x, weight, bias), atol=1e-5)
    assert torch.allclose(linear(x.view(3, 11, 32)), torch.nn.functional.linear(x, weight, bias).view(3, 11, 48), atol=1e-5)
    if pack:  # BOTH keeps two packed copies; a single layout serves every pass from one
        assert (linear.weight is linear.many_rows_weight) == (layout != BOTH)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_worker_in_any_layout_decodes_like_the_reference(model, layout):
    """Decode steps (one row) and chain verifies (several) in each layout equal a plain
    causal forward."""
    gen = torch.Generator().manual_seed(4)
    seq = torch.randint(0, 97, (14,), generator=gen).tolist()
    worker = TorchWorker(model, linear_layout=layout)
    assert worker.linear_layout == layout
    worker.forward([ForwardItem("r", seq[:8])])
    step = worker.forward([ForwardItem("r", seq[:9])])[0]
    verify = worker.forward([ForwardItem("r", seq[:9], TokenTree.chain(seq[9:13]))])[0]
    reference = reference_logits(model, seq[:13])
    assert torch.allclose(step[0], reference[8], atol=ATOL)
    assert torch.allclose(verify, reference[8:13], atol=ATOL)


def test_the_default_layout_follows_the_dtype_and_unknown_layouts_are_refused(model):
    from specserve.engine.torch_worker import Linear, default_linear_layout

    assert TorchWorker(model).linear_layout == BOTH  # tiny models are float32
    assert default_linear_layout(torch.bfloat16) == ONE_ROW
    with pytest.raises(SpecserveError, match="unknown linear layout"):
        Linear(torch.ones(2, 2), pack=False, layout="diagonal")


def test_an_int8_linear_is_close_to_the_float_map_and_keeps_the_dtype():
    from specserve.engine.torch_worker import Int8Linear, Linear

    gen = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(64, 48, generator=gen), torch.randn(64, generator=gen)
    linear = Int8Linear(weight, bias, sizes=[40, 24])
    for rows in (1, 5):
        x = torch.randn(rows, 48, generator=gen)
        exact = torch.nn.functional.linear(x, weight, bias)
        got = linear(x)
        assert got.dtype == x.dtype and got.shape == exact.shape
        assert (got - exact).abs().max() < 0.05 * exact.abs().max()  # int8: close, not equal
    assert linear(x.view(1, 5, 48)).shape == (1, 5, 64)
    assert linear.sizes == [40, 24]
    bf16 = Int8Linear(weight.bfloat16(), bias.bfloat16())
    assert bf16(x.bfloat16()).dtype == torch.bfloat16
    fused = Linear.fused([torch.nn.Linear(48, 8), torch.nn.Linear(48, 4)], pack=False, quantize="int8")
    assert isinstance(fused, Int8Linear) and fused.sizes == [8, 4]


def test_kernel_rows_keep_small_passes_and_bound_the_shapes_of_large_ones():
    """oneDNN keeps memory per row count it ran, so a replica's linears must see few of them."""
    import doctest

    from specserve.engine import kernel_rows as module
    from specserve.engine.kernel_rows import EXACT_ROWS, kernel_rows

    assert doctest.testmod(module).failed == 0
    assert [kernel_rows(n) for n in range(1, EXACT_ROWS + 1)] == list(range(1, EXACT_ROWS + 1))
    padded = [kernel_rows(n) for n in range(1, 8193)]
    assert all(n <= p <= n * 17 / 16 for n, p in zip(range(1, 8193), padded))  # at most 1/16 more rows
    assert padded == sorted(padded) and len(set(padded)) == 176  # 64 exact, then 16 per doubling
    assert all(kernel_rows(p) == p for p in set(padded))  # a padded size is its own size


def test_linears_of_many_rows_run_padded_and_return_each_row_unchanged():
    from specserve.engine.greedy_screen import linear_dynamic, prepack, quantize_rows
    from specserve.engine.kernel_rows import kernel_rows, run_padded
    from specserve.engine.torch_worker import Int8Linear, Linear, can_prepack

    seen = []
    x = torch.randn(65, 8)
    out = run_padded(lambda rows: seen.append(rows.shape[0]) or rows * 2, x)
    assert seen == [kernel_rows(65)] == [68] and torch.equal(out, x * 2)  # padded, then cut back

    gen = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(40, 32, generator=gen), torch.randn(40, generator=gen)
    linear = Linear(weight, bias, pack=can_prepack(torch.device("cpu"), torch.float32), layout=MANY_ROWS)
    int8 = Int8Linear(weight, bias)
    packed = prepack(quantize_rows(weight), bias)
    for rows in (65, 100, 129, 300):
        x = torch.randn(rows, 32, generator=gen)
        assert linear(x).shape == (rows, 40)
        assert torch.allclose(linear(x), torch.nn.functional.linear(x, weight, bias), atol=1e-5)
        # int8: zero rows leave the per-pass quantization as it was (its range holds 0)
        unpadded = torch.ops.quantized.linear_dynamic(x, packed, True)
        assert torch.allclose(linear_dynamic(x, packed), unpadded, atol=1e-5)
        assert int8(x).shape == (rows, 40)


def test_a_worker_refuses_an_unknown_quantization(model):
    with pytest.raises(SpecserveError, match="unknown quantization"):
        TorchWorker(model, quantize="int4")


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_releasing_the_model_weights_unmaps_the_checkpoint_and_keeps_the_output(tmp_path, quantize):
    """A checkpoint loaded on CPU is views of one mmap of its safetensors file: the release
    drops the projections and copies what stays (tied embedding, norms, biases), so the file is
    no longer mapped, and the worker computes what one that keeps them computes."""
    from specserve import models
    from specserve.engine.torch_worker import can_quantize

    if quantize is not None and not can_quantize(torch.device("cpu")):
        pytest.skip("no x86 quantized engine")
    tied = tiny_model("qwen2", seed=5)
    tied.config.tie_word_embeddings = True  # as Qwen2.5-Coder's: lm_head is the embedding
    tied.lm_head.weight = tied.model.embed_tokens.weight
    tied.save_pretrained(tmp_path)
    checkpoint = str(tmp_path / "model.safetensors")

    def mapped() -> bool:
        with open("/proc/self/maps") as maps:
            return any(line.rstrip().endswith(checkpoint) for line in maps)

    seq = torch.randint(0, 97, (12,), generator=torch.Generator().manual_seed(6)).tolist()

    def logits(worker) -> tuple[torch.Tensor, list[int]]:
        prefill = worker.forward([ForwardItem("r", seq[:8])])[0]
        [verify] = worker.run([ForwardItem("r", seq[:8], TokenTree.chain(seq[8:]))])
        greedy = verify.argmax()  # before the logits: through the greedy screen where there is one
        return torch.cat([prefill, verify.logits]), greedy

    want = logits(TorchWorker(models.load_causal_lm(tmp_path, dtype="float32"), quantize=quantize))
    assert not mapped()  # that worker and its model are gone
    model = models.load_causal_lm(tmp_path, dtype="float32")
    assert mapped()
    worker = TorchWorker(model, quantize=quantize, release_model_weights=True)
    assert not mapped()
    assert all(m.weight.numel() == 0 for m in (model.model.layers[0].self_attn.q_proj, model.model.layers[1].mlp.down_proj))
    assert model.lm_head.weight is model.get_input_embeddings().weight and model.lm_head.weight.numel() > 0
    got = logits(worker)
    assert torch.equal(got[0], want[0]) and got[1] == want[1]
