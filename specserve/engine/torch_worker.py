"""The torch engine: one Hugging Face decoder model plus the KV caches of many requests.

The worker runs the model's own weights (embedding, norms, rotary tables; projections and MLPs
fused and, on CPU, prepacked for oneDNN, see `Linear`) through specserve's attention, so that it
controls the KV cache and can verify a token tree in one pass with a tree attention mask and
per-node positions. A chain of draft tokens is the one-branch tree.

One pass is ragged: every request's new tokens are packed into one [N, hidden] batch for the
linear layers (no padding to the widest request), and attention runs per request over its own
cached length, with a mask built once per pass.

The KV cache is one preallocated slab per replica (`KVCache`), sized in bytes, handed out in
blocks of BLOCK_TOKENS slots; least recently used requests are evicted when a pass needs room.
A request's cache is a cache, not the truth: every call carries the request's full token ids.
The worker keeps the longest prefix of its cached tokens that agrees with the call (after moving
the accepted path of the previous call's tree into place, by relabelling slots, not copying)
and recomputes the rest, so a worker that never saw a request, evicted it, or holds a stale
copy returns the same logits.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import record_function

from specserve.engine.greedy_screen import GreedyScreen, linear_dynamic, prepack, quantize_rows
from specserve.engine.kernel_rows import run_padded
from specserve.protocol import SpecserveError, TokenTree

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
EMPTY_TREE = TokenTree()
BLOCK_TOKENS = 16  # KV slots are handed out in blocks: less bookkeeping, consecutive slots
DEFAULT_KV_CACHE_BYTES = 1 << 30
# On CUDA, attention without cuDNN's backend: with it (PyTorch's first choice on an H100, torch
# 2.11) a batch-1 decode step, whose KV length changes every step, took 3-6x as long (95.8 ms
# against 15.0, docs/bench/gpu-h100). Flash where it applies, else memory-efficient (masks).
CUDA_ATTENTION_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
# Small passes (decode, chain verify) replayed as CUDA graphs by default on CUDA; see cuda_graphs.py.
CUDA_GRAPHS_BY_DEFAULT = True
# oneDNN weight layouts of a prepacked Linear (see Linear): packed for passes of one row, of
# many rows, or both. float32 linears on CPU keep both by default (measured on AVX2).
ONE_ROW, MANY_ROWS, BOTH = "one_row", "many_rows", "both"
LAYOUTS = (ONE_ROW, MANY_ROWS, BOTH)
# Weight quantizations a worker may run its linears in; a draft's numerics never change the
# output (the target verifies), so a draft may trade a little acceptance for speed. Int8:
# per-output-channel int8 weights, activations quantized per pass (PyTorch's x86 dynamic
# int8 linear): on this 2-core AVX2 CPU it ran the 0.5B draft's matrices 3-5x faster than
# the float32 prepacked kernel. CPU only.
INT8 = "int8"
QUANTIZATIONS = (INT8,)


@dataclass
class ForwardItem:
    """One request's share of a batched forward pass.

    The worker returns rows for the last token of `token_ids` followed by one row per tree
    node: [1 + len(tree), V]. Row 0 predicts the first draft position; row i+1 is the
    target's distribution after node i.

    With `logits_from = n` it returns only the rows after nodes n.. ([len(tree) - n, V]), and
    when the tree extends the one of the request's previous call (same token_ids), the nodes
    already computed keep their keys and values: a draft grows its tree level by level and
    pays only for the new nodes.
    """

    request_id: str
    token_ids: list[int]
    tree: TokenTree = EMPTY_TREE
    logits_from: int | None = None


class Rows:
    """What a forward pass returns for one item: the rows `ForwardItem` describes.

    logits: [rows, V] where the model ran (device and dtype), truncated to the usable
    vocabulary: sampling converts only the rows it visits. hidden: [rows, hidden] the model's
    last hidden state (after its final norm, what the lm_head reads and what Medusa-style heads
    read). argmax(): each row's greedy token, what greedy acceptance reads.

    A worker with a greedy screen computes its output layer when first asked, for every row
    of the pass at once: argmax() through the screen (the float32 argmax, for a fraction of
    the bytes), logits in full. Either way the values are the same as computing them eagerly.
    """

    __slots__ = ("hidden", "_logits", "_output", "_span")

    def __init__(self, logits: torch.Tensor | None, hidden: torch.Tensor,
                 output: PassOutput | None = None, span: slice | None = None):
        if logits is None and output is None:
            raise SpecserveError("rows need logits or the pass output that computes them")
        self.hidden = hidden
        self._logits = logits
        self._output = output
        self._span = span

    @property
    def logits(self) -> torch.Tensor:
        if self._logits is None:
            self._logits = self._output.logits()[self._span]
        return self._logits

    def argmax(self) -> list[int]:
        if self._logits is None:
            return self._output.argmax()[self._span]
        return self.logits.argmax(-1).tolist()


class PassOutput:
    """One pass's output layer, computed on first use for all of the pass's rows (one batched
    matmul, as an eager pass would): full logits, or greedy tokens through the screen."""

    def __init__(self, hidden: torch.Tensor, output: Linear, screen: GreedyScreen):
        self.hidden = hidden
        self.output = output
        self.screen = screen
        self._logits: torch.Tensor | None = None
        self._argmax: list[int] | None = None

    def logits(self) -> torch.Tensor:
        if self._logits is None:
            with torch.inference_mode(), record_function("specserve::output_layer"):
                self._logits = self.output(self.hidden)
        return self._logits

    def argmax(self) -> list[int]:
        if self._argmax is None:
            if self._logits is not None:
                self._argmax = self._logits.argmax(-1).tolist()
            else:
                with torch.inference_mode(), record_function("specserve::output_layer"):
                    self._argmax = self.screen.argmax(self.hidden, full_rows=self._full_rows)
        return self._argmax

    def _full_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return self.output(self.hidden.index_select(0, rows))


class Linear:
    """A linear map `x @ weight.T + bias`, on CPU prepacked into oneDNN's blocked layout: at
    batch 1 the packed bf16 kernel streams weights ~1.5x faster than eager `F.linear`
    (DESIGN.md), with the same results. Elsewhere (CUDA) it is a plain F.linear. `sizes`: the
    output widths of the layers fused into it (see `fused`). Inputs of any rank [..., in].

    oneDNN packs for a batch size. The layout packed for one row is the fastest for a lone
    decode step, but in float32 on AVX2 it ran passes of 2-9 rows (a verify, a batched decode)
    about 2x slower than a layout packed for many rows, which costs a lone step 5-20% more
    (README, "Float32 on an AVX2 CPU"). `layout`: ONE_ROW, MANY_ROWS (for passes that always have many rows, such
    as the heads' shared projection), or BOTH (twice the memory; each pass takes the layout
    for its row count)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pack: bool,
                 sizes: list[int] | None = None, layout: str = ONE_ROW):
        if layout not in LAYOUTS:
            raise SpecserveError(f"unknown linear layout {layout!r}; choose from {', '.join(LAYOUTS)}")
        self.bias = bias
        self.sizes = sizes or [weight.shape[0]]
        self.packed = pack
        many = torch.ops.mkldnn._reorder_linear_weight(weight) if pack and layout != ONE_ROW else None
        one = torch.ops.mkldnn._reorder_linear_weight(weight, 1) if pack and layout != MANY_ROWS else None
        self.weight = weight if not pack else one if one is not None else many  # a pass of one row takes this
        self.many_rows_weight = many if many is not None else self.weight  # a pass of several rows this

    @classmethod
    def fused(cls, modules, *, pack: bool, rows: int | None = None, layout: str = ONE_ROW,
              quantize: str | None = None) -> Linear | Int8Linear:
        """nn.Linear layers that read the same input (q/k/v, gate/up), fused along their outputs
        into one matrix. rows: keep only the first output rows (the usable vocabulary).
        quantize: INT8 gives an Int8Linear instead."""
        weight = torch.cat([m.weight.detach() for m in modules]) if len(modules) > 1 else modules[0].weight.detach()
        weight = weight[:rows]
        biases = [m.bias for m in modules]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b.detach() if b is not None else weight.new_zeros(m.out_features)
                              for m, b in zip(modules, biases)])
        sizes = [m.out_features for m in modules] if rows is None else [weight.shape[0]]
        if quantize == INT8:
            return Int8Linear(weight, bias, sizes=sizes)
        return cls(weight, bias, pack=pack, sizes=sizes, layout=layout)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            return F.linear(x, self.weight, self.bias)
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # the worker's passes are 2-D already
        weight = self.weight if flat.shape[0] == 1 else self.many_rows_weight
        out = run_padded(lambda rows: torch.ops.mkldnn._linear_pointwise(rows, weight, self.bias, "none", [], ""), flat)
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out.shape[-1])


