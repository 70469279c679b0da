"""Sampling settings at the edge of float32, found by the HTTP fuzzer (HTTP 500s): a top_p or a
temperature so small that float32 rounds it to 0."""

import torch

from specserve.protocol import SamplingParams
from specserve.sampling import target_probs

LOGITS = torch.tensor([[2.0, 1.0, 0.5, -1.0]])


def test_a_top_p_that_underflows_float32_keeps_the_top_token():
    for top_p in (5e-324, 1e-323, 1e-30):
        probs = target_probs(LOGITS, SamplingParams(temperature=1.0, top_p=top_p))
        assert torch.equal(probs, torch.tensor([[1.0, 0.0, 0.0, 0.0]])), top_p


def test_a_vanishing_temperature_is_greedy():
    for temperature in (5e-324, 1e-30, 9e-6):
        params = SamplingParams(temperature=temperature)
        assert params.greedy
        assert torch.equal(target_probs(LOGITS, params), torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    assert not SamplingParams(temperature=1e-5).greedy
    probs = target_probs(LOGITS, SamplingParams(temperature=1e-5))
    assert not probs.isnan().any() and abs(float(probs.sum()) - 1) < 1e-6
