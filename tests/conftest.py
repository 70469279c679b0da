"""Shared fixtures: tiny seeded random-weight models (seconds), real models only in slow tests."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

# The Ray Serve integration tier: one local cluster for the session, SmolLM2-135M in fp32.
SMOL = "smollm2-135m-instruct"
# Fixed ports; SPECSERVE_TEST_PORT moves all three (a second test session on the same machine).
PORT = int(os.environ.get("SPECSERVE_TEST_PORT", 8765))
BASE = f"http://127.0.0.1:{PORT}"
GRPC_PORT = PORT + 1000  # Serve's gRPC proxy (specserve/grpc/specserve.proto)
METRICS_PORT = PORT + 1001  # the node's metrics export port (Prometheus text at /metrics)


def tiny_model(arch: str = "qwen2", *, seed: int = 0, vocab_size: int = 97, layers: int = 2,
               hidden: int = 64, max_positions: int = 512):
    """A float32 random-weight decoder built in the test: qwen2 (q/k/v biases) or llama."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM),
                             "llama": (LlamaConfig, LlamaForCausalLM)}[arch]
    config = config_cls(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_positions, initializer_range=0.02,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(seed)
    return model_cls(config).eval().requires_grad_(False)


def perturbed(model, *, scale: float = 0.05, seed: int = 1):
    """A draft that agrees with `model` often but not always: every weight scaled by 1 + N(0, scale)."""
    import copy

    import torch

    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    for p in draft.parameters():
        p.mul_(1 + scale * torch.randn(p.shape, generator=gen))
    return draft


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos_token_id=None) -> list[int]:
    """The reference: transformers' own greedy decoding of the target alone."""
    import torch

    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
        eos_token_id=eos_token_id, pad_token_id=0, repetition_penalty=1.0,
    )[0, len(prompt):].tolist()
    if eos_token_id is not None and eos_token_id in out:  # generate pads after EOS
        out = out[: out.index(eos_token_id) + 1]
    return out


def empirical_pairs(draw_pair, vocab: int, n: int, seed: int):
    """The empirical joint distribution [vocab * vocab] of n draws of `draw_pair(generator) ->
    (first token, second token)`, seeded."""
    import torch

    from specserve.sampling import generator_for

    gen = generator_for(seed)
    counts = torch.zeros(vocab * vocab)
    for _ in range(n):
        a, b = draw_pair(gen)
        counts[a * vocab + b] += 1
    return counts / n


def make_decoder(target, draft=None, *, k: int = 4, method: str | None = None, eos_token_ids=(), top_m: int = 256,
                 draft_quantize: str | None = None):
    from specserve.decoder import SpeculativeDecoder
    from specserve.engine.torch_worker import TorchWorker
    from specserve.proposers.draft_model import DraftModelProposer
    from specserve.verifier import Verifier

    proposer = (DraftModelProposer(TorchWorker(draft, quantize=draft_quantize), top_m=top_m)
                if draft is not None else None)
    return SpeculativeDecoder(
        Verifier(TorchWorker(target)), proposer, k=k, eos_token_ids=eos_token_ids,
        method=method or ("draft" if draft is not None else "none"),
        max_context=target.config.max_position_embeddings,
    )


def tiny_heads(model, *, num_heads: int = 3, noise: float = 0.0, seed: int = 0, head_vocab_size: int | None = None):
    """Untrained Medusa heads on `model` (identity blocks, plus `noise` on their weights)."""
    import torch

    from specserve.heads.medusa import MedusaConfig, MedusaHeads

    config = MedusaConfig(model.config.hidden_size, model.config.vocab_size, num_heads=num_heads,
                          head_vocab_size=head_vocab_size)
    token_map = torch.arange(head_vocab_size) if head_vocab_size else None
    heads = MedusaHeads(config, model.lm_head.weight, token_map)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.blocks.parameters():
            p.add_(noise * torch.randn(p.shape, generator=gen))
    return heads.requires_grad_(False).eval()


