"""Sampling from the starting policy before training (embedded preference pairs, PRM step rows):
the run's rollout engine over the policy in eval mode, without gradients."""

from __future__ import annotations

import torch

from posttrain.models.loading import stop_token_ids
from posttrain.rollout import SamplingParams, build_rollout, engine_options
from posttrain.rollout.base import RolloutBatch


class PolicySampler:
    def __init__(self, rollout_cfg, tokenizer, policy):
        self.engine = build_rollout(rollout_cfg.engine, **engine_options(rollout_cfg))
        self.policy, self.tokenizer = policy, tokenizer
        self.eos = stop_token_ids(tokenizer, policy)

    @torch.no_grad()
    def generate(self, prompt_ids, prompt_mask, temperature: float, max_new_tokens: int, generator) -> RolloutBatch:
        was_training = self.policy.training
        self.policy.eval()
        try:
            return self.engine.generate(self.policy, prompt_ids, prompt_mask,
                                        SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature),
                                        eos_token_id=self.eos, pad_token_id=self.tokenizer.pad_token_id,
                                        generator=generator)
        finally:
            self.policy.train(was_training)
