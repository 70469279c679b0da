"""Pure sampling and acceptance functions."""

import pytest
import torch

from conftest import empirical_pairs
from specserve.protocol import SamplingParams, SparseDist, SpecserveError
from specserve.sampling import (
    accept_greedy, accept_rejection, densify, generator_for, target_probs, truncate_top_m,
)


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def test_greedy_probs_are_one_hot_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0], [5.0, 4.0, 0.0]])
    probs = target_probs(logits, SamplingParams())
    assert probs.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def test_temperature_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    same = target_probs(logits, SamplingParams(temperature=1.0))
    assert torch.allclose(same, torch.tensor([[0.5, 0.3, 0.15, 0.05]]), atol=1e-6)
    top2 = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(top2, torch.tensor([[0.625, 0.375, 0.0, 0.0]]), atol=1e-6)
    # top_p = 0.8: 0.5 + 0.3 reaches it, so only the first two survive
    nucleus = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.allclose(nucleus, torch.tensor([[0.625, 0.375, 0.0, 0.0]]), atol=1e-6)
    # top_p smaller than the top token keeps the top token alone
    assert target_probs(logits, SamplingParams(temperature=1.0, top_p=0.1))[0, 0] == 1.0
    hot = target_probs(logits, SamplingParams(temperature=0.5))
    assert hot[0, 0] > same[0, 0]


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_p=0.0),
                                 dict(top_p=1.5), dict(top_k=-1), dict(max_tokens=0), dict(stop=("",))])
def test_bad_sampling_params_are_refused(bad):
    with pytest.raises(SpecserveError):
        SamplingParams(**bad)


def test_accept_greedy_prefix_then_target_token():
    logits = torch.eye(5)[[1, 2, 3, 4]] * 10  # argmax 1, 2, 3, 4
    assert accept_greedy([1, 2, 3], logits) == [1, 2, 3, 4]  # all accepted + bonus
    assert accept_greedy([1, 0, 3], logits) == [1, 2]  # rejected at position 1
    assert accept_greedy([], logits[:1]) == [1]


def test_truncate_and_densify_roundtrip():
    probs = torch.tensor([[0.1, 0.6, 0.3]])
    ids, p = truncate_top_m(probs, 2)
    assert ids.tolist() == [[1, 2]] and torch.allclose(p, torch.tensor([[2 / 3, 1 / 3]]))
    dense = densify(SparseDist(ids.numpy(), p.numpy()), 3)
    assert torch.allclose(dense, torch.tensor([[0.0, 2 / 3, 1 / 3]]))


def _first_token_histogram(p, q, draws, seed):
    """Draft one token from q, verify against p; histogram of the first emitted token."""
    gen = generator_for(seed)
    counts = torch.zeros(p.shape[-1])
    for _ in range(draws):
        x = int(torch.multinomial(q[0], 1, generator=gen))
        out = accept_rejection([x], q, p, gen)
        counts[out[0]] += 1
    return counts / draws


def test_rejection_sampling_emits_the_target_distribution():
    """The first emitted token follows p[0] whatever q is; the error shrinks with samples and
    stays far below the distance of p from random distributions."""
    torch.manual_seed(0)
    vocab = 6
    p = torch.softmax(torch.randn(2, vocab) * 1.5, -1)
    q = torch.softmax(torch.randn(1, vocab) * 1.5, -1)
    errors = [tv(_first_token_histogram(p, q, n, seed=n), p[0]) for n in (200, 2000, 20000)]
    assert errors[2] < errors[0] and errors[2] < 0.02
    random_refs = [tv(torch.softmax(torch.randn(vocab) * 1.5, -1), p[0]) for _ in range(20)]
    assert errors[2] < min(random_refs) / 3
    # the draft alone is measurably different, so this test could fail
    assert tv(q[0], p[0]) > 0.1


def test_identical_draft_is_always_accepted():
    torch.manual_seed(1)
    p = torch.softmax(torch.randn(4, 10), -1)
    gen = generator_for(3)
    for _ in range(200):
        drafts = [int(torch.multinomial(p[i], 1, generator=gen)) for i in range(3)]
        out = accept_rejection(drafts, p[:3], p, gen)
        assert out[:3] == drafts and len(out) == 4


def test_same_seed_same_tokens():
    torch.manual_seed(2)
    p = torch.softmax(torch.randn(5, 50), -1)
    q = torch.softmax(torch.randn(4, 50), -1)
    runs = [accept_rejection([1, 2, 3, 4], q, p, generator_for(42)) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]


