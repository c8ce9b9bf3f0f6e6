"""The datamodule: an endless, resumable training stream and a fixed evaluation set.

Training example ``i`` is a pure function of the seed and ``i`` (finite sources are
reshuffled each pass with a seeded permutation), so a resumed run starts the stream at
``batches_seen * batch_size`` and sees exactly the data it would have seen.
"""

from __future__ import annotations

import logging
from typing import Callable

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from posttrain.data.examples import Example, PromptLimits
from posttrain.data.templates import render_chat
from posttrain.distributed.collectives import rank_and_world, rank_share
from posttrain.errors import ConfigError, DataError

log = logging.getLogger(__name__)

# Generated (endless) sources are checked on this many training prompts: their prompts are
# short and alike, so a sample shows whether they fit.
ENDLESS_SAMPLE = 256
# A tokenizer that was never told its model's context reports a huge sentinel (1e30).
UNKNOWN_CONTEXT = 10**9


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

    def take_indices(self, count: int) -> list[int]:
        """The source indices of this rank's next ``count`` items."""
        indices = [self.index(self.stream_position(p)) for p in range(self.position, self.position + count)]
        self.position += count
        return indices

    def take(self, count: int) -> list[Example]:
        return [self.source.example(self.split, i) for i in self.take_indices(count)]


class ExampleStream(IterableDataset):
    """This rank's items of a split from its position ``start`` on, endlessly, in ExampleCursor's
    seeded, resumable order: the examples of a task source, or with ``pairs`` the pairs of a
    preference source (data/preference.py). Under data parallelism each rank streams its own
    share (ExampleCursor), so the ranks' batches together are one global batch."""

    def __init__(self, source, split: str, start: int, seed: int, rank: int = 0, world_size: int = 1,
                 pairs: bool = False):
        self.source, self.split, self.start, self.seed = source, split, start, seed
        self.rank, self.world_size, self.pairs = rank, world_size, pairs

    def __iter__(self):
        cursor = ExampleCursor(self.source, self.split, self.seed, self.start, self.rank, self.world_size)
        pairs = self.source.pairs(self.split) if self.pairs else None
        while True:
            (index,) = cursor.take_indices(1)
            yield pairs[index] if pairs is not None else self.source.example(self.split, index)


class StepTickets(IterableDataset):
    """For modules that draw their own prompts (online RL): one item per training step."""

    def __iter__(self):
        step = 0
        while True:
            yield step
            step += 1


def prompt_text(example: Example, tokenizer) -> str:
    """The prompt as text the model continues: a chat rendered with the tokenizer's chat
    template (which writes its own special tokens), else the prompt itself."""
    return example.prompt if example.messages is None else render_chat(example.messages, tokenizer)


def prompt_token_ids(example: Example, tokenizer) -> list[int]:
    """The prompt as the model sees it: its truncated ids if it was cut to fit, else its tokens."""
    if example.prompt_ids is not None:
        return list(example.prompt_ids)
    return tokenizer(prompt_text(example, tokenizer), add_special_tokens=False)["input_ids"]


def collate_sft(examples: list[Example], tokenizer) -> dict:
    """Right-padded prompt+response+EOS with labels only on response tokens."""
    rows, labels = [], []
    for example in examples:
        prompt = prompt_token_ids(example, tokenizer)
        response = tokenizer(example.response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(prompt + response)
        labels.append([-100] * len(prompt) + response)
    return sft_batch(rows, labels, tokenizer.pad_token_id)


def sft_batch(rows: list[list[int]], labels: list[list[int]], pad_id: int) -> dict:
    """An SFT batch (input_ids, attention_mask, labels) of token rows and their labels, right-padded."""
    input_ids, attention_mask, label_ids = right_padded(rows, labels, pad_id)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": label_ids}


def right_padded(rows: list[list[int]], labels: list[list[int]] | None, pad_id: int) -> tuple[torch.Tensor, ...]:
    """(input_ids, attention_mask, labels) [B, T] of token rows padded on the right (labels with
    -100; None without `labels`)."""
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    label_ids = torch.full((len(rows), width), -100, dtype=torch.long) if labels is not None else None
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = torch.tensor(row)
        attention_mask[i, : len(row)] = 1
        if labels is not None:
            label_ids[i, : len(row)] = torch.tensor(labels[i])
    return input_ids, attention_mask, label_ids


def collate_prompts(examples: list[Example], tokenizer) -> dict:
    """Left-padded prompts (generation appends on the right) and the examples themselves."""
    prompt_ids, prompt_mask = left_padded([prompt_token_ids(e, tokenizer) for e in examples], tokenizer.pad_token_id)
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "examples": examples}


