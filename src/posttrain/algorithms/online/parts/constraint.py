"""reward.constraint, E[cost] <= limit, through a Lagrange multiplier lambda (a PID controller
on the mean cost; plain dual ascent with kp = kd = 0). lambda lives in the trainer and is
applied to each batch as it is consumed: the reward stage may run in a producer process
(rollout.max_staleness > 0), which holds no lambda, so it only stores each sample's cost.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from posttrain import core
from posttrain.algorithms.online.part import Part
from posttrain.distributed.collectives import all_reduce_sum


class Constraint(Part):
    name = "constraint"

    def __init__(self, constraint: dict):
        self.constraint = constraint
        self.multiplier = core.Multiplier.start(float(constraint.get("init", 0.0)))

    def collect_options(self) -> dict:
        return dict(cost_component=self.constraint["cost"])

    @torch.no_grad()
    def after_collect(self, exp):
        """Each sample's reward becomes r - lambda * max(0, cost - limit) with the lambda of this
        batch (core.constrained_reward), then lambda takes its step from the batch's mean cost
        (core.pid_multiplier_step). The mean is over every rank's rows, so every rank holds one
        lambda, that of a 1-process run on the union of their batches. Every later stage
        (advantages, rollout/reward_mean) sees the penalised reward; rewards/total/mean stays the
        reward stage's, without it. Logged: the lambda after the step (the next batch's), the
        mean cost, its excess over the limit, the share of samples over it and the mean penalty."""
        limit, applied = self.constraint["limit"], self.multiplier.value
        scores = core.constrained_reward(exp.scores, exp.cost, applied, limit)
        cost = exp.cost.double()
        sums = torch.stack([cost.sum(), (cost > limit).double().sum(), (exp.scores - scores).double().sum(),
                            torch.tensor(float(len(exp)), dtype=torch.float64, device=cost.device)])
        cost_sum, over, penalty, rows = all_reduce_sum(sums).tolist()
        mean_cost = cost_sum / rows
        self.multiplier = core.pid_multiplier_step(self.multiplier, mean_cost, limit, ki=self.constraint["lr"],
                                                   kp=self.constraint.get("kp", 0.0), kd=self.constraint.get("kd", 0.0))
        metrics = {"rewards/constraint/lambda": self.multiplier.value, "rewards/constraint/cost_mean": mean_cost,
                   "rewards/constraint/violation": mean_cost - limit, "rewards/constraint/over_limit_frac": over / rows,
                   "rewards/constraint/penalty_mean": penalty / rows}
        return replace(exp, scores=scores), metrics

    def save(self, checkpoint):  # one lambda, the same on every rank
        checkpoint["constraint_lambda"] = self.multiplier.value
        checkpoint["constraint_integral"] = self.multiplier.integral
        checkpoint["constraint_last_cost"] = self.multiplier.last_cost

    def load(self, checkpoint):
        if "constraint_lambda" in checkpoint:
            value = float(checkpoint["constraint_lambda"])  # a checkpoint of plain dual ascent: the integral is lambda
            self.multiplier = core.Multiplier(value, float(checkpoint.get("constraint_integral", value)),
                                              checkpoint.get("constraint_last_cost"))
