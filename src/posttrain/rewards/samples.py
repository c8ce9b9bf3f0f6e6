"""A rollout batch as reward samples: each response decoded, with its example, group, length,
truncation and repetition flags, and (with the task's step rule) its steps."""

from __future__ import annotations

from posttrain.data.steps import split_response
from posttrain.rewards import ScoredSample
from posttrain.rewards.base import ScoredSample
from posttrain.rollout.base import decode_responses


def rollout_samples(tokenizer, batch, examples, groups, step_rule=None) -> tuple[list, list[list[int]] | None]:
    """Each response of a rollout batch as a reward sample (`examples`, `groups`: one per row);
    with a step rule (data/steps.py) also split into steps. Returns (the samples, each row's step
    ends, the index of each step's last token, or None without a rule). Online RL's rewards and
    best-of-N's judges see responses through here."""
    texts = decode_responses(tokenizer, batch.response_ids, batch.response_mask)
    samples = [ScoredSample(example, text, int(length), bool(cut), group, repeated=bool(looped))
               for example, text, length, cut, group, looped in zip(examples, texts, batch.response_lengths().tolist(),
                                                                    batch.truncated, groups, batch.repeated)]
    if step_rule is None:
        return samples, None
    step_ends = []
    for sample, ids, mask in zip(samples, batch.response_ids, batch.response_mask):
        steps = split_response(step_rule, tokenizer, ids[mask.bool()].tolist())
        sample.steps = steps.texts
        step_ends.append(steps.ends)
    return samples, step_ends


def held_out_samples(examples, texts, lengths, truncated) -> list:
    """Held-out responses as reward samples, each its own group (no group to compare with)."""
    return [ScoredSample(example, text, int(length), bool(cut), group)
            for group, (example, text, length, cut) in enumerate(zip(examples, texts, lengths, truncated))]
