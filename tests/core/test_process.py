import itertools
import math
from collections import Counter
from fractions import Fraction

import pytest
import torch

from posttrain.core import (
    STEP_AGGREGATES,
    STEP_REWARD_FORMS,
    aggregate_step_scores,
    best_of_n_expected_accuracy,
    majority_vote_expected_accuracy,
    monte_carlo_step_labels,
    process_step_rewards,
)

D = torch.float64
NAN = float("nan")
INF = float("inf")

# row 0: three steps; row 1: two steps (NaN in its padding); row 2: no step at all
SCORES = torch.tensor([[0.9, 0.6, 0.8], [0.5, 0.7, NAN], [NAN, NAN, NAN]], dtype=D)
VALID = torch.tensor([[True, True, True], [True, True, False], [False, False, False]])


def random_steps(B=16, K=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, K + 1, (B,), generator=g)
    valid = torch.arange(K) < lengths.unsqueeze(-1)
    scores = torch.where(valid, torch.rand(B, K, generator=g, dtype=D), torch.full((B, K), NAN, dtype=D))
    return scores, valid


# ---------------------------------------------------------------- step rewards


@pytest.mark.parametrize(
    "form, expected",
    [
        ("raw", [[0.9, 0.6, 0.8], [0.5, 0.7, 0.0], [0.0, 0.0, 0.0]]),
        # s_k - s_{k-1}, s_0 = 0
        ("marginal", [[0.9, -0.3, 0.2], [0.5, 0.2, 0.0], [0.0, 0.0, 0.0]]),
        # suffix minima m = [0.6, 0.6, 0.8] and [0.5, 0.7]; r_k = m_k - m_{k+1}, m_{K+1} = 0
        ("min", [[0.0, -0.2, 0.8], [-0.2, 0.7, 0.0], [0.0, 0.0, 0.0]]),
    ],
)
def test_step_reward_forms_hand_values(form, expected):
    rewards = process_step_rewards(SCORES, VALID, form)
    torch.testing.assert_close(rewards, torch.tensor(expected, dtype=D))


@pytest.mark.parametrize("form", sorted(STEP_REWARD_FORMS))
def test_step_rewards_padding_gets_no_gradient(form):
    scores = SCORES.clone().requires_grad_(True)
    rewards = process_step_rewards(scores, VALID, form)
    (rewards * torch.arange(1.0, 4.0, dtype=D)).sum().backward()
    assert torch.isfinite(scores.grad).all()
    assert (scores.grad[~VALID] == 0).all()
    assert scores.grad[VALID].abs().sum() > 0


def test_step_reward_returns_are_the_prm_returns():
    scores, valid = random_steps()
    clean = torch.where(valid, scores, torch.zeros_like(scores))
    lengths = valid.sum(-1)
    last = torch.stack([clean[b, n - 1] if n else clean.new_zeros(()) for b, n in enumerate(lengths)])
    mins = torch.where(valid, scores, torch.full_like(scores, INF)).amin(-1)
    mins = torch.where(lengths > 0, mins, torch.zeros_like(mins))
    expected = {"marginal": last, "raw": clean.sum(-1), "min": mins}
    for form, total in expected.items():
        rewards = process_step_rewards(scores, valid, form)
        assert (rewards[~valid] == 0).all()
        torch.testing.assert_close(rewards.sum(-1), total)
        # return-to-go of the min form is the PURE value min_{j>=t} s_j at every step
        if form == "min":
            to_go = rewards.flip(-1).cumsum(-1).flip(-1)
            for b in range(scores.shape[0]):
                for t in range(int(lengths[b])):
                    assert to_go[b, t].item() == pytest.approx(scores[b, t : lengths[b]].min().item())


def test_step_rewards_bad_input():
    with pytest.raises(ValueError, match="marginal, min, raw"):
        process_step_rewards(SCORES, VALID, "sum")
    with pytest.raises(ValueError, match="left-aligned"):
        process_step_rewards(SCORES, torch.tensor([[False, True, True]] * 3), "raw")
    bad = SCORES.clone()
    bad[0, 1] = NAN
    with pytest.raises(ValueError, match="scores"):
        process_step_rewards(bad, VALID, "raw")


# ---------------------------------------------------------------- aggregates


def test_aggregate_step_scores_hand_values():
    expected = {
        "last": [0.8, 0.7],
        "min": [0.6, 0.5],
        "product": [0.9 * 0.6 * 0.8, 0.5 * 0.7],
        "mean": [(0.9 + 0.6 + 0.8) / 3, 0.6],
    }
    assert set(expected) == set(STEP_AGGREGATES)
    for how, values in expected.items():
        out = aggregate_step_scores(SCORES, VALID, how)
        torch.testing.assert_close(out, torch.tensor(values + [0.0], dtype=D))  # empty row: 0
        ranked = aggregate_step_scores(SCORES, VALID, how, empty=-INF)
        assert ranked[2].item() == -INF and not ranked.isnan().any()


