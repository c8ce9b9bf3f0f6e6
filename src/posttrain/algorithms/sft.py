"""Supervised fine-tuning: next-token cross-entropy on completion tokens only."""

from __future__ import annotations

import torch.nn.functional as F

from posttrain.algorithms.base import PosttrainModule
from posttrain.data.datamodule import collate_sft


class SFTModule(PosttrainModule):
    train_collate = staticmethod(collate_sft)

    def __init__(self, policy, tokenizer, source, optim, rollout, eval_max_new_tokens, batch_size,
                 max_grad_norm=1.0):
        super().__init__(policy, tokenizer, source, optim, rollout, eval_max_new_tokens, max_grad_norm)
        self.batch_size = batch_size

    def training_step(self, batch, batch_idx):
        logits = self.policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        # position t predicts token t+1; labels are -100 on the prompt and on padding
        loss = F.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(), ignore_index=-100
        )
        self.train_batches_seen += 1
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.log("train/grad_norm", self.last_grad_norm)