def make_co_located_decoder(target, proposer, **speculation):
    """A decoder whose target verifies and proposes with `proposer`'s heads (co-located)."""
    from specserve.decoder import SpeculativeDecoder
    from specserve.engine.torch_worker import TorchWorker
    from specserve.protocol import Speculation
    from specserve.verifier import Verifier

    return SpeculativeDecoder(Verifier(TorchWorker(target), proposer),
                              speculation=Speculation(proposer=proposer.method, **speculation),
                              max_context=target.config.max_position_embeddings)


def make_medusa_decoder(target, heads=None, **speculation):
    """A decoder whose target verifies and proposes with Medusa heads (co-located)."""
    from specserve.proposers.medusa import MedusaProposer

    return make_co_located_decoder(target, MedusaProposer(heads if heads is not None else tiny_heads(target)),
                                   **speculation)


def tiny_hydra_heads(model, *, num_heads: int = 3, noise: float = 0.0, seed: int = 0,
                     head_vocab_size: int | None = None, prefix_window: int = 0):
    """Untrained Hydra heads on `model` (Medusa's identity on h, plus `noise` on every weight,
    so the path's embeddings, and with `prefix_window` the past hidden states, matter)."""
    import torch

    from specserve.heads.hydra import HydraConfig, HydraHeads

    config = HydraConfig(model.config.hidden_size, model.config.vocab_size, num_heads=num_heads,
                         head_vocab_size=head_vocab_size, prefix_window=prefix_window, prefix_heads=2)
    token_map = torch.arange(head_vocab_size) if head_vocab_size else None
    heads = HydraHeads(config, model.lm_head.weight, model.get_input_embeddings().weight, token_map)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(noise * torch.randn(p.shape, generator=gen))
    return heads.requires_grad_(False).eval()


def make_hydra_decoder(target, heads=None, **speculation):
    """A decoder whose target verifies and proposes with Hydra heads (co-located)."""
    from specserve.proposers.hydra import HydraProposer

    return make_co_located_decoder(target, HydraProposer(heads if heads is not None else tiny_hydra_heads(target)),
                                   **speculation)


def tiny_redrafter(model, *, num_heads: int = 3, noise: float = 0.0, seed: int = 0,
                   head_vocab_size: int | None = None):
    """An untrained ReDrafter on `model`: W and U random from `seed`, the head Medusa's identity
    on h plus `noise` on its weights (so the recurrent state, hence the path, matters)."""
    import torch

    from specserve.heads.redrafter import ReDrafter, ReDrafterConfig

    config = ReDrafterConfig(model.config.hidden_size, model.config.vocab_size, num_heads=num_heads,
                             head_vocab_size=head_vocab_size)
    token_map = torch.arange(head_vocab_size) if head_vocab_size else None
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        drafter = ReDrafter(config, model.lm_head.weight, model.get_input_embeddings().weight, token_map)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.head.parameters():
            p.add_(noise * torch.randn(p.shape, generator=gen))
    return drafter.requires_grad_(False).eval()


def make_redrafter_decoder(target, drafter=None, **speculation):
    """A decoder whose target verifies and proposes with a ReDrafter (co-located, beam search)."""
    from specserve.proposers.redrafter import ReDrafterProposer

    return make_co_located_decoder(target, ReDrafterProposer(drafter if drafter is not None else tiny_redrafter(target)),
                                   **speculation)


@pytest.fixture(scope="session")
def qwen_pair():
    target = tiny_model("qwen2", seed=0)
    return target, perturbed(target)


# ---- the Ray Serve integration tier (test_serve*.py) -------------------------------------