class Int8Linear:
    """`x @ weight.T + bias` with int8 weights (one scale per output channel) and activations
    quantized per pass (PyTorch's dynamic int8 linear; float in, float out). For drafts only:
    it changes the logits. Same interface as Linear."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, sizes: list[int] | None = None):
        self.sizes = sizes or [weight.shape[0]]
        self.packed = True
        self.dtype = weight.dtype
        self.weight = prepack(quantize_rows(weight), bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        out = linear_dynamic(flat.float(), self.weight).to(self.dtype)
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out.shape[-1])


def can_quantize(device: torch.device) -> bool:
    """Int8 linears: CPU, and a build with the x86 (or fbgemm) quantized engine."""
    return device.type == "cpu" and any(e in torch.backends.quantized.supported_engines for e in ("x86", "fbgemm"))


def default_linear_layout(dtype: torch.dtype) -> str:
    """BOTH for float32 (a verify of 5 rows ran ~2x faster in the many-rows layout on AVX2,
    a lone decode step 5-20% slower); ONE_ROW for bf16, whose one-row layout verified 5 rows
    at ~1.17x a decode step on AVX-512 (DESIGN.md)."""
    return BOTH if dtype == torch.float32 else ONE_ROW


def owns_its_weights(device: torch.device, prepacked: bool, quantize: str | None) -> bool:
    """Whether a worker's layers run on copies of the projections (oneDNN-packed or int8) and
    none on views of the model's tensors (an unpacked Linear of one module is a view)."""
    return device.type == "cpu" and (prepacked or quantize is not None)


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN prepacking: CPU tensors of a dtype it packs, and a build that has it."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8, dtype=dtype), 1)
        torch.ops.mkldnn._linear_pointwise(torch.ones(1, 8, dtype=dtype), w, None, "none", [], "")
        return True
    except (RuntimeError, AttributeError):
        return False


