"""The step-labelled responses a process reward model trains on (algorithm=prm), sampled from
the policy the run starts from, labelled by the verifier or by Math-Shepherd's Monte-Carlo
completions, built once and cached (see data/process.py for the row format)."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from posttrain import core
from posttrain.data.datamodule import left_padded, prompt_token_ids
from posttrain.data.preference import SPLITS
from posttrain.data.process import LABEL_SOURCES, StepRow, StepSource
from posttrain.data.steps import source_step_rule, split_response
from posttrain.distributed.collectives import job_rank_and_size
from posttrain.errors import ConfigError, DataError
from posttrain.files import write_json_atomic
from posttrain.prepare.sampling import PolicySampler
from posttrain.rewards.base import ScoredSample
from posttrain.rewards.prm import ProcessRewardModel

log = logging.getLogger("posttrain")




# Rows of one Monte-Carlo completion call (prefixes x rollouts_per_step).
COMPLETIONS_PER_CALL = 1024


# Bump when the cached file's layout or the way rows are made changes: old entries are then ignored.
CACHE_VERSION = 1


def build_step_source(cfg, task_source, tokenizer, policy) -> StepSource:
    """The step rows of `cfg.algorithm` (labels, process_data) sampled from `policy` (the SFT
    warm start) on the task: from the cache, else built (and cached when process_data.cache)."""
    labels, settings = cfg.algorithm.labels, cfg.algorithm.process_data
    if labels not in LABEL_SOURCES:
        raise ConfigError(f"algorithm.labels={labels!r} is not one of {list(LABEL_SOURCES)}")
    source_step_rule(task_source)  # a task without a step rule fails here, before any sampling
    path = step_rows_cache_path(cfg)
    if settings.cache and path.is_file():
        log.info(f"Step rows: read from the cache {path}")
        indexed = read_cached_rows(path, task_source)
    else:
        started = time.perf_counter()
        indexed = {"train": step_rows("train", settings.num_train_prompts, labels, task_source, tokenizer, policy, cfg),
                   "validation": step_rows("validation", settings.num_validation_prompts, "verifier", task_source,
                                           tokenizer, policy, cfg)}
        log.info(f"Step rows: sampled and labelled in {time.perf_counter() - started:.1f} s")
        if settings.cache and job_rank_and_size()[0] == 0:
            # only rank 0 of a job writes (the others made the same rows: the same seeds)
            write_json_atomic(path, {split: [cached_row(index, row) for index, row in rows]
                                     for split, rows in indexed.items()})
    source = StepSource(task_source, {split: [row for _, row in rows] for split, rows in indexed.items()}, labels)
    for split in source.splits():
        rows = source.rows(split)
        log.info(f"Step rows ({labels if split == 'train' else 'verifier'} labels): {len(rows)} {split} responses, "
                 f"{sum(len(row.steps) for row in rows)} steps")
    return source


def step_rows_cache_path(cfg) -> Path:
    """paths.cache_dir/process_rows/<key>.json, the key a hash of what the rows depend on: the
    policy's starting weights (the warm start's directory is itself a content key), the model
    and task settings, the label source and data settings and the sampler; never run paths."""
    identity = {group: OmegaConf.to_container(cfg[group], resolve=True) for group in ("model", "data")}
    identity["process_data"] = OmegaConf.to_container(cfg.algorithm.process_data, resolve=True)
    unread = ("cache",) if cfg.algorithm.labels == "monte_carlo" else ("cache", "rollouts_per_step", "hard_labels")
    for key in unread:
        identity["process_data"].pop(key, None)  # settings these rows do not depend on
    identity.update(labels=cfg.algorithm.labels, rollout_engine=cfg.rollout.engine, version=CACHE_VERSION)
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cfg.paths.cache_dir) / "process_rows" / f"{key}.json"


def cached_row(index: int, row: StepRow) -> dict:
    """A row as stored: its example as the task index it is rebuilt from on reading."""
    return {"index": index, "steps": row.steps, "ended": row.ended, "labels": row.labels, "verifier": row.verifier}


def read_cached_rows(path: Path, task_source) -> dict[str, list[tuple[int, StepRow]]]:
    stored = json.loads(path.read_text())
    return {split: [(row["index"], StepRow(task_source.example(split, row["index"]), row["steps"], row["ended"],
                                           row["labels"], row["verifier"])) for row in rows]
            for split, rows in stored.items()}


def step_rows(split: str, count: int, labels: str, task_source, tokenizer, policy, cfg) -> list[tuple[int, StepRow]]:
    """(task index, row) for `samples_per_prompt` sampled responses to each of the first `count`
    prompts of `split`, labelled by `labels` (see the module doc)."""

    settings = cfg.algorithm.process_data
    size = task_source.size(split)
    if size is not None and size < count:
        count = size  # a finite task: every prompt it has
    rule = source_step_rule(task_source)
    oracle = ProcessRewardModel(model="oracle")  # prefix scores: 1 until the first wrong step
    n = settings.samples_per_prompt
    generator = torch.Generator().manual_seed(settings.seed * len(SPLITS) + SPLITS.index(split))
    sampler = PolicySampler(cfg.rollout, tokenizer, policy)
    rows: list[tuple[int, StepRow]] = []
    responses: list[tuple[list[int], list[int]]] = []  # each row's (response ids with its EOS, step ends): MC prefixes
    for start, examples, rollout in sampler.sample_prompts(task_source, split, count, n, settings.temperature,
                                                           cfg.data.max_response_tokens, generator):
        cut = rollout.truncated | rollout.repeated  # no EOS: the PRM row ends without one
        for i, (ids, mask) in enumerate(zip(rollout.response_ids, rollout.response_mask)):
            example = examples[i // n]
            response = ids[mask.bool()].tolist()
            steps = split_response(rule, tokenizer, response)
            sample = ScoredSample(example, "".join(steps.texts), len(response), bool(cut[i]), group=start + i // n,
                                  steps=steps.texts)
            truth = oracle.oracle(sample, task_source)
            rows.append((start + i // n, StepRow(example, steps.texts, not bool(cut[i]), list(truth), list(truth))))
            responses.append((response, steps.ends))
    if not rows:
        raise DataError(f"no {split} prompt to sample step rows from (process_data.num_{split}_prompts={count})")
    if labels == "monte_carlo":
        monte_carlo_labels([row for _, row in rows], responses, task_source, tokenizer, sampler, cfg,
                           torch.Generator().manual_seed(settings.seed * len(SPLITS) + SPLITS.index(split) + 7919))
    return rows


def monte_carlo_labels(rows: list[StepRow], responses: list[tuple[list[int], list[int]]], task_source, tokenizer,
                       sampler, cfg, generator) -> None:
    """Math-Shepherd labels in place: for each step k but the last of each row, `rollouts_per_step`
    completions of prompt + the response up to step k's last token, sampled at the data
    temperature within the response budget; label = core.monte_carlo_step_labels(correct
    completions). The last step keeps the outcome (is the whole response right?)."""
    settings = cfg.algorithm.process_data
    budget, n = cfg.data.max_response_tokens, settings.rollouts_per_step
    # one prefix per step but the last: (row, step, the response tokens up to the step's end)
    prefixes = []
    for r, (response, ends) in enumerate(responses):
        prefixes += [(r, k, response[:end + 1]) for k, end in enumerate(ends[:-1])]
    prefixes.sort(key=lambda item: len(item[2]))  # alike lengths share a call: its budget is their longest remainder
    correct = torch.zeros(len(prefixes), dtype=torch.long)
    per_call = max(1, COMPLETIONS_PER_CALL // n)
    for start in range(0, len(prefixes), per_call):
        chunk = prefixes[start:start + per_call]
        prompt_rows = [prompt_token_ids(rows[r].example, tokenizer) + prefix for r, _, prefix in chunk]
        prompt_ids, prompt_mask = left_padded(prompt_rows, tokenizer.pad_token_id)
        rollout = sampler.generate(prompt_ids.repeat_interleave(n, dim=0), prompt_mask.repeat_interleave(n, dim=0),
                                   settings.temperature, budget - len(chunk[0][2]), generator)
        for j, (ids, mask) in enumerate(zip(rollout.response_ids, rollout.response_mask)):
            r, _, prefix = chunk[j // n]
            completion = ids[mask.bool()].tolist()[:budget - len(prefix)]  # the response's own budget
            text = tokenizer.decode(prefix + completion, skip_special_tokens=True)
            correct[start + j // n] += int(task_source.is_correct(rows[r].example, text))
    labels = core.monte_carlo_step_labels(correct, n, hard=settings.hard_labels).tolist()
    for (r, k, _), label in zip(prefixes, labels):
        rows[r].labels[k] = float(label)
    for row in rows:  # the last step: the response's outcome
        row.labels[-1] = float(task_source.is_correct(row.example, "".join(row.steps)))