@pytest.fixture(scope="session")
def cluster():
    from specserve import models

    if not models.is_cached(SMOL):
        pytest.skip(f"run `specserve models pull {SMOL}` first (make test does)")
    import ray
    from ray import serve

    # replicas push their autoscaling metrics every second (default 10 s): test_serve_autoscaling
    os.environ.setdefault("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "1")
    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False, _metrics_export_port=METRICS_PORT)
    from specserve.grpc import grpc_options

    serve.start(http_options={"host": "127.0.0.1", "port": PORT}, grpc_options=grpc_options(GRPC_PORT))
    yield
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def app(cluster, reference, tmp_path_factory):
    """The tier's main app, `specserve` at / (HTTP) and on the gRPC proxy: SmolLM2 target pool of
    two replicas (killing one leaves another) and a draft pool of SmolLM2's first 27 layers (same
    vocabulary, agrees often but not always). Returns the pools' handles (target, draft)."""
    import copy
    import shutil

    from ray import serve

    from specserve import models
    from specserve.serve import build_app

    _, model, _, _ = reference
    draft_dir = tmp_path_factory.mktemp("draft")
    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:27]
    draft.config.num_hidden_layers = 27
    draft.save_pretrained(draft_dir)
    source = models.model_dir(SMOL)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(source / name, draft_dir / name)
    pool = {"dtype": "float32", "torch_threads": 1, "ray_actor_options": {"num_cpus": 1},
            "health_check_period_s": 2, "health_check_timeout_s": 30}
    serve.run(build_app({
        "model_name": "smol",
        "target": {"model": SMOL, "num_replicas": 2, **pool},
        "draft": {"model": str(draft_dir), "num_replicas": 1, **pool},
        # fixed: these tests need every round to draft (failover, batching); test_serve_medusa
        # covers the load-aware policy. draft_ahead: greedy rounds also draft the next round
        # during their verify, so the tier's exactness, failover and release tests cover it too.
        "speculation": {"k": 3, "policy": "fixed", "draft_min_confidence": 0.0, "draft_timeout_s": 3,
                        "draft_retry_after_s": 0.5, "draft_ahead": True},
        "router": {"max_ongoing_requests": 8, "max_queued_requests": 4, "target_retry_timeout_s": 60},
    }), name="specserve", route_prefix="/")
    return serve.get_deployment_handle("TargetPool", "specserve"), serve.get_deployment_handle("DraftPool", "specserve")


@pytest.fixture(scope="session")
def reference():
    """The target alone, in this process: transformers' greedy decoding (each prompt and length
    once a session)."""
    from specserve import models

    tokenizer = models.load_tokenizer(SMOL)
    model = models.load_causal_lm(SMOL, dtype="float32")

    done: dict[tuple[tuple[int, ...], int], list[int]] = {}  # tests ask for the same prompts again

    def greedy_ids(prompt_ids: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt_ids), max_tokens)
        if key not in done:
            done[key] = hf_greedy(model, prompt_ids, max_tokens, eos_token_id=tokenizer.eos_token_id)
        return list(done[key])

    def greedy_text(prompt_ids: list[int], max_tokens: int) -> str:
        return tokenizer.decode(greedy_ids(prompt_ids, max_tokens), skip_special_tokens=True)

    greedy_text.ids = greedy_ids

    def chat_ids(content: str) -> list[int]:
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)

    return tokenizer, model, greedy_text, chat_ids




@pytest.fixture(scope="session")
def smol_medusa_heads(tmp_path_factory):
    """Medusa heads for SmolLM2-135M, trained here by `specserve train-heads`' library function
    on the offline text: the directory they were saved to. Half of quick_options' data and 2/3
    of its steps (165 s here against 285 s; held-out top-1 of the first head 0.22 against 0.28
    on text, 0.31 against 0.34 on the target's own continuations). The target's hidden states
    and continuations are cached where `make heads` keeps its own (named by a hash of the
    weights, text and options), so a later run only trains (~45 s of ~95 s saved)."""
    from specserve import models
    from specserve.heads.train import quick_options, train_heads

    if not models.is_cached(SMOL):
        pytest.skip(f"run `specserve models pull {SMOL}` first (make test does)")
    out = tmp_path_factory.mktemp("smol-medusa")
    train_heads(SMOL, out, quick_options(num_heads=3, progress=False, max_tokens=8000, generated_tokens=1500,
                                           generated_eval_tokens=256, steps=200), force=True, log=lambda *_: None,
                cache_dir=models.specserve_home() / "heads" / "cache")
    return out
