"""Step-labelled responses: the training data of a process reward model (algorithm=prm).

Made on the run's task with the policy it starts from (the SFT warm start), as embedded
preference pairs are: each of `num_train_prompts` training prompts and `num_validation_prompts`
validation prompts gets `samples_per_prompt` responses sampled at `temperature`, each split
into steps by the task's rule (data/steps.py). A `StepRow` holds the example, the step texts,
whether the response ended (EOS), and one label per step. Where the labels come from
(`algorithm.labels`):

``verifier``     the task's step verifier, as the oracle PRM scores it (prefix form): 1 while
                 every step so far is right, 0 from the first wrong one on.
``monte_carlo``  Math-Shepherd (Wang et al. 2024): from the prefix ending at step k,
                 `rollouts_per_step` completions are sampled; the step's label is
                 `core.monte_carlo_step_labels` of how many reach the right answer (hard: any;
                 soft: the share). The last step's label is the response's own outcome.

Every row also carries the verifier's labels: held-out rows are always scored against them
(eval/step_accuracy measures the truth whatever trained the model), and on training rows they
give the Monte-Carlo labels' agreement with the truth. Rows are built once and cached under
``paths.cache_dir``/process_rows, keyed by what they depend on; only rank 0 writes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import torch

from posttrain.data.datamodule import prompt_text, right_padded
from posttrain.data.examples import Example
from posttrain.data.preference import PreferenceSource
from posttrain.data.steps import step_token_row

log = logging.getLogger("posttrain")

LABEL_SOURCES = ("verifier", "monte_carlo")


@dataclass
class StepRow:
    example: Example
    steps: list[str]       # the response's steps (data/steps.py), special tokens removed
    ended: bool            # the response ended with EOS (not cut by the budget)
    labels: list[float]    # the training label of each step (algorithm.labels)
    verifier: list[float]  # the step verifier's prefix labels (the truth held-out rows are scored against)


class StepSource(PreferenceSource):
    """The step rows of a run by split, behind the task source. The datamodule streams a source
    of fixed rows through `pairs(split)` (the name it has for preference pairs); here they are
    `StepRow`s. Generative pieces (`example`, `is_correct`, ...) delegate to the task."""

    def __init__(self, task, rows_by_split: dict[str, list[StepRow]], labels: str):
        super().__init__(task, rows_by_split, "the embedded step rows")
        self.labels = labels

    def rows(self, split: str) -> list[StepRow]:
        return self.pairs(split)

    @property
    def step_rule(self):
        return self.task.step_rule


def step_summary(source: StepSource) -> dict[str, float]:
    """For summary.json: rows, steps and the share of steps labelled good per split, and with
    Monte-Carlo labels their agreement with the verifier on the training steps
    (eval/label_agreement: a label >= 0.5 read as good)."""
    summary = {}
    for split in source.splits():
        rows = source.rows(split)
        labels = [label for row in rows for label in row.labels]
        summary[f"process/{split}/rows"] = float(len(rows))
        summary[f"process/{split}/steps"] = float(len(labels))
        summary[f"process/{split}/good_share"] = sum(label >= 0.5 for label in labels) / max(1, len(labels))
    if source.labels == "monte_carlo":
        agree = [(label >= 0.5) == (truth >= 0.5) for row in source.rows("train")
                 for label, truth in zip(row.labels, row.verifier)]
        summary["eval/label_agreement"] = sum(agree) / max(1, len(agree))
    return summary


def collate_step_rows(rows: list[StepRow], tokenizer) -> dict:
    """Right-padded PRM rows (`prm_row`: the layout scoring uses) and per step:
    step_ends [B, K] long (the index of each step's last token; 0 past a row's steps),
    step_mask [B, K] bool, labels and verifier [B, K] float (0 past a row's steps)."""
    laid_out = [prm_row(tokenizer, row.example, row.steps, row.ended) for row in rows]
    input_ids, attention_mask, _ = right_padded([ids for ids, _ in laid_out], None, tokenizer.pad_token_id)
    width = max(len(row.steps) for row in rows)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask,
             "step_ends": torch.zeros(len(rows), width, dtype=torch.long),
             "step_mask": torch.zeros(len(rows), width, dtype=torch.bool),
             "labels": torch.zeros(len(rows), width), "verifier": torch.zeros(len(rows), width)}
    for i, (row, (_, ends)) in enumerate(zip(rows, laid_out)):
        count = len(ends)
        batch["step_ends"][i, :count] = torch.tensor(ends)
        batch["step_mask"][i, :count] = True
        batch["labels"][i, :count] = torch.tensor(row.labels)
        batch["verifier"][i, :count] = torch.tensor(row.verifier)
    return batch


# --- building the rows ------------------------------------------------------------------------


def prm_row(tokenizer, sample_or_example, steps: Sequence[str], ended: bool) -> tuple[list[int], list[int]]:
    """A learned PRM's input for one response: the prompt as text tokenised by the PRM's own
    tokenizer, then the steps (see `step_token_row`). Training (algorithm=prm) and scoring share it."""
    example = getattr(sample_or_example, "example", sample_or_example)
    prompt = tokenizer(prompt_text(example, tokenizer), add_special_tokens=False)["input_ids"]
    return step_token_row(tokenizer, prompt, steps, ended)
