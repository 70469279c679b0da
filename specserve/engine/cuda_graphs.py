"""Static-shape passes for the engine's small passes, replayed as CUDA graphs.

On a GPU a batch-1 decode step of the ragged pass is bound by Python and kernel launches
(docs/bench/gpu-h100: 15 ms of wall time for 3.6 ms of GPU work). A CUDA graph replays a whole
pass with one launch, but it needs every tensor's shape and address fixed at capture. So the
passes that fit a `Shape` run a padded, static-shape version of the pass:

- `batch` requests, bucketed (1, 2, 4, 8, 16): missing requests are padding;
- `tokens` new tokens per request, bucketed (1, 2, 4, ... 64), at most MAX_ROWS rows in all:
  decode steps, chain and tree verify passes (a Medusa tree of 63 nodes and its root is 64),
  a draft's chain and tree steps. A request with fewer tokens is padded;
- `context` KV positions read per request (a power of two >= 256): every request reads its
  slots through a padded [batch, context] slot table;
- `span` the cache window whose visibility is not "all of it": the new tokens, after the
  cached nodes of a tree being extended (`_Plan.window_start`). Every key before the
  window is visible; inside it a [tokens, span] mask per request says which (a causal
  triangle for a chain, ancestors for a tree); none after it.

Padding rows write their keys and values to scratch slots of the slab that no request owns,
and see the first key of their request's window (padding requests: a scratch slot); no real
token ever sees a scratch slot. Keys a row does not see are still read (the slot table is
padded), so the slab's free blocks are zeroed once: a masked key's weight is 0, and 0 * NaN
from never-written memory would not be. Inputs, positions, write slots, the slot table and
the window masks are copied into static buffers before each replay.

The same static pass runs eagerly without capture (on CPU too): that is how its exactness
against the ragged pass is tested on machines without a GPU (tests/test_cuda_graphs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from specserve.engine.torch_worker import Rows
from specserve.protocol import SpecserveError

BATCH_BUCKETS = (1, 2, 4, 8, 16)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
SPAN_BUCKETS = TOKEN_BUCKETS + (128,)  # new tokens plus a tree's cached nodes
MAX_ROWS = 256  # batch * tokens: 16 requests of 16 tokens, 4 of 64 (each shape keeps its [rows, V] logits)
MIN_CONTEXT = 256  # smallest context bucket: shorter contexts share one graph
DEFAULT_MAX_CONTEXT = 8192  # longer contexts run the ragged pass (the padded gather grows)
DEFAULT_MAX_GRAPHS = 96  # shapes captured at most; others run the ragged pass


@dataclass(frozen=True)
class Shape:
    batch: int  # requests, padding included
    tokens: int  # new tokens per request, padding included
    context: int  # KV positions each request reads
    span: int  # the masked window's width: new tokens plus a tree's cached nodes, bucketed

    @property
    def rows(self) -> int:
        return self.batch * self.tokens


def bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds n, None when none does."""
    return next((b for b in buckets if b >= n), None)


def context_bucket(length: int, max_context: int) -> int | None:
    """The power of two (at least MIN_CONTEXT) that holds `length` positions, None past max_context."""
    size = max(MIN_CONTEXT, 1 << (length - 1).bit_length())
    return size if size <= max_context else None


def static_shape(plans, *, max_context: int) -> Shape | None:
    """The shape a pass pads to, None when it must run ragged (a prefill chunk, too many new
    tokens, rows, requests or positions)."""
    if any(p.first_logit_row < 0 for p in plans):  # a prefill chunk returns no rows
        return None
    batch = bucket(len(plans), BATCH_BUCKETS)
    tokens = bucket(max(len(p.input_ids) for p in plans), TOKEN_BUCKETS)
    span = bucket(max(p.start + len(p.input_ids) - p.window_start for p in plans), SPAN_BUCKETS)
    if batch is None or tokens is None or span is None or batch * tokens > MAX_ROWS:
        return None
    context = context_bucket(max(p.start + len(p.input_ids) for p in plans), max_context)
    return None if context is None else Shape(batch, tokens, context, span)


