"""Supervised fine-tuning: next-token cross-entropy on completion tokens only. With an
environment (`env=...`) it trains on the environment's worked episodes, the environment's
replies masked out (envs/worked.py), and held-out prompts are played as episodes."""

from __future__ import annotations

from functools import partial

import torch.nn.functional as F

from posttrain.algorithms.base import OfflineModule
from posttrain.data.datamodule import collate_sft, sft_row_length
from posttrain.envs.build import build_env, turn_tokens
from posttrain.envs.worked import collate_worked_episodes, worked_row_length
from posttrain.distributed.collectives import all_reduce_sum, rank_and_world


class SFTModule(OfflineModule):
    train_collate = staticmethod(collate_sft)
    sft_row_length = staticmethod(sft_row_length)  # checked against the context before training

    def __init__(self, policy, tokenizer, source, optim, rollout, eval_max_new_tokens, batch_size,
                 max_grad_norm=1.0, env=None):
        super().__init__(policy, tokenizer, source, optim, rollout, eval_max_new_tokens, max_grad_norm)
        self.batch_size = batch_size
        self.env, self.turn_tokens = build_env(env, source), turn_tokens(env)
        if self.env is not None:
            self.train_collate = partial(collate_worked_episodes, env=self.env)
            self.sft_row_length = partial(worked_row_length, env=self.env)

    def training_step(self, batch, batch_idx):
        logits = self.policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        # position t predicts token t+1; labels are -100 on the prompt and on padding
        labels = batch["labels"][:, 1:].flatten()
        loss_sum = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels, ignore_index=-100, reduction="sum")
        # The mean over the completion tokens of every rank's batch: each rank divides its sum by
        # the global count and scales by the world size, so the ranks' averaged gradients
        # (on_before_optimizer_step; FSDP2's reduce-scatter) are those of one global token mean.
        global_tokens = all_reduce_sum((labels != -100).sum().float()).clamp(min=1.0)
        world = rank_and_world()[1]
        self.train_batches_seen += 1
        self.log("train/loss", all_reduce_sum(loss_sum.detach()) / global_tokens, prog_bar=True)
        return loss_sum * world / global_tokens
