"""Which prompts an online RL step trains on, and when (`data_curriculum` group).

* ``none``: prompts in stream order.
* ``dynamic_sampling`` (DAPO): groups whose rewards all agree carry no signal under
  group baselines; drop them and sample more prompts until the batch is full, at most
  ``max_extra_rounds`` extra generation rounds per step.
* ``pass_rate_filter`` (Kimi k1.5 / Qwen3): estimate each prompt's pass rate under the
  starting policy once (cached on disk, keyed by everything it depends on), then train
  only on prompts whose rate lies in [low, high].
* ``difficulty_schedule``: raise the task's difficulty knob at given steps, or when the
  training accuracy passes a threshold.

The prompt stream is resumable: its cursor and the curriculum's state go into the
Lightning checkpoint.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable

import torch

from posttrain.core.groups import informative_groups
from posttrain.data.datamodule import ExampleCursor
from posttrain.data.sources import Example
from posttrain.errors import ConfigError
from posttrain.utils import write_json_atomic


class Curriculum:
    """`none`: every prompt, in stream order. The base of the others."""

    max_extra_rounds = 0

    def __init__(self, cursor: ExampleCursor):
        self.cursor = cursor

    def setup(self, estimate_pass_rates: Callable[[list[Example]], list[float]], cache_key: str) -> None:
        """Called once before training with a function that scores prompts under the start policy."""

    def next_prompts(self, count: int) -> list[Example]:
        return self.cursor.take(count)

    def keep_groups(self, scores: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
        """[B] bool: which samples' groups stay in the batch."""
        return torch.ones_like(group_index, dtype=torch.bool)

    def on_step_end(self, step: int, train_accuracy: float | None) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict:
        return {"cursor": self.cursor.position}

    def load_state_dict(self, state: dict) -> None:
        self.cursor.position = state["cursor"]


class DynamicSampling(Curriculum):
    """DAPO dynamic sampling: keep only groups with a non-zero reward spread."""

    def __init__(self, cursor: ExampleCursor, max_extra_rounds: int = 3):
        super().__init__(cursor)
        self.max_extra_rounds = max_extra_rounds

    def keep_groups(self, scores: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
        return informative_groups(scores, group_index)


class PassRateFilter(Curriculum):
    """Keep prompts whose pass rate under the starting policy lies in [low, high].

    A pool of ``pool_size`` prompts is scored once; the in-band prompts then become the
    training set, reshuffled (seeded) on every pass.
    """

    def __init__(self, cursor: ExampleCursor, low: float = 0.1, high: float = 0.9, pool_size: int = 512,
                 cache_dir: str | None = None):
        super().__init__(cursor)
        if not 0.0 <= low <= high <= 1.0:
            raise ConfigError(f"data_curriculum: need 0 <= low <= high <= 1, got low={low}, high={high}")
        self.low, self.high, self.pool_size = low, high, pool_size
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.kept: list[Example] = []
        self.position = 0
        self.rates: list[float] = []

    def setup(self, estimate_pass_rates, cache_key: str) -> None:
        pool = ExampleCursor(self.cursor.source, "train", self.cursor.seed, position=0).take(self.pool_size)
        key = hashlib.sha256(f"{cache_key}|{self.pool_size}".encode()).hexdigest()[:16]
        cache = self.cache_dir / f"pass_rates-{key}.json" if self.cache_dir else None
        if cache is not None and cache.is_file():
            self.rates = json.loads(cache.read_text())["rates"]
        else:
            self.rates = list(estimate_pass_rates(pool))
            if cache is not None:
                write_json_atomic(cache, {"rates": self.rates, "key": cache_key})
        self.kept = [e for e, r in zip(pool, self.rates) if self.low <= r <= self.high]
        if not self.kept:
            raise ConfigError(
                f"data_curriculum=pass_rate_filter kept no prompt: all {len(pool)} pass rates fall outside "
                f"[{self.low}, {self.high}] (mean rate {sum(self.rates) / len(self.rates):.2f}); widen the band"
            )

    def next_prompts(self, count: int) -> list[Example]:
        chosen = []
        for _ in range(count):
            epoch, offset = divmod(self.position, len(self.kept))
            order = torch.randperm(len(self.kept), generator=torch.Generator().manual_seed(self.cursor.seed + epoch))
            chosen.append(self.kept[int(order[offset])])
            self.position += 1
        return chosen

    def metrics(self) -> dict[str, float]:
        return {"curriculum/kept_frac": len(self.kept) / max(1, len(self.rates)),
                "curriculum/pool_pass_rate": sum(self.rates) / max(1, len(self.rates))}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.position = state["position"]


class DifficultySchedule(Curriculum):
    """Raise ``max_digits`` (the task's difficulty knob) by one at each milestone step, or
    whenever the mean training accuracy of the last step passes ``accuracy_threshold``,
    up to ``max_level`` extra digits."""

    def __init__(self, cursor: ExampleCursor, milestones: list[int] | None = None,
                 accuracy_threshold: float | None = None, max_level: int = 2):
        super().__init__(cursor)
        if not hasattr(cursor.source, "set_difficulty"):
            raise ConfigError("data_curriculum=difficulty_schedule needs a source with a difficulty knob "
                              "(data=arithmetic)")
        if not milestones and accuracy_threshold is None:
            raise ConfigError("data_curriculum=difficulty_schedule needs milestones or accuracy_threshold")
        self.milestones = sorted(milestones or [])
        self.accuracy_threshold = accuracy_threshold
        self.max_level = max_level
        self.base_digits = cursor.source.task.max_digits
        self.level = 0

    def on_step_end(self, step: int, train_accuracy: float | None) -> dict[str, float]:
        raise_now = step in self.milestones or (
            self.accuracy_threshold is not None and train_accuracy is not None
            and train_accuracy >= self.accuracy_threshold)
        if raise_now and self.level < self.max_level:
            self.level += 1
            self.cursor.source.set_difficulty(max_digits=self.base_digits + self.level)
        return {"curriculum/difficulty_level": float(self.level)}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "level": self.level}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.level = state["level"]
        self.cursor.source.set_difficulty(max_digits=self.base_digits + self.level)


CURRICULA = {
    "none": Curriculum,
    "dynamic_sampling": DynamicSampling,
    "pass_rate_filter": PassRateFilter,
    "difficulty_schedule": DifficultySchedule,
}


def build_curriculum(curriculum_cfg, cursor: ExampleCursor, cache_dir: str | None = None) -> Curriculum:
    options = {k: v for k, v in curriculum_cfg.items() if k != "name"}
    name = curriculum_cfg.name
    if name not in CURRICULA:
        raise ConfigError(f"data_curriculum={name!r} is not one of {sorted(CURRICULA)}")
    if name == "pass_rate_filter":
        options["cache_dir"] = cache_dir
    try:
        return CURRICULA[name](cursor, **options)
    except TypeError as err:
        raise ConfigError(f"data_curriculum={name}: {err}") from None
