"""Self-distillation data: the target's own greedy continuations, with its hidden states.

Heads serve on what the target writes, not on human text: trained on the standard library and
HumanEval solutions alone, head 0 of the default target guessed the target's own next-next token
46% of the time on held-out prompts against 53% on held-out human text, and heads 1-3 fell
further behind (0.18/0.08/0.09 against 0.31/0.20/0.14). So the trainer also lets the target
continue prompts of its own (never the benchmarks' held-out ones), greedily, continuously
batched on the torch engine, and keeps the last hidden state of every decode step: the row that
produced each generated token is exactly what serving hands the heads, so no second pass over
the text is needed.

The result has `compute_hidden_states`' format, one sequence per prompt that produced at least
two tokens: `tokens` are the inputs of the decode steps (the prompt's last token, then every
generated token but the last), `greedy` what each step produced (the next input), `hidden` the
step's hidden state; `prompt_index` says which prompt each sequence continued.

A run takes over an hour on a small CPU, so with `parts_dir` it keeps what it has: every
`save_every_s` seconds the continuations finished since the last save go to a new part file
there, and a later run with the same `parts_dir` starts from them (prompts already continued
are skipped, the budget counts their tokens; continuations that were still running when the
run stopped start again). The caller deletes the parts once it has the whole result.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specserve.engine.torch_worker import MANY_ROWS, ForwardItem, TorchWorker
from specserve.heads.data import answer_text


@torch.inference_mode()
def generate_states(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, max_tokens: int,
                    eos_token_ids=(), batch_size: int = 16, progress: bool = True,
                    desc: str = "target continuations", parts_dir: str | Path | None = None,
                    save_every_s: float = 300.0) -> dict[str, torch.Tensor]:
    """Greedy continuations of `prompts` until `max_tokens` generated tokens in all; each stops
    at `max_new_tokens` or an EOS id. `batch_size` prompts decode together, and a prompt that
    finishes is replaced by the next one in the following pass (its prefill rides along with
    the others' decode rows), so passes stay full instead of draining to the longest
    continuation. The result lists the sequences in prompt order. `parts_dir`: see the module
    docstring."""
    from tqdm import tqdm

    worker = TorchWorker(model, linear_layout=MANY_ROWS)  # passes of a batch's rows: one layout
    eos = frozenset(eos_token_ids)
    parts = Path(parts_dir) if parts_dir is not None else None
    finished: dict[int, _Continuation] = load_parts(parts) if parts is not None else {}
    unsaved: list[int] = []
    saved_at = time.monotonic()
    pending = iter((i, p) for i, p in enumerate(prompts) if i not in finished)
    live: dict[int, _Continuation] = {}
    generated = sum(len(c.outputs) for c in finished.values())
    bar = tqdm(total=max_tokens, initial=min(generated, max_tokens), unit="tok", unit_scale=True, desc=desc,
               disable=not progress, dynamic_ncols=True)
    try:
        with bar:
            while generated < max_tokens:
                while len(live) < batch_size and (nxt := next(pending, None)) is not None:
                    index, prompt = nxt
                    live[index] = _Continuation(f"gen-{index}", list(prompt))
                if not live:
                    break
                rows = worker.run([ForwardItem(c.request_id, c.sequence) for c in live.values()])
                for (index, seq), r in zip(list(live.items()), rows):
                    # a copy of the row: a view would keep the whole pass's hidden states alive
                    token = seq.append(r.argmax()[0], r.hidden[0].cpu().clone())
                    generated += 1
                    if token in eos or len(seq.outputs) >= max_new_tokens:
                        finished[index] = live.pop(index)
                        unsaved.append(index)
                        worker.release(seq.request_id)
                    if generated >= max_tokens:
                        break
                bar.update(min(len(rows), bar.total - bar.n))
                if parts is not None and unsaved and time.monotonic() - saved_at >= save_every_s:
                    save_part(parts, {i: finished[i] for i in unsaved})
                    unsaved, saved_at = [], time.monotonic()
    finally:
        for seq in live.values():
            worker.release(seq.request_id)
    finished.update(live)  # continuations the budget cut short
    kept_index = [i for i in sorted(finished) if len(finished[i].outputs) >= 2]
    kept = [finished[i] for i in kept_index]
    offsets = torch.tensor([0] + [len(c.outputs) for c in kept]).cumsum(0)
    width = model.config.hidden_size
    dtype = next(model.parameters()).dtype
    return {"hidden": torch.stack([h for c in kept for h in c.hidden]) if kept else torch.zeros(0, width, dtype=dtype),
            "greedy": torch.tensor([t for c in kept for t in c.outputs], dtype=torch.long),
            "tokens": torch.tensor([t for c in kept for t in c.inputs], dtype=torch.long),
            "offsets": offsets,
            "prompt_index": torch.tensor(kept_index, dtype=torch.long)}


def continuation_text(tokenizer, states: dict[str, torch.Tensor], sequence: int) -> str:
    """What the target wrote in one sequence of `generate_states`' result, as text (its end of
    text and other special tokens left out)."""
    start, end = states["offsets"][sequence:sequence + 2].tolist()
    return answer_text(tokenizer, states["greedy"][start:end].tolist())


def concat_states(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Two `generate_states` results as one: `second`'s sequences after `first`'s."""
    return {"hidden": torch.cat([first["hidden"], second["hidden"]]),
            "greedy": torch.cat([first["greedy"], second["greedy"]]),
            "tokens": torch.cat([first["tokens"], second["tokens"]]),
            "offsets": torch.cat([first["offsets"], second["offsets"][1:] + first["offsets"][-1]]),
            "prompt_index": torch.cat([first["prompt_index"], second["prompt_index"]])}


