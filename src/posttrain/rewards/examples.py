"""A user-defined reward, as a template for `_target_:` components.

    reward:
      components:
        accuracy: {weight: 1.0}
        steps: {weight: 0.2, _target_: posttrain.rewards.examples.step_accuracy}

Any importable function with this signature works: the batch of `ScoredSample`s and the
task source in, one float per sample out (a list or a [B] tensor). Extra options in its
config entry arrive as keyword arguments.
"""

from __future__ import annotations

from typing import Sequence

from posttrain.rewards.base import ScoredSample


def step_accuracy(samples: Sequence[ScoredSample], source, empty_score: float = 0.0) -> list[float]:
    """Fraction of the written steps that are right (`source.step_correctness`, e.g. the
    column additions of a verbose arithmetic solution); `empty_score` when none are written."""
    scores = []
    for sample in samples:
        steps = source.step_correctness(sample.example, sample.response)
        scores.append(sum(steps) / len(steps) if steps else float(empty_score))
    return scores
