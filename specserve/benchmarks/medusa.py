"""`python -m specserve.benchmarks.medusa` is `specserve bench --preset medusa`:
make bench-medusa: Medusa heads against target-only and the draft model.

    python -m specserve.benchmarks.medusa [specserve bench flags]     # the same as:
    specserve bench --preset medusa [flags]

Kept so older commands work; the measurement is `specserve bench`'s (specserve/benchmarks/suite.py).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from specserve.benchmarks.suite import main as bench

    return bench(["--preset", "medusa", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
