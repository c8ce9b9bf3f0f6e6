"""The embedded preference pairs (`preference.source=embedded`): made on the run's task with the
policy it starts from, judged by the task's verifier, built once and cached (see
data/preference.py for the pair format and the dataset source)."""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
from dataclasses import asdict
from pathlib import Path

import torch
from omegaconf import OmegaConf

from posttrain.data.examples import Example
from posttrain.data.preference import (
    DATASET_KEYS,
    DEFAULT_HEADS,
    EMBEDDED_HEADS,
    SPLITS,
    PreferencePair,
    PreferenceSource,
    check_pair_heads,
    check_pairs_fit,
    embedded_heads_problem,
    read_pair_dataset,
)
from posttrain.distributed.collectives import job_rank_and_size
from posttrain.errors import ConfigError, DataError
from posttrain.files import write_json_atomic
from posttrain.prepare.sampling import PolicySampler
from posttrain.rollout.base import decode_responses

log = logging.getLogger("posttrain")

# Bump when the cached file's layout or the way pairs are made changes: old entries are then ignored.
CACHE_VERSION = 2  # 2: a truncated sample's side records that it never generated an EOS


def build_preference_source(cfg, task_source, tokenizer, policy) -> PreferenceSource:
    """From `cfg.preference`: embedded pairs sampled from `policy` (the SFT warm start) where it
    can, perturbed correct solutions otherwise; or a dataset. Embedded pairs are built once and
    cached under paths.cache_dir keyed by what they depend on. A reward model with several heads
    (algorithm.heads) needs each pair to name the head it trains."""
    settings = cfg.preference
    heads = reward_heads(cfg)
    if settings.source == "dataset":
        source = PreferenceSource(task_source, read_pair_dataset(settings), f"preference.path={settings.path!r}")
    elif settings.source == "embedded":
        source = PreferenceSource(task_source, cached_embedded_pairs(cfg, task_source, tokenizer, policy),
                                  "the embedded preference pairs")
    else:
        raise ConfigError(f"preference.source={settings.source!r} is not one of ['embedded', 'dataset']")
    check_pair_heads(source, heads)
    if tokenizer is not None:
        check_pairs_fit(source, tokenizer)
    for split in source.splits():
        shares = ", ".join(f"{kind} {share:.1%}" for kind, share in source.shares(split).items() if share)
        log.info(f"Preference pairs ({settings.source}): {source.size(split)} {split} pairs: {shares}")
    return source


def reward_heads(cfg) -> list[str]:
    """The reward model's heads (algorithm.heads; other preference algorithms have one)."""
    return list(cfg.algorithm.get("heads") or DEFAULT_HEADS)


def cached_embedded_pairs(cfg, task_source, tokenizer, policy) -> dict[str, list[PreferencePair]]:
    """The embedded pairs from the cache, else built (and cached when preference.cache)."""
    if problem := embedded_heads_problem(reward_heads(cfg)):
        raise ConfigError(problem)
    path = embedded_cache_path(cfg)
    if cfg.preference.cache and path.is_file():
        log.info(f"Preference pairs: read from the cache {path}")
        return read_cached_pairs(path, task_source)
    indexed = {split: embedded_pairs(split, count, task_source, tokenizer, policy, cfg)
               for split, count in (("train", cfg.preference.num_train_pairs),
                                    ("validation", cfg.preference.num_validation_pairs))}
    if cfg.preference.cache and job_rank_and_size()[0] == 0:
        # only rank 0 of a job writes (the others made the same pairs: the same seeds); the jobs
        # of a sweep that build them at once write the same content: the last write wins
        write_json_atomic(path, {split: [cached_row(index, pair) for index, pair in rows]
                                 for split, rows in indexed.items()})
    return {split: [pair for _, pair in rows] for split, rows in indexed.items()}


def embedded_cache_path(cfg) -> Path:
    """paths.cache_dir/preference_pairs/<key>.json, the key a hash of what the pairs depend on:
    the policy's starting weights (the warm start's directory is itself a content key), the
    model and task settings, the pair settings and the sampler; never run paths."""
    identity = {group: OmegaConf.to_container(cfg[group], resolve=True) for group in ("model", "data", "preference")}
    identity.update(rollout_engine=cfg.rollout.engine, version=CACHE_VERSION)
    if len(heads := reward_heads(cfg)) > 1:  # one head's pairs (and their cache entries) are those of before
        identity["heads"] = heads
    for key in ("cache", *DATASET_KEYS):
        identity["preference"].pop(key, None)  # settings the embedded pairs do not read
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cfg.paths.cache_dir) / "preference_pairs" / f"{key}.json"


def cached_row(index: int, pair: PreferencePair) -> dict:
    """A pair as stored: its example as the task index it is rebuilt from on reading."""
    row = {k: v for k, v in asdict(pair).items() if k != "example"}
    row["index"] = index
    return row


def read_cached_pairs(path: Path, task_source) -> dict[str, list[PreferencePair]]:
    stored = json.loads(path.read_text())
    return {split: [PreferencePair(**{k: v for k, v in row.items() if k != "index"},
                                   example=task_source.example(split, row["index"])) for row in rows]
            for split, rows in stored.items()}


