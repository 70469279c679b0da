"""`specserve bench`: specserve against its peers, side by side (see docs/BENCHMARKS.md)."""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    print("specserve bench: not built yet", file=sys.stderr)
    return 2
