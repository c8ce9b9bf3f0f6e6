"""PPO-ptx (InstructGPT): + ptx_coef * (-mean log pi) on a batch of pretraining text
(algorithm.ptx_data) or, without one, of the task's supervised data, accumulated into the
policy's gradient after each minibatch's micro-batches, before its optimiser step. Its own
data stream (a distinct seed, each rank its share), whose position is checkpointed.
"""

from __future__ import annotations

import torch

from posttrain import core
from posttrain.algorithms.online.part import Part
from posttrain.core.options import Option, integer, number, optional, text
from posttrain.data.datamodule import ExampleCursor, collate_sft, tokenizer_context
from posttrain.data.pretraining import PretrainingChunks, read_documents
from posttrain.distributed.collectives import all_reduce_sum, rank_and_world

OPTIONS = (
    Option("ptx_coef", 0.0, number(0), "weight of the LM loss on ptx_data; 0: off"),
    Option("ptx_batch_size", 16, integer(1), "rows per update: reference responses, or chunks of text"),
    Option("ptx_data", None, optional(text()), "null: the task's supervised data; else pretraining text: a text "
                                               "file, a .jsonl with a 'text' field, or a hub name[:config]"),
    Option("ptx_seq_len", 128, integer(2), "ptx_data: tokens per chunk of pretraining text"),
)


class Pretraining(Part):
    name = "ptx"
    options = OPTIONS

    def __init__(self, policy, tokenizer, source, steppers, *, coef: float, batch_size: int,
                 data: str | None, seq_len: int, seed: int):
        self.policy, self.tokenizer, self.source, self.steppers = policy, tokenizer, source, steppers
        self.coef, self.batch_size, self.data, self.seq_len, self.seed = coef, batch_size, data, seq_len, seed
        self.cursor = None  # built in setup(), when this process's rank is known

    def setup(self, rank, world):
        source = self.source  # the task's supervised data, or chunks of pretraining text
        if self.data is not None:
            source = PretrainingChunks(read_documents(self.data), self.tokenizer, self.seq_len,
                                       context=tokenizer_context(self.tokenizer))
        self.cursor = ExampleCursor(source, "train", self.seed + 1, rank=rank, world_size=world)

    def after_micro_batches(self, train_policy):
        if not train_policy or not self.coef:
            return {}
        if self.data is None:  # the task's supervised data: the loss on the reference responses
            batch = collate_sft(self.cursor.take(self.batch_size), self.tokenizer)
        else:  # chunks of pretraining text: the loss on every token after the first
            ids = torch.stack(self.cursor.take(self.batch_size))
            batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        device = next(self.policy.parameters()).device
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = self.policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        labels = batch["labels"][:, 1:]
        logp, _ = core.token_logprobs_and_entropy(logits, labels, with_entropy=False)
        mask = (labels >= 0).float()
        num_tokens = all_reduce_sum(mask.sum())
        loss = core.ptx_loss(logp, mask, num_tokens=num_tokens, dp_size=rank_and_world()[1])
        self.steppers.backward(self.coef * loss)  # the learner's backward (learner.Steppers)
        return {"ptx/loss": float(loss.detach())}

    def save(self, checkpoint):
        checkpoint["ptx_position"] = self.cursor.position

    def load(self, checkpoint):
        self.cursor.position = checkpoint.get("ptx_position", 0)