@pytest.mark.parametrize("how", sorted(STEP_AGGREGATES))
def test_aggregate_step_scores_padding_gets_no_gradient(how):
    scores = SCORES.clone().requires_grad_(True)
    aggregate_step_scores(scores, VALID, how).sum().backward()
    assert torch.isfinite(scores.grad).all()
    assert (scores.grad[~VALID] == 0).all()


def test_aggregate_step_scores_unknown_name():
    with pytest.raises(ValueError, match="last, mean, min, product"):
        aggregate_step_scores(SCORES, VALID, "max")


# ---------------------------------------------------------------- Monte-Carlo step labels


def test_monte_carlo_step_labels_hard_and_soft():
    counts = torch.tensor([[0, 1], [4, 2]])
    torch.testing.assert_close(monte_carlo_step_labels(counts, 4), torch.tensor([[0.0, 1.0], [1.0, 1.0]]))
    torch.testing.assert_close(
        monte_carlo_step_labels(counts, 4, hard=False), torch.tensor([[0.0, 0.25], [1.0, 0.5]])
    )
    assert monte_carlo_step_labels(3, 8, hard=False).item() == pytest.approx(3 / 8)
    for bad_n in (0, 2.0, True):
        with pytest.raises(ValueError, match="num_rollouts"):
            monte_carlo_step_labels(counts, bad_n)
    with pytest.raises(ValueError, match="num_correct"):
        monte_carlo_step_labels(torch.tensor([5]), 4)


# ---------------------------------------------------------------- best-of-n


def test_best_of_n_hand_values():
    # levels 0.1 (wrong), 0.3 (right), 0.5 x3 (one right)
    scores = torch.tensor([[0.1, 0.5, 0.5, 0.5, 0.3]])
    correct = torch.tensor([[False, True, False, False, True]])
    assert best_of_n_expected_accuracy(scores, correct, 1).item() == pytest.approx(2 / 5)  # mean
    assert best_of_n_expected_accuracy(scores, correct, 5).item() == pytest.approx(1 / 3)  # ties averaged
    # n=2, 10 pairs: {0.1, 0.3} -> 1; six pairs with one 0.5 -> 1/3 each; three pairs of two 0.5s -> 1/2, 1/2, 0
    assert best_of_n_expected_accuracy(scores, correct, 2).item() == pytest.approx((1 + 2 + 1) / 10)
    # -inf is a level: pairs {-inf, -inf} -> right, {-inf, 0.2} x2 -> wrong
    out = best_of_n_expected_accuracy(torch.tensor([[-INF, -INF, 0.2]]), torch.tensor([[1.0, 1.0, 0.0]]), 2)
    assert out.dtype == D and out.item() == pytest.approx(1 / 3)


def _best_of_n_brute_force(scores, correct, n):
    """Every ordering of the N responses: its first n are the subset, and the first top-scored
    of them the winner (so each subset and each tie-break is equally likely)."""
    total, count = Fraction(0), 0
    for order in itertools.permutations(range(len(scores))):
        subset = order[:n]
        best = max(scores[i] for i in subset)
        winner = next(i for i in subset if scores[i] == best)
        total += correct[winner]
        count += 1
    return total / count


def test_best_of_n_matches_brute_force_with_many_ties():
    g = torch.Generator().manual_seed(1)
    levels = torch.tensor([-INF, 0.0, 1.0, 2.0])
    scores = levels[torch.randint(0, 4, (6, 6), generator=g)]
    correct = torch.randint(0, 2, (6, 6), generator=g).bool()
    for n in range(1, 7):
        out = best_of_n_expected_accuracy(scores, correct, n)
        for p in range(6):
            expected = _best_of_n_brute_force(scores[p].tolist(), correct[p].int().tolist(), n)
            assert out[p].item() == pytest.approx(float(expected), abs=1e-12), (p, n)


def test_best_of_n_monte_carlo():
    g = torch.Generator().manual_seed(2)
    N, n, trials = 8, 3, 40_000
    scores = torch.randint(0, 3, (1, N), generator=g).double()
    correct = torch.rand(1, N, generator=g) < 0.5
    subsets = torch.rand(trials, N, generator=g).argsort(-1)[:, :n]  # random order: first max is a fair tie-break
    winners = subsets.gather(1, scores[0][subsets].argmax(-1, keepdim=True)).squeeze(1)
    estimate = correct[0][winners].double().mean().item()
    exact = best_of_n_expected_accuracy(scores, correct, n).item()
    assert abs(estimate - exact) < 4 * 0.5 / math.sqrt(trials)


