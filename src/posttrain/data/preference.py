"""Preference pairs: (prompt, chosen, rejected) for reward models and DPO-family algorithms.

Two sources, picked by ``preference.source`` (conf/train.yaml):

``embedded``  pairs made on the run's task (``data.*``) with the policy it starts from (the
              SFT warm start): each prompt gets ``samples_per_prompt`` sampled responses,
              judged by the task's verifier. A prompt with a right and a wrong sample gives
              an ``on_policy`` pair (the first of each); otherwise the reference solution is
              chosen and a copy of it with one digit of its final answer changed (which the
              verifier marks wrong) is rejected: a ``perturbed`` pair. A reward model with
              several heads (``algorithm.heads``) gets, per prompt, a pair for each head the
              task can label: ``correct`` (the pair above) and ``concise`` (the shortest right
              response, the reference among them, over the longest: ``shorter_right``). Training pairs come
              from the task's training prompts, held-out pairs from its validation prompts
              (the task splits by prompt hash: no prompt is in both). They are built once and
              cached under ``paths.cache_dir``/preference_pairs, keyed by what they depend on.
``dataset``   a table read through ``datasets`` (a hub name, or a local json/jsonl/parquet
              file or directory; data/hub.py's loaders) with columns prompt / chosen /
              rejected. Each is plain text or chat messages; in the common conversation
              schema chosen and rejected are whole conversations, whose turns before the last
              are the prompt and whose last (assistant) turn is the response. An optional
              column (``preference.columns.head``) names the reward-model head a pair trains.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import torch

from posttrain.data.datamodule import prompt_token_ids, right_padded, tokenizer_context
from posttrain.data.examples import Example
from posttrain.data.hub import load_splits
from posttrain.data.templates import check_messages, last_user_content
from posttrain.errors import ConfigError, DataError

log = logging.getLogger("posttrain")

KINDS = ("on_policy", "perturbed", "shorter_right", "dataset")
SPLITS = ("train", "validation")
DEFAULT_HEADS = ("reward",)  # algorithm.heads' default: one head, the reward model of before heads had names
# The heads embedded pairs can label (prepare/preference_pairs.py makes them): a right response over
# a wrong one (the verifier's verdict), a shorter right response over a longer one
EMBEDDED_HEADS = ("correct", "concise")


@dataclass
class PreferencePair:
    prompt: str                         # the prompt text (verifiers and logs read it)
    chosen: str                         # the preferred response (no EOS)
    rejected: str                       # the dispreferred response (no EOS)
    kind: str                           # "on_policy" | "perturbed" | "dataset"
    messages: list[dict] | None = None  # the prompt as chat messages (rendered with the tokenizer's chat template)
    example: Example | None = None      # the task example it came from (embedded task), for verification
    origin: str | None = None           # where it was read (dataset: "<file> split 'train' row 12"), for errors
    # whether each response ended with EOS: a sampled one cut by the generation budget never
    # did, so its row gets none (embedded on-policy pairs)
    chosen_ended: bool = True
    rejected_ended: bool = True
    # the reward-model head it trains (algorithm.heads, when there are several): "correct" or
    # "concise" for embedded pairs, the head column (preference.columns.head) of a dataset
    head: str | None = None


# --- collation ------------------------------------------------------------------------------

def pair_prompt_ids(pair: PreferencePair, tokenizer) -> list[int]:
    """The prompt's token ids exactly as SFT and generation make them (chat template or text)."""
    example = pair.example or Example(pair.prompt, "", None, messages=pair.messages)
    return prompt_token_ids(example, tokenizer)


