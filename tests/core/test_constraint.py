import math

import pytest
import torch

from posttrain.core import constrained_reward, dual_ascent_step


def test_constrained_reward_hand_values():
    reward = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0])
    cost = torch.tensor([0.2, 0.8, 0.5, 1.0, 0.5])
    # limit 0.5, lambda 2: excess max(0, c - 0.5) = [0, 0.3, 0, 0.5, 0] -> R = r - 2 * excess
    out = constrained_reward(reward, cost, multiplier=2.0, limit=0.5)
    assert out.tolist() == pytest.approx([1.0, 0.4, 0.0, -1.0, 1.0])
    # a sample under the limit gains nothing from being further under it
    assert out[0] == out[4] == 1.0
    # lambda 0: the reward as it was
    assert constrained_reward(reward, cost, multiplier=0.0, limit=0.5).tolist() == reward.tolist()


def test_dual_ascent_step_hand_values():
    # over the limit: lambda grows by lr * (E[c] - limit) = 0.5 * (0.8 - 0.5) = 0.15
    assert dual_ascent_step(1.0, mean_cost=0.8, limit=0.5, lr=0.5) == pytest.approx(1.15)
    # under it: lambda shrinks by 0.5 * (0.3 - 0.5) = -0.1
    assert dual_ascent_step(1.0, mean_cost=0.3, limit=0.5, lr=0.5) == pytest.approx(0.9)
    # ... and is clamped at 0, never negative (a negative multiplier would reward the cost)
    assert dual_ascent_step(0.05, mean_cost=0.3, limit=0.5, lr=0.5) == 0.0
    assert dual_ascent_step(0.0, mean_cost=0.0, limit=0.5, lr=10.0) == 0.0
    # lr 0: a fixed weight
    assert dual_ascent_step(0.7, mean_cost=0.9, limit=0.5, lr=0.0) == 0.7


def test_dual_ascent_meets_the_constraint_of_a_cost_that_falls_with_lambda():
    """A cost that responds to the penalty, E[c](lambda) = 0.9 / (1 + lambda): lambda climbs until the
    mean cost reaches the limit, lambda* = 0.9 / 0.6 - 1 = 0.5, and stays there."""
    lam, limit = 0.0, 0.6
    for _ in range(200):
        lam = dual_ascent_step(lam, mean_cost=0.9 / (1 + lam), limit=limit, lr=0.5)
    assert lam == pytest.approx(0.5, abs=1e-6)
    assert 0.9 / (1 + lam) == pytest.approx(limit, abs=1e-6)


def test_constraint_errors():
    with pytest.raises(ValueError, match="multiplier"):
        constrained_reward(torch.zeros(2), torch.zeros(2), multiplier=-1.0, limit=0.5)
    with pytest.raises(ValueError, match="cost has shape"):
        constrained_reward(torch.zeros(2), torch.zeros(3), multiplier=1.0, limit=0.5)
    with pytest.raises(ValueError, match="cost"):
        constrained_reward(torch.zeros(2), torch.tensor([0.0, math.nan]), multiplier=1.0, limit=0.5)
    with pytest.raises(ValueError, match="mean_cost"):
        dual_ascent_step(1.0, mean_cost=math.nan, limit=0.5, lr=0.1)
    with pytest.raises(ValueError, match="lr"):
        dual_ascent_step(1.0, mean_cost=0.5, limit=0.5, lr=-0.1)