def left_padded(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) [B, T] of token rows padded on the left (generation appends on the right)."""
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    return ids, mask


def tokenizer_context(tokenizer) -> int | None:
    """The model's context in tokens, as the loader recorded it in ``tokenizer.model_max_length``
    (None when the tokenizer was never told)."""
    value = getattr(tokenizer, "model_max_length", None)
    return value if isinstance(value, int) and 0 < value < UNKNOWN_CONTEXT else None


def prompt_token_limit(limits: PromptLimits, context: int | None) -> tuple[int | None, str]:
    """The most tokens a prompt may have, and the reason, for messages."""
    limit, reason = None, ""
    if context is not None:
        budget = limits.max_response_tokens
        if budget >= context:
            raise ConfigError(
                f"data.max_response_tokens={budget} leaves no room for a prompt in the model's context of {context} "
                f"tokens (its max_position_embeddings); lower data.max_response_tokens or use a model with a "
                f"longer context")
        limit = context - budget
        reason = (f"the {limit} tokens that fit in the model's context of {context} tokens beside the response "
                  f"budget data.max_response_tokens={budget}")
    if limits.max_prompt_tokens is not None and (limit is None or limits.max_prompt_tokens < limit):
        limit, reason = limits.max_prompt_tokens, f"data.max_prompt_tokens={limits.max_prompt_tokens}"
    return limit, reason


def fit_prompts(source, tokenizer, splits: dict[str, int], sft_row_length: Callable | None = None) -> None:
    """Check that the prompts of ``splits`` fit the model before training starts.

    ``splits`` maps each split the run reads to how many of an endless source's examples to
    check (a file's are all checked). A prompt longer than its limit (the model's context
    minus ``data.max_response_tokens``, or ``data.max_prompt_tokens``) is a DataError naming
    its file and line, unless ``data.truncate_prompts=left``: then its last tokens are kept
    (``Example.prompt_ids``) and the count is logged once. With ``sft_row_length(example,
    tokenizer)`` (an SFT module's: the tokens of the row it trains on) the training rows must
    fit the context too.
    """
    limits = getattr(source, "prompt_limits", None) or PromptLimits()
    context = tokenizer_context(tokenizer)
    limit, reason = prompt_token_limit(limits, context)
    if limit is None:
        return
    truncated = []  # (split, count, total, first place)
    for split, count in splits.items():
        size = source.size(split)
        endless = size is None
        examples = [source.example(split, i) for i in range(count if endless else size)]
        if not examples:
            continue
        ids = tokenizer([prompt_text(e, tokenizer) for e in examples], add_special_tokens=False)["input_ids"]
        over = [i for i, row in enumerate(ids) if len(row) > limit]
        if over and (limits.truncate is None or endless):
            raise DataError(_overlong_message(source, split, examples, ids, over, limit, reason, endless))
        for i in over:  # truncate == "left": the question and its format cue usually end a prompt
            examples[i].prompt_ids = ids[i][len(ids[i]) - limit:]
        if over:
            truncated.append((split, len(over), len(examples), _where(source, split, over[0], examples)))
        if sft_row_length is not None and split == "train" and context is not None:
            _check_sft_rows(source, tokenizer, examples, context, sft_row_length)
    if truncated:
        counts = "; ".join(f"{n} of {total} {split} prompts (the first at {where})"
                           for split, n, total, where in truncated)
        log.warning(f"data.truncate_prompts={limits.truncate}: kept the last {limit} tokens of prompts longer than "
                    f"{reason}: {counts}")


def _where(source, split: str, index: int, examples: list[Example]) -> str:
    origin = source.origin(split, index) if hasattr(source, "origin") else None
    return origin or f"{split} example {index} ({examples[index].prompt[:60]!r})"


def _overlong_message(source, split, examples, ids, over, limit, reason, endless) -> str:
    first = over[0]
    others = f" ({len(over)} of the {len(examples)} {split} prompts are too long)" if len(over) > 1 else ""
    message = (f"{_where(source, split, first, examples)}: the prompt is {len(ids[first])} tokens, "
               f"more than {reason}{others}. ")
    if reason.startswith("data.max_prompt_tokens"):
        room = "raise data.max_prompt_tokens"
    else:
        room = "lower data.max_response_tokens or use a model with a longer context"
    if endless:
        return message + (f"Generated prompts are not truncated: make the task smaller (data.max_digits, "
                          f"data.num_operands) or {room}.")
    return message + (f"Shorten or drop such prompts, {room}, or set data.truncate_prompts=left to keep each over-long "
                      f"prompt's last {limit} tokens (the count is logged).")


def sft_row_length(example: Example, tokenizer) -> int:
    """The tokens of `collate_sft`'s row of `example`: prompt + reference response + EOS."""
    response = tokenizer(example.response, add_special_tokens=False)["input_ids"]
    return len(prompt_token_ids(example, tokenizer)) + len(response) + 1


def _check_sft_rows(source, tokenizer, examples: list[Example], context: int, row_length: Callable) -> None:
    """A training row past the context would train positions the model does not have."""
    for i, example in enumerate(examples):
        length = row_length(example, tokenizer)
        if length > context:
            raise DataError(
                f"{_where(source, 'train', i, examples)}: its training row (the prompt, the response and their "
                f"end tokens) is {length} tokens, more than the model's context of {context} tokens; shorten "
                f"that example or use a model with a longer context")


class PosttrainDataModule(L.LightningDataModule):
    """Training stream (`train_collate` picks SFT pairs or prompts) and held-out prompts.
    `sft_row_length`: an SFT module's row length, checked against the context before training."""

    def __init__(self, source, tokenizer, batch_size: int, train_collate: Callable, eval_split: str,
                 eval_num_prompts: int, eval_batch_size: int, seed: int = 0, eval_on_pairs: bool = False,
                 eval_collate: Callable | None = None, sft_row_length: Callable | None = None):
        super().__init__()
        self.source, self.tokenizer = source, tokenizer
        self.batch_size, self.train_collate, self.seed = batch_size, train_collate, seed
        self.eval_split, self.eval_batch_size = eval_split, eval_batch_size
        # a preference source trains on its pairs; its held-out prompts are its task's
        self.trains_on_pairs = hasattr(source, "pairs")
        self.eval_on_pairs = eval_on_pairs  # held-out batches of validation pairs (reward model), not prompts
        self.eval_collate = eval_collate  # how those held-out items are batched (with eval_on_pairs: the module's own)
        prompts = source.task if self.trains_on_pairs else source
        size = prompts.size(eval_split)
        count = eval_num_prompts if size is None else min(size, eval_num_prompts)
        # before any example is handed out: prompts too long for the model fail (or are cut) here
        fit_prompts(prompts, tokenizer, {"train": ENDLESS_SAMPLE, eval_split: count},
                    sft_row_length=sft_row_length)
        self.eval_examples = [prompts.example(eval_split, i) for i in range(count)]

    def train_dataloader(self) -> DataLoader:
        if self.train_collate is None:  # the module owns its prompt stream
            return DataLoader(StepTickets(), batch_size=None)
        batches_seen = getattr(self.trainer.lightning_module, "train_batches_seen", 0) if self.trainer else 0
        rank, world_size = rank_and_world()
        stream = ExampleStream(self.source, "train", start=batches_seen * self.batch_size, seed=self.seed, rank=rank,
                               world_size=world_size, pairs=self.trains_on_pairs)
        return DataLoader(stream, batch_size=self.batch_size,
                          collate_fn=lambda b: self.train_collate(b, self.tokenizer))

    def val_dataloader(self) -> DataLoader:
        """This rank's held-out batches: prompts, or with `eval_on_pairs` the pairs (reward
        model) or step rows (PRM) batched by the module's own collate. Each item counts once
        over the ranks (Lightning's sampler would repeat items to even out the shares), and
        every rank has as many batches of the same sizes, as a forward or generate call is a
        collective under FSDP: the stand-ins that pad a shorter share (rank_share) come with
        `counted` False in the batch's [B] bool `counted`, which the module's sums skip."""
        items = self.source.pairs(self.eval_split) if self.eval_on_pairs else self.eval_examples
        collate = self.eval_collate if self.eval_on_pairs else collate_prompts
        share = list(zip(*rank_share(len(items))))  # (index, counted)

        def collate_share(rows):
            return {**collate([items[index] for index, _ in rows], self.tokenizer),
                    "counted": torch.tensor([counted for _, counted in rows])}

        # a sampler of one replica: the share is this rank's already, and Lightning splits a
        # loader without a DistributedSampler again
        sampler = DistributedSampler(share, num_replicas=1, rank=0, shuffle=False)
        return DataLoader(share, batch_size=self.eval_batch_size, sampler=sampler, collate_fn=collate_share)
