"""Greedy tokens through an int8 output layer, proven equal to the float32 argmax.

A greedy row needs only the argmax of its logits, yet a float32 target's output layer reads all
V x hidden float32 weights for it (0.93 GB for Qwen2.5-Coder-1.5B: 15% of a CPU decode step's
bytes). The screen computes every logit with the int8 weights and 7-bit activations of PyTorch's
dynamic int8 linear (a quarter of the bytes) and bounds each logit's error:

    |w_j.h - w^_j.h^| <= ||w_j - w^_j|| ||h|| + ||w^_j|| ||h - h^||        (Cauchy-Schwarz)

w^_j: row j's int8 weights, dequantized (known at load); h^: the activations as the kernel
quantizes them (one scale and zero point for the whole input, reproduced by `quantized_input`;
an element that could round either way counts a whole step). The bound also covers the
rounding of a float32 dot product (gamma_d ||w_j|| ||h||) and of the kernel's own float epilogue.
Every token whose upper bound reaches the best lower bound is a candidate; only the candidates'
logits are computed in float32 from the original weights, and the argmax is taken among them
(the lowest id on a tie, as torch.argmax). Every other token's logit is provably below the best
candidate's, so the token is the float32 argmax, whatever the int8 kernel rounded.

On the Qwen2.5-Coder pair's real hidden states a row had 2-50 candidates. A row whose bound is
loose (the first position of a text, whose activations are huge) has too many; it takes the
full float32 row instead (`max_candidates`).
"""

from __future__ import annotations

import warnings

import torch

from specserve.engine.kernel_rows import run_padded

QMAX = 127  # reduce_range: 7-bit activations (AVX2's 16-bit pairwise sums cannot saturate)
ROUNDING_SLACK = 1e-3  # an element this close to a rounding boundary may round either way in the kernel
RELATIVE_SLACK = 1e-5  # the kernel's float epilogue (int32 -> float, scales) and our own sums
DEFAULT_MAX_CANDIDATES = 4096


def quantize_rows(weight: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 per output row (one scale per row): what Int8Linear packs."""
    weight = weight.float()
    scales = (weight.abs().amax(dim=1) / 127).clamp_min(1e-12)
    zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # quantized tensors are deprecated; their kernels are what we use
        warnings.simplefilter("ignore")
        return torch.quantize_per_channel(weight, scales.double(), zero_points, 0, torch.qint8)


def prepack(qweight: torch.Tensor, bias: torch.Tensor | None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ops.quantized.linear_prepack(qweight, None if bias is None else bias.float())


def linear_dynamic(x: torch.Tensor, packed) -> torch.Tensor:
    """x [n, in] float32 through a prepacked int8 weight, activations quantized to 7 bits. Many
    rows run padded with zero rows (kernel_rows), which leaves the quantization unchanged: its
    range always holds 0."""
    return run_padded(lambda rows: torch.ops.quantized.linear_dynamic(rows, packed, True), x)


def quantized_input(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The dynamic int8 linear's view of its input x [n, in]: (x^, per-element error bound).

    One scale and zero point for the whole tensor, from its range widened to hold 0 (fbgemm's
    ChooseQuantizationParams with reduce_range), then q = clamp(round(zp + x / scale), 0, 127).
    Where the kernel's float arithmetic could round an element the other way (within
    ROUNDING_SLACK of a half step), that element's bound is a whole step; an ambiguous zero
    point makes every element's bound a whole step.
    """
    lo = min(float(x.min()), 0.0)
    hi = max(float(x.max()), 0.0)
    scale = (hi - lo) / QMAX
    if scale == 0.0:  # an all-zero input: the kernel's scale is then 0.1, and every x^ is exact
        return x.clone(), torch.zeros_like(x)
    exact_zero_point = -lo / scale
    zero_point = round(exact_zero_point)
    t = zero_point + x * (1.0 / scale)
    q = t.round().clamp_(0, QMAX)
    approx = (q - zero_point) * scale
    error = (x - approx).abs()
    step = torch.full_like(x, scale)
    ambiguous = (t - t.floor() - 0.5).abs() < ROUNDING_SLACK
    if abs(exact_zero_point - int(exact_zero_point) - 0.5) < ROUNDING_SLACK:
        ambiguous = torch.ones_like(ambiguous)
    # a rounding the other way moves x^ by one step (and a clamped element stays within a step)
    return approx, torch.where(ambiguous, error + step, error)


class GreedyScreen:
    """The output layer's int8 screen; `argmax(hidden)` gives the float32 argmax of each row of
    `hidden @ weight.T + bias` (see the module docstring)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 max_candidates: int = DEFAULT_MAX_CANDIDATES):
        self.weight = weight  # [V, hidden] float32: candidates' exact logits (a view; no copy)
        self.bias = bias
        self.max_candidates = max_candidates
        qweight = quantize_rows(weight)
        self.packed = prepack(qweight, bias)
        dequantized = qweight.dequantize()
        norms = weight.float().norm(dim=1)
        d = weight.shape[1]
        gamma = d * 2.0 ** -24 / (1 - d * 2.0 ** -24)  # rounding of a float32 dot product of length d
        self.per_hidden_norm = (weight.float() - dequantized).norm(dim=1) + gamma * norms  # x ||h||
        self.per_input_error = dequantized.norm(dim=1)  # x ||h - h^||
        self.fallbacks = 0  # rows that took the full float32 row (too many candidates)

    def bounds(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 logits [n, V], their error bounds [n, V])."""
        approx = linear_dynamic(hidden.float(), self.packed)
        _, element_error = quantized_input(hidden.float())
        input_error = element_error.norm(dim=1)
        bound = (hidden.float().norm(dim=1, keepdim=True) * self.per_hidden_norm
                 + input_error[:, None] * self.per_input_error
                 + RELATIVE_SLACK * (approx.abs() + 1.0))
        return approx, bound

    def candidates(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        """Per row, the ids whose logit may be the largest (ascending)."""
        approx, bound = self.bounds(hidden)
        best_lower = (approx - bound).amax(dim=1, keepdim=True)
        reach = approx + bound >= best_lower
        return [row.nonzero().flatten() for row in reach]

    def argmax(self, hidden: torch.Tensor, full_rows=None) -> list[int]:
        """The float32 argmax of each row's logits. `full_rows(rows)` gives full float32 logits
        of those rows (default: hidden @ weight.T) for rows with too many candidates."""
        tokens: list[int | None] = []
        loose: list[int] = []
        for r, ids in enumerate(self.candidates(hidden)):
            if len(ids) > self.max_candidates:
                tokens.append(None)
                loose.append(r)
                continue
            logits = self.weight.index_select(0, ids).float() @ hidden[r].float()
            if self.bias is not None:
                logits += self.bias.float()[ids]
            tokens.append(int(ids[int(logits.argmax())]))
        if loose:
            self.fallbacks += len(loose)
            index = torch.tensor(loose)
            full = full_rows(index) if full_rows is not None else self._full(hidden.index_select(0, index))
            for r, token in zip(loose, full.argmax(-1).tolist()):
                tokens[r] = token
        return tokens

    def _full(self, hidden: torch.Tensor) -> torch.Tensor:
        out = hidden.float() @ self.weight.float().T
        return out if self.bias is None else out + self.bias.float()
