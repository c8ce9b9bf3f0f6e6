import math

import pytest
import torch

from posttrain.core import pass_at_k


def test_pass_at_k_hand_values():
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert float(pass_at_k(5, 2, 2)) == pytest.approx(0.7)
    # n=10, c=3, k=4: 1 - C(7,4)/C(10,4) = 1 - 35/210
    assert float(pass_at_k(10, 3, 4)) == pytest.approx(1 - 35 / 210)


def test_pass_at_k_matches_binomial_formula():
    for n in range(1, 12):
        for c in range(n + 1):
            for k in range(1, n + 1):
                expected = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert float(pass_at_k(n, c, k)) == pytest.approx(expected, abs=1e-12), (n, c, k)


def test_pass_at_k_edge_cases():
    assert float(pass_at_k(8, 0, 4)) == 0.0  # nothing correct
    assert float(pass_at_k(8, 5, 4)) == 1.0  # n - c = 3 < k: every draw of 4 holds a correct one
    assert float(pass_at_k(8, 8, 8)) == 1.0
    for c in range(9):
        assert float(pass_at_k(8, c, 1)) == pytest.approx(c / 8)  # k = 1: the fraction correct


def test_pass_at_k_per_prompt_tensors():
    counts = torch.tensor([0, 1, 4, 8])
    out = pass_at_k(8, counts, 2)
    assert out.shape == (4,) and out.dtype == torch.float64
    expected = [1 - math.comb(8 - c, 2) / math.comb(8, 2) for c in counts.tolist()]
    assert out.tolist() == pytest.approx(expected)
    # per-prompt sample counts too
    mixed = pass_at_k(torch.tensor([4, 6]), torch.tensor([1, 1]), 2)
    assert mixed.tolist() == pytest.approx([1 - 3 / 6, 1 - 10 / 15])
    # non-decreasing in k
    values = [pass_at_k(8, counts, k) for k in range(1, 9)]
    for smaller, larger in zip(values, values[1:]):
        assert bool((larger >= smaller - 1e-12).all())
    assert pass_at_k(8, torch.tensor([], dtype=torch.long), 2).shape == (0,)


def test_pass_at_k_large_n_is_stable():
    # the binomials here overflow float64; the product does not
    value = float(pass_at_k(2000, 3, 500))
    assert value == pytest.approx(1 - (1500 * 1499 * 1498) / (2000 * 1999 * 1998), rel=1e-12)


def test_pass_at_k_monte_carlo():
    n, c, k, trials = 10, 3, 4, 40_000
    generator = torch.Generator().manual_seed(0)
    correct = torch.arange(n) < c  # which of the n samples are correct
    draws = torch.rand(trials, n, generator=generator).argsort(dim=1)[:, :k]  # k of n without replacement
    hit_rate = correct[draws].any(dim=1).double().mean().item()
    expected = float(pass_at_k(n, c, k))
    std_error = math.sqrt(expected * (1 - expected) / trials)
    assert abs(hit_rate - expected) < 4 * std_error


def test_pass_at_k_errors():
    with pytest.raises(ValueError, match="k=5 is larger than num_samples"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="k=3 is larger than num_samples"):
        pass_at_k(torch.tensor([4, 2]), torch.tensor([1, 1]), 3)
    with pytest.raises(ValueError, match="k must be an integer"):
        pass_at_k(4, 1, 0)
    with pytest.raises(ValueError, match="num_correct"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match="num_correct"):
        pass_at_k(4, -1, 1)
