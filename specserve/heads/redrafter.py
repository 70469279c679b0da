"""ReDrafter (Cheng et al. 2024, apple/ml-recurrent-drafter): one recurrent drafter on the target.

Medusa and Hydra keep one head per depth. ReDrafter keeps one drafter whose parameters are
shared by every step: a recurrent state carries what was drafted so far,

    s_0 = 0
    s_j = SiLU(W·e(x_{t+j}) + U·s_{j-1})                        (j = 1, 2, ...)
    step j:  [h_t ; s_j]  ->  hidden  ->  lm_head  ->  token t + j + 1

where h_t is the target's last hidden state (the row that produced x_{t+1}, the round's root)
and e() the target's input embedding. Step 0 reads the root x_{t+1} and guesses x_{t+2}, like
Medusa's and Hydra's head 0; step i has read the path x_{t+1} .. x_{t+i+1}, like Hydra's head i.
s_0 is zero (not learned): the first step's state is then a function of the root alone.

[h ; s_j] goes through Hydra's input block (`skip(x) + SiLU(linear(x))`, 2 x hidden folded back
to hidden; `skip` starts as "take h", `linear` at zero) and `num_layers - 1` Medusa ResBlocks to
the target's own lm_head, frozen and shared (its `token_map` rows, as for Medusa and Hydra): the
drafter trains hidden^2-sized matrices only. An untrained drafter therefore proposes what an
untrained Medusa head 0 would at every step. W and U start random (PyTorch's default init): with
them at zero the state would stay zero and get no gradient.

`num_heads` in the config is the number of steps the drafter is trained to take (the beam length
it serves at most), so the trainer, the CLI (`--heads`) and the proposers share one meaning.

Files: `config.json` (`method: redrafter`) + `redrafter.safetensors` (W, U, the head and the
token_map; the embedding table and lm_head are the target's, never saved).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specserve.heads import files
from specserve.heads.hydra import HydraHead
from specserve.heads.medusa import check_head_sizes

WEIGHTS_FILE = "redrafter.safetensors"


@dataclass
class ReDrafterConfig:
    hidden_size: int
    vocab_size: int  # the target's full vocabulary (lm_head and embedding rows)
    num_heads: int = 4  # drafting steps trained (the longest beam served)
    num_layers: int = 1  # the input block, then num_layers - 1 ResBlocks
    head_vocab_size: int | None = None  # size of token_map; None: the whole vocabulary
    target: str | None = None  # the model the drafter was trained on (informational)
    score_temperatures: list[float] | None = None  # per drafting step: see medusa.check_head_sizes
    method: str = "redrafter"

    def __post_init__(self) -> None:
        check_head_sizes("ReDrafter", self)


class ReDrafter(files.TiedHeads):
    """The recurrent drafter over the target's last hidden state, on the target's lm_head and
    input embedding (`files.TiedHeads`)."""

    context_window = 0  # reads h_t alone, never past hidden states

    def __init__(self, config: ReDrafterConfig, lm_head_weight: torch.Tensor, embedding_weight: torch.Tensor,
                 token_map: torch.Tensor | None = None):
        super().__init__(config, lm_head_weight, embedding_weight, token_map, "ReDrafter")
        size = config.hidden_size
        self.rnn_w = nn.Linear(size, size, bias=True)  # W·e(x) (+ the cell's bias)
        self.rnn_u = nn.Linear(size, size, bias=False)  # U·s
        self.head = HydraHead(size, 0, config.num_layers)  # [h ; s] -> hidden

    def initial_state(self, rows: int) -> torch.Tensor:
        """s_0 for `rows` drafts: zeros [rows, hidden]."""
        weight = self.rnn_w.weight
        return torch.zeros(rows, self.config.hidden_size, dtype=weight.dtype, device=weight.device)

    def advance(self, state: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """s_j = SiLU(W·e(x) + U·s_{j-1}): state [N, H] after reading tokens [N]."""
        return F.silu(self.rnn_w(self.embed(tokens)) + self.rnn_u(state))

    def step_features(self, hidden: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """[h ; s] -> [N, H], before the projection."""
        return self.head(torch.cat([hidden.to(state.dtype), state], dim=-1))

    def step_logits(self, hidden: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """[N, head_vocab] logits over `token_map`'s ids of the token after the state's path."""
        out = self.step_features(hidden, state)
        return self.project(out)

    def features(self, hidden: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
        """Every step at once, teacher-forced: hidden [B, H] (h_t), path [B, >= K] (x_{t+1} ..
        x_{t+K} from the sequence). Returns [K, B, H]: step i read path[:, :i + 1]."""
        hidden = hidden.to(self.rnn_w.weight.dtype)
        state = self.initial_state(len(hidden))
        out = []
        for i in range(self.config.num_heads):
            state = self.advance(state, path[:, i])
            out.append(self.step_features(hidden, state))
        return torch.stack(out)

    def forward(self, hidden: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
        """[K, B, head_vocab] logits, teacher-forced (see `features`)."""
        out = self.features(hidden, path)
        return self.project(out)

    def save(self, directory: str | Path) -> Path:
        return files.save_heads(self, directory, WEIGHTS_FILE)


def read_config(directory: str | Path) -> ReDrafterConfig:
    return files.read_config(directory, ReDrafterConfig, "ReDrafter")


def load_heads(directory: str | Path, lm_head_weight: torch.Tensor, embedding_weight: torch.Tensor, *,
               dtype=None, device=None) -> ReDrafter:
    """A drafter saved by `ReDrafter.save`, on the target whose lm_head and input embedding
    weights are given, in the lm_head's dtype and on its device unless told otherwise."""
    return files.load_heads(directory, ReDrafter, ReDrafterConfig, WEIGHTS_FILE, "ReDrafter", lm_head_weight,
                            embedding_weight, dtype=dtype, device=device)