def save_part(parts_dir: Path, continuations: dict[int, "_Continuation"]) -> Path:
    """A new part file in `parts_dir` with these finished continuations (by prompt index)."""
    from safetensors.torch import save_file

    parts_dir.mkdir(parents=True, exist_ok=True)
    number = 1 + max((int(p.stem.split("-")[1]) for p in parts_dir.glob("part-*.safetensors")), default=-1)
    path = parts_dir / f"part-{number:05d}.safetensors"
    items = sorted(continuations.items())
    tensors = {"index": torch.tensor([i for i, _ in items], dtype=torch.long),
               "lengths": torch.tensor([len(c.outputs) for _, c in items], dtype=torch.long),
               "inputs": torch.tensor([t for _, c in items for t in c.inputs], dtype=torch.long),
               "outputs": torch.tensor([t for _, c in items for t in c.outputs], dtype=torch.long),
               "hidden": torch.stack([h for _, c in items for h in c.hidden])}
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)  # a part is complete or absent
    return path


def load_parts(parts_dir: Path) -> dict[int, "_Continuation"]:
    """The finished continuations saved in `parts_dir` by earlier runs, by prompt index."""
    from safetensors.torch import load_file

    finished = {}
    for path in sorted(parts_dir.glob("part-*.safetensors")):
        part = load_file(str(path))
        start = 0
        for index, length in zip(part["index"].tolist(), part["lengths"].tolist()):
            end = start + length
            finished[index] = _Continuation(f"gen-{index}", [], part["inputs"][start:end].tolist(),
                                            part["outputs"][start:end].tolist(), list(part["hidden"][start:end]))
            start = end
    return finished


@dataclass
class _Continuation:
    """One prompt being continued: per decode step its input, output and hidden state."""

    request_id: str
    sequence: list[int]
    inputs: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)

    def append(self, token: int, hidden: torch.Tensor) -> int:
        self.inputs.append(self.sequence[-1])
        self.outputs.append(token)
        self.hidden.append(hidden)
        self.sequence.append(token)
        return token
