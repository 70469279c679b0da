"""Train heads (Medusa, Hydra or ReDrafter) on a target by distillation from the target itself (Medusa-2
weighting).

1. The target reads the training text once; its last hidden states (after the final norm, what
   the serving worker feeds the heads) and its greedy next tokens are cached on disk under
   `out_dir/cache/`, keyed by the target, the data options and the dtype, so a second run or a
   resumed one skips this, the slow part. So are the target's own continuations
   (`generated.py`), and an interrupted generation keeps its finished continuations there for
   the next run to pick up.
2. Head i at position t learns the target's distribution of token t+i+2, which is
   softmax(lm_head(h_{t+i+1})) over the `token_map` rows: the teacher costs one matrix product
   on cached states. Loss = sum_i 0.8^i * cross-entropy(teacher, head i) (Hydra++'s teacher
   distillation is this same loss).
3. Held-out accuracy: head i's argmax against the target's greedy token at t+i+2, on HumanEval
   problems the benchmarks use (never trained on), before and after training.

What differs between methods sits behind one small interface (`HEAD_METHODS`: build fresh
heads; the heads' `features(hidden, path)`, `lm_heads`, `token_map` and `save`). Every head
gets the path tokens x_{t+1} .. x_{t+K} of its position from the training sequence (teacher
forcing); Medusa's heads ignore them, Hydra's head i reads the first i + 1, and ReDrafter's
recurrent drafter reads them one per step (step i has read the first i + 1).

    >>> result = train_heads("smollm2-135m-instruct", tmp / "heads", quick_options())  # doctest: +SKIP
    >>> result.report["heldout_accuracy_after"]                                       # doctest: +SKIP
    [0.295, 0.167]

Files in `out_dir`: the heads (`MedusaHeads.save`: config.json, medusa.safetensors, and vllm/ once
`specserve export-heads` writes it; `HydraHeads.save`: config.json, hydra.safetensors; `ReDrafter.save`: config.json,
redrafter.safetensors), train_report.json, checkpoint.pt (to
resume) and cache/.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from specserve.protocol import SpecserveError

if TYPE_CHECKING:  # torch is imported where it is used: the CLI builds its parser from TrainOptions
    import torch

HEADS_CONFIG_FILE = "config.json"  # the heads' save writes it: heads are there
CHECKPOINT_FILE = "checkpoint.pt"
REPORT_FILE = "train_report.json"
CACHE_DIR = "cache"
MAX_FULL_HEAD_VOCAB = 65536  # larger vocabularies get a token map of TRUNCATED_HEAD_VOCAB ids
TRUNCATED_HEAD_VOCAB = 32768
EVAL_BATCH = 1024  # positions per evaluation batch
CALIBRATION_POSITIONS = 4096  # held-out positions the score temperatures are fitted on (at most)
TRAINED_EVAL_TOKENS = 4096  # training continuations measured like the held-out ones (memorisation)
ACCURACY_LOG = "top-1 accuracy per head (held out: text, own; trained: continuations trained on)"

Log = Callable[[str], object]


@dataclass
class TrainOptions:
    """What to train. The defaults are `make heads`' budget (its times for
    qwen2.5-coder-1.5b-instruct on a 2-core CPU are in the README); `quick_options()` is a short
    run for tests."""

    method: str = "medusa"  # medusa | hydra | redrafter
    num_heads: int = 4  # ReDrafter: drafting steps (the longest beam it serves)
    num_layers: int = 1  # Medusa: ResBlocks per head; Hydra, ReDrafter: the input block + num_layers - 1 ResBlocks
    steps: int = 1500
    lr: float = 1e-3
    batch_size: int = 256  # positions per step
    seq_len: int = 256  # tokens per forward pass while caching hidden states (KV carried over)
    max_tokens: int = 60_000  # training text budget, in target tokens
    eval_tokens: int = 2048  # held-out text budget
    # Self-distillation: the target's own greedy continuations of training prompts
    # (specserve.heads.generated); 0 turns them off.
    generated_tokens: int = 50_000  # tokens the target writes for training
    generated_eval_tokens: int = 1024  # ... and for held-out evaluation (held-out prompts)
    generated_max_new: int = 256  # longest continuation of one prompt
    generated_share: float = 0.7  # share of each step's positions taken from the continuations
    # MT-Bench turns the target answers: 2 also continues each question's second turn after its
    # own first answer (at most generated_max_new more tokens per question, on top of
    # generated_tokens)
    chat_turns: int = 1
    head_vocab_size: int | None = None  # None: the full vocabulary up to 65536, else 32768
    own_lm_head: bool = False  # Medusa only: train a copy of the lm_head per head (large: slow on CPU)
    prefix_window: int = 0  # Hydra only: Hydra++ prefix attention over the last N hidden states (0: off)
    seed: int = 0
    dtype: str = "auto"  # the target's dtype while caching (auto: resolve_dtype); heads train in float32
    warmup_steps: int | None = None  # None: 5% of the steps, at most 100
    loss_decay: float = 0.8  # head i's loss weight is loss_decay ** i
    # The teacher's distribution per hidden row, computed once before training: its `teacher_top`
    # most likely tokens, renormalised (0: the whole distribution, recomputed every step, which
    # is a third of a step's matrix products and works out each row's ~14 times at the default
    # budget).
    teacher_top: int = 64
    weight_decay: float = 0.0
    # Hydra++'s regularisation (its recipe: dropout 0.2, weight decay 0.1): while training, dropout
    # on the hidden state every head reads and on the heads' features before the projection. Why:
    # unregularised heads fit the continuations they train on far above held-out ones
    # (train_report.json's trained_own_accuracy_after against heldout_own_accuracy_after).
    dropout: float = 0.0
    # How to run, not what to train: a resumed run may change these.
    device: str | None = None  # None: "cuda" when available, else "cpu"
    threads: int | None = None  # torch CPU threads (None: torch's default)
    checkpoint_every: int = 100
    progress: bool = True

    RUNTIME = ("device", "threads", "checkpoint_every", "progress")

    def resumable(self) -> dict:
        """The options a resumed run must share with the interrupted one."""
        return {k: v for k, v in asdict(self).items() if k not in self.RUNTIME}

    def resolved_device(self) -> str:
        import torch

        return self.device or ("cuda" if torch.cuda.is_available() else "cpu")

    def resolved_warmup(self) -> int:
        if self.warmup_steps is not None:
            return min(self.warmup_steps, self.steps)
        return min(100, max(1, self.steps // 20))


def quick_options(**overrides) -> TrainOptions:
    """A short run (about 5 minutes for smollm2-135m-instruct on 2 CPU cores) whose heads
    clearly beat untrained ones: for tests and smoke runs."""
    base = TrainOptions(num_heads=2, steps=300, batch_size=256, max_tokens=16_000, eval_tokens=1024,
                        generated_tokens=3000, generated_eval_tokens=512, generated_max_new=128,
                        generated_share=0.5, head_vocab_size=8192, warmup_steps=10, checkpoint_every=1000, lr=3e-3,
                        dtype="float32")  # bfloat16 runs SmolLM2-135M several times slower here
    return replace(base, **overrides)


class TrainableHeads(Protocol):
    """What the trainer needs of a method's heads (MedusaHeads, HydraHeads, ReDrafter)."""

    config: object  # num_heads, head_vocab_size, vocab_size, target
    token_map: torch.Tensor  # [head_vocab] the ids the projection covers
    lm_heads: object  # None: the target's shared lm_head rows; else one trained projection per head

    def features(self, hidden: torch.Tensor, path: torch.Tensor, context=None) -> torch.Tensor:
        """hidden [B, H] (h_t), path [B, K] (x_{t+1} .. x_{t+K}), context (states [B, W, H],
        valid [B, W]: the last W hidden states up to h_t, for heads whose `context_window` > 0)
        -> [K, B, H], float32."""
        ...

    def trainable_parameters(self) -> list: ...

    def save(self, directory: Path) -> Path: ...


