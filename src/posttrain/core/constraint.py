"""A constraint on the mean of a cost, E[c] <= limit, through a Lagrange multiplier.

The constrained problem max E[r] s.t. E[c] <= limit is relaxed to max E[r] - lambda * (E[c] - limit)
and lambda is learned by dual ascent (projected gradient ascent on the dual, as RCPO, Tessler
et al. 2019, and Safe RLHF, Dai et al. 2023, do): it grows while the batch's mean cost is over
the limit and shrinks back to 0 once it is under. The policy sees the penalised reward of each
sample, the dual step sees the batch's mean cost.
"""

from __future__ import annotations

import math

import torch

from .checks import check_finite, check_shape


def constrained_reward(reward: torch.Tensor, cost: torch.Tensor, multiplier: float, limit: float) -> torch.Tensor:
    """R = r - lambda * max(0, c - limit), per sample: only a sample over the limit pays, by how far
    it is over, so that a response within the limit is never pushed further down."""
    if not multiplier >= 0:
        raise ValueError(f"multiplier must be >= 0, got {multiplier}")
    check_shape("cost", cost, reward.shape, "reward")
    check_finite("reward", reward)
    check_finite("cost", cost)
    return reward - multiplier * (cost - limit).clamp(min=0.0)


def dual_ascent_step(multiplier: float, mean_cost: float, limit: float, lr: float) -> float:
    """lambda <- max(0, lambda + lr * (E[c] - limit)): one projected step of gradient ascent on the
    dual (its gradient in lambda is E[c] - limit), kept >= 0 as a multiplier of an inequality must be."""
    if not math.isfinite(mean_cost):
        raise ValueError(f"mean_cost must be finite, got {mean_cost}")
    if not lr >= 0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    return max(0.0, multiplier + lr * (mean_cost - limit))