def embedded_pairs(split: str, count: int, task_source, tokenizer, policy, cfg) -> list[tuple[int, PreferencePair]]:
    """(task index, pair) for each of the first `count` prompts of the task's `split` that gives
    one (see the module doc); with several reward-model heads, a pair per head a prompt gives."""
    settings = cfg.preference
    size = task_source.size(split)
    if size is not None and size < count:
        count = size  # a finite task: every prompt it has
    sampler = PolicySampler(cfg.rollout, tokenizer, policy)
    n = settings.samples_per_prompt
    generator = torch.Generator().manual_seed(settings.seed * len(SPLITS) + SPLITS.index(split))
    rng = random.Random(f"{settings.seed}/{split}")  # the perturbed digits
    heads = reward_heads(cfg)
    makers = {head: EMBEDDED_HEAD_PAIRS[head] for head in heads} if len(heads) > 1 else {None: pair_for_prompt}
    pairs = []
    for start, examples, rollout in sampler.sample_prompts(task_source, split, count, n, settings.temperature,
                                                           cfg.data.max_response_tokens, generator):
        texts = decode_responses(tokenizer, rollout.response_ids, rollout.response_mask)
        # a sample cut by the budget generated no EOS (this sampler runs no repetition check)
        ended = (~rollout.truncated).tolist()
        for offset, example in enumerate(examples):
            rows = slice(offset * n, (offset + 1) * n)
            for head, make_pair in makers.items():
                pair = make_pair(example, texts[rows], task_source, rng, ended=ended[rows])
                if pair is not None:
                    pair.head = head
                    pairs.append((start + offset, pair))
    for head in makers:
        check_pair_count(sum(pair.head == head for _, pair in pairs), count, split, head, cfg)
    return pairs


def check_pair_count(made: int, count: int, split: str, head: str | None, cfg) -> None:
    """Warn when some of `count` prompts gave no pair (for `head`, with several heads); none is an error."""
    what = "preference pair" if head is None else f"preference pair for the head {head!r}"
    why = HOW_PAIRS_FAIL[head or "correct"]
    if made < count:
        log.warning(f"Preference pairs: {count - made} of {count} {split} prompts gave no {what} ({why})")
    if not made:
        raise DataError(f"no {split} {what} could be made from the task (data.source={cfg.data.source}): {why}; "
                        f"use preference.source=dataset")


HOW_PAIRS_FAIL = {
    "correct": "no right and wrong sample, and no digit in the reference answer to change",
    "concise": "no two right responses, the reference among them, of different lengths; a task whose right "
               "answers vary in length, e.g. data.style=mixed, gives some",
}


def pair_for_prompt(example: Example, samples: list[str], task_source, rng: random.Random,
                    ended: list[bool] | None = None) -> PreferencePair | None:
    """On-policy when the samples hold a right and a wrong response, else the reference against
    a perturbed copy; None when neither can be made. `ended`: whether each sample ended with
    EOS (all did, when not given); a pair's side that did not gets no EOS in training."""
    ended = [True] * len(samples) if ended is None else ended
    verdicts = [task_source.is_correct(example, text) for text in samples]
    if any(verdicts) and not all(verdicts):
        chosen, rejected = verdicts.index(True), verdicts.index(False)
        return PreferencePair(example.prompt, samples[chosen], samples[rejected], "on_policy", example.messages,
                              example, chosen_ended=ended[chosen], rejected_ended=ended[rejected])
    rejected = perturb_final_answer(example.response, rng, lambda text: not task_source.is_correct(example, text))
    if rejected is None:
        return None
    return PreferencePair(example.prompt, example.response, rejected, "perturbed", example.messages, example)


def shorter_right_pair(example: Example, samples: list[str], task_source, rng: random.Random | None = None,
                       ended: list[bool] | None = None) -> PreferencePair | None:
    """The shortest right response over the longest (in characters), among the reference and the
    samples that ended (a cut one never finished) and that the verifier accepts; None when they
    all have one length. `rng` is unused (the signature of `pair_for_prompt`)."""
    ended = [True] * len(samples) if ended is None else ended
    right = [text for text, done in zip([example.response, *samples], [True, *ended])
             if done and task_source.is_correct(example, text)]
    if not right:
        return None
    shortest, longest = min(right, key=len), max(right, key=len)
    if len(shortest) == len(longest):
        return None
    return PreferencePair(example.prompt, shortest, longest, "shorter_right", example.messages, example)


# How the embedded task labels each head it can (data.preference.EMBEDDED_HEADS): the pair it makes from a prompt
EMBEDDED_HEAD_PAIRS = dict(zip(EMBEDDED_HEADS, (pair_for_prompt, shorter_right_pair)))


FINAL_NUMBER = re.compile(r"\d+(?!.*\d)", re.DOTALL)  # the last run of digits in a text


def perturb_final_answer(response: str, rng: random.Random, is_wrong) -> str | None:
    """`response` with one digit of its final number (the last run of digits) changed so that
    `is_wrong` accepts it, or None if no single-digit change does. A leading digit never
    becomes 0, so the result still reads as a number of the same length."""
    match = FINAL_NUMBER.search(response)
    if match is None:
        return None
    positions = list(range(match.start(), match.end()))
    rng.shuffle(positions)
    for position in positions:
        leading = position == match.start() and match.end() - match.start() > 1
        digits = [d for d in "0123456789" if d != response[position] and not (leading and d == "0")]
        candidate = response[:position] + rng.choice(digits) + response[position + 1:]
        if is_wrong(candidate):
            return candidate
    return None