def collate_pairs(pairs: list[PreferencePair], tokenizer) -> dict:
    """Right-padded rows prompt + response + EOS for both sides (no EOS after a sampled response
    that never generated one: `chosen_ended` / `rejected_ended`), the same token layout as
    SFT's collate_sft (prompt rendered by posttrain.data.datamodule.prompt_token_ids / chat
    template): chosen_input_ids, chosen_attention_mask, chosen_labels (-100 on prompt and
    padding), rejected_input_ids, rejected_attention_mask, rejected_labels: [B, T] long;
    chosen_len, rejected_len: [B] long response tokens including the EOS; "pairs": the list."""
    batch: dict = {"pairs": pairs}
    prompts = [pair_prompt_ids(pair, tokenizer) for pair in pairs]
    for side in ("chosen", "rejected"):
        texts = [getattr(pair, side) for pair in pairs]
        ended = [getattr(pair, f"{side}_ended") for pair in pairs]
        responses = [ids + ([tokenizer.eos_token_id] if has_eos else [])
                     for ids, has_eos in zip(tokenizer(texts, add_special_tokens=False)["input_ids"], ended)]
        rows = [prompt + response for prompt, response in zip(prompts, responses)]
        labels = [[-100] * len(prompt) + response for prompt, response in zip(prompts, responses)]
        input_ids, attention_mask, label_ids = right_padded(rows, labels, tokenizer.pad_token_id)
        batch[f"{side}_input_ids"], batch[f"{side}_attention_mask"] = input_ids, attention_mask
        batch[f"{side}_labels"] = label_ids
        batch[f"{side}_len"] = torch.tensor([len(r) for r in responses], dtype=torch.long)
    return batch


# --- the source -------------------------------------------------------------------------------

class PreferenceSource:
    """The pairs of a run, by split ("train", "validation"), behind the task source:
    `pairs(split) -> list[PreferencePair]`, `size(split)`, and `example(split, i)`, `is_correct`,
    `has_style`, `alphabet`, `prompt_limits`, `origin` delegate to the wrapped task source so
    generative held-out evaluation on the task works unchanged. `shares(split) -> dict[str, float]`
    is the fraction of each pair kind."""

    def __init__(self, task, pairs_by_split: dict[str, list[PreferencePair]], where: str):
        self.task = task
        self.where = where  # what the pairs were made from, for errors
        self._pairs = pairs_by_split

    def pairs(self, split: str) -> list[PreferencePair]:
        if split not in self._pairs:
            raise ConfigError(f"{self.where} has no {split!r} preference pairs; this run needs them")
        return self._pairs[split]

    def size(self, split: str) -> int:
        return len(self.pairs(split))

    def splits(self) -> list[str]:
        """The splits that have pairs."""
        return [split for split in SPLITS if split in self._pairs]

    def shares(self, split: str) -> dict[str, float]:
        pairs = self.pairs(split)
        return {kind: sum(p.kind == kind for p in pairs) / max(1, len(pairs)) for kind in KINDS}

    # the task's own interface, for held-out generative evaluation and verifiers
    def example(self, split: str, index: int) -> Example:
        return self.task.example(split, index)

    def is_correct(self, example: Example, response: str) -> bool:
        return self.task.is_correct(example, response)

    def has_style(self, response: str) -> bool:
        return self.task.has_style(response)

    def origin(self, split: str, index: int) -> str | None:
        return self.task.origin(split, index)

    @property
    def alphabet(self) -> str:
        return self.task.alphabet

    @property
    def prompt_limits(self):
        return self.task.prompt_limits


def share_summary(source: PreferenceSource) -> dict[str, float]:
    """`pairs/<split>/<kind>_share` and `pairs/<split>/count` for summary.json."""
    summary = {}
    for split in source.splits():
        summary[f"pairs/{split}/count"] = float(source.size(split))
        summary.update({f"pairs/{split}/{kind}_share": share for kind, share in source.shares(split).items()})
    return summary


