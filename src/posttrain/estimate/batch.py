"""The sizes of one rollout batch: the prompts' width (from the data when not given), the
generation budget, the update's micro-batches and the held-out eval batch, on one device."""

from __future__ import annotations

import math
from dataclasses import dataclass

from posttrain.data.datamodule import prompt_token_ids
from posttrain.data.sources import build_source
from posttrain.errors import DataError

PROMPTS_SAMPLED = 64  # training prompts tokenised to find the prompt length (the longest of them)


@dataclass(frozen=True)
class Batch:
    """The sizes of one rollout batch on one device and of the update's micro-batch."""

    prompts: int           # unique prompts per rollout batch (algorithm.prompts_per_step)
    rows: int              # sampled responses: prompts x group_size
    prompt_tokens: int     # padded prompt width
    response_tokens: int   # generation budget (every response assumed full)
    micro_rows: int        # rows in one forward + backward of the update
    micro_prompts: int     # unique prompts in it (a group's rows share their prompt's forward)
    micro_batches: int     # forwards + backwards per optimiser step
    optimiser_steps: int   # ppo_epochs x num_minibatches per rollout batch
    eval_rows: int         # held-out prompts per eval generate call
    eval_tokens: int       # their generation budget


def task_source(cfg, prompt_tokens: int | None):
    """The task's source, when the estimate needs it: the embedded model's alphabet, or the
    prompts' length (neither `--prompt-tokens` nor data.max_prompt_tokens given); None else, so
    that a hub dataset out of reach does not stop an estimate that does not read it."""
    if cfg.model.get("name_or_path") is not None and (prompt_tokens or cfg.data.get("max_prompt_tokens")):
        return None
    try:
        return build_source(cfg.data)
    except DataError as err:
        raise DataError(f"{err} (posttrain-estimate reads the data only for the prompts' length: give it with "
                        f"--prompt-tokens N or data.max_prompt_tokens=N)") from err


def prompt_length(cfg, source, tokenizer) -> int:
    """The padded prompt width: data.max_prompt_tokens when set, else the longest of the first
    `PROMPTS_SAMPLED` training prompts as the model sees them."""
    if cfg.data.get("max_prompt_tokens"):
        return int(cfg.data.max_prompt_tokens)
    available = source.size("train")
    count = PROMPTS_SAMPLED if available is None else min(PROMPTS_SAMPLED, available)
    return max(len(prompt_token_ids(source.example("train", i), tokenizer)) for i in range(count))


def batch_of(cfg, prompt_tokens: int, response_tokens: int | None) -> Batch:
    algorithm = cfg.algorithm
    online = algorithm.get("kind") == "online"
    prompts = int(algorithm.get("prompts_per_step", 1)) if online else 1
    group = int(algorithm.get("group_size", 1)) if online else 1
    rows = prompts * group if online else int(algorithm.get("batch_size", 1))
    minibatches = int(algorithm.get("num_minibatches", 1) or 1)
    minibatch_rows = math.ceil(rows / minibatches)
    micro_rows = min(int(algorithm.get("micro_batch_size") or minibatch_rows), minibatch_rows)
    response_tokens = response_tokens or int(cfg.rollout.get("max_new_tokens") or cfg.data.max_response_tokens)
    if algorithm.get("micro_batch_tokens"):  # every response full: as many whole rows as the budget holds (>= 1)
        micro_rows = min(micro_rows, max(1, int(algorithm.micro_batch_tokens) // (prompt_tokens + response_tokens)))
    # rows stay in batch order in one minibatch: groups stay whole when the micro-batch holds
    # whole groups (by tokens too: rows of equal length keep their order); a random minibatch
    # splits them (every row then runs its own prompt)
    shares_prompts = online and minibatches == 1 and micro_rows % group == 0
    return Batch(prompts=prompts, rows=rows, prompt_tokens=prompt_tokens, response_tokens=response_tokens,
                 micro_rows=micro_rows, micro_prompts=micro_rows // group if shares_prompts else micro_rows,
                 micro_batches=math.ceil(minibatch_rows / micro_rows),
                 optimiser_steps=int(algorithm.get("ppo_epochs", 1) or 1) * minibatches,
                 eval_rows=min(int(cfg.eval.batch_size), int(cfg.eval.num_prompts)),
                 eval_tokens=int(cfg.eval.max_new_tokens))