def _medusa_heads(model, options: TrainOptions, token_map: torch.Tensor, name: str) -> TrainableHeads:
    from specserve.heads.medusa import MedusaConfig, MedusaHeads

    vocab_size, hidden_size = model.lm_head.weight.shape
    config = MedusaConfig(hidden_size=hidden_size, vocab_size=vocab_size, num_heads=options.num_heads,
                          num_layers=options.num_layers, own_lm_head=options.own_lm_head,
                          head_vocab_size=len(token_map), target=name)
    return MedusaHeads(config, model.lm_head.weight.detach().float().cpu(), token_map)


def _hydra_heads(model, options: TrainOptions, token_map: torch.Tensor, name: str) -> TrainableHeads:
    from specserve.heads.hydra import HydraConfig, HydraHeads

    vocab_size, hidden_size = model.lm_head.weight.shape
    config = HydraConfig(hidden_size=hidden_size, vocab_size=vocab_size, num_heads=options.num_heads,
                         num_layers=options.num_layers, head_vocab_size=len(token_map), target=name,
                         prefix_window=options.prefix_window)
    return HydraHeads(config, model.lm_head.weight.detach(), model.get_input_embeddings().weight, token_map)


def _redrafter(model, options: TrainOptions, token_map: torch.Tensor, name: str) -> TrainableHeads:
    from specserve.heads.redrafter import ReDrafter, ReDrafterConfig

    vocab_size, hidden_size = model.lm_head.weight.shape
    config = ReDrafterConfig(hidden_size=hidden_size, vocab_size=vocab_size, num_heads=options.num_heads,
                             num_layers=options.num_layers, head_vocab_size=len(token_map), target=name)
    return ReDrafter(config, model.lm_head.weight.detach(), model.get_input_embeddings().weight, token_map)


# method -> fresh float32 heads on the CPU: (target model, options, token_map, target name) -> heads
HEAD_METHODS: dict[str, Callable[..., TrainableHeads]] = {"medusa": _medusa_heads, "hydra": _hydra_heads,
                                                          "redrafter": _redrafter}


@dataclass
class TrainResult:
    heads: TrainableHeads
    out_dir: Path
    step: int  # steps done; < options.steps when stopped early (`stop_at`)
    report: dict | None  # train_report.json's content; None when stopped early


def validate_options(options: TrainOptions) -> None:
    """Refuse bad options before anything is loaded."""
    if options.method not in HEAD_METHODS:
        raise SpecserveError(f"unknown head method {options.method!r}; built: {', '.join(HEAD_METHODS)}")
    if options.prefix_window and options.method != "hydra":
        raise SpecserveError(f"prefix attention (--prefix-window) is a Hydra++ option; {options.method} heads "
                             "read h_t alone")
    if options.prefix_window < 0:
        raise SpecserveError(f"prefix_window must be >= 0 (0: off), got {options.prefix_window}")
    if options.own_lm_head and options.method != "medusa":
        raise SpecserveError(f"{options.method} heads share the target's frozen lm_head; own_lm_head "
                             "(--own-lm-head) is for medusa")
    for name in ("steps", "num_heads", "num_layers", "batch_size", "seq_len", "max_tokens", "eval_tokens",
                 "checkpoint_every", "generated_max_new"):
        if getattr(options, name) < 1:
            raise SpecserveError(f"{name} must be >= 1, got {getattr(options, name)}")
    for name in ("generated_tokens", "generated_eval_tokens"):
        if getattr(options, name) < 0:
            raise SpecserveError(f"{name} must be >= 0 (0: no self-distillation), got {getattr(options, name)}")
    if options.chat_turns not in (1, 2):
        raise SpecserveError(f"chat_turns must be 1 or 2 (MT-Bench questions have two turns), got {options.chat_turns}")
    if not 0.0 <= options.generated_share <= 1.0:
        raise SpecserveError(f"generated_share must be in [0, 1], got {options.generated_share}")
    if not options.lr > 0:
        raise SpecserveError(f"lr must be > 0, got {options.lr}")
    if not 0.0 <= options.dropout < 1.0:
        raise SpecserveError(f"dropout must be in [0, 1), got {options.dropout}")
    if options.weight_decay < 0:
        raise SpecserveError(f"weight_decay must be >= 0, got {options.weight_decay}")
    if options.head_vocab_size is not None and options.head_vocab_size < 1:
        raise SpecserveError(f"head_vocab_size must be >= 1, got {options.head_vocab_size}")
    if options.teacher_top < 0:
        raise SpecserveError(f"teacher_top must be >= 0 (0: the whole distribution), got {options.teacher_top}")
    if options.warmup_steps is not None and options.warmup_steps < 0:
        raise SpecserveError(f"warmup_steps must be >= 0, got {options.warmup_steps}")
    from specserve.models import parse_dtype

    try:
        parse_dtype(options.dtype)
    except ValueError as exc:
        raise SpecserveError(str(exc)) from None


def check_supported(config) -> None:
    """The heads serve on the torch engine: refuse a target it cannot run."""
    from specserve.engine.torch_worker import SUPPORTED_MODEL_TYPES

    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise SpecserveError(f"the torch engine supports {', '.join(SUPPORTED_MODEL_TYPES)} targets, "
                             f"not {model_type!r}: no heads for it")
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        raise SpecserveError("the torch engine does not support sliding-window attention: no heads for this target")