@dataclass
class _Layer:
    """One decoder layer's weights, in the form the worker runs them."""

    input_norm: torch.nn.Module
    post_norm: torch.nn.Module
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    act: torch.nn.Module
    scale: float
    q_norm: torch.nn.Module | None = None  # qwen3 normalises each head before rotary
    k_norm: torch.nn.Module | None = None


class KVCache:
    """Every request's keys and values in one preallocated slab, [layers, 2, kv_heads, slots,
    head_dim], of `budget_bytes`. Slots are handed out in blocks of BLOCK_TOKENS; a request's
    `slots` tensor maps its positions to slab slots."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 budget_bytes: int):
        self.bytes_per_token = self.token_bytes(layers, kv_heads, head_dim, dtype)
        self.num_blocks = budget_bytes // (self.bytes_per_token * BLOCK_TOKENS)
        if self.num_blocks < 1:
            raise SpecserveError(f"the KV cache budget ({budget_bytes} bytes) is smaller than one block of "
                                 f"{BLOCK_TOKENS} tokens ({self.bytes_per_token * BLOCK_TOKENS} bytes)")
        # empty, not zeros: on CPU untouched pages cost no memory; the ragged pass writes a
        # slot before it reads it (the static passes, which read masked slots, zero them).
        with torch.inference_mode():
            self.slab = torch.empty(layers, 2, kv_heads, self.num_blocks * BLOCK_TOKENS, head_dim,
                                    dtype=dtype, device=device)
        self._free = list(range(self.num_blocks - 1, -1, -1))  # a stack: lowest block first
        self._block_offsets = torch.arange(BLOCK_TOKENS, device=device)

    @staticmethod
    def token_bytes(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K and V of every layer for one token."""
        return layers * 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * BLOCK_TOKENS

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @staticmethod
    def blocks_for(tokens: int) -> int:
        return -(-tokens // BLOCK_TOKENS)

    def allocate(self, count: int) -> tuple[list[int], torch.Tensor]:
        """`count` blocks and their slots, in order."""
        blocks = [self._free.pop() for _ in range(count)]
        slots = (torch.tensor(blocks, device=self.slab.device)[:, None] * BLOCK_TOKENS + self._block_offsets).flatten()
        return blocks, slots

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))

    def zero_free_blocks(self) -> None:
        """Zero the slots of every free block (a pass that reads masked slots, the static
        passes, must not meet NaN in memory never written). By runs of consecutive blocks, in
        place: at start-up every block is free, one run, and a slice's zero_ took a fraction of
        the 0.7 s an index over a 1-GiB slab's every slot took on the 2-core EPYC."""
        with torch.inference_mode():
            for first, end in block_runs(self._free):
                self.slab[:, :, :, first * BLOCK_TOKENS:end * BLOCK_TOKENS].zero_()


def block_runs(blocks: list[int]) -> list[tuple[int, int]]:
    """Runs of consecutive block numbers, as [first, end) pairs in ascending order.

    >>> block_runs([7, 2, 3, 5, 4, 0])
    [(0, 1), (2, 6), (7, 8)]
    """
    runs: list[tuple[int, int]] = []
    for block in sorted(blocks):
        if runs and runs[-1][1] == block:
            runs[-1] = (runs[-1][0], block + 1)
        else:
            runs.append((block, block + 1))
    return runs


