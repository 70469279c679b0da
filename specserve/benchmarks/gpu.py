"""The torch engine on a GPU: exactness on CUDA, and where the time of a step goes.

    PYTHONUNBUFFERED=1 python -m specserve.benchmarks.gpu --out DIR      # on a CUDA machine
    python -m specserve.benchmarks.gpu --tiny --device cpu --out DIR     # the same logic, tiny shapes

The models have the real shapes of Qwen2.5-Coder-1.5B (target) and 0.5B (draft), copied from
their config.json below, with RANDOM weights: no weights need to travel to the GPU machine.
Timings depend on shapes, not on weight values; acceptance and outputs do not mean anything
about the real models (a random draft almost never agrees with a random target, so the
`self` cases, whose draft is the target's own weights, exercise full-length speculation).

It writes, to --out, results.json (every number) and results.md (the tables):
- exactness: greedy speculative outputs (draft chain k=4, a static 8-node draft tree, Medusa
  heads, self-speculation) against the same engine's target-only greedy output, and that
  against transformers' own `generate`, in float32 and bfloat16;
- the engine's decode step at several batch sizes and its verify passes (chain, trees);
- a bare transformers forward with a static KV cache, eager and replayed as a CUDA graph, at
  the same shapes: how much of the engine's step is Python and kernel-launch overhead;
- end-to-end tokens/s at batch 1: target only against draft k=4 (random draft, self draft);
- profile.txt: torch.profiler tables of one batch-1 decode step, the engine's and transformers'.
- graphs (--phases graphs): the engine's CUDA-graph path (specserve.engine.cuda_graphs) against
  its eager ragged pass: float32 logits and greedy outputs, bfloat16 decode steps and a chain
  verify pass, end to end. On a CPU the same static-shape passes run uncaptured.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

# From ~/.cache/specserve/models/qwen2.5-coder-{1.5b,0.5b}-instruct/config.json (shape fields).
QWEN_CODER_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                       rms_norm_eps=1e-06, rope_theta=1000000.0, tie_word_embeddings=False)
QWEN_CODER_0_5B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                       rms_norm_eps=1e-06, rope_theta=1000000.0, tie_word_embeddings=False)
# --tiny: the same code paths in seconds on a CPU (tests/test_gpu_bench.py)
TINY_TARGET = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=97, max_position_embeddings=512, rms_norm_eps=1e-06,
                   rope_theta=10000.0, tie_word_embeddings=False)
TINY_DRAFT = dict(TINY_TARGET, hidden_size=32, intermediate_size=64)

# A static 8-node draft tree (Medusa-style paths of child ranks), depth 4.
TREE_8 = ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0))


class Plan:
    """Sizes of one run; --tiny shrinks them."""

    def __init__(self, tiny: bool):
        self.exact_prompts = 3
        self.exact_prompt_len = 16 if tiny else 32
        self.exact_tokens = 12 if tiny else 48
        self.context = 24 if tiny else 128
        self.batches = (1, 4) if tiny else (1, 4, 16)
        self.steps = 3 if tiny else 32
        self.warmup = 1 if tiny else 3
        self.tree_sizes = (8, 16)
        self.e2e_tokens = 12 if tiny else 128
        self.exact_steps = 4 if tiny else 16


def log(message: str, started=[time.perf_counter()]) -> None:  # noqa: B006 (the run's start time)
    print(f"[{time.perf_counter() - started[0]:7.1f}s] {message}", flush=True)


# ---- models -----------------------------------------------------------------------------

def build_model(shape: dict, *, dtype: torch.dtype, device: str, seed: int):
    """A Qwen2 decoder with `shape` and seeded random weights, built on `device`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**shape, bos_token_id=None, eos_token_id=None, pad_token_id=None, initializer_range=0.02)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    return model.to(dtype).eval().requires_grad_(False)


def random_heads(model, *, num_heads: int = 3, noise: float = 0.02, seed: int = 0):
    """Medusa heads on `model` with random blocks (not trained; they propose something cheap)."""
    from specserve.heads.medusa import MedusaConfig, MedusaHeads

    config = MedusaConfig(model.config.hidden_size, model.config.vocab_size, num_heads=num_heads)
    heads = MedusaHeads(config, model.lm_head.weight)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.blocks.parameters():
            p.add_((noise * torch.randn(p.shape, generator=gen)).to(p.device, p.dtype))
    return heads.to(device=model.device, dtype=model.dtype).requires_grad_(False).eval()


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=gen).tolist()


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---- exactness --------------------------------------------------------------------------

def speculations():
    """(case, proposer's model: None / 'draft' / 'self' / 'heads', Speculation)."""
    from specserve.protocol import Speculation, TreeSpec

    tree = TreeSpec(shape=TREE_8)
    return [
        ("target only", None, Speculation(proposer="none")),
        ("draft chain k=4", "draft", Speculation(proposer="draft", k=4)),
        ("draft tree (8 nodes)", "draft", Speculation(proposer="draft", shape="tree", tree=tree)),
        ("medusa chain k=3 (random heads)", "heads", Speculation(proposer="medusa", k=3)),
        ("self chain k=4", "self", Speculation(proposer="draft", k=4)),
        ("self tree (8 nodes)", "self", Speculation(proposer="draft", shape="tree", tree=tree)),
    ]


