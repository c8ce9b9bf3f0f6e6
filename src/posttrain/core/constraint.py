"""A constraint on the mean of a cost, E[c] <= limit, through a Lagrange multiplier.

The constrained problem max E[r] s.t. E[c] <= limit is relaxed to max E[r] - lambda * (E[c] - limit)
and lambda is learned by dual ascent (projected gradient ascent on the dual, as RCPO, Tessler
et al. 2019, and Safe RLHF, Dai et al. 2023, do): it grows while the batch's mean cost is over
the limit and shrinks back to 0 once it is under. The policy sees the penalised reward of each
sample, the dual step sees the batch's mean cost.

Dual ascent is the integral term of a PID controller on the violation E[c] - limit, and like an
integral controller alone it overshoots and cycles: lambda keeps growing until the cost is back
under the limit, by which time the policy has gone too far the other way. Stooke et al. (2020,
"Responsive Safety in Reinforcement Learning by PID Lagrangian Methods") add a proportional term,
which reacts to the violation now, and a derivative term on the cost's rise, which pushes back
before the integral has grown: `pid_multiplier_step`. With kp = kd = 0 it is dual ascent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Multiplier:
    """A PID Lagrange multiplier between batches: `value`, the lambda the next batch pays; `integral`,
    the I term (the sum of ki x violations, kept >= 0: the dual-ascent lambda); `last_cost`, the
    previous batch's mean cost (the D term's), None before the first batch."""

    value: float
    integral: float
    last_cost: float | None = None

    @classmethod
    def start(cls, init: float) -> Multiplier:
        return cls(value=init, integral=init)


def pid_multiplier_step(multiplier: Multiplier, mean_cost: float, limit: float, ki: float, kp: float = 0.0,
                        kd: float = 0.0) -> Multiplier:
    """lambda = max(0, kp * (E[c] - limit) + I + kd * max(0, E[c] - E[c]_previous)), with the integral
    I <- max(0, I + ki * (E[c] - limit)) (`dual_ascent_step`): the P term answers this batch's
    violation, the D term a cost on the rise (only a rise: a falling cost lets lambda relax through
    I alone). kp = kd = 0: plain dual ascent, lambda = I."""
    if not (kp >= 0 and kd >= 0):
        raise ValueError(f"kp and kd must be >= 0, got kp={kp}, kd={kd}")
    integral = dual_ascent_step(multiplier.integral, mean_cost, limit, ki)
    rise = 0.0 if multiplier.last_cost is None else max(0.0, mean_cost - multiplier.last_cost)
    value = max(0.0, kp * (mean_cost - limit) + integral + kd * rise)
    return Multiplier(value=value, integral=integral, last_cost=mean_cost)