# ---- the target ----------------------------------------------------------------------------


@dataclass
class Target:
    model: object  # a causal LM: .model (decoder body) and .lm_head
    tokenizer: object | None
    name: str
    fingerprint: str  # changes whenever the weights may have


def load_target(target, options: TrainOptions, device: str) -> Target:
    """A registry name, local directory or Hub id (loaded in options.dtype), or a model object
    (used as it is: tests pass tiny random models)."""
    if not isinstance(target, (str, os.PathLike)):
        check_supported(target.config)
        return Target(target, None, type(target).__name__, _weights_fingerprint(target))
    from transformers import AutoConfig

    from specserve import models

    path = models.resolve(target)
    check_supported(AutoConfig.from_pretrained(path))  # before loading gigabytes
    model = models.load_causal_lm(target, dtype=options.dtype, device=device)
    return Target(model, models.load_tokenizer(target), str(target), _directory_fingerprint(Path(path)))


def _directory_fingerprint(path: Path) -> str:
    """A converted registry model's marker holds its source sha256; otherwise names, sizes and
    modification times of the checkpoint files."""
    from specserve.models import MARKER

    if (path / MARKER).is_file():
        return (path / MARKER).read_text().strip()
    if not path.is_dir():  # a Hub id
        return str(path)
    stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.iterdir()) if p.is_file()]
    return hashlib.sha256(json.dumps(stats).encode()).hexdigest()


def _weights_fingerprint(model) -> str:
    import torch

    digest = hashlib.sha256(model.config.to_json_string().encode())
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# ---- hidden-state cache --------------------------------------------------------------------


def cache_key(target: Target, options: TrainOptions, train_ids: Sequence[Sequence[int]],
              eval_ids: Sequence[Sequence[int]], dtype: torch.dtype) -> str:
    digest = hashlib.sha256(json.dumps({
        "target": target.fingerprint, "dtype": str(dtype), "seq_len": options.seq_len,
        "train": hashlib.sha256(json.dumps(list(map(list, train_ids))).encode()).hexdigest(),
        "eval": hashlib.sha256(json.dumps(list(map(list, eval_ids))).encode()).hexdigest(),
    }, sort_keys=True).encode())
    return digest.hexdigest()[:20]


def compute_hidden_states(model, sequences: Sequence[Sequence[int]], seq_len: int, *,
                          progress: bool = True, desc: str = "hidden states") -> dict[str, torch.Tensor]:
    """The target's last hidden states and greedy next tokens for every position.

    Each sequence is read in chunks of `seq_len` tokens with the KV cache carried over (memory
    stays bounded, every position still sees its whole prefix). Returns, over all N positions:
    hidden [N, H] (target dtype, on the CPU), greedy [N] (argmax of the full lm_head), tokens [N]
    and offsets [S + 1] (sequence s is rows offsets[s]:offsets[s+1]).

    It runs on specserve's torch engine where it supports the model (fused, prepacked linears:
    1.2x transformers' forward on a 2-core AVX2 EPYC in float32), else on transformers'; the two
    agree to float rounding (the cache files do not say which made them).
    """
    import torch
    from tqdm import tqdm

    from specserve.engine.torch_worker import SUPPORTED_MODEL_TYPES

    chunks = engine_chunks if getattr(model.config, "model_type", None) in SUPPORTED_MODEL_TYPES \
        else transformers_chunks
    hidden, greedy = [], []
    total = sum(map(len, sequences))
    bar = tqdm(total=total, unit="tok", unit_scale=True, desc=desc, disable=not progress, dynamic_ncols=True)
    with torch.inference_mode(), bar:
        for h, logits in chunks(model, sequences, seq_len):
            greedy.append(logits.argmax(-1).cpu())
            hidden.append(h.cpu())
            bar.update(h.shape[0])
    lengths = torch.tensor([0] + [len(s) for s in sequences])
    return {"hidden": torch.cat(hidden), "greedy": torch.cat(greedy),
            "tokens": torch.tensor([t for s in sequences for t in s], dtype=torch.long),
            "offsets": lengths.cumsum(0)}


def engine_chunks(model, sequences: Sequence[Sequence[int]], seq_len: int):
    """(hidden [n, H], logits [n, V]) of each chunk of `seq_len` positions, in order, on the torch
    engine: a chunk is the token before it plus a chain of the rest, whose nodes the next chunk
    finds cached (a chain's path is kept, as an accepted draft's)."""
    from specserve.engine.torch_worker import MANY_ROWS, ForwardItem, TorchWorker
    from specserve.protocol import TokenTree

    # one sequence at a time, in chunks of many rows: one weight layout, the many-rows one
    worker = TorchWorker(model, max_cached_tokens=max(map(len, sequences), default=1) + 64, linear_layout=MANY_ROWS,
                         greedy_screen=False)  # distillation reads whole rows
    for s, seq in enumerate(sequences):
        request_id = f"hidden-{s}"
        for start in range(0, len(seq), seq_len):
            end = min(start + seq_len, len(seq))
            rows = worker.run([ForwardItem(request_id, list(seq[:start + 1]), TokenTree.chain(seq[start + 1:end]))])[0]
            yield rows.hidden, rows.logits
        worker.release(request_id)


def transformers_chunks(model, sequences: Sequence[Sequence[int]], seq_len: int):
    """engine_chunks' chunks from transformers' own forward, with its KV cache carried over."""
    import torch

    device = next(model.parameters()).device
    for seq in sequences:
        past = None
        for start in range(0, len(seq), seq_len):
            ids = torch.tensor([list(seq[start:start + seq_len])], device=device)
            out = model.model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            h = out.last_hidden_state[0]
            yield h, model.lm_head(h)


def load_or_build_cache(path: Path, build: Callable[[], dict[str, torch.Tensor]], log: Log) -> tuple[dict, float]:
    """The cached tensors at `path`, built and saved first when missing. Returns them and the
    seconds spent building (0 when reused)."""
    from safetensors.torch import load_file, save_file

    if path.is_file():
        log(f"reusing the cached {path.name} from {path.parent}")
        return load_file(str(path)), 0.0
    start = time.perf_counter()
    tensors = build()
    seconds = time.perf_counter() - start
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)  # a cache file is complete or absent
    return tensors, seconds


# ---- pieces of the training step -----------------------------------------------------------


def default_head_vocab(vocab_size: int) -> int:
    return vocab_size if vocab_size <= MAX_FULL_HEAD_VOCAB else TRUNCATED_HEAD_VOCAB


