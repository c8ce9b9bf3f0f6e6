"""The parts of the online learner (part.py), one file each, built from the config only when
on. Their order is the order every hook runs in: process rewards shape the per-token rewards
before the KL does; the KL term precedes distillation's in the summed loss.
"""

from __future__ import annotations

from omegaconf import OmegaConf

from posttrain.algorithms import rules
from posttrain.algorithms.online.parts.constraint import Constraint
from posttrain.algorithms.online.parts.critic import Critic
from posttrain.algorithms.online.parts.distillation import Distillation, distill_settings
from posttrain.algorithms.online.parts.mismatch import MismatchBudget, budget_of
from posttrain.algorithms.online.parts.process_rewards import (ProcessRewards, check_process_options,
                                                               process_reward_of)
from posttrain.algorithms.online.parts.ptx import Pretraining
from posttrain.algorithms.online.parts.reference import ReferenceKL


def model_parts(policy, roles, *, kl_estimator, advantage_name: str, critic, distill, scoring, batches_seen) -> list:
    """The parts with a model of their own (the reference, the critic, the teacher), built in
    this order before the reward (a critic's value head draws from the global RNG)."""
    rules.refuse(rules.gae_critic_problem(advantage_name, critic is not None),
                 rules.kl_placement_problem(kl_estimator.name, kl_estimator.coef, kl_estimator.placement))
    parts = []
    if rules.uses_kl(kl_estimator.name, kl_estimator.coef):
        parts.append(ReferenceKL(kl_estimator, policy, roles.reference, scoring))
    if critic is not None:
        parts.append(Critic(critic, policy, roles.critic))
    distill = distill_settings(distill)
    if distill is not None:
        parts.append(Distillation(distill, policy, roles.teacher, advantage_name, scoring, batches_seen))
    return parts


def reward_parts(reward, reward_fn, source, rollout, *, advantage_name: str, kl_in_reward: bool) -> list:
    """The parts that read the reward: process rewards, the constraint's multiplier."""
    parts = []
    process_reward = process_reward_of(reward_fn)
    prm_stop_below = rollout.get("prm_stop_below")
    check_process_options(process_reward, advantage_name, kl_in_reward, prm_stop_below)
    if process_reward is not None:
        parts.append(ProcessRewards(process_reward, source, advantage_name, prm_stop_below))
    constraint, components = (OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
                              for node in (reward.get("constraint"), reward.get("components")))
    rules.refuse(rules.constraint_problem(constraint, components))
    if constraint is not None:
        parts.append(Constraint(dict(constraint)))
    return parts


def update_parts(policy, tokenizer, source, rollout, steppers, *, ptx: dict, seed: int) -> list:
    """The parts acting in and after the update: PTX, the mismatch budget."""
    parts = []
    if ptx["ptx_coef"]:
        parts.append(Pretraining(policy, tokenizer, source, steppers, coef=ptx["ptx_coef"],
                                 batch_size=ptx["ptx_batch_size"], data=ptx["ptx_data"], seq_len=ptx["ptx_seq_len"],
                                 seed=seed))
    budget = budget_of(rollout)
    if budget:
        parts.append(MismatchBudget(budget))
    return parts


def in_hook_order(parts: list) -> list:
    """Process rewards first (they replace the per-token rewards the KL then shapes)."""
    return sorted(parts, key=lambda part: part.name != "process_rewards")
