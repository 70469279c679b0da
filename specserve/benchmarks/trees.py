"""`python -m specserve.benchmarks.trees` is `specserve bench --preset trees`:
draft chains against draft trees, and a static tree from their acceptance.

    python -m specserve.benchmarks.trees [specserve bench flags]     # the same as:
    specserve bench --preset trees [flags]

Kept so older commands work; the measurement is `specserve bench`'s (specserve/benchmarks/suite.py).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from specserve.benchmarks.suite import main as bench

    return bench(["--preset", "trees", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