def choose_token_map(tokens: torch.Tensor, greedy: torch.Tensor, vocab_size: int, head_vocab: int) -> torch.Tensor:
    """The `head_vocab` most frequent ids among the training tokens and the target's greedy
    predictions (ties: lower id first), sorted."""
    import torch

    if head_vocab >= vocab_size:
        return torch.arange(vocab_size)
    counts = torch.bincount(tokens, minlength=vocab_size) + torch.bincount(greedy, minlength=vocab_size)
    order = torch.argsort(-counts[:vocab_size], stable=True)
    return order[:head_vocab].sort().values


def usable_positions(offsets: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Positions t whose every head has a teacher: t + num_heads is in the same sequence."""
    import torch

    ranges = [torch.arange(int(s), int(e) - num_heads) for s, e in zip(offsets[:-1], offsets[1:])
              if int(e) - int(s) > num_heads]
    return torch.cat(ranges) if ranges else torch.zeros(0, dtype=torch.long)


def sequence_starts(offsets: torch.Tensor) -> torch.Tensor:
    """[N]: for every position, where its sequence starts.

    >>> import torch
    >>> sequence_starts(torch.tensor([0, 2, 5])).tolist()
    [0, 0, 2, 2, 2]
    """
    import torch

    return torch.repeat_interleave(offsets[:-1], offsets[1:] - offsets[:-1])


def leading_sequences(hidden: torch.Tensor, greedy: torch.Tensor, tokens: torch.Tensor, offsets: torch.Tensor,
                      max_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first sequences of a cached set, up to `max_tokens` tokens in all (at least one
    sequence), as (hidden, greedy, tokens, offsets).

    >>> import torch
    >>> t = torch.arange(7)
    >>> [x.tolist() for x in leading_sequences(t, t, t, torch.tensor([0, 2, 5, 7]), 5)]
    [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [0, 2, 5]]
    """
    count = max(1, int((offsets[1:] <= max_tokens).sum()))
    end = int(offsets[count])
    return hidden[:end], greedy[:end], tokens[:end], offsets[:count + 1]


def gather_context(hidden: torch.Tensor, positions: torch.Tensor, starts: torch.Tensor, window: int,
                   lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(states [B, window, H], valid [B, window]): h_{t-window+1} .. h_t for each position t,
    oldest first, valid only inside t's sequence and, with `lengths` [B], only the last
    lengths[b] of them (training draws short windows too: a serving pool's window starts at
    the prompt's last token).

    >>> import torch
    >>> states, valid = gather_context(torch.arange(6.)[:, None], torch.tensor([1, 4]), torch.tensor([0, 0, 0, 3, 3, 3]), 3)
    >>> states[..., 0].tolist(), valid.tolist()
    ([[0.0, 0.0, 1.0], [2.0, 3.0, 4.0]], [[False, True, True], [False, True, True]])
    """
    import torch

    index = positions[:, None] - torch.arange(window - 1, -1, -1, device=positions.device)[None, :]
    first = starts[positions]
    if lengths is not None:
        first = torch.maximum(first, positions - lengths + 1)
    valid = index >= first[:, None]
    return hidden[index.clamp(min=0)], valid


def gather_path(tokens: torch.Tensor, positions: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[B, num_heads]: x_{t+1} .. x_{t+num_heads} for each position t, the tokens the heads'
    paths hold under teacher forcing (x_{t+1}: the token h_t's row produced, the round's root).

    >>> import torch
    >>> gather_path(torch.tensor([10, 11, 12, 13]), torch.tensor([0, 1]), 2).tolist()
    [[11, 12], [12, 13]]
    """
    import torch

    return tokens[positions[:, None] + torch.arange(1, num_heads + 1, device=positions.device)[None, :]]


def student_logits(heads: TrainableHeads, h: torch.Tensor, path: torch.Tensor,
                   shared_projection: torch.Tensor, context=None, dropout: float = 0.0) -> torch.Tensor:
    """What the heads compute, [K, B, head_vocab], with the vocabulary products in the
    projection's dtype (bfloat16 matrix products are ~4x faster than float32 on this CPU; the
    heads and their gradients stay float32). `path`: [B, K] (see `gather_path`).
    `shared_projection`: the token_map rows of the target's lm_head, used when the heads share it.
    `dropout`: training only (TrainOptions.dropout), on h and on the features; the same for every method."""
    import torch
    import torch.nn.functional as F

    h = F.dropout(h.float(), dropout) if dropout else h.float()
    outs = (heads.features(h, path) if context is None else
            heads.features(h, path, (context[0].float(), context[1])))  # [K, B, H] float32
    if dropout:
        outs = F.dropout(outs, dropout)
    dtype = shared_projection.dtype
    if heads.lm_heads is None:
        flat = F.linear(outs.reshape(-1, outs.shape[-1]).to(dtype), shared_projection)
        return flat.view(*outs.shape[:2], -1)
    return torch.stack([F.linear(o.to(dtype), w.to(dtype)) for o, w in zip(outs, heads.lm_heads)])


def teacher_distributions(rows: torch.Tensor, teacher_weight: torch.Tensor, top: int = 0
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's distribution of the next token at hidden rows [..., H], over the token map:
    (probabilities [..., head_vocab], None) for top=0, else its `top` most likely tokens,
    renormalised, (probabilities [..., top], their indices in the map [..., top], most likely
    first)."""
    import torch.nn.functional as F

    logits = F.linear(rows.to(teacher_weight.dtype), teacher_weight).float()
    if not top or top >= logits.shape[-1]:
        return logits.softmax(-1), None
    values, index = logits.topk(top, dim=-1)
    return values.softmax(-1), index  # the softmax of the top logits is the top probabilities renormalised


def sparse_teacher(hidden: torch.Tensor, teacher_weight: torch.Tensor, top: int, *, progress: bool = True,
                   chunk: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """`teacher_distributions` of every row of `hidden` [N, H], computed once in chunks:
    (probabilities [N, top] float32, indices [N, top])."""
    import torch
    from tqdm import tqdm

    probs, index = [], []
    with torch.no_grad():
        for rows in tqdm(hidden.split(chunk), desc="teacher distributions", unit="chunk", disable=not progress,
                         dynamic_ncols=True):
            p, i = teacher_distributions(rows.to(teacher_weight.device), teacher_weight, top)
            probs.append(p)
            index.append(i)
    return torch.cat(probs), torch.cat(index)


def distillation_loss(heads: TrainableHeads, h: torch.Tensor, path: torch.Tensor,
                      teacher: tuple[torch.Tensor, torch.Tensor | None], teacher_weight: torch.Tensor,
                      decay: float, context=None, dropout: float = 0.0
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h: [B, H], the rows the heads read; path: [B, K] from `gather_path`; teacher: head i's
    target at every position, `teacher_distributions` of h_{t+i+1} ([K, B, ...]): the target's
    distribution of token t+i+2 restricted to the map (whole, or its top tokens); teacher_weight:
    [head_vocab, H], the lm_head's token_map rows the heads project with when they share it;
    dropout: see `student_logits`. Returns (weighted loss, per-head loss [K], per-head top-1
    agreement with the teacher [K])."""
    import torch

    probs, index = teacher
    student = student_logits(heads, h, path, teacher_weight, context, dropout).float().log_softmax(-1)
    picked = student if index is None else student.gather(-1, index)
    per_head = -(probs * picked).sum(-1).mean(-1)
    num_heads = per_head.shape[0]
    weights = decay ** torch.arange(num_heads, dtype=torch.float32, device=per_head.device)
    best = probs.argmax(-1) if index is None else index[..., 0]
    agree = (student.argmax(-1) == best).float().mean(-1)
    return (weights * per_head).sum(), per_head.detach(), agree


def heldout_logits(heads: TrainableHeads, teacher_weight: torch.Tensor, hidden: torch.Tensor, greedy: torch.Tensor,
                   tokens: torch.Tensor, offsets: torch.Tensor, device: str):
    """Per batch of the usable positions of a held-out set, (logits [K, B, head_vocab], truth
    [K, B]): every head's logits with paths teacher-forced from `tokens`, and the target's greedy
    token each should predict (head i at t: greedy[t + i + 1], the token t + i + 2)."""
    import torch

    num_heads = heads.config.num_heads
    window = getattr(heads, "context_window", 0)
    starts = sequence_starts(offsets)
    shifts = torch.arange(1, num_heads + 1)
    with torch.no_grad():
        for batch in usable_positions(offsets, num_heads).split(EVAL_BATCH):
            path = gather_path(tokens, batch, num_heads).to(device)
            context = None
            if window:
                states, valid = gather_context(hidden, batch, starts, window)
                context = (states.to(device), valid.to(device))
            logits = student_logits(heads, hidden[batch].to(device), path, teacher_weight, context)
            yield logits, greedy[batch[None, :] + shifts[:, None]]


def heldout_accuracy(heads: TrainableHeads, teacher_weight: torch.Tensor, hidden: torch.Tensor, greedy: torch.Tensor,
                     tokens: torch.Tensor, offsets: torch.Tensor, device: str) -> list[float]:
    """Per head, how often its argmax (through token_map) is the target's greedy token at t+i+2,
    over every usable position of the held-out text (see `heldout_logits`)."""
    import torch

    hits, count = torch.zeros(heads.config.num_heads), 0
    for logits, truth in heldout_logits(heads, teacher_weight, hidden, greedy, tokens, offsets, device):
        hits += (heads.token_map[logits.argmax(-1)].cpu() == truth).sum(-1)
        count += truth.shape[1]
    return (hits / count).tolist() if count else [0.0] * heads.config.num_heads


def fit_score_temperatures(batches, token_map: torch.Tensor, max_positions: int = CALIBRATION_POSITIONS
                           ) -> list[float] | None:
    """Per head, the temperature T that makes softmax(logits / T) the best model (least
    log-loss) of the token the target writes, over the first `max_positions` positions of
    `batches` ((logits [K, B, head_vocab], truth token ids [K, B]), as `heldout_logits` yields
    them: paths teacher-forced, so a head is judged on paths that were right, as a tree's
    conditional scores are): the heads' `score_temperatures`. Positions whose token is not
    in `token_map` are left out. None when there are no positions.

    >>> import torch
    >>> _ = torch.manual_seed(0)
    >>> truth = torch.distributions.Categorical(logits=torch.tensor([2.0, 1.0, 0.0])).sample((20000,))
    >>> sharp = torch.tensor([4.0, 2.0, 0.0]).expand(1, 20000, 3)  # twice the truth's logits
    >>> [round(t, 1) for t in fit_score_temperatures([(sharp, truth[None])], torch.arange(3))]
    [2.0]
    """
    import torch

    index = torch.full((int(token_map.max()) + 1,), -1, dtype=torch.long)
    index[token_map.cpu()] = torch.arange(len(token_map))
    rows: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # per head, (logits, head-vocabulary label) chunks
    seen = 0
    for logits, truth in batches:
        take = min(truth.shape[1], max_positions - seen)
        truth = truth[:, :take].cpu()
        label = torch.where(truth < len(index), index[truth.clamp(max=len(index) - 1)], -1)
        rows = rows or [[] for _ in range(len(truth))]
        for head, chunks in enumerate(rows):
            known = label[head] >= 0  # bfloat16 below: half the memory, ample for a log-loss
            chunks.append((logits[head, :take][known].to(torch.bfloat16).cpu(), label[head][known]))
        seen += take
        if seen >= max_positions:
            break
    if not seen:
        return None
    return [_least_log_loss_temperature(torch.cat([x for x, _ in chunks]), torch.cat([y for _, y in chunks]))
            for chunks in rows]


def _least_log_loss_temperature(logits: torch.Tensor, labels: torch.Tensor, low: float = 0.25,
                                high: float = 8.0, steps: int = 40) -> float:
    """argmin over T in [low, high] of the mean -log softmax(logits / T)[label] (convex in
    1/T): a golden-section search on log T. 1 where there are no rows."""
    import math

    if len(labels) == 0:
        return 1.0

    def loss(log_t: float) -> float:
        total = 0.0
        for chunk, y in zip(logits.split(256), labels.split(256)):
            scaled = chunk.float() / math.exp(log_t)
            total += float((scaled.logsumexp(-1) - scaled.gather(-1, y[:, None])[:, 0]).sum())
        return total / len(labels)

    a, b = math.log(low), math.log(high)
    ratio = (math.sqrt(5) - 1) / 2
    x1, x2 = b - ratio * (b - a), a + ratio * (b - a)
    f1, f2 = loss(x1), loss(x2)
    for _ in range(steps):
        if f1 <= f2:
            b, x2, f2 = x2, x1, f1
            x1 = b - ratio * (b - a)
            f1 = loss(x1)
        else:
            a, x1, f1 = x1, x2, f2
            x2 = a + ratio * (b - a)
            f2 = loss(x2)
    return round(math.exp((a + b) / 2), 4)


def lr_lambda(warmup: int, steps: int) -> Callable[[int], float]:
    """Linear warmup to the full rate, then cosine decay to 0 at `steps`."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))
    return factor


# ---- checkpoints ---------------------------------------------------------------------------


def save_checkpoint(path: Path, state: dict) -> None:
    import torch

    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)  # never a half-written checkpoint


def load_checkpoint(path: Path, options: TrainOptions) -> dict:
    import torch

    if not path.is_file():
        raise SpecserveError(f"nothing to resume: no checkpoint at {path} (start without --resume)")
    state = torch.load(path, map_location="cpu", weights_only=True)
    saved = {**TrainOptions().resumable(), **state["options"]}  # options added since take their defaults
    if saved != options.resumable():
        changed = sorted(k for k, v in options.resumable().items() if saved.get(k) != v)
        raise SpecserveError(f"cannot resume {path}: it was trained with other options ({', '.join(changed)} "
                             f"differ); use the same options, or --force to start over")
    return state


def check_out_dir(out_dir: Path, *, resume: bool, force: bool) -> None:
    if resume and force:
        raise SpecserveError("--resume continues a run, --force starts over: pick one")
    if resume or force:
        return
    if (out_dir / HEADS_CONFIG_FILE).exists():
        raise SpecserveError(f"{out_dir} already holds heads; --force to train them again, "
                             f"or --resume to continue their run")
    if (out_dir / CHECKPOINT_FILE).exists():
        raise SpecserveError(f"{out_dir} holds the checkpoint of an unfinished run; "
                             f"--resume to continue it, or --force to start over")


# ---- the whole run -------------------------------------------------------------------------


def train_heads(target, out_dir: str | Path | None = None, options: TrainOptions | None = None, *,
                 resume: bool = False, force: bool = False,
                 sequences: Sequence[Sequence[int]] | None = None,
                 eval_sequences: Sequence[Sequence[int]] | None = None,
                 stop_at: int | None = None, cache_dir: str | Path | None = None, log: Log = print) -> TrainResult:
    """Train `options.method` heads (medusa, hydra, redrafter) for `target` (a registry name, directory,
    Hub id, or a causal LM object) into `out_dir` (default: `default_heads_dir(target, method)`).

    `cache_dir` (default OUT/cache) keeps the target's hidden states and continuations. Its
    files are named by a hash of the target, the text and the options that shape them, never
    the method, so runs of several methods that share a cache directory compute them once.

    `sequences` / `eval_sequences`: explicit training and held-out token ids (both, or neither:
    then the offline text of `specserve.heads.data`, which needs the target's tokenizer). With
    explicit sequences, the first half of each is a prompt for the target's own continuations.
    `stop_at`: stop after that many steps with a checkpoint, as an interrupted run would;
    `resume=True` then continues to `options.steps`.
    """
    import torch

    options = options or TrainOptions()
    validate_options(options)
    if (sequences is None) != (eval_sequences is None):
        raise SpecserveError("give both sequences and eval_sequences, or neither")
    if sequences is not None and options.chat_turns > 1:
        raise SpecserveError("chat_turns 2 continues MT-Bench's second turns, from the offline text; explicit "
                             "token sequences hold no conversations")
    if out_dir is None:
        if not isinstance(target, (str, os.PathLike)):
            raise SpecserveError("out_dir is needed when the target is a model object")
        from specserve.heads import default_heads_dir

        out_dir = default_heads_dir(str(target), options.method)
    out_dir = Path(out_dir)
    check_out_dir(out_dir, resume=resume, force=force)
    out_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = load_checkpoint(out_dir / CHECKPOINT_FILE, options) if resume else None
    if force:
        (out_dir / CHECKPOINT_FILE).unlink(missing_ok=True)

    device = options.resolved_device()
    if options.threads:
        torch.set_num_threads(options.threads)
    loaded = load_target(target, options, device)
    data = _prepare_data(loaded, options, sequences, eval_sequences,
                         Path(cache_dir) if cache_dir is not None else out_dir / CACHE_DIR, log)
    if checkpoint is not None and checkpoint["cache_key"] != data["key"]:
        raise SpecserveError(f"cannot resume {out_dir}: its checkpoint is for another target or other "
                             f"training text; --force to start over")
    heads, teacher_weight = _build_heads(loaded, options, data, device,
                                         checkpoint["token_map"] if checkpoint else None)
    del loaded  # the decoder body is no longer needed: only its lm_head rows are
    return _train(heads, teacher_weight, options, data, out_dir, device, checkpoint, stop_at, target, log)


def _prepare_data(target: Target, options: TrainOptions, sequences, eval_sequences, cache_dir: Path,
                  log: Log) -> dict:
    if sequences is None:
        if target.tokenizer is None:
            raise SpecserveError("a target without a tokenizer needs explicit token sequences")
        from specserve.heads import data

        sequences = data.token_sequences(target.tokenizer, options.max_tokens, options.seed)
        eval_sequences = data.heldout_sequences(target.tokenizer, options.eval_tokens)
        prompts, turns = data.generation_prompts_with_turns(target.tokenizer, options.seed)
        eval_prompts = data.heldout_prompts(target.tokenizer)
        second_turns = turns if options.chat_turns > 1 else {}
    else:
        prompts = [s[: max(1, len(s) // 2)] for s in sequences]
        eval_prompts = [s[: max(1, len(s) // 2)] for s in eval_sequences]
        second_turns = {}
    dtype = next(target.model.parameters()).dtype
    key = cache_key(target, options, sequences, eval_sequences, dtype)

    def build() -> dict[str, torch.Tensor]:
        train = compute_hidden_states(target.model, sequences, options.seq_len, progress=options.progress,
                                      desc="caching hidden states")
        held = compute_hidden_states(target.model, eval_sequences, options.seq_len, progress=options.progress,
                                     desc="held-out hidden states")
        return {**{f"train.{k}": v for k, v in train.items()}, **{f"eval.{k}": v for k, v in held.items()}}

    tensors, seconds = load_or_build_cache(cache_dir / f"hidden-{key}.safetensors", build, log)
    train_tokens, eval_tokens = len(tensors["train.tokens"]), len(tensors["eval.tokens"])
    if seconds:
        log(f"hidden states: {train_tokens + eval_tokens} tokens in {seconds:.1f} s "
            f"({(train_tokens + eval_tokens) / seconds:.1f} tokens/s)")
    generated, generated_seconds, generated_key = _generated_data(target, options, prompts, eval_prompts, dtype,
                                                                  cache_dir, log, second_turns)
    return {"key": f"{key}-{generated_key}", "tensors": {**tensors, **generated}, "cache_seconds": seconds,
            "generated_seconds": generated_seconds, "dtype": dtype, "train_tokens": train_tokens,
            "eval_tokens": eval_tokens, "generated_tokens": len(generated["gen.tokens"]),
            "generated_eval_tokens": len(generated["geneval.tokens"])}


def _generated_data(target: Target, options: TrainOptions, prompts, eval_prompts, dtype, cache_dir: Path,
                    log: Log, second_turns: dict[int, tuple[str, str]]) -> tuple[dict, float, str]:
    """The target's own continuations of the training prompts (`gen.*`: with `second_turns`,
    by prompt index, also those conversations' second turns after the target's own first
    answers) and of held-out prompts (`geneval.*`), with their hidden states, cached like the
    text's."""
    from specserve.heads import data
    from specserve.heads.generated import concat_states, continuation_text, generate_states
    from specserve.loading import eos_ids

    fields = {
        "target": target.fingerprint, "dtype": str(dtype), "max_new": options.generated_max_new,
        "batching": "continuous",  # where the budget cuts the continuations short depends on it
        "tokens": [options.generated_tokens, options.generated_eval_tokens],
        "prompts": hashlib.sha256(json.dumps([list(map(int, p)) for p in prompts]).encode()).hexdigest(),
        "eval": hashlib.sha256(json.dumps([list(map(int, p)) for p in eval_prompts]).encode()).hexdigest(),
    }
    if second_turns:  # only then: caches made before second turns existed stay valid
        fields["second_turns"] = hashlib.sha256(json.dumps(sorted(second_turns.items())).encode()).hexdigest()
    key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:20]
    eos = eos_ids(target.model, target.tokenizer)

    # an interrupted run's finished continuations, picked up by the next run (see generated.py)
    parts_dir = cache_dir / f"generated-{key}.parts"

    def continue_prompts(name: str, part_prompts, budget: int, desc: str) -> dict[str, torch.Tensor]:
        if (parts_dir / name).is_dir():
            log(f"resuming the {name} continuations from {parts_dir / name}")
        return generate_states(target.model, part_prompts, max_new_tokens=options.generated_max_new,
                               max_tokens=budget, eos_token_ids=eos, progress=options.progress, desc=desc,
                               parts_dir=parts_dir / name)

    def build() -> dict[str, torch.Tensor]:
        gen = continue_prompts("gen", prompts, options.generated_tokens, "target continuations")
        follow_ups = [data.second_turn_prompt(target.tokenizer, turns, continuation_text(target.tokenizer, gen, j))
                      for j, i in enumerate(gen["prompt_index"].tolist()) if (turns := second_turns.get(i)) is not None]
        if follow_ups:  # numbered after the first turns' prompts
            turn2 = continue_prompts("turn2", follow_ups, len(follow_ups) * options.generated_max_new, "second turns")
            gen = concat_states(gen, {**turn2, "prompt_index": turn2["prompt_index"] + len(prompts)})
        held = continue_prompts("geneval", eval_prompts, options.generated_eval_tokens, "held-out continuations")
        return {**{f"gen.{k}": v for k, v in gen.items()}, **{f"geneval.{k}": v for k, v in held.items()}}

    tensors, seconds = load_or_build_cache(cache_dir / f"generated-{key}.safetensors", build, log)
    shutil.rmtree(parts_dir, ignore_errors=True)  # the whole result is cached now
    if seconds:
        count = len(tensors["gen.tokens"]) + len(tensors["geneval.tokens"])
        log(f"target continuations: {count} tokens in {seconds:.1f} s ({count / seconds:.1f} tokens/s)")
    return tensors, seconds, key


def _build_heads(target: Target, options: TrainOptions, data: dict, device: str,
                 token_map: torch.Tensor | None) -> tuple[TrainableHeads, torch.Tensor]:
    """Fresh float32 heads (untrained: the identity on h) and the teacher's lm_head rows in the
    cache dtype."""
    import torch

    lm_head = target.model.lm_head.weight.detach()
    vocab_size = lm_head.shape[0]
    head_vocab = min(options.head_vocab_size or default_head_vocab(vocab_size), vocab_size)
    if token_map is None:
        t = data["tensors"]
        token_map = choose_token_map(torch.cat([t["train.tokens"], t["gen.tokens"]]),
                                     torch.cat([t["train.greedy"], t["gen.greedy"]]), vocab_size, head_vocab)
    torch.manual_seed(options.seed)  # randomly initialised layers: same seed, same start
    heads = HEAD_METHODS[options.method](target.model, options, token_map, target.name).to(device)
    teacher_weight = lm_head[token_map.to(lm_head.device)].to(device=device, dtype=data["dtype"])
    return heads, teacher_weight


def _train(heads: TrainableHeads, teacher_weight: torch.Tensor, options: TrainOptions, data: dict, out_dir: Path,
           device: str, checkpoint: dict | None, stop_at: int | None, target, log: Log) -> TrainResult:
    import torch
    from tqdm import tqdm

    t = data["tensors"]
    hidden = torch.cat([t["train.hidden"], t["gen.hidden"].to(t["train.hidden"].dtype)]).to(device)
    tokens = torch.cat([t["train.tokens"], t["gen.tokens"]]).to(device)
    text_positions = usable_positions(t["train.offsets"], options.num_heads)
    own_positions = usable_positions(t["gen.offsets"], options.num_heads) + len(t["train.hidden"])
    if len(text_positions) + len(own_positions) == 0:
        raise SpecserveError(f"no training positions: every sequence is shorter than {options.num_heads + 1} tokens")
    own_count = (options.batch_size if len(text_positions) == 0 else
                 round(options.batch_size * options.generated_share) if len(own_positions) else 0)
    draws = [(p, n) for p, n in ((text_positions, options.batch_size - own_count), (own_positions, own_count)) if n]
    window = getattr(heads, "context_window", 0)
    starts = sequence_starts(torch.cat([t["train.offsets"][:-1], t["gen.offsets"] + len(t["train.hidden"])])).to(device)

    def cached_set(name: str) -> tuple[torch.Tensor, ...]:
        return tuple(t[f"{name}.{field}"] for field in ("hidden", "greedy", "tokens", "offsets"))

    eval_sets = {"text": cached_set("eval")}
    if len(t["geneval.greedy"]):
        eval_sets["own"] = cached_set("geneval")
    if len(t["gen.greedy"]):  # continuations the heads train on: their gap to "own" is memorisation
        eval_sets["trained"] = leading_sequences(*cached_set("gen"), max(options.generated_eval_tokens,
                                                                         TRAINED_EVAL_TOKENS))

    def evaluate() -> dict[str, list[float]]:
        return {name: heldout_accuracy(heads, teacher_weight, *tensors, device) for name, tensors in eval_sets.items()}

    shifts = torch.arange(1, options.num_heads + 1, device=device)

    def teacher_for(batch: torch.Tensor):
        later = batch[None, :] + shifts[:, None]  # [K, B]: head i's teacher reads h_{t+i+1}
        if sparse is None:
            with torch.no_grad():
                return teacher_distributions(hidden[later], teacher_weight)
        return sparse[0][later], sparse[1][later]

    optimizer = torch.optim.AdamW(heads.trainable_parameters(), lr=options.lr, weight_decay=options.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(options.resolved_warmup(), options.steps))
    sampler = torch.Generator().manual_seed(options.seed)  # positions are drawn on the CPU: same on any device
    torch.manual_seed(options.seed)
    step, seconds, losses = 0, 0.0, []
    if checkpoint is not None:
        heads.load_state_dict(checkpoint["heads"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        sampler.set_state(checkpoint["sampler"])
        torch.set_rng_state(checkpoint["torch_rng"])
        step, seconds, losses = checkpoint["step"], checkpoint["train_seconds"], list(checkpoint["losses"])
        before = checkpoint["accuracy_before"]
    else:
        before = evaluate()
    log(f"{ACCURACY_LOG}, untrained: {_fmt(before)}")

    def state() -> dict:
        return {"step": step, "options": options.resumable(), "cache_key": data["key"],
                "token_map": heads.token_map.cpu(), "heads": heads.state_dict(),
                "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "sampler": sampler.get_state(), "torch_rng": torch.get_rng_state(),
                "train_seconds": seconds, "losses": losses, "accuracy_before": before}

    end = min(options.steps, stop_at) if stop_at is not None else options.steps
    # the teacher's top tokens of every row, once, where steps remain (`teacher_for` reads it)
    sparse = (sparse_teacher(hidden, teacher_weight, options.teacher_top, progress=options.progress)
              if step < end and 0 < options.teacher_top < teacher_weight.shape[0] else None)
    bar = tqdm(total=options.steps, initial=step, unit="step", desc="training heads", disable=not options.progress,
               dynamic_ncols=True)
    heads.train()
    try:
        while step < end:
            started = time.perf_counter()
            batch = torch.cat([p[torch.randint(len(p), (n,), generator=sampler)] for p, n in draws])
            batch = batch.to(device)
            path = gather_path(tokens, batch, options.num_heads)
            context = None
            if window:
                lengths = torch.randint(1, window + 1, (len(batch),), generator=sampler).to(device)
                context = gather_context(hidden, batch, starts, window, lengths)
            loss, _, agree = distillation_loss(heads, hidden[batch], path, teacher_for(batch), teacher_weight,
                                               options.loss_decay, context, options.dropout)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            seconds += time.perf_counter() - started
            losses = (losses + [loss.item()])[-20:]
            bar.set_postfix(loss=f"{loss.item():.3f}", acc0=f"{agree[0].item():.2f}")
            bar.update(1)
            if step % options.checkpoint_every == 0 and step < end:
                save_checkpoint(out_dir / CHECKPOINT_FILE, state())
    except KeyboardInterrupt:
        save_checkpoint(out_dir / CHECKPOINT_FILE, state())
        log(f"interrupted at step {step}; --resume continues from {out_dir / CHECKPOINT_FILE}")
        raise
    finally:
        bar.close()
    heads.eval()
    save_checkpoint(out_dir / CHECKPOINT_FILE, state())
    if step < options.steps:
        return TrainResult(heads, out_dir, step, None)

    after = evaluate()
    log(f"{ACCURACY_LOG}, trained:   {_fmt(after)}")
    calibration = "own" if "own" in eval_sets else "text"  # what serving sees: the target's own text
    heads.config.score_temperatures = fit_score_temperatures(
        heldout_logits(heads, teacher_weight, *eval_sets[calibration], device), heads.token_map)
    log(f"score temperatures per head (held out: {calibration}): {heads.config.score_temperatures}")
    heads.save(out_dir)
    report = _report(options, data, heads, target, device, step, seconds, losses, before, after)
    (out_dir / REPORT_FILE).write_text(json.dumps(report, indent=1) + "\n")
    return TrainResult(heads, out_dir, step, report)


def _report(options, data, heads, target, device, step, seconds, losses, before, after) -> dict:
    import torch

    return {
        "target": str(target) if isinstance(target, (str, os.PathLike)) else heads.config.target,
        "method": options.method,
        "options": asdict(options),
        "device": device,
        "torch_threads": torch.get_num_threads(),
        "head_vocab_size": heads.config.head_vocab_size,
        "vocab_size": heads.config.vocab_size,
        "train_tokens": data["train_tokens"],
        "eval_tokens": data["eval_tokens"],
        "generated_tokens": data["generated_tokens"],
        "generated_eval_tokens": data["generated_eval_tokens"],
        "cache_seconds": round(data["cache_seconds"], 2),
        "cache_reused": data["cache_seconds"] == 0,
        "generated_seconds": round(data["generated_seconds"], 2),
        "train_seconds": round(seconds, 2),
        "seconds_per_step": round(seconds / max(1, step), 4),
        "steps": step,
        "final_loss": round(sum(losses) / max(1, len(losses)), 4),  # mean of the last (up to) 20 steps
        # top-1 per head on held-out human text ("text") and on the target's own continuations
        # of held-out prompts ("own": what serving sees)
        "heldout_accuracy_before": _rounded(before["text"]),
        "heldout_accuracy_after": _rounded(after["text"]),
        "heldout_own_accuracy_before": _rounded(before.get("own")),
        "heldout_own_accuracy_after": _rounded(after.get("own")),
        # the same on the first of the continuations trained on: far above heldout_own when the
        # heads memorise their text (then more --generated-tokens pays, more --steps does not)
        "trained_own_accuracy_before": _rounded(before.get("trained")),
        "trained_own_accuracy_after": _rounded(after.get("trained")),
        # what a tree's path scores divide each head's logits by (fitted on the held-out "own"
        # continuations, else "text"; saved in config.json: see medusa.check_head_sizes)
        "score_temperatures": heads.config.score_temperatures,
    }


def _rounded(values: Sequence[float] | None) -> list[float] | None:
    return None if values is None else [round(v, 4) for v in values]


def _fmt(accuracies: dict[str, list[float]]) -> str:
    return "; ".join(f"{name} " + " ".join(f"{a:.3f}" for a in values) for name, values in accuracies.items())
