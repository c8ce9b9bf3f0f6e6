"""The reward of a mixture of sources (data=mixture, data/mixture.py): each sample scored by its
own source's reward, with its own source judging it.

Samples are split by the source their example names (`Example.source`); each source's samples
go, together, to that source's reward — the run's reward, or `data.mixture.<name>.reward` where
given — called with that source (not the mixture), so everything a component asks the source
(`is_correct`, `has_style`, `format_score`, the step labels, the verifier's timeouts) is asked
of the source that made the example. A group never spans sources (its samples share a prompt),
so a component that compares a group's samples sees its whole group. The outputs are put back
in the batch's order; a component one source's reward lacks scores that source's samples 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Sequence

import torch
from omegaconf import DictConfig, OmegaConf

from posttrain.errors import ConfigError
from posttrain.rewards.base import RewardOutput, ScoredSample
from posttrain.rewards.composite import ACCURACY, CompositeReward

# An override replaces the run's reward node key by key: `components` whole (a source's reward
# is the components it lists), `on_error` and `failure_score` where it sets them.
OVERRIDE_KEYS = ("components", "on_error", "failure_score")
# Metrics that count (summed over the sources); the others are means (weighted by samples).
COUNTED = ("/errors", "rewards/verifier_timeouts")


def source_reward_config(run_reward: Any, override: Mapping | None, name: str) -> dict:
    """The reward node of source `name`: the run's, with `override`'s keys in place of its own."""
    run_reward = OmegaConf.to_container(run_reward, resolve=True) if isinstance(run_reward, DictConfig) else dict(
        run_reward)
    if override is None:
        return run_reward
    key = f"data.mixture.{name}.reward"
    if isinstance(override, DictConfig):
        override = OmegaConf.to_container(override, resolve=True)
    if not isinstance(override, Mapping):
        raise ConfigError(f"{key} must be null or a reward node such as {{components: {{accuracy: {{weight: 1.0}}, "
                          f"format: {{weight: 0.2}}}}}}, got {override!r}")
    unknown = sorted(set(override) - set(OVERRIDE_KEYS))
    if unknown:
        raise ConfigError(f"{key}: unknown key(s) {unknown}; valid keys: {', '.join(OVERRIDE_KEYS)}")
    return {**run_reward, **override}


class MixtureReward:
    """Each source's samples scored by `rewards[name]` with `sources[name]` (module docstring)."""

    def __init__(self, rewards: dict[str, CompositeReward], sources: dict[str, Any], default: CompositeReward):
        judged = {name: any(fn.name == ACCURACY for fn, _ in reward.components) for name, reward in rewards.items()}
        if len(set(judged.values())) > 1:
            without = sorted(name for name, has in judged.items() if not has)
            raise ConfigError(f"data.mixture: the reward of {without} has no accuracy component while the others' "
                              f"have one; rollout accuracy needs a verdict on every sample: give every source's "
                              f"reward an accuracy component, or none")
        self.rewards, self.sources, self.default = rewards, sources, default
        # what the trainer reads of a reward (the environment's weight, the process reward's
        # component): the run's reward's, which each source's reward replaces only in its scores
        self.components = default.components

    def weight_of(self, name: str) -> float:
        return self.default.weight_of(name)

    def set_step(self, step: int) -> None:
        for reward in self.rewards.values():
            reward.set_step(step)

    def __call__(self, samples: Sequence[ScoredSample], source=None) -> RewardOutput:
        rows: dict[str, list[int]] = {}
        for i, sample in enumerate(samples):
            if sample.example.source not in self.rewards:
                raise ConfigError(f"a sample's example names source {sample.example.source!r}, which is not one of "
                                  f"data.mixture's {list(self.rewards)}")
            rows.setdefault(sample.example.source, []).append(i)
        outputs = {name: self.rewards[name]([samples[i] for i in index], self.sources[name])
                   for name, index in rows.items()}
        return combined(outputs, rows, len(samples))


def combined(outputs: dict[str, RewardOutput], rows: dict[str, list[int]], batch: int) -> RewardOutput:
    """The sources' outputs as one, in the batch's order (each source's samples at `rows[name]`)."""
    total = torch.zeros(batch, dtype=torch.float32)
    components: dict[str, torch.Tensor] = {}
    correct = torch.zeros(batch, dtype=torch.bool)
    has_verdicts = all(out.correct is not None for out in outputs.values())
    step_rewards: list | None = [None] * batch
    for name, out in outputs.items():
        index = torch.tensor(rows[name])
        total[index] = out.total
        for component, scores in out.components.items():
            components.setdefault(component, torch.zeros(batch, dtype=torch.float32))[index] = scores
        if has_verdicts:
            correct[index] = out.correct
        for i, rewards in zip(rows[name], out.step_rewards or [None] * len(rows[name])):
            step_rewards[i] = rewards
    if any(r is None for r in step_rewards):
        if any(r is not None for r in step_rewards):
            raise ConfigError("data.mixture: a process reward (reward=prm) scores the steps of some sources' samples "
                              "but not of others'; give every source's reward the same process reward, or none")
        step_rewards = None
    return RewardOutput(total=total, components=components, metrics=combined_metrics(outputs, rows),
                        correct=correct if has_verdicts else None, step_rewards=step_rewards)


def combined_metrics(outputs: dict[str, RewardOutput], rows: dict[str, list[int]]) -> dict[str, float]:
    """Counts summed; means over every sample whose reward reports them (each source's mean
    weighted by its samples), so rewards/<component>/mean is that component's mean over the
    samples it scored."""
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for name, out in outputs.items():
        for key, value in out.metrics.items():
            counted = key.endswith(COUNTED)
            weight = 1.0 if counted else float(len(rows[name]))
            sums[key] = sums.get(key, 0.0) + weight * value
            weights[key] = weights.get(key, 0.0) + (0.0 if counted else weight)
    return {key: value / weights[key] if weights[key] else value for key, value in sums.items()}


def build_mixture_reward(reward_cfg, mixture, build: Callable[..., CompositeReward]) -> MixtureReward:
    """`build(reward_cfg, source)` (rewards/build.py's build_reward with the run's settings) for
    the run's reward (shared by several sources: built with none) and each source's own (built
    with the source it judges)."""
    default = build(reward_cfg, None)
    rewards = {name: default if mixture.rewards.get(name) is None else
               build(source_reward_config(reward_cfg, mixture.rewards[name], name), mixture.sources[name])
               for name in mixture.source_names}
    return MixtureReward(rewards, mixture.sources, default)
