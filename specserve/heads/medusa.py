"""Medusa heads (Cai et al. 2024, FasterDecoding/Medusa): extra decoding heads on the target.

Head i (0-based) maps the target's last hidden state at position t (after the final norm) to a
distribution over the token at position t + i + 2; the target's own lm_head already predicts
t + 1. Each head is `num_layers` residual blocks `x + SiLU(Linear(x))` (weights start at zero,
so an untrained head is the identity) followed by a vocabulary projection:

- by default the target's own lm_head, frozen and shared by every head (vLLM's
  `original_lm_head` layout): the heads stay small (hidden^2 parameters per block) and cheap
  to train;
- optionally a trained copy per head (`own_lm_head`).

The projection may cover only a subset of the vocabulary (`token_map`, the most frequent
tokens of the training text, vLLM's `truncated_vocab_size`): a 150k-token lm_head costs as
much as a quarter of a 1.5B model's step on a CPU, and tokens outside the map are rarely worth
proposing. Proposals are verified exactly either way; the map only limits what the heads can
guess.

Files: `config.json` + `medusa.safetensors` (specserve's layout: blocks, token_map, and the
per-head projections when `own_lm_head`). `save_vllm` (`specserve export-heads`) writes the
layout vLLM's Medusa model loads (`speculative_config={"method": "medusa", "model": DIR}`):
`blocks.{h}.layers.{l}.weight/.bias`, `lm_heads.{h}.weight`, and a config with `num_heads`,
`num_hidden_layers`, `hidden_size`, `vocab_size`, `medusa_fc_bias: true` and `original_lm_head`.
It spans the whole vocabulary: vLLM 0.26-0.32 cannot load a truncated one (its loader makes
`token_map` a parameter it never counts as loaded, then refuses the checkpoint: "Following
weights were not initialized from checkpoint: {'token_map'}"), so ids outside token_map get
zero rows.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from specserve.protocol import SpecserveError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "medusa.safetensors"
VLLM_DIR = "vllm"


@dataclass
class MedusaConfig:
    hidden_size: int
    vocab_size: int  # the target's full vocabulary (lm_head rows)
    num_heads: int = 4
    num_layers: int = 1
    own_lm_head: bool = False  # False: the target's frozen lm_head, shared by every head
    head_vocab_size: int | None = None  # size of token_map; None: the whole vocabulary
    target: str | None = None  # the model the heads were trained on (informational)
    score_temperatures: list[float] | None = None  # see check_head_sizes
    method: str = "medusa"

    def __post_init__(self) -> None:
        check_head_sizes("Medusa", self)


def check_head_sizes(method: str, config) -> None:
    """What every head config (Medusa, Hydra, ReDrafter) shares: heads, layers, head vocabulary,
    and `score_temperatures`: per head, the temperature its logits are divided by before a tree
    ranks its candidates by path probability (fitted by the trainer on held-out continuations,
    `fit_score_temperatures`; None: 1). Deep heads are overconfident on text they did not train
    on, and a reranked tree spends its budget where its scores say. Each head's own order of
    candidates is unchanged, so a static shape drafts the same tree either way."""
    temperatures = config.score_temperatures
    if temperatures is not None and (len(temperatures) != config.num_heads
                                     or not all(0 < t < float("inf") for t in temperatures)):
        raise SpecserveError(f"score_temperatures needs one positive temperature per head ({config.num_heads}), "
                             f"got {temperatures}")
    if config.num_heads < 1 or config.num_layers < 1:
        raise SpecserveError(f"{method} needs >= 1 head and >= 1 layer per head, got "
                             f"{config.num_heads} heads, {config.num_layers} layers")
    if config.head_vocab_size is not None and not 1 <= config.head_vocab_size <= config.vocab_size:
        raise SpecserveError(f"head_vocab_size must be in [1, {config.vocab_size}], got {config.head_vocab_size}")


class ResBlock(nn.Module):
    """x + SiLU(Linear(x)), zero-initialised: an untrained block is the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size, bias=True)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class VocabularyHeads(nn.Module):
    """What every kind of heads ends in: the target's lm_head rows of `token_map` as one
    projection shared by every head (the `shared_lm_head` buffer; Medusa's `own_lm_head`
    heads have their own instead). Serving swaps in a faster kernel for it
    (`use_projection_kernel`): every head's and row's logits in one product, so the matrix
    (~100 MB for 32k rows of a 1536-wide model) is read once per round, not once per head."""

    shared_lm_head: torch.Tensor | None
    projection_kernel = None  # a callable with the same results as `features @ shared_lm_head.T`

    def use_projection_kernel(self, kernel) -> None:
        """Serve the shared projection through `kernel` (e.g. the engine's oneDNN-prepacked
        `Linear` over `shared_lm_head`): [..., hidden] -> [..., head_vocab]. Inference only."""
        if self.shared_lm_head is None:
            raise SpecserveError("these heads have their own projections; there is no shared one to serve")
        self.projection_kernel = kernel

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> logits [..., head_vocab] over `token_map`'s ids, in one product."""
        if self.projection_kernel is not None:
            return self.projection_kernel(features)
        return features @ self.shared_lm_head.to(features.dtype).T

    def scoring_logits(self, logits: torch.Tensor, head: int | None = None) -> torch.Tensor:
        """`logits` as a tree scores them: divided by the config's `score_temperatures`, those of
        head `head`, or of every head along the first axis ([num_heads, ..., head_vocab]) when
        `head` is None. Unchanged where the heads have none."""
        temperatures = self.config.score_temperatures
        if temperatures is None:
            return logits
        if head is not None:
            return logits.float() / temperatures[head]
        scale = torch.tensor(temperatures, dtype=torch.float32, device=logits.device)
        return logits.float() / scale.view(-1, *(1,) * (logits.dim() - 1))


