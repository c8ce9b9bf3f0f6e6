"""The KL against the frozen reference (kl_estimator=k1 | k2 | k3 | ...): its log-probs are
annotated, and the KL is either subtracted from the per-token rewards (placement in_reward,
PPO's) or added to the loss (as_loss, GRPO's), with a fixed or adaptive coefficient whose
state is checkpointed. On only with a KL in use (kl_estimator != none and coef > 0).

A LoRA policy's reference is its own base with the adapter switched off (models/lora.py):
no second model is built.
"""

from __future__ import annotations

import torch

from posttrain import core
from posttrain.algorithms.formulas import resolve_kl
from posttrain.algorithms.online.part import Part
from posttrain.algorithms.online.terms import MicroBatch, renamed_aggregation
from posttrain.distributed.collectives import all_reduce_sum, rank_and_world
from posttrain.models.lora import reference_is_the_base, reference_model
from posttrain.models.roles import build_role



class KLTerm:
    """beta * aggregate(k) against the frozen reference. As a loss only with `placement:
    as_loss`; with `in_reward` the KL is already in the rewards and this term only logs it."""

    prefix = "policy"

    def __init__(self, kl, options: dict, controller, as_loss: bool):
        self.kl, self.options, self.controller, self.as_loss = kl, options, controller, as_loss

    def __call__(self, mb: MicroBatch):
        kl = self.kl(mb.logp, mb.exp.ref_logp, mb.old_logp, **self.options)
        value = core.aggregate_loss(kl, mb.mask, **renamed_aggregation(mb.aggregation))
        loss = self.controller.value * value if self.as_loss else value.detach() * 0.0
        return loss, {"kl": value.detach()}


def build_controller(kl_estimator):
    controller = kl_estimator.get("controller", "fixed")
    if controller == "fixed":
        return core.build_kl_controller(controller, beta=kl_estimator.coef)
    return core.build_kl_controller(controller, init_beta=kl_estimator.coef, target_kl=kl_estimator.target,
                                    horizon=kl_estimator.horizon)


class ReferenceKL(Part):
    name = "reference"

    def __init__(self, kl_estimator, policy, reference_role, scoring):
        self.kl, self.kl_name, self.kl_options = resolve_kl(kl_estimator)  # formulas.py: a built-in or a _target_
        self.placement = kl_estimator.placement
        self.controller = build_controller(kl_estimator)
        self.in_reward = self.placement == "in_reward"
        self.needs_old_logp = self.in_reward  # the in-reward KL is that of the sampling policy
        self.policy, self.scoring = policy, scoring
        self.reference = (None if reference_is_the_base(policy, reference_role)
                          else build_role("reference", reference_role, policy))
        self.term = KLTerm(self.kl, self.kl_options, self.controller, as_loss=self.placement == "as_loss")

    def roles(self) -> dict:
        return {"reference": self.reference} if self.reference is not None else {}

    def scorers(self):
        return [("ref_logp", self.reference_logprobs)]

    def reference_logprobs(self, exp) -> torch.Tensor:
        """log pi_ref of the response tokens: the frozen reference's, or a LoRA policy's with its
        adapter switched off (models.lora.reference_model)."""
        with reference_model(self.policy, self.reference) as model:
            return self.scoring.logprobs(model, exp)

    def shape_rewards(self, exp, token_rewards, options):
        if not self.in_reward:
            return token_rewards, {}
        mask = exp.response_mask
        kl = self.kl(exp.old_logp, exp.ref_logp, exp.old_logp, **self.kl_options)
        token_rewards = core.apply_kl_in_reward(token_rewards, kl, self.controller.value, mask)
        # the KL part of each sequence's return, batch mean
        return token_rewards, {"rewards/kl_penalty": float(-self.controller.value * core.masked_sum(kl, mask)
                                                           / len(exp))}

    def policy_terms(self):
        return [self.term]

    def after_update(self, exp, metrics, step):
        if "policy/kl" not in metrics:
            return
        # one beta on every rank, that of the whole batch: each rank's KL stat is its share of
        # the global aggregate times the world size (global token counts), so their mean is
        # the global KL; the controller counts the rows of every rank
        world = rank_and_world()[1]
        device = exp.response_mask.device
        kl_sum, rows = all_reduce_sum(torch.tensor([metrics["policy/kl"], float(len(exp))], dtype=torch.float64,
                                                   device=device)).tolist()
        self.controller.update(kl_sum / world, n_steps=int(rows))
        metrics["policy/kl_coef"] = float(self.controller.value)

    def save(self, checkpoint):
        checkpoint["kl_controller"] = self.controller.state_dict()

    def load(self, checkpoint):
        if "kl_controller" in checkpoint:
            self.controller.load_state_dict(checkpoint["kl_controller"])