@dataclass
class _CacheEntry:
    blocks: list[int] = field(default_factory=list)
    # position -> slab slot, for every slot of the request's blocks (a permutation of them)
    slots: torch.Tensor | None = None
    tokens: list[int] = field(default_factory=list)  # ids whose keys/values fill positions [0, len)
    # Tree nodes written after `tokens` by the last call (node i at position len(tokens) + i),
    # waiting for the next call to tell which path was accepted.
    pending: TokenTree | None = None


@dataclass
class _Plan:
    """What one item feeds this step: the uncached tail of its sequence, then its tree."""

    entry: _CacheEntry
    start: int  # first position written: every cached position before it is visible ...
    input_ids: list[int]
    positions: list[int]
    local_mask: np.ndarray  # [t, t] bool, visibility among this step's new tokens
    first_logit_row: int  # first row returned, among the new tokens; -1: none (a prefill chunk)
    # ... except the cached nodes of a tree being extended, at positions [start - r, start):
    # [t, r] bool, which of them each new token sees (its ancestors)
    cached_tree_mask: np.ndarray | None = None

    @property
    def window_start(self) -> int:
        """The first position not simply visible to every new token: the cached tree nodes
        before them (none when the new tokens see them all, as a chain's extension does), else
        the new tokens themselves."""
        cached = self.cached_tree_mask
        return self.start - (0 if cached is None or cached.all() else cached.shape[1])

    def window_mask(self) -> np.ndarray:
        """[t, start + t - window_start] bool: what each new token sees from `window_start` on
        (every position before it is visible)."""
        if self.window_start == self.start:
            return self.local_mask
        return np.concatenate([self.cached_tree_mask, self.local_mask], axis=1)


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the common prefix; C-speed list comparison in the usual case (one is a
    prefix of the other), numpy otherwise: no Python loop over the context."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0])


def new_token_mask(num_chain: int, tree: TokenTree) -> np.ndarray:
    """[t, t] visibility among one step's new tokens: a causal chain, then tree nodes that see
    the whole chain plus their own ancestors."""
    t = num_chain + len(tree)
    mask = np.zeros((t, t), dtype=bool)
    mask[:num_chain, :num_chain] = np.tril(np.ones((num_chain, num_chain), dtype=bool))
    mask[num_chain:, :num_chain] = True
    mask[num_chain:, num_chain:] = tree.ancestor_mask()
    return mask


def attention_mask(plan: _Plan) -> np.ndarray | None:
    """[t, start + t] bool: what each new token of `plan` sees; None when it sees everything
    (one token, no tree: a decode step)."""
    t = len(plan.input_ids)
    if t == 1 and plan.cached_tree_mask is None:
        return None
    mask = np.ones((t, plan.start + t), dtype=bool)
    mask[:, plan.window_start :] = plan.window_mask()
    return mask


