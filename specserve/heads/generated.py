"""Self-distillation data: the target's own greedy continuations, with its hidden states.

Heads serve on what the target writes, not on human text: trained on the standard library and
HumanEval solutions alone, head 0 of the default target guessed the target's own next-next token
46% of the time on held-out prompts against 53% on held-out human text, and heads 1-3 fell
further behind (0.18/0.08/0.09 against 0.31/0.20/0.14). So the trainer also lets the target
continue prompts of its own (never the benchmarks' held-out ones), greedily, in batches on the
torch engine, and keeps the last hidden state of every decode step: the row that produced each
generated token is exactly what serving hands the heads, so no second pass over the text is
needed.

The result has `compute_hidden_states`' format, one sequence per prompt that produced at least
two tokens: `tokens` are the inputs of the decode steps (the prompt's last token, then every
generated token but the last), `greedy` what each step produced (the next input), `hidden` the
step's hidden state.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.engine.torch_worker import ForwardItem, TorchWorker


@torch.inference_mode()
def generate_states(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, max_tokens: int,
                    eos_token_ids=(), batch_size: int = 8, progress: bool = True,
                    desc: str = "target continuations") -> dict[str, torch.Tensor]:
    """Greedy continuations of `prompts` (in order, `batch_size` at a time) until `max_tokens`
    generated tokens in all; each stops at `max_new_tokens` or an EOS id."""
    from tqdm import tqdm

    worker = TorchWorker(model)
    eos = frozenset(eos_token_ids)
    hidden, greedy, tokens, lengths = [], [], [], []
    bar = tqdm(total=max_tokens, unit="tok", unit_scale=True, desc=desc, disable=not progress, dynamic_ncols=True)
    left = max_tokens
    with bar:
        for start in range(0, len(prompts), batch_size):
            if left <= 0:
                break
            batch = [list(p) for p in prompts[start:start + batch_size]]
            states = _continue_batch(worker, batch, start, max_new_tokens, left, eos, bar)
            for seq_tokens, seq_greedy, seq_hidden in states:
                seq_tokens, seq_greedy, seq_hidden = (x[:left] for x in (seq_tokens, seq_greedy, seq_hidden))
                left -= len(seq_greedy)
                if len(seq_greedy) >= 2:
                    tokens += seq_tokens
                    greedy += seq_greedy
                    hidden += seq_hidden
                    lengths.append(len(seq_greedy))
    offsets = torch.tensor([0] + lengths).cumsum(0)
    width = model.config.hidden_size
    return {"hidden": torch.stack(hidden) if hidden else torch.zeros(0, width, dtype=next(model.parameters()).dtype),
            "greedy": torch.tensor(greedy, dtype=torch.long), "tokens": torch.tensor(tokens, dtype=torch.long),
            "offsets": offsets}


def _continue_batch(worker: TorchWorker, prompts: list[list[int]], first_id: int, max_new_tokens: int,
                    budget: int, eos: frozenset[int], bar) -> list[tuple[list[int], list[int], list[torch.Tensor]]]:
    """Decode every prompt of the batch together, until each has `max_new_tokens` or an EOS,
    or the batch has `budget` tokens in all; per prompt (inputs, outputs, hidden rows)."""
    ids = [f"gen-{first_id + i}" for i in range(len(prompts))]
    sequences = [list(p) for p in prompts]
    out: list[tuple[list[int], list[int], list[torch.Tensor]]] = [([], [], []) for _ in prompts]
    live = list(range(len(prompts)))
    try:
        generated = 0
        for _ in range(max_new_tokens):
            if not live or generated >= budget:
                break
            rows = worker.run([ForwardItem(ids[i], sequences[i]) for i in live])
            still = []
            for i, r in zip(live, rows):
                token = int(r.logits[0].argmax())
                inputs, outputs, states = out[i]
                inputs.append(sequences[i][-1])
                outputs.append(token)
                states.append(r.hidden[0].cpu())
                sequences[i].append(token)
                bar.update(1)
                generated += 1
                if token not in eos:
                    still.append(i)
            live = still
    finally:
        for rid in ids:
            worker.release(rid)
    return out
