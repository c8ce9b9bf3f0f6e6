import itertools
import math

import pytest
import torch

from posttrain.core import Multiplier, constrained_reward, dual_ascent_step, pid_multiplier_step


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


def test_pid_multiplier_hand_values():
    start = Multiplier.start(1.0)
    # first batch, no previous cost: I = 1 + 0.5 * (0.8 - 0.5) = 1.15; lambda = 2 * 0.3 + 1.15 = 1.75
    first = pid_multiplier_step(start, mean_cost=0.8, limit=0.5, ki=0.5, kp=2.0, kd=4.0)
    assert (first.value, first.integral, first.last_cost) == pytest.approx((1.75, 1.15, 0.8))
    # the cost rises by 0.1: I = 1.15 + 0.5 * 0.4 = 1.35; lambda = 2 * 0.4 + 1.35 + 4 * 0.1 = 2.55
    second = pid_multiplier_step(first, mean_cost=0.9, limit=0.5, ki=0.5, kp=2.0, kd=4.0)
    assert (second.value, second.integral) == pytest.approx((2.55, 1.35))
    # it falls under the limit: no D term (only a rise counts); I = 1.35 - 0.5 * 0.3 = 1.2,
    # lambda = 2 * (-0.3) + 1.2 = 0.6
    third = pid_multiplier_step(second, mean_cost=0.2, limit=0.5, ki=0.5, kp=2.0, kd=4.0)
    assert (third.value, third.integral) == pytest.approx((0.6, 1.2))
    # far under: the P term would make lambda negative; it is clipped at 0, I is not touched by the clip
    fourth = pid_multiplier_step(Multiplier.start(0.1), mean_cost=0.0, limit=0.5, ki=0.1, kp=2.0)
    assert (fourth.value, fourth.integral) == pytest.approx((0.0, 0.05))


def test_pid_without_p_and_d_is_dual_ascent():
    multiplier, lam = Multiplier.start(0.2), 0.2
    for cost in (0.9, 0.7, 0.1, 0.0, 0.6, 0.8):
        multiplier = pid_multiplier_step(multiplier, cost, limit=0.5, ki=0.7)
        lam = dual_ascent_step(lam, cost, limit=0.5, lr=0.7)
        assert multiplier.value == multiplier.integral == pytest.approx(lam)


def lagged_cost_run(kp: float, kd: float, steps: int = 300) -> list[float]:
    """A cost that answers lambda with a lag, as a policy does: each batch moves the cost a fifth of
    the way towards 0.9 / (1 + lambda), its level at the current lambda. Returns the batches' costs."""
    multiplier, cost, costs = Multiplier.start(0.0), 0.9, []
    for _ in range(steps):
        cost += 0.2 * (0.9 / (1 + multiplier.value) - cost)
        costs.append(cost)
        multiplier = pid_multiplier_step(multiplier, cost, limit=0.6, ki=0.5, kp=kp, kd=kd)
    return costs


def test_the_p_and_d_terms_damp_the_overshoot_of_dual_ascent():
    """On a lagged cost, dual ascent overshoots the limit and rings; a PID multiplier settles at the
    same point (lambda* = 0.5, cost 0.6) with a smaller overshoot below the limit."""
    integral_only, pid = lagged_cost_run(kp=0.0, kd=0.0), lagged_cost_run(kp=1.0, kd=2.0)
    assert integral_only[-1] == pytest.approx(0.6, abs=1e-3) and pid[-1] == pytest.approx(0.6, abs=1e-3)
    undershoot = [0.6 - min(costs) for costs in (integral_only, pid)]
    assert undershoot[1] < 0.5 * undershoot[0]
    crossings = [sum((a - 0.6) * (b - 0.6) < 0 for a, b in itertools.pairwise(costs)) for costs in (integral_only, pid)]
    assert crossings[1] < crossings[0]


def test_pid_gains_must_be_non_negative():
    with pytest.raises(ValueError, match="kp"):
        pid_multiplier_step(Multiplier.start(0.0), 0.5, limit=0.5, ki=0.1, kp=-1.0)