def grouped_query_attention(q, keys, values, mask, scale) -> torch.Tensor:
    """One request's attention for grouped-query models, with each KV head's query heads
    folded into the query-length axis: one [G*t, S] problem per KV head instead of G copies of
    the keys.

    q: [t, H, D]; keys, values: [KV, S, D]; mask: [G*t, S] bool (already folded, see
    `fold_mask`) or None. Returns [t, H*D]. Besides avoiding repeated K/V, this keeps torch's
    CPU kernels on their fast path: a single-query (t = 1) SDPA call is ~10x slower than the
    folded one.
    """
    t, heads, dim = q.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    q = q.view(t, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(1, kv_heads, group * t, dim)
    out = F.scaled_dot_product_attention(q, keys[None], values[None], attn_mask=mask, scale=scale)
    return out.view(kv_heads, group, t, dim).permute(2, 0, 1, 3).reshape(t, heads * dim)


def fold_mask(mask: np.ndarray | None, group: int, device) -> torch.Tensor | None:
    """[t, S] -> [G*t, S]: row g*t + i is query head g of token i (see grouped_query_attention)."""
    if mask is None:
        return None
    return torch.from_numpy(np.tile(mask, (group, 1))).to(device)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class TorchWorker:
    """Holds one causal LM and the KV caches of many requests; see the module docstring.

    kv_cache_bytes: the KV budget (default 1 GiB); `max_cached_tokens` says the same in
    tokens. prepack: oneDNN-prepacked linears (default: on CPU when available). Prepacking
    copies the weights it packs; `release_model_weights` then frees the model's own copies of
    the projections (the model's forward can no longer be used; the embedding, norms and
    lm_head stay, heads read them; on CPU they are copied out of the checkpoint's mmap so that
    the file's pages go too). cuda_graphs: run decode and chain-verify passes of up to 16
    requests as static-shape passes replayed as CUDA graphs (specserve.engine.cuda_graphs);
    default: on CUDA devices (CUDA_GRAPHS_BY_DEFAULT), never on CPU. greedy_screen: greedy
    tokens (`Rows.argmax`) through an int8 screen of the output layer, proven equal to the
    float32 argmax (specserve.engine.greedy_screen); default: float32 workers on CPU that do
    not quantize (a draft's logits are its proposals' probabilities)."""

    def __init__(self, model, *, kv_cache_bytes: int | None = None, max_cached_tokens: int | None = None,
                 vocab_size: int | None = None, prepack: bool | None = None, linear_layout: str | None = None,
                 quantize: str | None = None, release_model_weights: bool = False, cuda_graphs: bool | None = None,
                 greedy_screen: bool | None = None):
        config = model.config
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise SpecserveError(
                f"the torch engine supports {', '.join(SUPPORTED_MODEL_TYPES)} models, "
                f"not {model_type!r}"
            )
        if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
            raise SpecserveError("sliding-window attention layers are not supported by the torch engine")
        self.model = model
        self.config = config
        self.body = model.model
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        # Rows of the LM head beyond the shared tokenizer vocabulary are never used.
        self.vocab_size = min(vocab_size or model.lm_head.out_features, model.lm_head.out_features)
        self.prepacked = can_prepack(self.device, self.dtype) if prepack is None else prepack
        # "auto" and "none" are the pool config's words for the defaults
        self.linear_layout = default_linear_layout(self.dtype) if linear_layout in (None, "auto") else linear_layout
        quantize = None if quantize in (None, "none") else quantize
        if quantize is not None and quantize not in QUANTIZATIONS:
            raise SpecserveError(f"unknown quantization {quantize!r}; choose from {', '.join(QUANTIZATIONS)}")
        if quantize is not None and not can_quantize(self.device):
            raise SpecserveError(f"quantize: {quantize} runs on CPU with PyTorch's x86 quantized engine, "
                                 f"not on {self.device}")
        self.quantize = quantize
        self.layers = [self._layer(layer) for layer in self.body.layers]
        if release_model_weights:  # before the output layer and the screen, which then read the private copy
            self._release_model_weights()
        self.output = Linear.fused([model.lm_head], pack=self.prepacked, rows=self.vocab_size,
                                   layout=self.linear_layout, quantize=quantize)
        if greedy_screen is None:  # where int8 kernels run and the logits are float32 (not a draft's int8)
            greedy_screen = quantize is None and self.dtype == torch.float32 and can_quantize(self.device)
        if greedy_screen and not can_quantize(self.device):
            raise SpecserveError(f"greedy_screen runs on CPU with PyTorch's x86 quantized engine, not on {self.device}")
        if greedy_screen and (self.dtype != torch.float32 or quantize is not None):
            raise SpecserveError("greedy_screen proves the float32 argmax: it needs a float32 worker that does not "
                                 f"quantize (this one: {self.dtype}, quantize {quantize})")
        self.greedy_screen = None
        if greedy_screen:
            head = model.lm_head
            self.greedy_screen = GreedyScreen(head.weight.detach()[: self.vocab_size],  # float32, checked above
                                              None if head.bias is None else head.bias.detach()[: self.vocab_size])
        layers = len(self.layers)
        if max_cached_tokens is not None:
            if kv_cache_bytes is not None:
                raise SpecserveError("give kv_cache_bytes or max_cached_tokens, not both")
            kv_cache_bytes = max_cached_tokens * KVCache.token_bytes(layers, self.num_kv_heads, self.head_dim,
                                                                     self.dtype)
        self.kv = KVCache(layers, self.num_kv_heads, self.head_dim, self.dtype, self.device,
                          DEFAULT_KV_CACHE_BYTES if kv_cache_bytes is None else kv_cache_bytes)
        self._cache: OrderedDict[str, _CacheEntry] = OrderedDict()
        self._queued_prefill: dict[str, list[int]] = {}
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        # SDPA backends the passes may use; None: PyTorch's own choice (always on CPU)
        self.attention_backends = list(CUDA_ATTENTION_BACKENDS) if self.device.type == "cuda" else None
        self.forward_passes = 0
        self.evictions = 0
        if cuda_graphs is None:
            cuda_graphs = CUDA_GRAPHS_BY_DEFAULT and self.device.type == "cuda"
        if cuda_graphs and self.device.type != "cuda":
            raise SpecserveError(f"cuda_graphs needs a CUDA device, not {self.device}")
        self.static_passes = None  # a StaticPasses: passes that fit a static shape run there
        if cuda_graphs:
            from specserve.engine.cuda_graphs import StaticPasses

            self.static_passes = StaticPasses(self, capture=True)

    def _layer(self, layer) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        packing = {"pack": self.prepacked, "layout": self.linear_layout, "quantize": self.quantize}
        return _Layer(
            input_norm=layer.input_layernorm, post_norm=layer.post_attention_layernorm,
            qkv=Linear.fused([attn.q_proj, attn.k_proj, attn.v_proj], **packing), o=Linear.fused([attn.o_proj], **packing),
            gate_up=Linear.fused([mlp.gate_proj, mlp.up_proj], **packing), down=Linear.fused([mlp.down_proj], **packing),
            act=mlp.act_fn, scale=attn.scaling,
            q_norm=getattr(attn, "q_norm", None), k_norm=getattr(attn, "k_norm", None),
        )

    def _release_model_weights(self) -> None:
        """Drop the model's own projections (the layers hold their copies) and, where those
        copies are all the layers read, give what stays (embedding and tied lm_head, norms,
        biases) memory of its own."""
        for layer in self.body.layers:
            for module in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                           layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                module.weight = torch.nn.Parameter(module.weight.new_empty(0), requires_grad=False)
        if owns_its_weights(self.device, self.prepacked, self.quantize):
            # A checkpoint loaded on CPU is views of one mmap of its safetensors file, resident
            # (RssFile) until the last view goes: dropping the projections alone freed nothing
            # (a 1.5B float32 target: 6.0 GB mapped before and after, docs/MEASURED.md).
            for param in self.model.parameters():  # a tied weight is yielded once and stays tied
                if param.numel():
                    param.data = param.data.clone()

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv.bytes_per_token

    # ---- cache bookkeeping -------------------------------------------------------------

    def _cached_len(self, entry: _CacheEntry, token_ids: list[int]) -> int:
        """How many leading tokens of `token_ids` the entry holds, counting the accepted path
        of a pending tree."""
        base = len(entry.tokens)
        cached = common_prefix_len(entry.tokens, token_ids)
        if cached == base and entry.pending is not None:
            cached += len(entry.pending.path_of(token_ids[base:]))
        return cached

    def uncached_tokens(self, request_id: str, token_ids: list[int]) -> int:
        """How many of `token_ids` a pass would compute for this request (chunked prefill asks)."""
        entry = self._cache.get(request_id)
        return len(token_ids) - (self._cached_len(entry, token_ids) if entry is not None else 0)

    def queue_prefill(self, request_id: str, token_ids: list[int]) -> None:
        """Compute and cache `token_ids` during the next pass, returning nothing for them: a
        chunk of a long prompt rides along with other requests' rounds."""
        self._queued_prefill[request_id] = list(token_ids)

    def _compact(self, entry: _CacheEntry, token_ids: list[int]) -> None:
        """Keep the pending tree's accepted path, moved to the positions right after the prefix.

        A node at depth d was computed at position len(prefix) - 1 + d, which is exactly the
        position it moves to, so its keys and values stay valid: only the slot map changes."""
        tree, entry.pending = entry.pending, None
        base = len(entry.tokens)
        if common_prefix_len(entry.tokens, token_ids) != base:
            return
        path = tree.path_of(token_ids[base:])
        if path != list(range(len(path))):
            kept = set(path)
            rest = [i for i in range(len(tree)) if i not in kept]
            order = torch.tensor(path + rest, device=entry.slots.device) + base
            entry.slots[base:base + len(tree)] = entry.slots[order]
        entry.tokens = entry.tokens + [tree.tokens[i] for i in path]

    def _plan(self, item: ForwardItem, prefill_only: bool = False) -> _Plan:
        if not item.token_ids:
            raise SpecserveError(f"request {item.request_id}: no tokens to run")
        if item.logits_from is not None and not 0 <= item.logits_from < len(item.tree):
            raise SpecserveError(f"request {item.request_id}: logits_from must name a node of the tree")
        entry = self._cache.get(item.request_id)
        if entry is None:
            entry = self._cache[item.request_id] = _CacheEntry()
        self._cache.move_to_end(item.request_id)
        pending = entry.pending
        if (pending is not None and item.logits_from is not None and len(pending) <= item.logits_from
                and entry.tokens == item.token_ids and item.tree.extends(pending)):
            return self._plan_extension(item, entry, len(pending))
        if pending is not None:
            self._compact(entry, item.token_ids)
        # The sequence's last token is fed again when its logits are wanted.
        need_last = item.logits_from is None and not prefill_only
        start = min(common_prefix_len(entry.tokens, item.token_ids), len(item.token_ids) - need_last)
        entry.tokens = entry.tokens[:start]
        chain = item.token_ids[start:]
        last_pos = len(item.token_ids) - 1
        positions = list(range(start, last_pos + 1)) + [last_pos + d for d in item.tree.depths]
        if prefill_only:
            first = -1
        else:
            first = len(chain) - 1 if need_last else len(chain) + item.logits_from
        return _Plan(
            entry=entry,
            start=start,
            input_ids=chain + list(item.tree.tokens),
            positions=positions,
            local_mask=new_token_mask(len(chain), item.tree),
            first_logit_row=first,
        )

    def _plan_extension(self, item: ForwardItem, entry: _CacheEntry, cached: int) -> _Plan:
        """Feed only the nodes after the first `cached`, which sit at the positions after the
        sequence since the previous call."""
        last_pos = len(item.token_ids) - 1
        ancestors = item.tree.ancestor_mask()[cached:]
        return _Plan(
            entry=entry,
            start=len(item.token_ids) + cached,
            input_ids=list(item.tree.tokens[cached:]),
            positions=[last_pos + d for d in item.tree.depths[cached:]],
            local_mask=ancestors[:, cached:],
            first_logit_row=item.logits_from - cached,
            cached_tree_mask=ancestors[:, :cached],
        )

    def _reserve(self, plans: list[_Plan], batch_ids: set[str]) -> None:
        """Give every plan's entry the blocks its positions need, evicting least recently used
        requests outside this pass when the slab is full."""
        needs = [(p.entry, self.kv.blocks_for(p.start + len(p.input_ids)) - len(p.entry.blocks)) for p in plans]
        wanted = sum(n for _, n in needs if n > 0)
        if wanted > self.kv.free_blocks:
            for rid in list(self._cache):  # least recently used first
                if self.kv.free_blocks >= wanted:
                    break
                if rid not in batch_ids:
                    self._drop(rid)
                    self.evictions += 1
        if wanted > self.kv.free_blocks:
            need_tokens = sum(self.kv.blocks_for(p.start + len(p.input_ids)) for p in plans) * BLOCK_TOKENS
            raise SpecserveError(
                f"the KV cache ({self.kv.capacity_tokens} tokens, {self.kv.capacity_tokens * self.kv_bytes_per_token} "
                f"bytes) cannot hold this pass ({need_tokens} tokens): raise the pool's kv_cache_memory or lower "
                "max_batch_size")
        for entry, count in needs:
            if count > 0:
                blocks, slots = self.kv.allocate(count)
                entry.blocks += blocks
                entry.slots = slots if entry.slots is None else torch.cat([entry.slots, slots])

    def _drop(self, request_id: str) -> bool:
        entry = self._cache.pop(request_id, None)
        if entry is None:
            return False
        self.kv.free(entry.blocks)
        return True

    def release(self, request_id: str) -> bool:
        """Free a request's cache. Returns whether there was one."""
        self._queued_prefill.pop(request_id, None)
        return self._drop(request_id)

    @property
    def cached_requests(self) -> int:
        """Requests holding a cache here (a dict length: safe to read from another thread)."""
        return len(self._cache)

    def cache_stats(self) -> dict:
        return {
            "requests": self.cached_requests,
            "cached_tokens": sum(len(e.tokens) for e in self._cache.values()),
            "kv_capacity_tokens": self.kv.capacity_tokens,
            "kv_free_tokens": self.kv.free_blocks * BLOCK_TOKENS,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "evictions": self.evictions,
            "forward_passes": self.forward_passes,
        }

    def cached_tokens(self, request_id: str) -> list[int]:
        entry = self._cache.get(request_id)
        return list(entry.tokens) if entry else []

    def cached_kv(self, request_id: str) -> torch.Tensor:
        """[layers, 2, kv_heads, len(tokens), head_dim]: the valid part of a request's cache."""
        entry = self._cache[request_id]
        return self.kv.slab.index_select(3, entry.slots[: len(entry.tokens)])

    # ---- the forward pass ----------------------------------------------------------------

    def forward(self, items: list[ForwardItem]) -> list[torch.Tensor]:
        """`run`, logits only."""
        return [rows.logits for rows in self.run(items)]

    @torch.inference_mode()
    def run(self, items: list[ForwardItem]) -> list[Rows]:
        """Run every item's new tokens, and any queued prefill chunks, in one ragged pass;
        returns, per item, the logits and last hidden states of rows [1 + len(tree)] (the last
        token, then each node), or of the rows asked for by `logits_from`."""
        ids = {i.request_id for i in items}
        if len(ids) != len(items):
            raise SpecserveError("a request may appear only once per forward pass")
        plans = [self._plan(item) for item in items]
        # A chunk already cached (or whose request runs in this pass anyway) is dropped: planning
        # it would cut the request's cached tokens back to the chunk.
        chunks = [(rid, tokens) for rid, tokens in self._queued_prefill.items()
                  if rid not in ids and self.uncached_tokens(rid, tokens) > 0]
        self._queued_prefill.clear()
        for rid, tokens in chunks:
            plan = self._plan(ForwardItem(rid, tokens), prefill_only=True)
            if plan.input_ids:
                plans.append(plan)
        if not plans:
            return []
        self._reserve(plans, ids | {rid for rid, _ in chunks})
        backends = sdpa_kernel(self.attention_backends) if self.attention_backends else contextlib.nullcontext()
        with backends:
            out = self.static_passes.forward(plans) if self.static_passes is not None else None
            if out is None:
                out = self._forward(plans)
        for item, p in zip(items, plans):
            p.entry.tokens = list(item.token_ids)
            p.entry.pending = item.tree if len(item.tree) else None
        for rid, tokens in chunks:
            if rid in self._cache:
                self._cache[rid].tokens = tokens
        return out[: len(items)]

    def _forward(self, plans: list[_Plan]) -> list[Rows]:
        device = self.device
        sizes = [len(p.input_ids) for p in plans]
        input_ids = torch.tensor([t for p in plans for t in p.input_ids], device=device)
        positions = torch.tensor([t for p in plans for t in p.positions], device=device)
        writes = torch.cat([p.entry.slots[p.start : p.start + t] for p, t in zip(plans, sizes)])
        reads = [p.entry.slots[: p.start + t] for p, t in zip(plans, sizes)]
        group = self.num_heads // self.num_kv_heads
        masks = [fold_mask(attention_mask(p), group, device) for p in plans]  # once per pass
        offsets = np.cumsum([0] + sizes).tolist()

        h = self.body.embed_tokens(input_ids)  # [N, hidden]
        cos, sin = self._rotary(h, int(positions.max()) + 1)
        cos, sin = cos[positions, None], sin[positions, None]  # [N, 1, D]
        for index, layer in enumerate(self.layers):
            x = layer.input_norm(h)
            h = h + layer.o(self._attention(index, layer, x, cos, sin, writes, reads, masks, offsets))
            gate, up = layer.gate_up(layer.post_norm(h)).split(layer.gate_up.sizes, dim=-1)
            h = h + layer.down(layer.act(gate) * up)
        self.forward_passes += 1

        wanted = [(offsets[b] + p.first_logit_row, offsets[b] + sizes[b]) for b, p in enumerate(plans)
                  if p.first_logit_row >= 0]
        if not wanted:
            return []
        rows = torch.cat([torch.arange(a, b, device=device) for a, b in wanted])
        hidden = self.body.norm(h.index_select(0, rows))
        counts = [b - a for a, b in wanted]
        spans = [slice(a, b) for a, b in zip(np.cumsum([0] + counts[:-1]).tolist(), np.cumsum(counts).tolist())]
        if self.greedy_screen is not None:  # the output layer when the rows are read (Rows)
            output = PassOutput(hidden, self.output, self.greedy_screen)
            return [Rows(None, hidden[span], output, span) for span in spans]
        with record_function("specserve::output_layer"):
            logits = self.output(hidden)
        return [Rows(logits[span], hidden[span]) for span in spans]

    def _rotary(self, h: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's own rotary tables for positions [0, length), [length, D], computed once
        (doubling as contexts grow): the same values as computing them per pass."""
        if self._rope is None or self._rope[0].shape[0] < length:
            size = max(length, 2 * (self._rope[0].shape[0] if self._rope else 256))
            cos, sin = self.body.rotary_emb(h[None, :1], torch.arange(size, device=self.device)[None])
            self._rope = (cos[0], sin[0])
        return self._rope

    def queries_into_cache(self, index, layer: _Layer, x, cos, sin, writes):
        """Layer `index`'s projections of the pass's rows `x`: the rotated queries [n, heads, D],
        and the layer's whole key and value slabs [KV, slots, D] with this pass's keys and
        values written at slots `writes`."""
        n, d = x.shape[0], self.head_dim
        q, k, v = layer.qkv(x).split(layer.qkv.sizes, dim=-1)
        q, k, v = q.view(n, -1, d), k.view(n, -1, d), v.view(n, -1, d)
        if layer.q_norm is not None:
            q, k = layer.q_norm(q), layer.k_norm(k)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        keys, values = self.kv.slab[index, 0], self.kv.slab[index, 1]
        keys.index_copy_(1, writes, k.transpose(0, 1))
        values.index_copy_(1, writes, v.transpose(0, 1))
        return q, keys, values

    def _attention(self, index, layer: _Layer, x, cos, sin, writes, reads, masks, offsets) -> torch.Tensor:
        q, keys, values = self.queries_into_cache(index, layer, x, cos, sin, writes)
        with record_function("specserve::attention"):
            out = [grouped_query_attention(q[offsets[b]:offsets[b + 1]], keys.index_select(1, slots),
                                           values.index_select(1, slots), mask, layer.scale)
                   for b, (slots, mask) in enumerate(zip(reads, masks))]
        return out[0] if len(out) == 1 else torch.cat(out)
