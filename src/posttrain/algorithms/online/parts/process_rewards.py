"""Process rewards (reward=prm): the collect stage splits each response into steps by the
task's rule (data/steps.py) for a process reward model to score, and may cut a response after
a low-scored step (rollout.prm_stop_below); with advantage=prm_step each step's reward sits
at its last token, the other components' part of the score at the response's last token.
"""

from __future__ import annotations

import torch

from posttrain.algorithms import rules
from posttrain.algorithms.experience import last_token_index
from posttrain.algorithms.online.part import Part
from posttrain.data.steps import source_step_rule
from posttrain.errors import ConfigError


def process_reward_of(reward_fn):
    """The composite's process reward component (reward=prm) when it weighs in, else None."""
    for fn, weight in reward_fn.components:
        if hasattr(fn, "take_step_rewards") and weight:
            return fn
    return None


def check_process_options(process_reward, advantage_name: str, kl_in_reward: bool, prm_stop_below) -> None:
    """ConfigErrors naming the keys for step-level options without a process reward to read."""
    rules.refuse(rules.prm_step_problem(advantage_name, process_reward is not None))
    if advantage_name == "prm_step" and kl_in_reward:
        raise ConfigError("advantage=prm_step reads rewards at step ends only, so kl_estimator.placement=in_reward "
                          "would drop the per-token KL: use kl_estimator.placement=as_loss")
    if prm_stop_below is not None and process_reward is None:
        raise ConfigError(f"rollout.prm_stop_below={prm_stop_below} cuts responses at a low process reward, "
                          f"but the reward has no PRM: use reward=prm, or rollout.prm_stop_below=null")


class ProcessRewards(Part):
    name = "process_rewards"

    def __init__(self, process_reward, source, advantage_name: str, prm_stop_below: float | None):
        self.process_reward, self.prm_stop_below = process_reward, prm_stop_below
        self.step_rule = source_step_rule(source)
        self.per_step = advantage_name == "prm_step"

    def collect_options(self) -> dict:
        return dict(step_rule=self.step_rule, process_reward=self.process_reward, prm_stop_below=self.prm_stop_below)

    def shape_rewards(self, exp, token_rewards, options):
        if not self.per_step:
            return token_rewards, {}
        # each step's process reward at its last token; the other components' part of the
        # score (an outcome reward mixed in) joins it at the last token, which ends the last step
        last = last_token_index(exp.response_mask)
        token_rewards = exp.step_rewards.clone()
        token_rewards[torch.arange(len(last)), last] += exp.scores.float() - exp.step_rewards.sum(dim=1)
        options["step_mask"] = exp.step_mask
        return token_rewards, {}
