"""The objects the reward layer passes around: one scored completion in, one
`RewardOutput` per batch out, and the `RewardFunction` protocol every scorer follows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from posttrain.data.examples import Example


@dataclass
class ScoredSample:
    """One sampled completion, built by the RL module."""

    example: Example   # prompt, reference response, answer
    response: str      # decoded text, special tokens stripped
    length: int        # response length in tokens (incl. EOS if generated)
    truncated: bool    # hit the generation budget without EOS
    group: int         # id shared by the G completions of one prompt
    repeated: bool = False  # stopped early because it started looping (rollout.repetition)
    steps: list[str] | None = None  # the response split into steps (data/steps.py), for process rewards
    prm_stopped: bool = False  # cut after a step its PRM scored below rollout.prm_stop_below
    # --- an episode of an environment (envs/): `response` is then its last policy turn ---
    env_return: float | None = None    # the environment's rewards, summed over the turns
    env_correct: bool | None = None    # the environment's verdict, where it gave one (accuracy reads it first)
    transcript: list[dict] | None = None  # [{"role": "policy" | "env", "text"}] the whole episode

    @property
    def ended(self) -> bool:
        """Whether the response ended with EOS (not cut by the budget, a loop or the PRM)."""
        return not (self.truncated or self.repeated or self.prm_stopped)


class RewardFunction(Protocol):
    """A scorer: the whole batch in, one score per sample out.

    Batched rather than per sample because some rewards compare the completions of one
    prompt (the Kimi length reward needs the group's shortest and longest response).
    """

    name: str

    def __call__(self, samples: Sequence[ScoredSample], source) -> torch.Tensor | list[float]: ...


@dataclass
class RewardOutput:
    total: torch.Tensor                  # [B] float32, weighted sum of the components
    components: dict[str, torch.Tensor]  # name -> [B] float32 unweighted scores
    metrics: dict[str, float]            # rewards/<name>/mean, rewards/total/mean, rewards/<name>/errors
    correct: torch.Tensor | None         # [B] bool from the `accuracy` component, None without one
    # per sample, the weighted step rewards of a process reward component (reward=prm), whose
    # sum is that component's weighted part of `total`; None without one
    step_rewards: list[list[float]] | None = None


def describe_sample(samples: Sequence[ScoredSample], index: int) -> str:
    """How an error names a sample: enough to find it in a log without dumping it all."""
    sample = samples[index]
    return (f"sample {index} (group {sample.group}, prompt {_clip(sample.example.prompt, 120)!r}, "
            f"response {_clip(sample.response, 80)!r})")


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