def make_decoder(target_worker, proposer_worker=None, heads=None, *, speculation, max_context: int):
    """A decoder over an existing target worker. min_confidence=0: random drafts are never
    confident, and the chain should still run to k."""
    from specserve.decoder import SpeculativeDecoder
    from specserve.proposers.draft_model import DraftModelProposer
    from specserve.proposers.medusa import MedusaProposer
    from specserve.verifier import Verifier

    proposer = DraftModelProposer(proposer_worker, min_confidence=0.0) if proposer_worker is not None else None
    verifier = Verifier(target_worker, MedusaProposer(heads) if heads is not None else None)
    return SpeculativeDecoder(verifier, proposer, speculation=speculation, max_context=max_context)


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy decoding of the target alone (its default attention)."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=0, repetition_penalty=1.0)
    return out[0, len(prompt):].tolist()


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or of the shorter one's end), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_outputs(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    mismatches = [first_mismatch(o, r) for o, r in zip(outputs, reference)]
    return {"identical": sum(m is None for m in mismatches), "of": len(outputs),
            "first_mismatch": mismatches}


def check_exactness(models: dict, dtype: torch.dtype, plan: Plan, *, device: str) -> list[dict]:
    """Every case's greedy outputs for the same prompts, batched, against the engine's own
    target-only outputs (same batch) and against transformers' generate (one prompt at a time)."""
    from specserve.engine.torch_worker import TorchWorker
    from specserve.protocol import SamplingParams

    target, draft, heads = models["target"], models["draft"], models["heads"]
    max_context = target.config.max_position_embeddings
    prompts = random_prompts(plan.exact_prompts, plan.exact_prompt_len, target.config.vocab_size, seed=1)
    params = SamplingParams(max_tokens=plan.exact_tokens)
    target_worker = TorchWorker(target)
    proposer_workers = {"draft": TorchWorker(draft), "self": TorchWorker(target)}
    hf = [hf_greedy(target, p, plan.exact_tokens) for p in prompts]
    rows, engine_greedy = [], None
    for case, source, spec in speculations():
        decoder = make_decoder(target_worker, proposer_workers.get(source),
                               heads if source == "heads" else None, speculation=spec, max_context=max_context)
        generations = decoder.generate(prompts, params)
        outputs = [g.token_ids for g in generations]
        if engine_greedy is None:
            engine_greedy = outputs
        stats = decoder.last_report.stats
        row = {"dtype": str(dtype).removeprefix("torch."), "case": case,
               "vs_engine_target_only": compare_outputs(outputs, engine_greedy),
               "vs_transformers_generate": compare_outputs(outputs, hf),
               "mean_accepted_length": round(stats.mean_accepted_length, 3),
               "acceptance_rate": round(stats.acceptance_rate, 3)}
        rows.append(row)
        log(f"exactness {row['dtype']:8s} {case:32s} = engine greedy "
            f"{row['vs_engine_target_only']['identical']}/{len(prompts)}, = HF generate "
            f"{row['vs_transformers_generate']['identical']}/{len(prompts)}, "
            f"accepted length {row['mean_accepted_length']}")
    synchronize(device)
    return rows


# ---- timing -----------------------------------------------------------------------------

