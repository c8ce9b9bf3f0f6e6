"""Weighted sum of reward components, each scored, checked and logged apart.

A reward function that crashes or returns NaN must never turn into a silent zero: it
either stops the run with a `RewardError` naming the component and the sample
(`on_error="raise"`), or, with `on_error="fail"`, gives just the offending samples
`failure_score` and counts them in `rewards/<name>/errors`.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from posttrain.errors import RewardError
from posttrain.rewards.base import RewardFunction, RewardOutput, ScoredSample, describe_sample

ON_ERROR_MODES = ("raise", "fail")

# The component whose full-credit score (1.0) marks a sample correct; `accuracy` may be the
# built-in verifier or a user's own (`accuracy: {_target_: ...}`).
ACCURACY = "accuracy"


class CompositeReward:
    def __init__(self, components: list[tuple[RewardFunction, float]], on_error: str = "raise",
                 failure_score: float = 0.0):
        if on_error not in ON_ERROR_MODES:
            raise ValueError(f"on_error must be one of {ON_ERROR_MODES}, got {on_error!r}")
        if not math.isfinite(failure_score):
            raise ValueError(f"failure_score must be a finite number, got {failure_score!r}")
        names = [fn.name for fn, _ in components]
        if len(set(names)) != len(names):
            raise ValueError(f"reward component names must be unique, got {names}")
        if not components:
            raise ValueError("a composite reward needs at least one component")
        self.components = [(fn, float(weight)) for fn, weight in components]
        self.on_error = on_error
        self.failure_score = float(failure_score)

    def weight_of(self, name: str) -> float:
        """The weight of component `name` (0 when it is not one of them)."""
        return next((weight for fn, weight in self.components if fn.name == name), 0.0)

    def set_step(self, step: int) -> None:
        """Tell the components that count rollout batches (a warm-up) which batch is scored next."""
        for fn, _ in self.components:
            if hasattr(fn, "set_step"):
                fn.set_step(step)

    def __call__(self, samples: Sequence[ScoredSample], source) -> RewardOutput:
        batch = len(samples)
        total = torch.zeros(batch, dtype=torch.float32)
        components: dict[str, torch.Tensor] = {}
        metrics: dict[str, float] = {}
        correct = None
        step_rewards = None
        for fn, weight in self.components:
            scores, failed = self._score(fn, samples, source)
            components[fn.name] = scores
            total += weight * scores
            take_step_rewards = getattr(fn, "take_step_rewards", None)  # a process reward's per-step split
            if take_step_rewards is not None and weight:
                step_rewards = weighted_step_rewards(take_step_rewards(samples), samples, scores, weight)
            metrics[f"rewards/{fn.name}/mean"] = _mean(scores)
            take_metrics = getattr(fn, "take_metrics", None)  # a component's own stats (an ensemble's spread)
            if take_metrics is not None:
                metrics.update(take_metrics())
            if self.on_error == "fail":
                metrics[f"rewards/{fn.name}/errors"] = float(failed.sum())
            if fn.name == ACCURACY:
                # a sample whose verifier failed is not known to be correct, whatever failure_score is
                correct = (scores == 1.0) & ~failed
        if correct is None and samples and all(s.env_correct is not None for s in samples):
            correct = torch.tensor([bool(s.env_correct) for s in samples])  # no verifier: the environment's verdicts
        metrics["rewards/total/mean"] = _mean(total)
        # answer checks cut by data.verify_timeout_s counted as wrong: logged, never silent
        take_timeouts = getattr(source, "take_verifier_timeouts", None)
        if take_timeouts is not None:
            metrics["rewards/verifier_timeouts"] = float(take_timeouts())
        return RewardOutput(total=total, components=components, metrics=metrics, correct=correct,
                            step_rewards=step_rewards)

    def _score(self, fn: RewardFunction, samples: Sequence[ScoredSample], source) -> tuple[torch.Tensor, torch.Tensor]:
        """[B] scores of one component and [B] bool marking samples that got failure_score."""
        batch = len(samples)
        try:
            scores = self._call(fn, samples, source)
        except RewardError:
            raise  # malformed output (not a per-sample problem): nothing to retry
        except Exception as err:
            return self._retry_per_sample(fn, samples, source, err)
        bad = ~torch.isfinite(scores)
        if bool(bad.any()):
            first = int(bad.nonzero()[0])
            if self.on_error == "raise":
                raise RewardError(f"reward component {fn.name!r} returned {scores[first].item()} "
                                  f"for {describe_sample(samples, first)}; "
                                  f"{int(bad.sum())} of {batch} scores are NaN/inf")
            scores = torch.where(bad, torch.tensor(self.failure_score), scores)
        return scores, bad

    def _retry_per_sample(self, fn, samples, source, batch_error: Exception):
        """The batch call raised: score each sample alone to find the culprits.

        Survivors are then scored again together, so a component that compares samples
        within a group (length rewards) sees its groups, less the culprits.
        """
        failed = torch.zeros(len(samples), dtype=torch.bool)
        for index in range(len(samples)):
            try:
                self._call(fn, [samples[index]], source)
            except RewardError:
                raise
            except Exception as err:
                if self.on_error == "raise":
                    raise RewardError(f"reward component {fn.name!r} raised on {describe_sample(samples, index)}: "
                                      f"{type(err).__name__}: {err}") from err
                failed[index] = True
        if not bool(failed.any()):
            # every sample passes alone: the failure comes from the batch as a whole
            raise RewardError(f"reward component {fn.name!r} raised on a batch of {len(samples)} samples, "
                              f"but on none of them alone: {type(batch_error).__name__}: {batch_error}") from batch_error
        scores = torch.full((len(samples),), self.failure_score, dtype=torch.float32)
        keep = (~failed).nonzero().flatten().tolist()
        if keep:
            # the same checks again (NaN, or raising only together, which stops the run)
            kept_scores, kept_failed = self._score(fn, [samples[i] for i in keep], source)
            scores[keep] = kept_scores
            failed[keep] = kept_failed
        return scores, failed

    def _call(self, fn: RewardFunction, samples: Sequence[ScoredSample], source) -> torch.Tensor:
        """Call a component and turn its answer into [B] float32 on CPU, or say why it can't."""
        raw = fn(samples, source)
        try:
            scores = torch.as_tensor(raw.detach() if torch.is_tensor(raw) else raw, dtype=torch.float32).cpu()
        except (TypeError, ValueError, RuntimeError) as err:
            raise RewardError(f"reward component {fn.name!r} must return [B] scores (a tensor or a list of "
                              f"floats), got {type(raw).__name__}: {err}") from None
        if scores.dim() != 1 or scores.numel() != len(samples):
            raise RewardError(f"reward component {fn.name!r} returned shape {tuple(scores.shape)} for "
                              f"{len(samples)} samples; expected [{len(samples)}] (one score per sample)")
        return scores


def weighted_step_rewards(per_sample: list[list[float] | None], samples: Sequence[ScoredSample],
                          scores: torch.Tensor, weight: float) -> list[list[float]]:
    """weight x each sample's step rewards. A sample the component did not score itself (it got
    failure_score, on_error=fail) has its whole score on its last step."""
    out = []
    for rewards, sample, score in zip(per_sample, samples, scores.tolist()):
        if rewards is None:
            rewards = [0.0] * (max(len(sample.steps or []), 1) - 1) + [score]
        out.append([weight * r for r in rewards])
    return out


def _mean(x: torch.Tensor) -> float:
    return float(x.mean()) if x.numel() else 0.0  # a mean of nothing is 0, never NaN
