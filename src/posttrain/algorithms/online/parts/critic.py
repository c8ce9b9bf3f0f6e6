"""PPO's critic (algorithm.critic with advantage=gae): a value model — its own backbone by
default, or a value head on the policy's (roles.critic.shared_backbone) — that annotates V(s_t)
at sampling time, learns from GAE's returns with the clipped value loss under an optimiser of
its own, and may train alone for `warmup_batches` rollout batches before the policy moves.
"""

from __future__ import annotations

from posttrain import core
from posttrain.algorithms.online.part import Part
from posttrain.algorithms.online.terms import MicroBatch
from posttrain.core.options import POSITIVE, Option, integer, number, optional
from posttrain.models.roles import ValueModel, build_role

# algorithm.critic.<name>, declared once (its `optim` node is an optimiser's, config/algorithm.py)
OPTIONS = (
    Option("warmup_batches", 0, integer(0), "rollout batches that train only the critic"),
    Option("value_clip", 0.2, optional(POSITIVE), "V_old +- value_clip (PPO value clipping); null: squared error"),
    Option("vf_coef", 1.0, number(0), "weight of the value loss"),
    Option("max_grad_norm", 1.0, optional(number(0)), "null or 0: no clipping"),
)


class ValueTerm:
    """PPO's clipped value loss, vf_coef * 0.5 max((V - R)^2, (V_old + clip(V - V_old) - R)^2)."""

    prefix = "critic"

    def __init__(self, clip_range: float | None, coef: float = 1.0):
        self.clip_range, self.coef = clip_range, coef

    def __call__(self, mb: MicroBatch):
        loss, stats = core.value_loss(mb.values, mb.exp.values, mb.exp.returns, mb.mask, self.clip_range,
                                      **mb.aggregation)
        return self.coef * loss, {"value_loss": loss.detach(), "vf_clipfrac": stats["vf_clip_frac"],
                                  "value_mean": stats["vpred_mean"]}


class Critic(Part):
    name = "critic"
    prefix = "critic"

    def __init__(self, critic, policy, critic_role):
        self.shared_backbone = bool(critic_role.get("shared_backbone", False))
        self.value_model = ValueModel(policy if self.shared_backbone else build_role("critic", critic_role, policy))
        self.warmup_batches = critic.warmup_batches
        self.role_optim, self.role_max_grad_norm = critic.optim, critic.max_grad_norm
        self.term = ValueTerm(critic.value_clip, critic.vf_coef)

    def roles(self) -> dict:
        return {"critic": self.value_model}

    def scorers(self):
        return [("values", lambda exp: self.value_model(*exp.model_inputs()))]

    def after_advantages(self, exp):
        mask = exp.response_mask
        return {"critic/explained_var": float(core.explained_variance(exp.values, exp.returns, mask)),
                "critic/returns_mean": float(core.masked_mean(exp.returns, mask))}

    def policy_may_train(self, batch_index: int) -> bool:
        return batch_index >= self.warmup_batches

    def role_terms(self):
        return [self.term]

    def role_parameters(self):
        """What the critic's optimiser steps: with a shared backbone only the value head (the
        backbone is the policy's, stepped by the policy's optimiser with the value loss's
        gradient in it), else the critic's own backbone and head."""
        if self.shared_backbone:
            return list(self.value_model.head.parameters())
        return self.value_model.trainable_parameters()