def summarize_ms(seconds: list[float]) -> dict:
    ms = sorted(s * 1e3 for s in seconds)
    return {"median_ms": round(statistics.median(ms), 3), "p10_ms": round(ms[len(ms) // 10], 3),
            "p90_ms": round(ms[(9 * len(ms)) // 10], 3), "samples": len(ms)}


def timed(run, *, repeats: int, warmup: int, device: str) -> list[float]:
    """Wall time of each call of `run`, the GPU drained before and after each."""
    for _ in range(warmup):
        run()
    synchronize(device)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - started)
    return times


def engine_decode_stepper(worker, batch: int, context: int, seed: int):
    """Prefill `batch` requests of `context` random tokens, then return a function that runs
    one batched decode step (the engine pass plus the greedy argmax that reads its logits),
    each request growing by one token per step."""
    from specserve.engine.torch_worker import ForwardItem

    sequences = random_prompts(batch, context, worker.vocab_size, seed)
    names = [f"step-{batch}-{seed}-{i}" for i in range(batch)]

    def step():
        rows = worker.forward([ForwardItem(n, s) for n, s in zip(names, sequences)])
        for s, logits in zip(sequences, rows):
            s.append(int(logits[-1].argmax()))

    step()  # prefill
    return step


def balanced_tree(nodes: int):
    """A tree whose every node has two children, breadth first: node i's parent is i//2 - 1."""
    from specserve.protocol import TokenTree

    return TokenTree(tuple(range(1, nodes + 1)), tuple(i // 2 - 1 for i in range(nodes)))


def chain_tree(nodes: int):
    from specserve.protocol import TokenTree

    return TokenTree(tuple(range(1, nodes + 1)), tuple(range(-1, nodes - 1)))


def engine_verify_pass(worker, tree, context: int, seed: int):
    """One request of `context` tokens, verifying `tree` again and again: the same pass each
    time (the pending tree is dropped, the last token and the tree are fed again)."""
    from specserve.engine.torch_worker import ForwardItem

    [tokens] = random_prompts(1, context, worker.vocab_size, seed)
    name = f"verify-{len(tree)}-{seed}"
    worker.forward([ForwardItem(name, tokens)])  # prefill

    def verify():
        [logits] = worker.forward([ForwardItem(name, tokens, tree)])
        logits.argmax(-1).tolist()

    return verify


def time_engine(worker, plan: Plan, *, device: str) -> dict:
    out = {"decode": {}, "verify": {}}
    for batch in plan.batches:
        step = engine_decode_stepper(worker, batch, plan.context, seed=10 + batch)
        stats = summarize_ms(timed(step, repeats=plan.steps, warmup=plan.warmup, device=device))
        stats["tokens_per_s"] = round(batch * 1e3 / stats["median_ms"], 1)
        out["decode"][batch] = stats
        log(f"engine decode step, batch {batch:2d}: {stats['median_ms']:.2f} ms ({stats['tokens_per_s']} tok/s)")
    # The same batch-1 decode pass again and again (context fixed): against the growing one,
    # what a new attention length per step costs.
    fixed = engine_verify_pass(worker, chain_tree(0), plan.context, seed=19)
    out["decode_fixed_context"] = summarize_ms(timed(fixed, repeats=plan.steps, warmup=plan.warmup, device=device))
    log(f"engine decode step, batch  1, the same context each time: {out['decode_fixed_context']['median_ms']:.2f} ms")
    if device.startswith("cuda"):
        out["decode_default_attention"] = time_with_default_attention(worker, plan, device=device)
    trees = [("chain of 4 drafts (5 tokens)", chain_tree(4))]
    trees += [(f"tree of {n} nodes", balanced_tree(n)) for n in plan.tree_sizes]
    for name, tree in trees:
        verify = engine_verify_pass(worker, tree, plan.context, seed=20 + len(tree))
        out["verify"][name] = summarize_ms(timed(verify, repeats=plan.steps, warmup=plan.warmup, device=device))
        log(f"engine verify, batch 1, {name}: {out['verify'][name]['median_ms']:.2f} ms")
    return out


def time_with_default_attention(worker, plan: Plan, *, device: str) -> dict:
    """Decode steps with PyTorch's own choice of attention backend (cuDNN's, on an H100)
    instead of the engine's (TorchWorker.attention_backends)."""
    out = {}
    chosen, worker.attention_backends = worker.attention_backends, None
    try:
        for batch in plan.batches:
            step = engine_decode_stepper(worker, batch, plan.context, seed=70 + batch)
            out[batch] = summarize_ms(timed(step, repeats=plan.steps, warmup=plan.warmup, device=device))
            log(f"engine decode step, batch {batch:2d}, PyTorch's default attention backend: "
                f"{out[batch]['median_ms']:.2f} ms")
    finally:
        worker.attention_backends = chosen
    return out


def hf_static_step(model, batch: int, context: int, seed: int):
    """A bare transformers decode step at position `context` over a static KV cache of
    exactly context + 1 slots (so no mask is needed and every slot is real), prefilled with
    random tokens. Each call recomputes the same step in place: fixed inputs, fixed cache."""
    from transformers import StaticCache

    device = model.device
    ids = torch.tensor(random_prompts(batch, context, model.config.vocab_size, seed), device=device)
    cache = StaticCache(config=model.config, max_cache_len=context + 1)
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=cache, cache_position=torch.arange(context, device=device),
              use_cache=True)
    step_ids = ids[:, -1:].clone()
    position = torch.tensor([context], device=device)
    position_ids = position[None].expand(batch, 1).contiguous()

    # Newer transformers track the fill level in the cache (a tensor per layer): rewind it so
    # the step writes the last slot again. Older ones take cache_position alone.
    levels = [layer.cumulative_length for layer in getattr(cache, "layers", ())
              if torch.is_tensor(getattr(layer, "cumulative_length", None))]

    @torch.inference_mode()
    def step():
        for level in levels:
            level.fill_(context)
        return model(input_ids=step_ids, past_key_values=cache, cache_position=position,
                     position_ids=position_ids, use_cache=True).logits

    return step


def bare_step_matches_engine(model, worker, context: int, seed: int) -> dict:
    """The bare step's logits against the engine's for the same tokens (prompt, then its last
    token again at position `context`): both must compute the same function."""
    from specserve.engine.torch_worker import ForwardItem

    bare = hf_static_step(model, 1, context, seed)()[0, -1].float()
    [tokens] = random_prompts(1, context, model.config.vocab_size, seed)
    [engine] = worker.forward([ForwardItem(f"check-{seed}", tokens + tokens[-1:])])
    engine = engine[-1].float()
    return {"same_argmax": bool(bare.argmax() == engine.argmax()),
            "max_abs_logit_diff": round(float((bare - engine).abs().max()), 4),
            "logit_scale": round(float(engine.abs().max()), 4)}


def as_cuda_graph(step):
    """Capture `step` once (after warming it up on a side stream) and return its replay, plus
    the static output it writes."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph.replay, out


def time_bare_transformers(model, plan: Plan, *, device: str) -> dict:
    """Eager and CUDA-graph decode steps."""
    out = {}
    for batch in plan.batches:
        row = {}
        step = hf_static_step(model, batch, plan.context, seed=30 + batch)
        row["eager"] = summarize_ms(timed(step, repeats=plan.steps, warmup=plan.warmup, device=device))
        eager_argmax = step()[:, -1].argmax(-1)
        if device.startswith("cuda"):
            try:
                replay, graph_out = as_cuda_graph(step)
                row["cuda_graph"] = summarize_ms(timed(replay, repeats=plan.steps, warmup=plan.warmup, device=device))
                replay()
                row["cuda_graph"]["same_argmax_as_eager"] = bool((graph_out[:, -1].argmax(-1) == eager_argmax).all())
            except Exception as error:  # recorded, not fatal: the eager numbers stand
                row["cuda_graph"] = {"error": f"{type(error).__name__}: {error}"[:500]}
        out[batch] = row
        log(f"transformers static-cache step, batch {batch:2d}: " + ", ".join(
            f"{k} {v.get('median_ms', v.get('error'))}" for k, v in row.items()))
    return out


def time_compiled(model, batch: int, plan: Plan, *, device: str) -> dict:
    compiled = copy.copy(model)  # a shallow copy whose forward is compiled; the weights are shared
    compiled.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=False)
    try:
        step = hf_static_step(compiled, batch, plan.context, seed=30 + batch)
        started = time.perf_counter()
        for _ in range(3):
            step()
        synchronize(device)
        stats = summarize_ms(timed(step, repeats=plan.steps, warmup=plan.warmup, device=device))
        stats["compile_and_warmup_s"] = round(time.perf_counter() - started, 1)
        return stats
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"[:500]}


def kernels_per_call(run, device: str) -> dict | None:
    """CUDA kernels one call launches and their summed GPU time (torch.profiler): against the
    call's wall time this says how long the GPU waits for Python."""
    if not device.startswith("cuda"):
        return None
    from torch.profiler import ProfilerActivity, profile

    run()
    synchronize(device)
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run()
            synchronize(device)
        # GPU events, less the engine's own record_function ranges (which span kernels)
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and not e.name.startswith("specserve::")]
        return {"kernels": len(kernels), "gpu_busy_ms": round(sum(e.device_time for e in kernels) / 1e3, 3)}
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"[:300]}


def profile_tables(run, device: str) -> str:
    """torch.profiler tables of one call (after a warm one): operators by their own CPU time
    and by GPU time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    run()
    synchronize(device)
    with profile(activities=activities) as prof:
        run()
        synchronize(device)
    by_cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
    by_gpu = prof.key_averages().table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=60)
    return "\n\n".join([by_cpu, by_gpu])


def time_end_to_end(models: dict, plan: Plan, *, device: str) -> list[dict]:
    """Batch 1 tokens/s of target only against draft k=4 (random draft, self draft) and the
    other speculative cases, one random prompt, `e2e_tokens` new tokens, after a warm run of
    the same length (CUDA graphs capture each shape the first time it runs)."""
    from specserve.engine.torch_worker import TorchWorker
    from specserve.protocol import SamplingParams

    target = models["target"]
    target_worker = TorchWorker(target)
    proposer_workers = {"draft": TorchWorker(models["draft"]), "self": TorchWorker(target)}
    prompts = random_prompts(1, plan.context, target.config.vocab_size, seed=40)
    rows, baseline = [], None
    for case, source, spec in speculations():
        decoder = make_decoder(target_worker, proposer_workers.get(source),
                               models["heads"] if source == "heads" else None, speculation=spec,
                               max_context=target.config.max_position_embeddings)
        params = SamplingParams(max_tokens=plan.e2e_tokens)
        decoder.generate(prompts, params)  # warm
        synchronize(device)
        [generation] = decoder.generate(prompts, params)
        report = decoder.last_report
        baseline = baseline or report.tokens_per_second
        rows.append({"case": case, "tokens_per_s": round(report.tokens_per_second, 1),
                     "speedup": round(report.tokens_per_second / baseline, 2),
                     "mean_accepted_length": round(report.stats.mean_accepted_length, 2),
                     "tokens": len(generation.token_ids), "seconds": round(report.seconds, 3)})
        log(f"end to end, batch 1, {case:32s}: {rows[-1]['tokens_per_s']} tok/s "
            f"({rows[-1]['speedup']}x), accepted length {rows[-1]['mean_accepted_length']}")
    return rows


# ---- CUDA graphs ------------------------------------------------------------------------

GRAPH_CASES = ("target only", "self chain k=4", "draft chain k=4", "self tree (8 nodes)", "draft tree (8 nodes)")
GRAPH_TREE_NODES = (8, 16, 63)  # 63: the size of Medusa's and Hydra's own tree (mc_sim_7b_63)
CPU_CACHED_TOKENS = 16384  # the KV cache of a CPU smoke run's static workers


def eager_worker(model):
    """The engine's ragged pass, every pass eager."""
    from specserve.engine.torch_worker import TorchWorker

    return TorchWorker(model, cuda_graphs=False)


def graph_worker(model, device: str):
    """Small passes replayed as CUDA graphs; on a CPU the same static-shape passes, uncaptured."""
    from specserve.engine.cuda_graphs import StaticPasses
    from specserve.engine.torch_worker import TorchWorker

    if device.startswith("cuda"):
        return TorchWorker(model, cuda_graphs=True)
    # on a CPU (a smoke run) a small KV cache: the static passes zero its free blocks
    worker = TorchWorker(model, cuda_graphs=False, max_cached_tokens=CPU_CACHED_TOKENS)
    worker.static_passes = StaticPasses(worker, capture=False)
    return worker


def static_pass_stats(worker) -> dict:
    passes = worker.static_passes
    return {"replays": passes.replays, "uncaptured_static_passes": passes.eager_passes,
            "shapes_captured": [vars(s) for s in passes.shapes_captured], "capture_error": passes.capture_error,
            "all_passes": worker.forward_passes}


def compare_decode_steps(model, batch: int, plan: Plan, *, device: str) -> dict:
    """The same decode steps through an eager and a graph worker (the eager argmax feeds both):
    the largest logit and hidden-state differences, and whether every argmax agrees."""
    from specserve.engine.torch_worker import ForwardItem

    eager, graphed = eager_worker(model), graph_worker(model, device)
    sequences = random_prompts(batch, plan.exact_prompt_len, model.config.vocab_size, seed=80 + batch)
    names = [f"exact-{batch}-{i}" for i in range(batch)]
    logit_diff = hidden_diff = 0.0
    same_argmax = True
    for _ in range(plan.exact_steps + 1):  # a prefill, then decode steps
        items = [ForwardItem(n, list(s)) for n, s in zip(names, sequences)]
        for s, e, g in zip(sequences, eager.run(items), graphed.run(items)):
            logit_diff = max(logit_diff, float((e.logits.float() - g.logits.float()).abs().max()))
            hidden_diff = max(hidden_diff, float((e.hidden.float() - g.hidden.float()).abs().max()))
            same_argmax &= bool((e.logits.argmax(-1) == g.logits.argmax(-1)).all())
            s.append(int(e.logits[-1].argmax()))
    return {"batch": batch, "steps": plan.exact_steps, "max_abs_logit_diff": logit_diff,
            "max_abs_hidden_diff": hidden_diff, "same_argmax": same_argmax, "graph_worker": static_pass_stats(graphed)}


def check_graph_exactness(models: dict, plan: Plan, *, device: str) -> dict:
    """float32: decode-step logits against the eager pass, and greedy outputs (GRAPH_CASES:
    chains and trees) over graph workers against eager target-only output."""
    from specserve.protocol import SamplingParams

    target, draft = models["target"], models["draft"]
    out = {"dtype": "float32", "decode_steps": [compare_decode_steps(target, b, plan, device=device)
                                                for b in plan.batches]}
    for row in out["decode_steps"]:
        log(f"graphs exactness, batch {row['batch']:2d}: max |logit diff| {row['max_abs_logit_diff']:.2e}, "
            f"max |hidden diff| {row['max_abs_hidden_diff']:.2e}, same argmax {row['same_argmax']}, "
            f"{row['graph_worker']['replays']} replays, capture error {row['graph_worker']['capture_error']}")
    prompts = random_prompts(plan.exact_prompts, plan.exact_prompt_len, target.config.vocab_size, seed=1)
    params = SamplingParams(max_tokens=plan.exact_tokens)
    max_context = target.config.max_position_embeddings
    specs = {case: (source, spec) for case, source, spec in speculations()}
    reference = [g.token_ids for g in make_decoder(eager_worker(target), speculation=specs["target only"][1],
                                                   max_context=max_context).generate(prompts, params)]
    out["greedy"] = []
    for case in GRAPH_CASES:
        source, spec = specs[case]
        target_worker = graph_worker(target, device)
        proposer = {"self": target, "draft": draft}.get(source)
        decoder = make_decoder(target_worker, graph_worker(proposer, device) if proposer is not None else None,
                               speculation=spec, max_context=max_context)
        outputs = [g.token_ids for g in decoder.generate(prompts, params)]
        out["greedy"].append({"case": case, "vs_eager_target_only": compare_outputs(outputs, reference),
                              "mean_accepted_length": round(decoder.last_report.stats.mean_accepted_length, 3),
                              "target_worker": static_pass_stats(target_worker)})
        log(f"graphs exactness, {case}: = eager target only "
            f"{out['greedy'][-1]['vs_eager_target_only']['identical']}/{len(prompts)}")
    return out


def time_graphs(models: dict, plan: Plan, *, device: str) -> dict:
    """bfloat16 decode steps, a batch-1 chain verify pass (4 drafts) and tree verify passes,
    eager against graph."""
    target = models["target"]
    out = {"dtype": "bfloat16", "context": plan.context, "decode": {}, "verify_chain_4": {}, "verify_trees": {},
           "kernels": {}, "graph_worker": None}
    for mode in ("eager", "graph"):
        worker = eager_worker(target) if mode == "eager" else graph_worker(target, device)
        for batch in plan.batches:
            step = engine_decode_stepper(worker, batch, plan.context, seed=10 + batch)
            stats = summarize_ms(timed(step, repeats=plan.steps, warmup=plan.warmup, device=device))
            stats["tokens_per_s"] = round(batch * 1e3 / stats["median_ms"], 1)
            out["decode"].setdefault(batch, {})[mode] = stats
            log(f"graphs timing, {mode:5s} decode step, batch {batch:2d}: {stats['median_ms']:.2f} ms")
        verify = engine_verify_pass(worker, chain_tree(4), plan.context, seed=24)
        out["verify_chain_4"][mode] = summarize_ms(timed(verify, repeats=plan.steps, warmup=plan.warmup,
                                                         device=device))
        log(f"graphs timing, {mode:5s} chain verify (5 tokens), batch 1: "
            f"{out['verify_chain_4'][mode]['median_ms']:.2f} ms")
        for nodes in GRAPH_TREE_NODES:
            verify = engine_verify_pass(worker, balanced_tree(nodes), plan.context, seed=30 + nodes)
            stats = out["verify_trees"].setdefault(nodes, {})[mode] = summarize_ms(
                timed(verify, repeats=plan.steps, warmup=plan.warmup, device=device))
            log(f"graphs timing, {mode:5s} tree verify ({nodes} nodes), batch 1: {stats['median_ms']:.2f} ms")
        out["kernels"][mode] = kernels_per_call(engine_decode_stepper(worker, 1, plan.context, seed=50), device)
        if mode == "graph":
            out["graph_worker"] = static_pass_stats(worker)
    return out


def time_graphs_end_to_end(models: dict, plan: Plan, *, device: str) -> list[dict]:
    """Batch 1 tokens/s, eager against graph workers; each case runs once in full to warm up
    (the graphs of its shapes are captured then), then again timed."""
    from specserve.protocol import SamplingParams

    target = models["target"]
    specs = {case: (source, spec) for case, source, spec in speculations()}
    prompts = random_prompts(1, plan.context, target.config.vocab_size, seed=40)
    params = SamplingParams(max_tokens=plan.e2e_tokens)
    rows, baseline = [], None
    for case in GRAPH_CASES:
        source, spec = specs[case]
        for mode in ("eager", "graph"):
            if source == "draft" and mode == "eager":
                continue  # a random draft accepts nothing: 7.8 tok/s eager (results.md), slow to rerun
            make = eager_worker if mode == "eager" else (lambda m: graph_worker(m, device))
            proposer = {"self": target, "draft": models["draft"]}.get(source)
            decoder = make_decoder(make(target), make(proposer) if proposer is not None else None, speculation=spec,
                                   max_context=target.config.max_position_embeddings)
            decoder.generate(prompts, params)  # warm
            synchronize(device)
            [generation] = decoder.generate(prompts, params)
            report = decoder.last_report
            baseline = baseline or report.tokens_per_second
            rows.append({"case": case, "mode": mode, "tokens_per_s": round(report.tokens_per_second, 1),
                         "vs_eager_target_only": round(report.tokens_per_second / baseline, 2),
                         "mean_accepted_length": round(report.stats.mean_accepted_length, 2),
                         "tokens": len(generation.token_ids)})
            log(f"graphs end to end, {case:16s} {mode:5s}: {rows[-1]['tokens_per_s']} tok/s "
                f"({rows[-1]['vs_eager_target_only']}x), accepted length {rows[-1]['mean_accepted_length']}")
    return rows


def static_passes_note(stats: dict) -> str:
    """Static passes run: replays on a GPU, uncaptured passes on a CPU; and a capture failure."""
    note = str(stats["replays"] or stats["uncaptured_static_passes"])
    return note + (f" (capture failed: {stats['capture_error']})" if stats["capture_error"] else "")


def graphs_markdown(graphs: dict) -> list[str]:
    lines = ["## CUDA graphs (specserve.engine.cuda_graphs) against the eager ragged pass", ""]
    exact = graphs.get("exactness")
    if exact:
        lines += ["float32, the same decode steps through both workers:", "",
                  "| batch | steps | max abs logit diff | max abs hidden diff | same argmax | replays |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['batch']} | {r['steps']} | {r['max_abs_logit_diff']:.2e} | {r['max_abs_hidden_diff']:.2e} | "
                  f"{r['same_argmax']} | {static_passes_note(r['graph_worker'])} |" for r in exact["decode_steps"]]
        lines += ["", "| float32 greedy, graph workers | = eager target only | accepted length |", "|---|---|---|"]
        for r in exact["greedy"]:
            same = r["vs_eager_target_only"]
            lines.append(f"| {r['case']} | {same['identical']}/{same['of']} {mismatch_note(same)} | "
                         f"{r['mean_accepted_length']} |")
        lines.append("")
    timing = graphs.get("timing")
    if timing:
        lines += [f"{timing['dtype']}, context {timing['context']} tokens, median ms:", "",
                  "| pass | eager | graph | eager tok/s | graph tok/s |", "|---|---|---|---|---|"]
        for batch, row in timing["decode"].items():
            lines.append(f"| decode step, batch {batch} | {cell(row.get('eager'))} | {cell(row.get('graph'))} | "
                         f"{row['eager']['tokens_per_s']} | {row['graph']['tokens_per_s']} |")
        v = timing["verify_chain_4"]
        lines.append(f"| chain verify (4 drafts, 5 tokens), batch 1 | {cell(v.get('eager'))} | "
                     f"{cell(v.get('graph'))} | - | - |")
        lines += [f"| tree verify ({nodes} nodes), batch 1 | {cell(v.get('eager'))} | {cell(v.get('graph'))} | - | - |"
                  for nodes, v in timing.get("verify_trees", {}).items()]
        lines += ["", "| one batch-1 decode step | CUDA kernels | GPU busy ms |", "|---|---|---|"]
        lines += [f"| {mode} | {k.get('kernels', '-')} | {k.get('gpu_busy_ms', k.get('error', '-'))} |"
                  for mode, k in timing["kernels"].items() if k]
        lines += ["", f"Graph worker: {timing['graph_worker']}", ""]
    if graphs.get("end_to_end"):
        lines += ["End to end, batch 1, bfloat16:", "",
                  "| case | mode | tok/s | vs eager target only | accepted length |", "|---|---|---|---|---|"]
        lines += [f"| {r['case']} | {r['mode']} | {r['tokens_per_s']} | {r['vs_eager_target_only']}x | "
                  f"{r['mean_accepted_length']} |" for r in graphs["end_to_end"]]
        lines.append("")
    return lines


# ---- report -----------------------------------------------------------------------------

def machine(device: str) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "device": device}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def markdown(results: dict) -> str:
    lines = [f"# The torch engine on {results['machine'].get('gpu', results['machine']['device'])}", "",
             "Random weights with the shapes of Qwen2.5-Coder-1.5B (target) and 0.5B (draft): timings depend only "
             "on shapes; acceptance and outputs say nothing about the real models.", "",
             f"`{results['command']}`; " + ", ".join(f"{k} {v}" for k, v in results["machine"].items()), ""]
    if results.get("exactness"):
        lines += ["## Exactness (greedy, batched prompts)", "",
                  "| dtype | case | = engine target only | = transformers generate | accepted length |",
                  "|---|---|---|---|---|"]
        for r in results["exactness"]:
            e, h = r["vs_engine_target_only"], r["vs_transformers_generate"]
            lines.append(f"| {r['dtype']} | {r['case']} | {e['identical']}/{e['of']} {mismatch_note(e)} | "
                         f"{h['identical']}/{h['of']} {mismatch_note(h)} | {r['mean_accepted_length']} |")
        lines.append("")
    timing = results.get("timing")
    if timing:
        lines += [f"## Decode step ({timing['dtype']}, context {timing['context']} tokens), median ms", "",
                  "| batch | engine | engine tok/s | engine, PyTorch's default attention backend | "
                  "transformers eager | transformers CUDA graph | torch.compile reduce-overhead |",
                  "|---|---|---|---|---|---|---|"]
        default_attention = timing["engine"].get("decode_default_attention", {})
        for batch, engine in timing["engine"]["decode"].items():
            hf = timing.get("transformers", {}).get(batch, {})
            lines.append(f"| {batch} | {engine['median_ms']} | {engine['tokens_per_s']} | "
                         f"{cell(default_attention.get(batch))} | {cell(hf.get('eager'))} | "
                         f"{cell(hf.get('cuda_graph'))} | {cell(hf.get('torch_compile_reduce_overhead'))} |")
        lines += ["", "Engine, batch 1, the same decode pass repeated (context fixed): "
                  f"{timing['engine']['decode_fixed_context']['median_ms']} ms."]
        lines += ["", "| batch 1 verify pass | median ms |", "|---|---|"]
        lines += [f"| {name} | {v['median_ms']} |" for name, v in timing["engine"]["verify"].items()]
        if timing.get("bare_step_vs_engine"):
            lines += ["", f"Bare transformers step against the engine's, same tokens: {timing['bare_step_vs_engine']}"]
        if timing.get("kernels"):
            lines += ["", "| one batch-1 decode step | CUDA kernels | GPU busy ms |", "|---|---|---|"]
            lines += [f"| {name} | {k.get('kernels', '-')} | {k.get('gpu_busy_ms', k.get('error', '-'))} |"
                      for name, k in timing["kernels"].items() if k]
        lines.append("")
    if results.get("end_to_end"):
        lines += [f"## End to end, batch 1, {results['plan']['e2e_tokens']} new tokens", "",
                  "| case | tok/s | speedup | accepted length |", "|---|---|---|---|"]
        lines += [f"| {r['case']} | {r['tokens_per_s']} | {r['speedup']}x | {r['mean_accepted_length']} |"
                  for r in results["end_to_end"]]
        lines.append("")
    if results.get("graphs"):
        lines += graphs_markdown(results["graphs"])
    return "\n".join(lines)


def mismatch_note(comparison: dict) -> str:
    firsts = [m for m in comparison["first_mismatch"] if m is not None]
    return f"(first differs at token {', '.join(map(str, firsts))})" if firsts else ""


def cell(stats: dict | None) -> str:
    if not stats:
        return "-"
    return str(stats["median_ms"]) if "median_ms" in stats else f"failed: {stats['error'][:80]}"


def write(out: Path, results: dict) -> None:
    """After each phase: an interrupted run keeps what it measured."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results.md").write_text(markdown(results))


# ---- main -------------------------------------------------------------------------------

def load_models(dtype: torch.dtype, *, tiny: bool, device: str) -> dict:
    target = build_model(TINY_TARGET if tiny else QWEN_CODER_1_5B, dtype=dtype, device=device, seed=0)
    draft = build_model(TINY_DRAFT if tiny else QWEN_CODER_0_5B, dtype=dtype, device=device, seed=1)
    return {"target": target, "draft": draft, "heads": random_heads(target)}


def run_timing(models: dict, plan: Plan, *, device: str, save) -> dict:
    """The engine's passes, then the bare transformers step at the same shapes."""
    from specserve.engine.torch_worker import TorchWorker

    target = models["target"]
    worker = TorchWorker(target)
    timing = {"dtype": "bfloat16", "context": plan.context, "engine": time_engine(worker, plan, device=device)}
    save(timing)
    timing["transformers"] = time_bare_transformers(target, plan, device=device)
    timing["bare_step_vs_engine"] = bare_step_matches_engine(target, worker, plan.context, seed=52)
    log(f"bare transformers step against the engine's: {timing['bare_step_vs_engine']}")
    timing["kernels"] = {
        "engine": kernels_per_call(engine_decode_stepper(worker, 1, plan.context, seed=50), device),
        "transformers eager": kernels_per_call(hf_static_step(target, 1, plan.context, seed=51), device),
    }
    return timing


def write_profile(models: dict, plan: Plan, *, device: str, out: Path) -> None:
    """Where one batch-1 decode step spends its time, the engine's and transformers'."""
    from specserve.engine.torch_worker import TorchWorker

    runs = {"engine": engine_decode_stepper(TorchWorker(models["target"]), 1, plan.context, seed=60),
            "transformers eager": hf_static_step(models["target"], 1, plan.context, seed=61)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.txt").write_text("\n\n".join(f"## {name}\n\n{profile_tables(run, device)}"
                                                  for name, run in runs.items()))
    log(f"profiles written to {out / 'profile.txt'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke run)")
    parser.add_argument("--phases", nargs="+", default=["exactness", "timing", "end_to_end", "profile", "graphs"],
                        choices=["exactness", "timing", "end_to_end", "profile", "graphs"])
    parser.add_argument("--compile", action="store_true",
                        help="also time transformers under torch.compile(mode='reduce-overhead') (minutes)")
    args = parser.parse_args(argv)
    plan, device = Plan(args.tiny), args.device
    results = {"command": "python -m specserve.benchmarks.gpu " + " ".join(sys.argv[1:] if argv is None else argv),
               "machine": machine(device), "weights": "random, tiny" if args.tiny else "random (real shapes)",
               "plan": vars(plan)}
    log(f"{results['machine']}")
    if "exactness" in args.phases:
        results["exactness"] = []
        for dtype in (torch.float32, torch.bfloat16):
            results["exactness"] += check_exactness(load_models(dtype, tiny=args.tiny, device=device), dtype, plan,
                                                    device=device)
            write(args.out, results)
    if "graphs" in args.phases:
        results["graphs"] = {"exactness": check_graph_exactness(load_models(torch.float32, tiny=args.tiny,
                                                                            device=device), plan, device=device)}
        write(args.out, results)
    if {"timing", "end_to_end", "profile", "graphs"} & set(args.phases):
        models = load_models(torch.bfloat16, tiny=args.tiny, device=device)
        if "graphs" in args.phases:
            results["graphs"]["timing"] = time_graphs(models, plan, device=device)
            write(args.out, results)
            results["graphs"]["end_to_end"] = time_graphs_end_to_end(models, plan, device=device)
            write(args.out, results)
        if "timing" in args.phases:
            results["timing"] = run_timing(models, plan, device=device,
                                           save=lambda timing: write(args.out, {**results, "timing": timing}))
            write(args.out, results)
        if "profile" in args.phases:
            write_profile(models, plan, device=device, out=args.out)
        if "end_to_end" in args.phases:
            results["end_to_end"] = time_end_to_end(models, plan, device=device)
            write(args.out, results)
        if "timing" in args.phases and args.compile:  # last: compiling takes the longest
            for batch, row in results["timing"]["transformers"].items():
                row["torch_compile_reduce_overhead"] = time_compiled(models["target"], batch, plan, device=device)
                log(f"transformers under torch.compile, batch {batch:2d}: {row['torch_compile_reduce_overhead']}")
                write(args.out, results)
    print(markdown(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
