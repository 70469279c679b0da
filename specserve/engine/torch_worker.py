"""The torch engine: one Hugging Face decoder model plus the KV caches of many requests.

The worker runs the model's own weights (embedding, projections, MLPs, norms, rotary tables)
through specserve's attention so that it controls the KV cache: one growable cache per request,
rollback by truncation, and verification of a token tree in one forward pass with a tree
attention mask and per-node positions. A chain of draft tokens is the one-branch tree.

A request's cache is a cache, not the truth: every call carries the request's full token ids.
The worker keeps the longest prefix of its cached tokens that agrees with the call (after moving
the accepted path of the previous call's tree into place) and recomputes the rest, so a worker
that never saw a request, lost it, or holds a stale copy returns the same logits.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from specserve.protocol import SpecserveError, TokenTree

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
EMPTY_TREE = TokenTree()


@dataclass
class ForwardItem:
    """One request's share of a batched forward pass.

    The worker returns logits for the last token of `token_ids` followed by one row per tree
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


@dataclass
class Rows:
    """What a forward pass returns for one item: the rows `ForwardItem` describes.

    logits: [rows, V] float32 on the CPU (acceptance runs there), truncated to the usable
    vocabulary. hidden: [rows, hidden] the model's last hidden state (after its final norm,
    what the lm_head reads and what Medusa-style heads read), on the model's device and dtype.
    """

    logits: torch.Tensor
    hidden: torch.Tensor


@dataclass
class _CacheEntry:
    kv: torch.Tensor  # [layers, 2, kv_heads, capacity, head_dim]
    tokens: list[int] = field(default_factory=list)  # ids whose keys/values fill slots [0, len)
    # Tree nodes written after `tokens` by the last call (node i in slot len(tokens) + i),
    # waiting for the next call to tell which path was accepted.
    pending: TokenTree | None = None
    last_used: float = 0.0


@dataclass
class _Plan:
    """What one item feeds this step: the uncached tail of its sequence, then its tree."""

    entry: _CacheEntry
    start: int  # first slot written: every cached slot before it is visible ...
    input_ids: list[int]
    positions: list[int]
    local_mask: np.ndarray  # [t, t] bool, visibility among this step's new tokens
    first_logit_row: int  # first row returned, among the new tokens
    # ... except the cached nodes of a tree being extended, in slots [start - r, start):
    # [t, r] bool, which of them each new token sees (its ancestors)
    cached_tree_mask: np.ndarray | None = None


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def new_token_mask(num_chain: int, tree: TokenTree) -> np.ndarray:
    """[t, t] visibility among one step's new tokens: a causal chain, then tree nodes that see
    the whole chain plus their own ancestors."""
    t = num_chain + len(tree)
    mask = np.zeros((t, t), dtype=bool)
    mask[:num_chain, :num_chain] = np.tril(np.ones((num_chain, num_chain), dtype=bool))
    mask[num_chain:, :num_chain] = True
    mask[num_chain:, num_chain:] = tree.ancestor_mask()
    return mask