def check_pairs_fit(source: PreferenceSource, tokenizer) -> None:
    """Every pair's rows (prompt + chosen / rejected + EOS, as collate_pairs lays them out) must fit
    the model's context, before training: past it the model has no positions (a crash, or
    silently extrapolated ones), and cutting either side would change what is preferred. A
    DataError names the first pair too long (its file and row for dataset pairs) and the count."""
    context = tokenizer_context(tokenizer)
    if context is None:
        return
    for split in source.splits():
        pairs = source.pairs(split)
        prompts = [len(pair_prompt_ids(pair, tokenizer)) for pair in pairs]
        sides = {side: tokenizer([getattr(pair, side) for pair in pairs], add_special_tokens=False)["input_ids"]
                 for side in ("chosen", "rejected")}
        over = [(i, side) for i in range(len(pairs)) for side in ("chosen", "rejected")
                if prompts[i] + len(sides[side][i]) + 1 > context]
        if not over:
            continue
        i, side = over[0]
        pair, response = pairs[i], len(sides[side][i])
        where = pair.origin or f"{split} pair {i} (prompt {pair.prompt[:60]!r})"
        count = len({index for index, _ in over})
        raise DataError(f"{where}: prompt ({prompts[i]} tokens) + {side} response ({response} tokens) + EOS is "
                        f"{prompts[i] + response + 1} tokens, more than the model's context of {context} tokens (its "
                        f"max_position_embeddings); {count} of the {len(pairs)} {split} pairs are too long. Drop or "
                        f"shorten such pairs, or use a model with a longer context")


def check_pair_heads(source: PreferenceSource, heads: list[str]) -> None:
    """With several reward-model heads (algorithm.heads) every pair must name one of them: the
    head its Bradley-Terry loss trains. One head trains on every pair, whatever it names."""
    if len(heads) < 2:
        return
    for split in source.splits():
        for number, pair in enumerate(source.pairs(split)):
            if pair.head not in heads:
                where = pair.origin or f"{split} pair {number} (prompt {pair.prompt[:60]!r})"
                named = "names no head" if pair.head is None else f"names head {pair.head!r}"
                raise DataError(f"{where} {named} (column preference.columns.head), but "
                                f"algorithm.heads={heads}: each pair must name the head it trains; add a head column "
                                f"with one of {heads} per row")


# --- embedded pairs ---------------------------------------------------------------------------

def embedded_heads_problem(heads: list[str]) -> str | None:
    """Several heads: each must be one the embedded pairs can label (one head trains on every pair)."""
    unknown = [head for head in heads if head not in EMBEDDED_HEADS] if len(heads) > 1 else []
    if not unknown:
        return None
    return (f"algorithm.heads={heads}: the embedded preference pairs label only the heads {list(EMBEDDED_HEADS)} "
            f"(correct: a right response over a wrong one; concise: a shorter right response over a longer one), not "
            f"{unknown}; rename the heads, or use preference.source=dataset with a head column "
            f"(preference.columns.head)")


# --- dataset pairs -----------------------------------------------------------------------------

COLUMNS = ("prompt", "chosen", "rejected", "head")
# The preference keys only preference.source=dataset reads.
DATASET_KEYS = ("path", "config", "splits", "columns", "validation_size", "validation_seed", "chat")


def read_pair_dataset(settings) -> dict[str, list[PreferencePair]]:
    """The pairs of `preference.path` by split; without a validation split (preference.splits.validation
    null), `validation_size` seeded-random training pairs are held out."""
    try:
        tables, name = load_splits(settings.path, settings.get("config"))
    except DataError as err:  # the loaders name data.* keys: here the table is preference.path
        raise DataError(str(err).replace("data.path", "preference.path").replace("data.config", "preference.config"))
    pairs = {}
    for split in SPLITS:
        table_name = settings.splits.get(split)
        if table_name is None:
            continue
        if table_name not in tables:
            raise DataError(f"{name} has no split {table_name!r} (preference.splits.{split}); its splits are "
                            f"{sorted(tables)}")
        pairs[split] = read_pair_table(tables[table_name], f"{name} split {table_name!r}", settings)
    if "train" not in pairs:
        raise ConfigError("preference.splits.train must name the dataset's training split")
    if "validation" not in pairs and settings.validation_size > 0:
        pairs["train"], pairs["validation"] = hold_out(pairs["train"], settings.validation_size,
                                                       settings.validation_seed, name)
    return pairs