def test_best_of_n_large_n_limits_and_bad_input():
    g = torch.Generator().manual_seed(3)
    scores = torch.randint(0, 20, (3, 256), generator=g).double()
    correct = torch.rand(3, 256, generator=g) < 0.3
    torch.testing.assert_close(best_of_n_expected_accuracy(scores, correct, 1), correct.double().mean(-1))
    top = scores == scores.amax(-1, keepdim=True)
    expected = (correct & top).sum(-1).double() / top.sum(-1)
    torch.testing.assert_close(best_of_n_expected_accuracy(scores, correct, 256), expected)
    middle = best_of_n_expected_accuracy(scores, correct, 128)
    assert torch.isfinite(middle).all() and ((middle >= 0) & (middle <= 1)).all()
    for bad_n in (0, 257, 2.0):
        with pytest.raises(ValueError, match="n must be"):
            best_of_n_expected_accuracy(scores, correct, bad_n)
    with pytest.raises(ValueError, match="NaN"):
        best_of_n_expected_accuracy(torch.tensor([[0.0, NAN]]), torch.tensor([[True, False]]), 1)


# ---------------------------------------------------------------- majority vote


def test_majority_vote_hand_values():
    answers = [["a", "a", "b", None]]
    correct = torch.tensor([[True, True, False, False]])
    # n=1: a, a right; b wrong; no answer wrong
    # n=2: (a,a) 1, (a,b) x2 tie 1/2, (a,None) x2 1, (b,None) 0 -> 4/6
    # n=3: (a,a,b) 1, (a,a,None) 1, (a,b,None) x2 1/2 -> 3/4
    expected = {1: 0.5, 2: 4 / 6, 3: 3 / 4, 4: 1.0}
    for n, value in expected.items():
        out = majority_vote_expected_accuracy(answers, correct, n)
        assert out.dtype == D and out.item() == pytest.approx(value), n
    # no answer anywhere: wrong, whatever correct says of the responses
    assert majority_vote_expected_accuracy([[None, None]], torch.tensor([[1.0, 1.0]]), 2).item() == 0.0


def test_majority_vote_bad_input():
    with pytest.raises(ValueError, match="disagree"):
        majority_vote_expected_accuracy([["a", "a"]], torch.tensor([[True, False]]), 1)
    with pytest.raises(ValueError, match="n must be"):
        majority_vote_expected_accuracy([["a", "a"]], torch.tensor([[True, True]]), 3)
    with pytest.raises(ValueError, match="answers"):
        majority_vote_expected_accuracy([["a"]], torch.tensor([[True, True]]), 1)


def _majority_brute_force(answers, right, n):
    """Every n-subset, and within it every answer tied for the most votes, equally likely."""
    total = Fraction(0)
    subsets = list(itertools.combinations(range(len(answers)), n))
    for subset in subsets:
        votes = Counter(answers[i] for i in subset if answers[i] is not None)
        if not votes:
            continue  # no answer: wrong
        top = max(votes.values())
        winners = [a for a, v in votes.items() if v == top]
        total += Fraction(sum(right[a] for a in winners), len(winners))
    return total / len(subsets)


def test_majority_vote_exact_enumeration_matches_brute_force():
    g = torch.Generator().manual_seed(4)
    pool = ["x", "y", "z", None]
    right = {"x": 1, "y": 0, "z": 1}
    answers = [[pool[i] for i in torch.randint(0, 4, (5,), generator=g).tolist()] for _ in range(8)]
    correct = torch.tensor([[right.get(a, 0) for a in row] for row in answers], dtype=D)
    for n in range(1, 6):
        out = majority_vote_expected_accuracy(answers, correct, n)
        for p, row in enumerate(answers):
            assert out[p].item() == pytest.approx(float(_majority_brute_force(row, right, n)), abs=1e-12)


def test_majority_vote_monte_carlo_beyond_the_enumeration_limit():
    # C(20, 10) = 184756 subsets: sampled. 12 right "a", 8 wrong "b": the vote of 10 is right
    # when a gets 6+ votes (hypergeometric) and half the time at 5-5.
    answers = [["a"] * 12 + ["b"] * 8]
    correct = torch.tensor([[True] * 12 + [False] * 8])

    def hypergeom(k):
        return math.comb(12, k) * math.comb(8, 10 - k) / math.comb(20, 10)

    exact = sum(hypergeom(k) for k in range(6, 11)) + 0.5 * hypergeom(5)
    draws = 4000
    out = majority_vote_expected_accuracy(answers, correct, 10, num_draws=draws,
                                          generator=torch.Generator().manual_seed(5))
    assert abs(out.item() - exact) < 4 * 0.5 / math.sqrt(draws)
    again = majority_vote_expected_accuracy(answers, correct, 10, num_draws=draws,
                                            generator=torch.Generator().manual_seed(5))
    assert again.item() == out.item()  # the generator makes it reproducible