def grouped_query_attention(q, keys, values, mask, scale) -> torch.Tensor:
    """Attention for grouped-query models, with each KV head's query heads folded into the
    query-length axis: one [G*T, S] problem per KV head instead of G copies of the keys.

    q: [B, H, T, D]; keys, values: [B, KV, S, D]; mask: [B, 1, T, S] bool or None.
    Returns [B, H, T, D]. Besides avoiding repeated K/V, this keeps torch's CPU kernels on
    their fast path: a single-query (T = 1) SDPA call is ~10x slower than the folded one.
    """
    batch, heads, width, dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    q = q.reshape(batch, kv_heads, group * width, dim)
    if mask is not None:
        mask = mask.unsqueeze(2).expand(batch, 1, group, width, mask.shape[-1]).reshape(batch, 1, group * width, -1)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    return out.view(batch, heads, width, dim)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class TorchWorker:
    """Holds one causal LM and per-request KV caches; see the module docstring."""

    def __init__(self, model, *, max_cached_tokens: int = 1 << 20, vocab_size: int | None = None):
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
        self.layers = list(self.body.layers)
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        # Rows of the LM head beyond the shared tokenizer vocabulary are never used.
        self.vocab_size = min(vocab_size or model.lm_head.out_features, model.lm_head.out_features)
        self.max_cached_tokens = max_cached_tokens
        self._cache: OrderedDict[str, _CacheEntry] = OrderedDict()
        self.forward_passes = 0

    # ---- cache bookkeeping -------------------------------------------------------------

    def _new_kv(self, capacity: int) -> torch.Tensor:
        return torch.zeros(
            len(self.layers), 2, self.num_kv_heads, capacity, self.head_dim,
            dtype=self.dtype, device=self.device,
        )

    def _reserve(self, entry: _CacheEntry, slots: int, keep: int) -> None:
        if entry.kv.shape[3] >= slots:
            return
        capacity = max(64, 1 << (slots - 1).bit_length())
        kv = self._new_kv(capacity)
        kv[:, :, :, :keep] = entry.kv[:, :, :, :keep]
        entry.kv = kv

    def _compact(self, entry: _CacheEntry, token_ids: list[int]) -> None:
        """Keep the pending tree's accepted path, moved into the slots right after the prefix.

        A node at depth d was computed at position len(prefix) - 1 + d, which is exactly the
        slot it moves to, so its keys and values stay valid: no recompute."""
        tree, entry.pending = entry.pending, None
        base = len(entry.tokens)
        if token_ids[:base] != entry.tokens:
            return
        path = tree.path_of(token_ids[base:])
        if path != list(range(len(path))):
            src = torch.tensor([base + i for i in path], device=self.device)
            entry.kv[:, :, :, base:base + len(path)] = entry.kv.index_select(3, src)
        entry.tokens = entry.tokens + [tree.tokens[i] for i in path]

    def _plan(self, item: ForwardItem) -> _Plan:
        if not item.token_ids:
            raise SpecserveError(f"request {item.request_id}: no tokens to run")
        if item.logits_from is not None and not 0 <= item.logits_from < len(item.tree):
            raise SpecserveError(f"request {item.request_id}: logits_from must name a node of the tree")
        entry = self._cache.get(item.request_id)
        if entry is None:
            entry = self._cache[item.request_id] = _CacheEntry(self._new_kv(0))
        self._cache.move_to_end(item.request_id)
        entry.last_used = time.monotonic()
        pending = entry.pending
        if (pending is not None and item.logits_from is not None and len(pending) <= item.logits_from
                and entry.tokens == item.token_ids and item.tree.extends(pending)):
            return self._plan_extension(item, entry, len(pending))
        if pending is not None:
            self._compact(entry, item.token_ids)
        # The sequence's last token is fed again when its logits are wanted.
        need_last = item.logits_from is None
        start = min(common_prefix_len(entry.tokens, item.token_ids), len(item.token_ids) - need_last)
        entry.tokens = entry.tokens[:start]
        chain = item.token_ids[start:]
        last_pos = len(item.token_ids) - 1
        positions = list(range(start, last_pos + 1)) + [last_pos + d for d in item.tree.depths]
        return _Plan(
            entry=entry,
            start=start,
            input_ids=chain + list(item.tree.tokens),
            positions=positions,
            local_mask=new_token_mask(len(chain), item.tree),
            first_logit_row=len(chain) - 1 if need_last else len(chain) + item.logits_from,
        )

    def _plan_extension(self, item: ForwardItem, entry: _CacheEntry, cached: int) -> _Plan:
        """Feed only the nodes after the first `cached`, which sit in the slots after the
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

    def release(self, request_id: str) -> bool:
        """Free a request's cache. Returns whether there was one."""
        return self._cache.pop(request_id, None) is not None

    def cache_stats(self) -> dict:
        return {
            "requests": len(self._cache),
            "cached_tokens": sum(len(e.tokens) for e in self._cache.values()),
            "forward_passes": self.forward_passes,
        }

    def cached_tokens(self, request_id: str) -> list[int]:
        entry = self._cache.get(request_id)
        return list(entry.tokens) if entry else []

    def cached_kv(self, request_id: str) -> torch.Tensor:
        """[layers, 2, kv_heads, len(tokens), head_dim]: the valid part of a request's cache."""
        entry = self._cache[request_id]
        return entry.kv[:, :, :, : len(entry.tokens)]

    def _evict(self, keep: set[str]) -> None:
        total = sum(e.kv.shape[3] for e in self._cache.values())
        for rid in list(self._cache):  # least recently used first
            if total <= self.max_cached_tokens:
                break
            if rid not in keep:
                total -= self._cache.pop(rid).kv.shape[3]

    # ---- the forward pass ----------------------------------------------------------------

    def forward(self, items: list[ForwardItem]) -> list[torch.Tensor]:
        """`run`, logits only."""
        return [rows.logits for rows in self.run(items)]

    @torch.inference_mode()
    def run(self, items: list[ForwardItem]) -> list[Rows]:
        """Run every item's new tokens in one batched pass; returns, per item, the logits and
        last hidden states of rows [1 + len(tree)] (the last token, then each node), or of the
        rows asked for by `logits_from`."""
        if len(items) != len({i.request_id for i in items}):
            raise SpecserveError("a request may appear only once per forward pass")
        plans = [self._plan(item) for item in items]
        batch = len(plans)
        width = max(len(p.input_ids) for p in plans)
        slots = max(p.start + len(p.input_ids) for p in plans)
        for p in plans:
            self._reserve(p.entry, slots, p.start)

        input_ids = torch.zeros(batch, width, dtype=torch.long)
        position_ids = torch.zeros(batch, width, dtype=torch.long)
        mask = torch.zeros(batch, 1, width, slots, dtype=torch.bool)
        for b, p in enumerate(plans):
            t = len(p.input_ids)
            input_ids[b, :t] = torch.tensor(p.input_ids)
            position_ids[b, :t] = torch.tensor(p.positions)
            mask[b, 0, :t, : p.start] = True
            if p.cached_tree_mask is not None:
                cached = p.cached_tree_mask.shape[1]
                mask[b, 0, :t, p.start - cached : p.start] = torch.from_numpy(p.cached_tree_mask)
            mask[b, 0, :t, p.start : p.start + t] = torch.from_numpy(p.local_mask)
            mask[b, 0, t:, 0] = True  # padding rows attend somewhere to stay finite
        attn_mask = None if bool(mask.all()) else mask.to(self.device)

        h = self.body.embed_tokens(input_ids.to(self.device))
        cos, sin = self.body.rotary_emb(h, position_ids.to(self.device))
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for index, layer in enumerate(self.layers):
            h = h + self._attention(index, layer, layer.input_layernorm(h), cos, sin, plans, slots, attn_mask)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        self.forward_passes += 1

        rows = [h[b, p.first_logit_row : len(p.input_ids)] for b, p in enumerate(plans)]
        hidden = self.body.norm(torch.cat(rows))
        # Acceptance runs on the CPU with CPU generators: one transfer for the whole batch.
        logits = self.model.lm_head(hidden)[:, : self.vocab_size].float().cpu()
        sizes = [r.shape[0] for r in rows]
        out = [Rows(lg, hd) for lg, hd in zip(logits.split(sizes), hidden.split(sizes))]

        for item, p in zip(items, plans):
            p.entry.tokens = list(item.token_ids)
            p.entry.pending = item.tree if len(item.tree) else None
        self._evict(keep={i.request_id for i in items})
        return out

    def _attention(self, index, layer, x, cos, sin, plans, slots, attn_mask) -> torch.Tensor:
        attn = layer.self_attn
        batch, width, _ = x.shape
        shape = (batch, width, -1, self.head_dim)
        q = attn.q_proj(x).view(shape)
        k = attn.k_proj(x).view(shape)
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        if hasattr(attn, "q_norm"):  # qwen3 normalises each head before rotary
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin

        for b, p in enumerate(plans):
            t = len(p.input_ids)
            p.entry.kv[index, 0, :, p.start : p.start + t] = k[b, :, :t]
            p.entry.kv[index, 1, :, p.start : p.start + t] = v[b, :, :t]
        if batch == 1:
            keys = plans[0].entry.kv[index, 0, :, :slots].unsqueeze(0)
            values = plans[0].entry.kv[index, 1, :, :slots].unsqueeze(0)
        else:
            kv = torch.stack([p.entry.kv[index, :, :, :slots] for p in plans])
            keys, values = kv[:, 0], kv[:, 1]
        out = grouped_query_attention(q, keys, values, attn_mask, attn.scaling)
        return attn.o_proj(out.transpose(1, 2).reshape(batch, width, -1))
