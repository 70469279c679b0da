"""Heads that lean on the target's frozen lm_head and input embedding (Hydra, ReDrafter): their
shared base (`TiedHeads`), and their files: `config.json` (a dataclass, with the method) and one
safetensors file of the heads' own parameters and their token_map. The target's lm_head and
embedding table are never saved: the loader is given them, and the heads are rebuilt on them."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specserve.heads.medusa import CONFIG_FILE, VocabularyHeads
from specserve.protocol import SpecserveError


class TiedHeads(VocabularyHeads):
    """What Hydra's heads and ReDrafter's drafter share: the target's lm_head rows of
    `token_map` as a frozen projection, and the target's input embedding table, kept by
    reference (never copied, moved or saved: it is the target's). `label` names them in errors."""

    lm_heads = None  # the projection is always the target's shared lm_head (the trainer asks)

    def __init__(self, config, lm_head_weight: torch.Tensor, embedding_weight: torch.Tensor,
                 token_map: torch.Tensor | None, label: str):
        super().__init__()
        expected = (config.vocab_size, config.hidden_size)
        for name, weight in (("lm_head", lm_head_weight), ("input embedding", embedding_weight)):
            if tuple(weight.shape) != expected:
                raise SpecserveError(f"the target's {name} is {tuple(weight.shape)}; these {label} heads need "
                                     f"{expected}: were they trained for another model?")
        token_map = (torch.arange(config.vocab_size) if token_map is None else token_map).long()
        if config.head_vocab_size is None:
            config.head_vocab_size = len(token_map)
        if len(token_map) != config.head_vocab_size:
            raise SpecserveError(f"token_map has {len(token_map)} ids, the config says {config.head_vocab_size}")
        self.config = config
        self.register_buffer("token_map", token_map, persistent=False)
        self.register_buffer("shared_lm_head", lm_head_weight.detach()[token_map.to(lm_head_weight.device)].clone()
                             .to(torch.float32), persistent=False)
        self.embedding = embedding_weight.detach()  # a plain attribute: `.to()` leaves the target's table alone

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> their input embeddings [..., hidden], RMS-normalised (so they enter at the
        scale of the normed hidden state), in the heads' dtype and on their device."""
        like = self.shared_lm_head
        e = F.embedding(ids.to(self.embedding.device), self.embedding).to(device=like.device, dtype=torch.float32)
        return (e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + 1e-6)).to(like.dtype)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]


def save_heads(heads, directory: str | Path, weights_file: str) -> Path:
    """Write `heads.config` and the heads' parameters (state_dict, token_map) into `directory`."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {name: value.detach() for name, value in heads.state_dict().items()}
    state["token_map"] = heads.token_map
    save_file({k: v.contiguous().cpu() for k, v in state.items()}, str(directory / weights_file))
    (directory / CONFIG_FILE).write_text(json.dumps(asdict(heads.config), indent=1) + "\n")
    return directory


def read_config(directory: str | Path, config_cls, label: str):
    """The `config_cls` saved in `directory`, refusing heads of another method (config_cls.method)."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise SpecserveError(f"no {label} heads at {directory} (missing {CONFIG_FILE})")
    data = json.loads(path.read_text())
    if data.get("method", "medusa") != config_cls.method:
        raise SpecserveError(f"{directory} holds {data.get('method', 'medusa')!r} heads, not {label} heads")
    return config_cls(**{k: v for k, v in data.items() if k in config_cls.__dataclass_fields__})


def load_heads(directory: str | Path, heads_cls, config_cls, weights_file: str, label: str,
               lm_head_weight: torch.Tensor, embedding_weight: torch.Tensor, *, dtype=None, device=None):
    """Heads saved by `save_heads`, rebuilt on the target whose lm_head and input embedding
    weights are given, frozen, in the lm_head's dtype and on its device unless told otherwise."""
    from safetensors.torch import load_file

    config = read_config(directory, config_cls, label)
    state = load_file(str(Path(directory) / weights_file))
    heads = heads_cls(config, lm_head_weight, embedding_weight, state.pop("token_map"))
    missing, unexpected = heads.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise SpecserveError(f"{label} weights at {directory} do not match their config "
                             f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    heads.requires_grad_(False).eval()
    return heads.to(dtype=dtype or lm_head_weight.dtype, device=device or lm_head_weight.device)