def test_greedy_tree_acceptance_follows_the_target_argmax_down_the_tree():
    from specserve.protocol import TokenTree
    from specserve.sampling import accept_greedy_tree

    tree = TokenTree((5, 6, 7, 8), (-1, -1, 1, 1))  # root -> 5 | root -> 6 -> {7, 8}
    onehot = lambda ids: torch.nn.functional.one_hot(torch.tensor(ids), 10).float()  # noqa: E731
    # rows: root, after 5, after 6, after 7, after 8
    assert accept_greedy_tree(tree, onehot([6, 0, 8, 0, 3])) == [6, 8, 3]  # down to a leaf + bonus
    assert accept_greedy_tree(tree, onehot([6, 0, 9, 0, 0])) == [6, 9]  # no child matches: recovered
    assert accept_greedy_tree(tree, onehot([4, 0, 0, 0, 0])) == [4]  # nothing accepted
    assert accept_greedy_tree(TokenTree(), onehot([2])) == [2]


def test_greedy_tree_acceptance_on_a_chain_equals_chain_acceptance():
    from specserve.protocol import TokenTree
    from specserve.sampling import accept_greedy_tree

    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        k = int(torch.randint(0, 5, (), generator=gen))
        logits = torch.randn(k + 1, 4, generator=gen)
        draft = torch.randint(0, 4, (k,), generator=gen).tolist()
        assert accept_greedy_tree(TokenTree.chain(draft), logits) == accept_greedy(draft, logits)


# ---- multi-draft (tree) rejection sampling -------------------------------------------------

def _tree_round(p_root, p_next, q_root, q_next, gen, siblings=(3, 2)):
    """Draw a 2-level tree without replacement from the draft (3 children at the root, 2 under
    each), verify it against the target, return the first two emitted tokens."""
    from specserve.protocol import TokenTree
    from specserve.sampling import accept_rejection_tree

    tokens, parents, q_rows, p_rows = [], [], [], [p_root]
    for x in torch.multinomial(q_root, siblings[0], replacement=False, generator=gen).tolist():
        tokens.append(x), parents.append(-1), q_rows.append(q_root), p_rows.append(p_next[x])
    for parent in range(siblings[0]):
        x1 = tokens[parent]
        for x in torch.multinomial(q_next[x1], siblings[1], replacement=False, generator=gen).tolist():
            tokens.append(x), parents.append(parent), q_rows.append(q_next[x1])
            p_rows.append(torch.full_like(p_root, 1 / len(p_root)))  # after depth 2: unused here
    out = accept_rejection_tree(TokenTree(tuple(tokens), tuple(parents)), torch.stack(q_rows),
                                torch.stack(p_rows), gen)
    if len(out) == 1:  # all rejected at the root: the second token comes from the next round
        out.append(int(torch.multinomial(p_next[out[0]], 1, generator=gen)))
    return out[:2]


def test_tree_rejection_sampling_emits_the_target_distribution():
    """Several siblings per node, drawn without replacement: the first two emitted tokens
    follow the target's joint distribution, with an error that shrinks with samples."""
    torch.manual_seed(4)
    vocab = 5
    p_root = torch.softmax(torch.randn(vocab) * 1.5, -1)
    p_next = torch.softmax(torch.randn(vocab, vocab) * 1.5, -1)
    q_root = torch.softmax(torch.randn(vocab) * 1.5, -1)
    q_next = torch.softmax(torch.randn(vocab, vocab) * 1.5, -1)
    exact = (p_root[:, None] * p_next).flatten()
    assert tv((q_root[:, None] * q_next).flatten(), exact) > 0.2  # the draft is far off

    def draw(gen):
        return _tree_round(p_root, p_next, q_root, q_next, gen)

    errors = [tv(empirical_pairs(draw, vocab, n, seed=n), exact) for n in (300, 12000)]
    assert errors[1] < errors[0] and errors[1] < 0.03
    random_refs = [tv(torch.softmax(torch.randn(vocab * vocab) * 1.5, -1), exact) for _ in range(20)]
    assert errors[1] < min(random_refs) / 4


def test_tree_rejection_with_an_identical_draft_accepts_the_first_child():
    from specserve.protocol import TokenTree
    from specserve.sampling import accept_rejection_tree

    torch.manual_seed(5)
    p = torch.softmax(torch.randn(3, 12), -1)
    gen = generator_for(0)
    for _ in range(200):
        first, second = torch.multinomial(p[0], 2, replacement=False, generator=gen).tolist()
        tree = TokenTree((first, second), (-1, -1))
        out = accept_rejection_tree(tree, p[[0, 0]], p, gen)
        assert out[0] == first and len(out) == 2


def test_a_rejected_sibling_cannot_be_emitted_as_the_recovered_token():
    from specserve.protocol import TokenTree
    from specserve.sampling import accept_rejection_tree

    p = torch.tensor([0.0, 0.0, 1.0])  # the target always says 2
    q = torch.tensor([0.5, 0.5, 0.0])
    tree = TokenTree((0, 1), (-1, -1))
    for seed in range(20):
        assert accept_rejection_tree(tree, torch.stack([q, q]), torch.stack([p, p, p]), generator_for(seed))[0] == 2
