"""The int8 greedy screen of the output layer: its token is the float32 argmax, always."""

import pytest
import torch

from conftest import tiny_model
from specserve.engine import greedy_screen as gs
from specserve.engine.torch_worker import ForwardItem, TorchWorker, can_quantize
from specserve.protocol import SpecserveError, TokenTree

pytestmark = pytest.mark.skipif(not can_quantize(torch.device("cpu")), reason="needs PyTorch's x86 int8 kernels")


def test_the_reproduced_input_quantization_is_the_kernels():
    """The bound rests on knowing h^: the kernel's output must be h^ @ w^.T (its float
    epilogue aside), for single rows, batches, outliers and inputs of one sign."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 64, generator=gen) * 0.05
    qweight = gs.quantize_rows(weight)
    packed = gs.prepack(qweight, None)
    cases = [torch.randn(1, 64, generator=gen), torch.randn(5, 64, generator=gen) * 3,
             torch.randn(3, 64, generator=gen).abs(), -torch.randn(2, 64, generator=gen).abs(),
             torch.cat([torch.randn(1, 64, generator=gen), torch.full((1, 64), 0.01)]),
             torch.randn(4, 64, generator=gen) * torch.tensor([100.0] + [1.0] * 63)]
    for x in cases:
        approx, error = gs.quantized_input(x)
        assert bool(((x - approx).abs() <= error + 1e-6).all())
        expected = approx @ qweight.dequantize().T
        got = gs.linear_dynamic(x, packed)
        assert torch.allclose(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max())), x.shape


def full_argmax(weight, hidden, bias=None):
    logits = hidden @ weight.T
    return (logits if bias is None else logits + bias).argmax(-1).tolist()


@pytest.mark.parametrize("seed", range(4))
def test_the_screened_token_is_the_float32_argmax(seed):
    gen = torch.Generator().manual_seed(seed)
    vocab, d = 2000, 96
    weight = torch.randn(vocab, d, generator=gen) * 0.04
    # near ties the int8 logits cannot tell apart: rows that differ in the last bits
    weight[7] = weight[3] + 1e-5 * torch.randn(d, generator=gen)
    weight[1500] = weight[3] * (1 + 1e-6)
    bias = torch.randn(vocab, generator=gen) * 0.1
    screen = gs.GreedyScreen(weight, bias)
    hidden = torch.randn(40, d, generator=gen) * 8
    hidden[:10] = weight[3] * 400 + torch.randn(10, d, generator=gen) * 0.01  # rows aimed at the near ties
    hidden[10, 0] = 500.0  # a huge activation: a loose bound for the whole batch
    assert screen.argmax(hidden) == full_argmax(weight, hidden, bias)


def test_rows_with_too_many_candidates_take_the_full_row():
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(500, 32, generator=gen) * 0.05
    screen = gs.GreedyScreen(weight, max_candidates=1)
    hidden = torch.randn(6, 32, generator=gen)
    hidden[0] = 0.0  # every logit 0: every token is a candidate, the argmax is token 0
    hidden[1, 0] = 1e4
    assert screen.argmax(hidden) == full_argmax(weight, hidden)
    assert screen.fallbacks >= 1


def test_a_screened_worker_gives_the_unscreened_workers_tokens_and_logits():
    model = tiny_model(seed=3, vocab_size=97)
    screened, plain = TorchWorker(model, greedy_screen=True), TorchWorker(model, greedy_screen=False)
    assert screened.greedy_screen is not None and plain.greedy_screen is None
    items = [ForwardItem("a", [1, 5, 9, 2, 7], TokenTree.chain([4, 4, 8])), ForwardItem("b", [3, 3], TokenTree((5, 6), (-1, -1)))]
    for _ in range(2):  # a second pass over cached prefixes
        got, want = screened.run(items), plain.run(items)
        assert [r.argmax() for r in got] == [r.logits.argmax(-1).tolist() for r in want]
        assert all(torch.equal(g.logits, w.logits) for g, w in zip(got, want))
        items = [ForwardItem(i.request_id, i.token_ids + [11]) for i in items]


def test_the_screen_is_on_by_default_only_where_it_pays():
    model = tiny_model(seed=3, vocab_size=97)
    assert TorchWorker(model).greedy_screen is not None  # float32 on CPU
    assert TorchWorker(model, quantize="int8").greedy_screen is None  # a draft: its logits are probabilities
    assert TorchWorker(tiny_model(seed=3, vocab_size=97).to(torch.bfloat16)).greedy_screen is None
    with pytest.raises(SpecserveError, match="float32"):
        TorchWorker(tiny_model(seed=3, vocab_size=97).to(torch.bfloat16), greedy_screen=True)
    with pytest.raises(SpecserveError, match="float32"):
        TorchWorker(model, quantize="int8", greedy_screen=True)
