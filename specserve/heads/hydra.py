"""Hydra heads (Ankner et al. 2024, zankner/Hydra): Medusa heads that see what was drafted before them.

Medusa's head i guesses token t + i + 2 from the target's hidden state h_t alone, so every
candidate at a depth is the same whatever the path above it. Hydra's head i also reads the
input embeddings of the tokens on the path: x_{t+1} (the round's root, the token the target
just produced) and the i tokens drafted below it,

    head i:  [h_t ; e(x_{t+1}) ; ... ; e(x_{t+i+1})]  ->  hidden  ->  lm_head  ->  token t + i + 2

so drafting goes depth by depth (head i runs on every node of depth i, with that node's path)
and each candidate is conditioned on its own branch.

Each head is an input block that folds the (i + 2) * hidden concatenation back to the hidden
size, `skip(x) + SiLU(linear(x))` (Hydra's ResBlock with a residual projection), then
`num_layers - 1` Medusa ResBlocks, then the target's own lm_head, frozen and shared (its
`token_map` rows: a reduced head vocabulary as for Medusa). `skip` starts as "take h_t" and
`linear` at zero, so an untrained Hydra head is an untrained Medusa head. The embeddings are
the target's own input embedding table (frozen, not saved with the heads), RMS-normalised so
they enter at the scale of the normed hidden state.

Hydra++'s prefix attention (`prefix_window` > 0, off by default): before the heads, one
attention layer lets h_t look back over the target's hidden states of the last `prefix_window`
committed tokens (h_t's own included), h'_t = h_t + o(attention(h_t; h_{t-W+1} .. h_t)), and
every head reads h'_t instead of h_t. Hydra++ attends over the whole prefix with an extra
decoder layer; a window keeps the per-request state small and fixed. Positions enter as a
learned bias per head and offset. `o` starts at zero, so an untrained prefix layer changes
nothing. The window holds what the serving pool has seen: at the start of a generation only
the prompt's last token, then every committed token (training draws shorter windows too, so the
layer copes with both).

Hydra++'s teacher distillation is the trainer's loss for every method (`specserve.heads.train`).

Files: `config.json` (`method: hydra`) + `hydra.safetensors` (the heads' parameters and the
token_map). vLLM has no Hydra model, so there is no vllm/ layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specserve.heads import files
from specserve.heads.medusa import ResBlock, check_head_sizes
from specserve.protocol import SpecserveError

WEIGHTS_FILE = "hydra.safetensors"


@dataclass
class HydraConfig:
    hidden_size: int
    vocab_size: int  # the target's full vocabulary (lm_head and embedding rows)
    num_heads: int = 4
    num_layers: int = 1  # the input block, then num_layers - 1 ResBlocks
    head_vocab_size: int | None = None  # size of token_map; None: the whole vocabulary
    target: str | None = None  # the model the heads were trained on (informational)
    prefix_window: int = 0  # Hydra++ prefix attention over the last N hidden states; 0: off
    prefix_heads: int = 4  # attention heads of the prefix layer
    score_temperatures: list[float] | None = None  # see medusa.check_head_sizes
    method: str = "hydra"

    def __post_init__(self) -> None:
        check_head_sizes("Hydra", self)
        if self.prefix_window < 0:
            raise SpecserveError(f"prefix_window must be >= 0 (0: no prefix attention), got {self.prefix_window}")
        if self.prefix_window and (self.prefix_heads < 1 or self.hidden_size % self.prefix_heads):
            raise SpecserveError(f"prefix_heads ({self.prefix_heads}) must divide hidden_size ({self.hidden_size})")


class PrefixAttention(nn.Module):
    """One attention layer from h_t over the last `window` hidden states (Hydra++'s prefix
    attention, windowed): returns h_t + o(attention). An untrained layer is the identity."""

    def __init__(self, hidden_size: int, window: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.q = nn.Linear(hidden_size, hidden_size, bias=False)
        self.kv = nn.Linear(hidden_size, 2 * hidden_size, bias=False)
        self.o = nn.Linear(hidden_size, hidden_size, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(num_heads, window))  # per head and offset
        with torch.no_grad():
            self.o.weight.zero_()

    def forward(self, hidden: torch.Tensor, states: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """hidden [B, H] (h_t); states [B, W, H], oldest first, the last one h_t itself; valid
        [B, W] bool (False: no state there, e.g. before the sequence began). Returns [B, H]."""
        batch, window, width = states.shape
        heads, size = self.num_heads, width // self.num_heads
        q = self.q(hidden).view(batch, heads, 1, size)
        k, v = self.kv(states).view(batch, window, 2, heads, size).permute(2, 0, 3, 1, 4)
        bias = self.position_bias[:, -window:].to(q.dtype)[None, :, None, :]  # [1, heads, 1, W]
        mask = bias.masked_fill(~valid[:, None, None, :], float("-inf"))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, heads, 1, size]
        return hidden + self.o(out.reshape(batch, width))

class HydraHead(nn.Module):
    """Head `index`: [h ; e_1 .. e_{index+1}] ((index + 2) * hidden wide) -> hidden."""

    def __init__(self, hidden_size: int, index: int, num_layers: int):
        super().__init__()
        width = hidden_size * (index + 2)
        self.skip = nn.Linear(width, hidden_size, bias=False)
        self.linear = nn.Linear(width, hidden_size, bias=True)
        with torch.no_grad():  # starts as Medusa's identity on h: skip picks h, linear is zero
            self.skip.weight.zero_()
            self.skip.weight[:, :hidden_size] = torch.eye(hidden_size)
            self.linear.weight.zero_()
            self.linear.bias.zero_()
        self.act = nn.SiLU()
        self.blocks = nn.Sequential(*(ResBlock(hidden_size) for _ in range(num_layers - 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.skip(x) + self.act(self.linear(x)))


class HydraHeads(files.TiedHeads):
    """K path-conditioned heads over the target's last hidden state, on the target's lm_head
    and input embedding (`files.TiedHeads`)."""

    def __init__(self, config: HydraConfig, lm_head_weight: torch.Tensor, embedding_weight: torch.Tensor,
                 token_map: torch.Tensor | None = None):
        super().__init__(config, lm_head_weight, embedding_weight, token_map, "Hydra")
        self.heads = nn.ModuleList(HydraHead(config.hidden_size, i, config.num_layers)
                                   for i in range(config.num_heads))
        self.prefix = (PrefixAttention(config.hidden_size, config.prefix_window, config.prefix_heads)
                       if config.prefix_window else None)

    @property
    def context_window(self) -> int:
        """How many past hidden states the heads read (0: h_t alone)."""
        return self.config.prefix_window

    def base(self, hidden: torch.Tensor, context: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """What the heads read for h_t: h_t itself, or with prefix attention h'_t over
        `context` = (states [B, W, H], valid [B, W]) (see `PrefixAttention`)."""
        hidden = hidden.to(self.heads[0].linear.weight.dtype)
        if self.prefix is None:
            return hidden
        if context is None:
            raise SpecserveError("these Hydra heads attend over the prefix: pass the last hidden states")
        states, valid = context
        return self.prefix(hidden, states.to(hidden.dtype), valid)

    def head_features(self, index: int, base: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
        """Head `index` before the projection. base [N, H] (from `base`); path [N, index + 1],
        the root token then the drafted tokens above the nodes being predicted. Returns [N, H]."""
        if path.shape[-1] != index + 1:
            raise SpecserveError(f"Hydra head {index} reads a path of {index + 1} tokens, got {path.shape[-1]}")
        x = torch.cat([base.to(self.heads[0].linear.weight.dtype), self.embed(path).flatten(-2)], dim=-1)
        return self.heads[index](x)

    def head_logits(self, index: int, base: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
        """[N, head_vocab] logits over `token_map`'s ids (see `head_features`)."""
        out = self.head_features(index, base, path)
        return self.project(out)

    def features(self, hidden: torch.Tensor, path: torch.Tensor,
                 context: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Every head at once, teacher-forced: hidden [B, H] (h_t), path [B, >= K] (x_{t+1} ..
        x_{t+K} from the sequence), context: see `base`. Returns [K, B, H]: head i read
        path[:, :i + 1]."""
        x = torch.cat([self.base(hidden, context),
                       self.embed(path[:, : self.config.num_heads]).flatten(-2)], dim=-1)
        width = self.config.hidden_size
        return torch.stack([head(x[:, : width * (i + 2)]) for i, head in enumerate(self.heads)])

    def forward(self, hidden: torch.Tensor, path: torch.Tensor,
                context: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """[K, B, head_vocab] logits, teacher-forced (see `features`)."""
        out = self.features(hidden, path, context)
        return self.project(out)

    def save(self, directory: str | Path) -> Path:
        return files.save_heads(self, directory, WEIGHTS_FILE)


def read_config(directory: str | Path) -> HydraConfig:
    return files.read_config(directory, HydraConfig, "Hydra")


def load_heads(directory: str | Path, lm_head_weight: torch.Tensor, embedding_weight: torch.Tensor, *,
               dtype=None, device=None) -> HydraHeads:
    """Heads saved by `HydraHeads.save`, on the target whose lm_head and input embedding
    weights are given, in the lm_head's dtype and on its device unless told otherwise."""
    return files.load_heads(directory, HydraHeads, HydraConfig, WEIGHTS_FILE, "Hydra", lm_head_weight,
                            embedding_weight, dtype=dtype, device=device)
