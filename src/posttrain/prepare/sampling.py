"""Sampling from the starting policy before training (embedded preference pairs, PRM step rows):
the run's rollout engine over the policy in eval mode, without gradients."""

from __future__ import annotations

import torch

from posttrain.data.datamodule import collate_prompts
from posttrain.models.loading import stop_token_ids
from posttrain.rollout import SamplingParams, build_rollout, engine_options
from posttrain.rollout.base import RolloutBatch

# Prompts sampled together in one generation call (times the samples per prompt).
PROMPTS_PER_CALL = 128


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

    def sample_prompts(self, task_source, split: str, count: int, samples_per_prompt: int, temperature: float,
                       max_new_tokens: int, generator):
        """`samples_per_prompt` responses to each of the first `count` prompts of `split`, in calls of
        PROMPTS_PER_CALL prompts: yields (the task index of the call's first prompt, its examples,
        its rollout, whose rows are each example's samples in turn)."""
        n = samples_per_prompt
        for start in range(0, count, PROMPTS_PER_CALL):
            examples = [task_source.example(split, i) for i in range(start, min(count, start + PROMPTS_PER_CALL))]
            batch = collate_prompts(examples, self.tokenizer)
            yield start, examples, self.generate(batch["prompt_ids"].repeat_interleave(n, dim=0),
                                                 batch["prompt_mask"].repeat_interleave(n, dim=0), temperature,
                                                 max_new_tokens, generator)
