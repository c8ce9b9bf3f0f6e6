"""The datamodule: an endless, resumable training stream and a fixed evaluation set.

Training example ``i`` is a pure function of the seed and ``i`` (finite sources are
reshuffled each pass with a seeded permutation), so a resumed run starts the stream at
``batches_seen * batch_size`` and sees exactly the data it would have seen.
"""

from __future__ import annotations

from typing import Callable

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset

from posttrain.data.sources import Example


class ExampleCursor:
    """A resumable position in the endless example stream of one split.

    Under data parallelism rank ``r`` of ``world_size`` W takes stream positions r, r+W,
    r+2W, ...: ranks draw disjoint prompts, and their union is the single-process stream.
    ``position`` counts the examples this rank has taken (what a resume restores).
    """

    def __init__(self, source, split: str, seed: int, position: int = 0, rank: int = 0, world_size: int = 1):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"ExampleCursor needs 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        self.source, self.split, self.seed, self.position = source, split, seed, position
        self.rank, self.world_size = rank, world_size

    def stream_position(self, position: int) -> int:
        """Where this rank's ``position``-th example lies in the single-process stream."""
        return self.rank + position * self.world_size

    def index(self, position: int) -> int:
        """The source index at single-process stream ``position``."""
        size = self.source.size(self.split)
        if size is None:
            return position
        epoch, offset = divmod(position, size)
        order = torch.randperm(size, generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch))
        return int(order[offset])

    def take(self, count: int) -> list[Example]:
        examples = [self.source.example(self.split, self.index(self.stream_position(p)))
                    for p in range(self.position, self.position + count)]
        self.position += count
        return examples


class ExampleStream(IterableDataset):
    """Examples ``start, start+1, ...`` of a split, endlessly."""

    def __init__(self, source, split: str, start: int, seed: int):
        self.source, self.split, self.start, self.seed = source, split, start, seed

    def __iter__(self):
        cursor = ExampleCursor(self.source, self.split, self.seed, self.start)
        while True:
            yield cursor.take(1)[0]


class StepTickets(IterableDataset):
    """For modules that draw their own prompts (online RL): one item per training step."""

    def __iter__(self):
        step = 0
        while True:
            yield step
            step += 1


def collate_sft(examples: list[Example], tokenizer) -> dict:
    """Right-padded prompt+response+EOS with labels only on response tokens."""
    rows, labels = [], []
    for example in examples:
        prompt = tokenizer(example.prompt, add_special_tokens=False)["input_ids"]
        response = tokenizer(example.response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(prompt + response)
        labels.append([-100] * len(prompt) + response)
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    label_ids = torch.full((len(rows), width), -100, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, label) in enumerate(zip(rows, labels)):
        input_ids[i, : len(row)] = torch.tensor(row)
        label_ids[i, : len(row)] = torch.tensor(label)
        attention_mask[i, : len(row)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": label_ids}


def collate_prompts(examples: list[Example], tokenizer) -> dict:
    """Left-padded prompts (generation appends on the right) and the examples themselves."""
    rows = [tokenizer(e.prompt, add_special_tokens=False)["input_ids"] for e in examples]
    width = max(len(r) for r in rows)
    prompt_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        prompt_ids[i, width - len(row):] = torch.tensor(row)
        prompt_mask[i, width - len(row):] = 1
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "examples": examples}


class PosttrainDataModule(L.LightningDataModule):
    """Training stream (`train_collate` picks SFT pairs or prompts) and held-out prompts."""

    def __init__(self, source, tokenizer, batch_size: int, train_collate: Callable, eval_split: str,
                 eval_num_prompts: int, eval_batch_size: int, seed: int = 0):
        super().__init__()
        self.source, self.tokenizer = source, tokenizer
        self.batch_size, self.train_collate, self.seed = batch_size, train_collate, seed
        self.eval_split, self.eval_batch_size = eval_split, eval_batch_size
        size = source.size(eval_split)
        count = eval_num_prompts if size is None else min(size, eval_num_prompts)
        self.eval_examples = [source.example(eval_split, i) for i in range(count)]

    def train_dataloader(self) -> DataLoader:
        if self.train_collate is None:  # the module owns its prompt stream
            return DataLoader(StepTickets(), batch_size=None)
        batches_seen = getattr(self.trainer.lightning_module, "train_batches_seen", 0) if self.trainer else 0
        stream = ExampleStream(self.source, "train", start=batches_seen * self.batch_size, seed=self.seed)
        return DataLoader(stream, batch_size=self.batch_size,
                          collate_fn=lambda b: self.train_collate(b, self.tokenizer))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.eval_examples, batch_size=self.eval_batch_size, shuffle=False,
                          collate_fn=lambda b: collate_prompts(b, self.tokenizer))
