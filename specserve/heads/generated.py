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
step's hidden state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specserve.engine.torch_worker import ForwardItem, TorchWorker


@torch.inference_mode()
def generate_states(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, max_tokens: int,
                    eos_token_ids=(), batch_size: int = 16, progress: bool = True,
                    desc: str = "target continuations") -> dict[str, torch.Tensor]:
    """Greedy continuations of `prompts` until `max_tokens` generated tokens in all; each stops
    at `max_new_tokens` or an EOS id. `batch_size` prompts decode together, and a prompt that
    finishes is replaced by the next one in the following pass (its prefill rides along with
    the others' decode rows), so passes stay full instead of draining to the longest
    continuation. The result lists the sequences in prompt order."""
    from tqdm import tqdm

    worker = TorchWorker(model)
    eos = frozenset(eos_token_ids)
    pending = iter(enumerate(prompts))
    live: dict[int, _Continuation] = {}
    finished: dict[int, _Continuation] = {}
    generated = 0
    bar = tqdm(total=max_tokens, unit="tok", unit_scale=True, desc=desc, disable=not progress, dynamic_ncols=True)
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
                    token = seq.append(int(r.logits[0].argmax()), r.hidden[0].cpu().clone())
                    generated += 1
                    if token in eos or len(seq.outputs) >= max_new_tokens:
                        finished[index] = live.pop(index)
                        worker.release(seq.request_id)
                    if generated >= max_tokens:
                        break
                bar.update(min(len(rows), bar.total - bar.n))
    finally:
        for seq in live.values():
            worker.release(seq.request_id)
    finished.update(live)  # continuations the budget cut short
    kept = [finished[i] for i in sorted(finished) if len(finished[i].outputs) >= 2]
    offsets = torch.tensor([0] + [len(c.outputs) for c in kept]).cumsum(0)
    width = model.config.hidden_size
    dtype = next(model.parameters()).dtype
    return {"hidden": torch.stack([h for c in kept for h in c.hidden]) if kept else torch.zeros(0, width, dtype=dtype),
            "greedy": torch.tensor([t for c in kept for t in c.outputs], dtype=torch.long),
            "tokens": torch.tensor([t for c in kept for t in c.inputs], dtype=torch.long),
            "offsets": offsets}


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