@dataclass
class _Buffers:
    """A shape's static inputs: the tensors a captured graph reads. The ones that come from the
    host are views of one tensor (`staged`), so a pass copies them in with one transfer."""

    staged: torch.Tensor  # [2 * rows + batch + batch * tokens * span] int64: the views below
    input_ids: torch.Tensor  # [rows]
    positions: torch.Tensor  # [rows]
    window_starts: torch.Tensor  # [batch] first position of each request's masked window
    windows: torch.Tensor  # [batch, tokens, span] 0/1: which window positions each row sees
    writes: torch.Tensor  # [rows] slab slot each new token's key and value go to
    reads: torch.Tensor  # [batch, context] slab slot of each position a request reads

    @classmethod
    def empty(cls, shape: Shape, device) -> _Buffers:
        window = shape.batch * shape.tokens * shape.span
        staged = torch.zeros(2 * shape.rows + shape.batch + window, dtype=torch.long, device=device)
        input_ids, positions, starts, windows = staged.split([shape.rows, shape.rows, shape.batch, window])
        return cls(staged, input_ids, positions, starts, windows.view(shape.batch, shape.tokens, shape.span),
                   torch.zeros(shape.rows, dtype=torch.long, device=device),
                   torch.zeros(shape.batch, shape.context, dtype=torch.long, device=device))


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [rows, V] written by each replay
    hidden: torch.Tensor  # [rows, hidden]


