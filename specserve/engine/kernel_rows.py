"""Row counts for oneDNN's CPU kernels: a pass of many rows runs padded to one of a few sizes.

oneDNN keeps memory for every distinct input shape it has run, about 0.6 MB per weight shape and
row count (measured on torch 2.13's prepacked bf16 and float32 linears and its x86 int8 dynamic
linear), and never gives it back: a cap on its primitive cache (ONEDNN_PRIMITIVE_CACHE_CAPACITY)
bounds only part of it. A replica's pass sizes change with every prompt length and batch, so
without a bound its memory grows for as long as it serves: generating 120k tokens of training
continuations (each new prompt's prefill rides along with the others' decode rows, so prompt
lengths become row counts) grew the trainer to 24 GB. Passes of up to EXACT_ROWS rows (decode
steps, chain and tree verifies of a few requests) keep their size; larger ones are padded with
zero rows to 16 sizes per doubling, at most 1/16 more rows, so a replica sees at most 64 + 16 per
doubling shapes per weight (176 up to 8192 rows). Padding left float32 rows bitwise unchanged
(measured on a Xeon with AMX); in bfloat16 oneDNN's blocking already changes a row's rounding
with the pass's size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

EXACT_ROWS = 64
SIZES_PER_DOUBLING = 16


def kernel_rows(rows: int) -> int:
    """The row count a pass of `rows` rows runs at: itself up to EXACT_ROWS, else rounded up
    to a multiple of 1/16 of the largest power of two not above it: 16 sizes per doubling.

    >>> [kernel_rows(n) for n in (1, 64, 65, 127, 128, 129, 300, 1000)]
    [1, 64, 68, 128, 128, 136, 304, 1024]
    """
    if rows <= EXACT_ROWS:
        return rows
    step = (1 << (rows.bit_length() - 1)) // SIZES_PER_DOUBLING  # the power of two <= rows, / 16
    return -(-rows // step) * step


def run_padded(kernel: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """kernel(x) for a 2-D x, run on x padded with zero rows to kernel_rows(len(x))."""
    rows = x.shape[0]
    padded = kernel_rows(rows)
    if padded == rows:
        return kernel(x)
    return kernel(F.pad(x, (0, 0, 0, padded - rows)))[:rows]