def hold_out(pairs: list[PreferencePair], count: int, seed: int, name: str):
    if count >= len(pairs):
        raise DataError(f"preference.validation_size={count} leaves no training pairs: {name} has {len(pairs)}; "
                        f"lower preference.validation_size")
    held = set(random.Random(seed).sample(range(len(pairs)), count))
    return [p for i, p in enumerate(pairs) if i not in held], [p for i, p in enumerate(pairs) if i in held]


def read_pair_table(table, where: str, settings) -> list[PreferencePair]:
    columns = {key: settings.columns.get(key) for key in COLUMNS}
    for key in ("chosen", "rejected"):
        if columns[key] not in table.column_names:
            raise DataError(f"{where} has no column {columns[key]!r} (preference.columns.{key}); its columns are "
                            f"{table.column_names}")
    if len(table) == 0:
        raise DataError(f"{where} holds no rows: an empty split")
    has_prompt = columns["prompt"] in table.column_names
    pairs = [read_pair_row(row, f"{where} row {number}", columns, has_prompt, settings.chat, table.column_names)
             for number, row in enumerate(table)]
    if columns["head"] in table.column_names:  # the reward-model head of each pair (check_pair_heads)
        for pair, row in zip(pairs, table):
            pair.head = None if row[columns["head"]] is None else str(row[columns["head"]])
    return pairs


def read_pair_row(row: dict, where: str, columns: dict, has_prompt: bool, chat: bool, names) -> PreferencePair:
    chosen_turns, chosen = response_of(row[columns["chosen"]], where, columns["chosen"], "chosen")
    rejected_turns, rejected = response_of(row[columns["rejected"]], where, columns["rejected"], "rejected")
    if chosen_turns is not None:  # a conversation carries its own prompt turns (a prompt column repeats them)
        if rejected_turns is not None and rejected_turns != chosen_turns:
            raise DataError(f"{where}: columns {columns['chosen']!r} and {columns['rejected']!r} are conversations "
                            f"whose turns before the last differ; a pair answers one prompt")
        return PreferencePair(last_user_content(chosen_turns), chosen, rejected, "dataset", chosen_turns, origin=where)
    if not has_prompt:
        raise DataError(f"{where} has no column {columns['prompt']!r} (preference.columns.prompt), and column "
                        f"{columns['chosen']!r} holds text, not a conversation, so the pair has no prompt; its "
                        f"columns are {names}")
    cell = row[columns["prompt"]]
    messages = prompt_messages(cell, where, columns["prompt"], chat)
    return PreferencePair(last_user_content(messages) if messages else cell, chosen, rejected, "dataset", messages,
                          origin=where)


def response_of(cell, where: str, column: str, key: str) -> tuple[list[dict] | None, str]:
    """(the prompt turns, the response) of a chosen / rejected cell: text is a response alone; a
    conversation's last turn must be the assistant's, its earlier turns are the prompt."""
    if isinstance(cell, str) and cell.strip():
        return None, cell
    if isinstance(cell, list):
        turns = check_messages(cell, f"{where} column {column!r} (preference.columns.{key})")
        if turns[-1]["role"] != "assistant" or len(turns) < 2:
            raise DataError(f"{where}: column {column!r} (preference.columns.{key}) is a conversation that does not "
                            f"end with an assistant turn after the prompt")
        return turns[:-1], turns[-1]["content"]
    raise DataError(f"{where}: column {column!r} (preference.columns.{key}) must be a non-empty string or a list "
                    f"of chat messages, got {cell!r:.80}")


def prompt_messages(cell, where: str, column: str, chat: bool) -> list[dict] | None:
    """A prompt cell as chat messages: given as messages, or text wrapped in a user turn with
    `chat`; None for a plain-text prompt."""
    if isinstance(cell, list):
        return check_messages(cell, f"{where} column {column!r} (preference.columns.prompt)")
    if not isinstance(cell, str) or not cell.strip():
        raise DataError(f"{where}: column {column!r} (preference.columns.prompt) must be a non-empty string or a "
                        f"list of chat messages, got {cell!r:.80}")
    return [{"role": "user", "content": cell}] if chat else None
