"""Load a target (and optional draft) into torch workers, checking they can work together."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specserve import models
from specserve.engine.torch_worker import BOTH, MANY_ROWS, Linear, TorchWorker
from specserve.proposers.draft_model import DraftModelProposer
from specserve.protocol import SpecserveError
from specserve.verifier import Verifier


def set_torch_threads(threads: int | None = None) -> None:
    """Ray sets OMP threads to floor(num_cpus); a worker should use the cores it was given."""
    torch.set_num_threads(threads or int(os.environ.get("SPECSERVE_TORCH_THREADS", 0)) or os.cpu_count() or 1)


def eos_ids(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def load_heads_proposer(directory: Path, worker: TorchWorker, *, method: str | None = None,
                        min_confidence: float = 0.0):
    """The heads in `directory` (from `specserve.heads.require_heads`) for a loaded target
    worker, on its device and dtype, as the proposer of their method (config.json says which).
    `method`: the proposer asked for; heads of another method are refused."""
    from specserve.heads import heads_method

    found = heads_method(directory)
    if method is not None and method != found:
        raise SpecserveError(f"proposer {method!r} needs {method} heads; {directory} holds {found} heads")
    if found == "medusa":
        return load_medusa(directory, worker, min_confidence=min_confidence)
    load, proposer = _embedding_heads(found)
    heads = load(directory, worker.model.lm_head.weight, worker.model.get_input_embeddings().weight)
    return proposer(serving_heads(heads, worker), vocab_size=worker.vocab_size, min_confidence=min_confidence)


def serving_heads(heads, worker: TorchWorker):
    """Loaded heads with their shared vocabulary projection on the target's linear kernel
    (oneDNN-prepacked on CPU, like the target's own layers): on a 2-core CPU four heads'
    projections of 32k rows took ~32 ms a round one head at a time and ~9 ms as one prepacked
    product, where a target step is ~145 ms."""
    if heads.shared_lm_head is not None:
        # every head's rows in one product: always many rows
        layout = MANY_ROWS if worker.linear_layout == BOTH else worker.linear_layout
        heads.use_projection_kernel(Linear(heads.shared_lm_head, pack=worker.prepacked, layout=layout))
    return heads


def _embedding_heads(method: str):
    """(load_heads, proposer class) of a method whose heads also read the target's input
    embedding (the tokens drafted so far): hydra, redrafter."""
    if method == "hydra":
        from specserve.heads.hydra import load_heads
        from specserve.proposers.hydra import HydraProposer

        return load_heads, HydraProposer
    from specserve.heads.redrafter import load_heads
    from specserve.proposers.redrafter import ReDrafterProposer

    return load_heads, ReDrafterProposer


def load_medusa(directory: Path, worker: TorchWorker, *, min_confidence: float = 0.0):
    """Medusa heads (a directory from `specserve.heads.require_heads`) for a loaded target
    worker, on its device and dtype, as a proposer."""
    from specserve.heads.medusa import load_heads
    from specserve.proposers.medusa import MedusaProposer

    heads = serving_heads(load_heads(directory, worker.model.lm_head.weight), worker)
    return MedusaProposer(heads, vocab_size=worker.vocab_size, min_confidence=min_confidence)


@dataclass
class LoadedPair:
    target: TorchWorker
    draft: TorchWorker | None
    tokenizer: object
    eos_token_ids: set[int]
    max_context: int
    heads: object | None = None  # a head proposer (Medusa, Hydra, ReDrafter) co-located with the target
    heads_by_method: dict = field(default_factory=dict)  # every head proposer loaded, by method

    def __post_init__(self) -> None:
        if self.heads is not None:
            self.heads_by_method.setdefault(self.heads.method, self.heads)

    def add_heads(self, directories) -> None:
        """Load more heads on the same target (one per method; a benchmark compares them on
        one loaded model). The first loaded becomes `heads` when there were none."""
        for directory in directories:
            proposer = load_heads_proposer(Path(directory), self.target)
            self.heads_by_method[proposer.method] = proposer
            self.heads = self.heads or proposer

    def verifier(self) -> Verifier:
        return Verifier(self.target, self.heads)

    def proposer(self, *, top_m: int = 256, min_confidence: float = 0.5) -> DraftModelProposer | None:
        if self.draft is None:
            return None
        return DraftModelProposer(self.draft, top_m=top_m, min_confidence=min_confidence)


def load_pair(target: str, draft: str | None = None, *, heads: str | None = None, heads_method: str | None = None,
              dtype: str = "auto", device: str = "cpu", draft_quantize: str | None = None,
              release_model_weights: bool = False) -> LoadedPair:
    """Load the target (and draft, and heads) into torch workers. A draft that does not share
    the target's vocabulary is refused before any weights are loaded, and so are missing heads
    and heads of another method than `heads_method` (None: whichever the directory holds;
    heads="default" is then Medusa's). draft_quantize: "int8" runs the draft's linears in int8
    (see TorchWorker; the output stays the target's); None or "none" does not. release_model_weights: the workers drop
    the models' own projection weights once they hold theirs (a float32 target keeps two
    prepacked layouts: without this it holds its projections three times); the models'
    own forward then no longer runs (transformers' generate needs it)."""
    from specserve.heads import require_heads

    heads_dir = require_heads(target, heads, heads_method) if heads is not None else None
    from transformers import AutoConfig

    tokenizer = models.load_tokenizer(target)
    vocab = None
    if draft is not None:
        vocab = models.check_compatible(
            tokenizer, models.load_tokenizer(draft),
            AutoConfig.from_pretrained(models.resolve(target)), AutoConfig.from_pretrained(models.resolve(draft)),
        )
    target_model = models.load_causal_lm(target, dtype=dtype, device=device)
    max_context = target_model.config.max_position_embeddings
    draft_worker = None
    if draft is not None:
        draft_model = models.load_causal_lm(draft, dtype=dtype, device=device)
        draft_worker = TorchWorker(draft_model, vocab_size=vocab, quantize=draft_quantize, greedy_screen=False,
                                   release_model_weights=release_model_weights)
        max_context = min(max_context, draft_model.config.max_position_embeddings)
    target_worker = TorchWorker(target_model, vocab_size=vocab, release_model_weights=release_model_weights)
    return LoadedPair(
        target_worker,
        draft_worker,
        tokenizer,
        eos_ids(target_model, tokenizer),
        max_context,
        load_heads_proposer(heads_dir, target_worker) if heads_dir is not None else None,
    )