class StaticPasses:
    """Runs the passes that fit a `Shape` as static-shape passes of `worker`: captured as CUDA
    graphs on first use of a shape and replayed after (capture=True, CUDA only), or eagerly
    (capture=False: the same arithmetic, for tests and CPUs)."""

    def __init__(self, worker, *, capture: bool, max_context: int = DEFAULT_MAX_CONTEXT,
                 max_graphs: int = DEFAULT_MAX_GRAPHS):
        if capture and worker.device.type != "cuda":
            raise SpecserveError("CUDA graphs need a CUDA device")
        self.worker = worker
        self.capture = capture
        self.max_context = max_context
        self.max_graphs = max_graphs
        device = worker.device
        # Scratch slots for padding rows, one per row of the largest shape: never a request's.
        if worker.kv.free_blocks <= worker.kv.blocks_for(MAX_ROWS):
            raise SpecserveError(f"the KV cache ({worker.kv.capacity_tokens} tokens) is too small for CUDA graphs, "
                                 f"which keep {MAX_ROWS} scratch slots: raise it or turn cuda_graphs off")
        worker.kv.zero_free_blocks()  # masked keys are read too: no NaN may lie there
        self._scratch_blocks, scratch = worker.kv.allocate(worker.kv.blocks_for(MAX_ROWS))
        self._scratch = scratch[:MAX_ROWS]
        self._padding_reads = scratch[:1].expand(max_context)
        # The rotary tables and key positions the graphs read: held here, so the worker
        # growing its own tables never frees memory a graph points to.
        self.cos, self.sin = (t[:max_context] for t in worker._rotary(
            torch.zeros(1, worker.config.hidden_size, dtype=worker.dtype, device=device), max_context))
        self._key_positions = torch.arange(max_context, device=device)
        self._buffers: dict[Shape, _Buffers] = {}
        self._graphs: dict[Shape, _Graph] = {}
        self._pool = None  # one memory pool for every graph: they never run at once
        self.replays = 0
        self.eager_passes = 0
        self.capture_error: str | None = None

    @property
    def shapes_captured(self) -> list[Shape]:
        return list(self._graphs)

    def forward(self, plans) -> list | None:
        """Rows for `plans` (reserved already), or None when the pass must run ragged."""
        shape = static_shape(plans, max_context=self.max_context)
        if shape is None or (self.capture and shape not in self._graphs
                             and (len(self._graphs) >= self.max_graphs or self.capture_error)):
            return None
        if shape not in self._buffers:
            self._buffers[shape] = _Buffers.empty(shape, self.worker.device)
        buffers = self._buffers[shape]
        self._fill(buffers, shape, plans)
        if not self.capture:
            logits, hidden = self._pass(buffers, shape)
            self.eager_passes += 1
        else:
            graph = self._graphs.get(shape) or self._capture(buffers, shape)
            if graph is None:
                return None
            graph.graph.replay()
            logits, hidden = graph.logits, graph.hidden
            self.replays += 1
        self.worker.forward_passes += 1
        return self._rows(plans, shape, logits, hidden)

    def _fill(self, buffers: _Buffers, shape: Shape, plans) -> None:
        """Copy the pass's inputs into the shape's static buffers. Padding rows feed token 0 at
        position 0, write to their own scratch slots and see their window's first key."""
        rows, batch = shape.rows, shape.batch
        host = np.zeros(buffers.staged.shape[0], dtype=np.int64)
        ids = host[: 2 * rows].reshape(2, batch, shape.tokens)
        starts = host[2 * rows : 2 * rows + batch]
        windows = host[2 * rows + batch :].reshape(batch, shape.tokens, shape.span)
        windows[:, :, 0] = 1
        writes = [self._scratch[:rows].view(batch, shape.tokens)[b] for b in range(batch)]
        reads = [self._padding_reads[: shape.context]] * batch
        for b, plan in enumerate(plans):
            t = len(plan.input_ids)
            ids[0, b, :t], ids[1, b, :t] = plan.input_ids, plan.positions
            mask = plan.window_mask()
            windows[b, :t, : mask.shape[1]] = mask
            starts[b] = plan.window_start
            slots = plan.entry.slots
            writes[b] = torch.cat([slots[plan.start : plan.start + t], writes[b][t:]])
            own = slots[: shape.context]
            reads[b] = torch.cat([own, self._padding_reads[: shape.context - len(own)]])
        buffers.staged.copy_(torch.from_numpy(host))
        torch.cat(writes, out=buffers.writes)
        torch.stack(reads, out=buffers.reads)

    def _rows(self, plans, shape: Shape, logits: torch.Tensor, hidden: torch.Tensor) -> list:
        """Each plan's returned rows, copied out of the (static) outputs."""
        out = []
        for b, plan in enumerate(plans):
            rows = slice(b * shape.tokens + plan.first_logit_row, b * shape.tokens + len(plan.input_ids))
            out.append(Rows(logits[rows].clone(), hidden[rows].clone()))
        return out

    def _capture(self, buffers: _Buffers, shape: Shape) -> _Graph | None:
        """Warm the shape up once on a side stream (the real pass: its cache writes are the
        ones the replay makes again), then capture it. A failure is kept, and every later pass
        runs ragged."""
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._pass(buffers, shape)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                logits, hidden = self._pass(buffers, shape)
        except Exception as error:  # noqa: BLE001 (kept and reported; the ragged pass stands in)
            self.capture_error = f"{type(error).__name__}: {error}"[:500]
            return None
        self._pool = self._pool or graph.pool()
        captured = self._graphs[shape] = _Graph(graph, logits, hidden)
        return captured

    def _pass(self, buffers: _Buffers, shape: Shape) -> tuple[torch.Tensor, torch.Tensor]:
        """The static-shape pass: the ragged pass's arithmetic on every row (the worker's own
        layers), attention through the padded slot table. Returns logits and hidden states of
        every row."""
        worker = self.worker
        group = worker.num_heads // worker.num_kv_heads
        h = worker.body.embed_tokens(buffers.input_ids)  # [rows, hidden]
        cos, sin = self.cos[buffers.positions, None], self.sin[buffers.positions, None]  # [rows, 1, D]
        visible = self._visible(buffers, shape)  # [batch, tokens, context]
        # [batch, 1, G*T, context]: row g*T + i is query head g of token i (grouped_query_attention)
        mask = visible[:, None].expand(-1, group, -1, -1).reshape(shape.batch, 1, group * shape.tokens, shape.context)
        for index, layer in enumerate(worker.layers):
            x = layer.input_norm(h)
            h = h + layer.o(self._attention(index, layer, x, cos, sin, buffers, mask, shape))
            gate, up = layer.gate_up(layer.post_norm(h)).split(layer.gate_up.sizes, dim=-1)
            h = h + layer.down(layer.act(gate) * up)
        hidden = worker.body.norm(h)
        return worker.output(hidden), hidden

    def _visible(self, buffers: _Buffers, shape: Shape) -> torch.Tensor:
        """[batch, tokens, context] bool: every key before a request's window, and the window's
        keys its mask shows each row (static shapes, no host sync: capturable)."""
        offset = self._key_positions[: shape.context] - buffers.window_starts[:, None]  # [batch, context]
        inside = (offset >= 0) & (offset < shape.span)
        index = offset.clamp(0, shape.span - 1)[:, None, :].expand(-1, shape.tokens, -1)
        shown = (buffers.windows.gather(2, index) != 0) & inside[:, None, :]
        return shown | (offset < 0)[:, None, :]

    def _attention(self, index, layer, x, cos, sin, buffers: _Buffers, mask, shape: Shape) -> torch.Tensor:
        worker = self.worker
        n, d, kv_heads = x.shape[0], worker.head_dim, worker.num_kv_heads
        group = worker.num_heads // kv_heads
        q, keys, values = worker.queries_into_cache(index, layer, x, cos, sin, buffers.writes)
        reads = buffers.reads.view(-1)
        keys = keys.index_select(1, reads).view(kv_heads, shape.batch, shape.context, d).transpose(0, 1)
        values = values.index_select(1, reads).view(kv_heads, shape.batch, shape.context, d).transpose(0, 1)
        q = q.view(shape.batch, shape.tokens, kv_heads, group, d).permute(0, 2, 3, 1, 4)
        q = q.reshape(shape.batch, kv_heads, group * shape.tokens, d)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=layer.scale)
        out = out.view(shape.batch, kv_heads, group, shape.tokens, d).permute(0, 3, 1, 2, 4)
        return out.reshape(n, worker.num_heads * d)

    def release(self) -> None:
        """Give the scratch blocks back (the worker stops using static passes)."""
        self.worker.kv.free(self._scratch_blocks)
        self._graphs.clear()