class MedusaHeads(VocabularyHeads):
    """K heads over the target's last hidden state.

    `lm_head_weight`: the target's lm_head weight [vocab, hidden]; its `token_map` rows become
    the shared frozen projection (or the initial value of each head's own copy).
    """

    def __init__(self, config: MedusaConfig, lm_head_weight: torch.Tensor, token_map: torch.Tensor | None = None):
        super().__init__()
        if tuple(lm_head_weight.shape) != (config.vocab_size, config.hidden_size):
            raise SpecserveError(f"the target's lm_head is {tuple(lm_head_weight.shape)}; these heads need "
                                 f"({config.vocab_size}, {config.hidden_size}): were they trained for another model?")
        if token_map is None:
            token_map = torch.arange(config.vocab_size)
        token_map = token_map.long()
        if config.head_vocab_size is None:
            config.head_vocab_size = len(token_map)
        if len(token_map) != config.head_vocab_size:
            raise SpecserveError(f"token_map has {len(token_map)} ids, the config says {config.head_vocab_size}")
        self.config = config
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResBlock(config.hidden_size) for _ in range(config.num_layers)))
            for _ in range(config.num_heads))
        self.register_buffer("token_map", token_map, persistent=False)
        projection = lm_head_weight.detach()[token_map].clone()
        if config.own_lm_head:
            self.lm_heads = nn.ParameterList(nn.Parameter(projection.clone()) for _ in range(config.num_heads))
            self.register_buffer("shared_lm_head", None, persistent=False)
        else:
            self.lm_heads = None
            self.register_buffer("shared_lm_head", projection, persistent=False)

    def projection(self, head: int) -> torch.Tensor:
        """[head_vocab, hidden]: head `head`'s vocabulary projection."""
        return self.lm_heads[head] if self.lm_heads is not None else self.shared_lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [..., hidden] (the target's last hidden state, after its final norm).
        Returns logits [num_heads, ..., head_vocab] over `token_map`'s ids."""
        features = self.features(hidden)
        if self.lm_heads is None:
            return self.project(features)
        return torch.stack([f @ w.T for f, w in zip(features, self.lm_heads)])

    context_window = 0  # Medusa's heads read h_t alone, never past hidden states

    def features(self, hidden: torch.Tensor, path: torch.Tensor | None = None) -> torch.Tensor:
        """[num_heads, ..., hidden]: every head before its projection (the trainer's interface,
        specserve.heads.train.TrainableHeads). Medusa's heads read no path."""
        return torch.stack([block(hidden) for block in self.blocks])

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    # ---- files ---------------------------------------------------------------------------

    def state_for_saving(self) -> dict[str, torch.Tensor]:
        """specserve's layout: blocks.{h}.layers.{l}.{weight,bias}, token_map, lm_heads.{h}.weight."""
        state: dict[str, torch.Tensor] = {}
        for h, block in enumerate(self.blocks):
            for l, res in enumerate(block):
                state[f"blocks.{h}.layers.{l}.weight"] = res.linear.weight.detach()
                state[f"blocks.{h}.layers.{l}.bias"] = res.linear.bias.detach()
        if self.lm_heads is not None:
            for h, weight in enumerate(self.lm_heads):
                state[f"lm_heads.{h}.weight"] = weight.detach()
        state["token_map"] = self.token_map
        return {k: v.contiguous().cpu() for k, v in state.items()}

    def save(self, directory: str | Path) -> Path:
        """specserve's layout: config.json + medusa.safetensors."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file(self.state_for_saving(), str(directory / WEIGHTS_FILE))
        (directory / CONFIG_FILE).write_text(json.dumps(asdict(self.config), indent=1) + "\n")
        return directory

    def vllm_state(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """vLLM's layout over the whole vocabulary. A token outside token_map gets a zero row, so
        its logit is 0: vLLM's top-1 proposal is the heads' own whenever their best logit is
        positive (a trained head's top logit is; if none were, vLLM would propose an id the
        heads cannot, which verification rejects like any wrong guess)."""
        state = {k: v.to(dtype) for k, v in self.state_for_saving().items() if k.startswith("blocks.")}
        for h in range(self.config.num_heads) if self.lm_heads is not None else [0]:
            rows = torch.zeros(self.config.vocab_size, self.config.hidden_size, dtype=dtype)
            rows[self.token_map.cpu()] = self.projection(h).detach().cpu().to(dtype)
            state[f"lm_heads.{h}.weight"] = rows
        return state

    def save_vllm(self, directory: str | Path, dtype: torch.dtype = torch.float32) -> Path:
        """The directory vLLM's Medusa model loads: config.json + model.safetensors."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file(self.vllm_state(dtype), str(directory / "model.safetensors"))
        (directory / CONFIG_FILE).write_text(json.dumps(vllm_config(self.config), indent=1) + "\n")
        return directory


def vllm_config(config: MedusaConfig) -> dict:
    """The config.json of vLLM's Medusa loader (vllm/transformers_utils/configs/medusa.py)."""
    return {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "num_heads": config.num_heads,
        "num_hidden_layers": config.num_layers,
        "truncated_vocab_size": config.vocab_size,  # see the module docstring
        "medusa_fc_bias": True,  # our blocks have biases; vLLM drops them silently when False
        "original_lm_head": not config.own_lm_head,
    }


def read_config(directory: str | Path) -> MedusaConfig:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise SpecserveError(f"no Medusa heads at {directory} (missing {CONFIG_FILE})")
    data = json.loads(path.read_text())
    if data.get("method", "medusa") != "medusa":
        raise SpecserveError(f"{directory} holds {data.get('method')!r} heads, not Medusa heads")
    return MedusaConfig(**{k: v for k, v in data.items() if k in MedusaConfig.__dataclass_fields__})


def load_heads(directory: str | Path, lm_head_weight: torch.Tensor, *, dtype=None, device=None) -> MedusaHeads:
    """Heads saved by `MedusaHeads.save`, on the target whose lm_head weight is given."""
    from safetensors.torch import load_file

    config = read_config(directory)
    state = load_file(str(Path(directory) / WEIGHTS_FILE))
    heads = MedusaHeads(config, lm_head_weight.float().cpu(), state.pop("token_map"))
    missing, unexpected = heads.load_state_dict(_module_keys(state), strict=False)
    if unexpected or [k for k in missing if k.startswith("blocks.")]:
        raise SpecserveError(f"Medusa weights at {directory} do not match their config "
                             f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    heads.requires_grad_(False).eval()
    return heads.to(dtype=dtype or lm_head_weight.dtype, device=device or lm_head_weight.device)


def export_vllm(directory: str | Path, lm_head_weight: torch.Tensor, out: str | Path | None = None,
                dtype: torch.dtype = torch.float32) -> Path:
    """The heads in `directory` (on the target whose lm_head weight is given) written in vLLM's
    layout to `out` (default: `directory`/vllm)."""
    heads = load_heads(directory, lm_head_weight.float(), dtype=torch.float32, device="cpu")
    return heads.save_vllm(Path(directory) / VLLM_DIR if out is None else out, dtype)


def exported_for_vllm(directory: str | Path, target) -> Path:
    """`directory`/vllm, exported first (`export_vllm`, with the lm_head of `target`, a model
    reference) unless an export of these heads is already there. An older export with a truncated
    vocabulary, which vLLM cannot load, is written again."""
    from specserve.models import lm_head_weight

    out = Path(directory) / VLLM_DIR
    config = out / CONFIG_FILE
    if (out / "model.safetensors").is_file() and config.is_file():
        written = json.loads(config.read_text())
        if written == vllm_config(read_config(directory)) and config.stat().st_mtime >= \
                (Path(directory) / WEIGHTS_FILE).stat().st_mtime:
            return out
    return export_vllm(directory, lm_head_weight(target), out)


def _module_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Saved names -> module names: blocks.{h}.layers.{l}.x is blocks.{h}.{l}.linear.x."""
    out = {}
    for name, value in state.items():
        parts = name.split(".")
        if parts[0] == "blocks":
            out[f"blocks.{parts[1]}.{parts[3]}.linear.{parts[4]}"] = value
        elif parts[0] == "lm_heads":
            out[f"lm_heads.{parts[1]}"] = value
    return out
