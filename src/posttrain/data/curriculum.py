"""Which prompts an online RL step trains on, and when (`data_curriculum` group).

* ``none``: prompts in stream order.
* ``dynamic_sampling`` (DAPO): groups whose rewards (or verifier accuracies, with
  ``filter_on: accuracy``) all agree carry no signal under group baselines; drop them and
  sample more prompts until the batch is full, at most ``max_extra_rounds`` extra
  generation rounds per step.
* ``pass_rate_filter`` (Kimi k1.5 / Qwen3): estimate each prompt's pass rate under the
  starting policy once (cached on disk, keyed by the prompt pool, the starting weights and
  the estimation settings; see `pass_rate_cache_key`), then train only on prompts whose
  rate lies in [low, high].
* ``difficulty_schedule``: raise the task's difficulty knob (arithmetic's ``max_digits``,
  word problems' ``max_steps``) at given steps, or when the training accuracy passes a
  threshold.

The prompt stream is resumable: its cursor and the curriculum's state go into the
Lightning checkpoint. Under data parallelism each rank holds a cursor with its own
``rank``/``world_size`` and draws prompts disjoint from the other ranks'.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Callable

import torch

from posttrain.core.groups import informative_groups
from posttrain.data.datamodule import ExampleCursor
from posttrain.data.examples import Example
from posttrain.errors import ConfigError
from posttrain.files import write_json_atomic

EstimatePassRates = Callable[[list[Example]], list[float]]
# The starting weights' fingerprint, computed when called: only a curriculum that scores its
# pool reads it, and hashing a large (sharded) policy is not free.
WeightsFingerprint = Callable[[], str]


def _plain(value):
    """JSON-ready copy of settings (dicts, DictConfigs, dataclasses, lists), keys sorted later."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):  # lists, tuples, ListConfigs
        return [_plain(v) for v in value]
    return value


def _digest(payload) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=repr).encode()).hexdigest()


def _example_fields(example: Example) -> dict:
    # every field: a reward may read any of them (the verifier reads prompt and answer)
    return dataclasses.asdict(example) if dataclasses.is_dataclass(example) else dict(vars(example))


def pool_digest(prompts: list[Example]) -> str:
    """Identifies a prompt pool by content, so a resume can tell whether it rebuilt the same one."""
    return _digest([_example_fields(e) for e in prompts])


def pass_rate_cache_key(prompts: list[Example], start_weights_fingerprint: str, settings: dict) -> str:
    """Cache key of pass rates: they depend on exactly the prompts scored (all their fields,
    hence the data config that produced them), the starting weights, and how they were
    estimated (`settings`: samples per prompt, sampling params, the reward that decides
    correctness - whatever else the caller's scoring depends on)."""
    if not isinstance(start_weights_fingerprint, str):
        raise TypeError(f"start_weights_fingerprint must be a str, got {type(start_weights_fingerprint).__name__}")
    payload = {"pool": pool_digest(prompts), "start_weights": start_weights_fingerprint,
               "settings": _plain(settings)}
    return _digest(payload)[:16]


class Curriculum:
    """`none`: every prompt, in stream order. The base of the others."""

    max_extra_rounds = 0

    def __init__(self, cursor: ExampleCursor):
        self.cursor = cursor

    def setup(self, estimate_pass_rates: EstimatePassRates, fingerprint: WeightsFingerprint,
              settings: dict) -> None:
        """Called before training (after a resume: after `load_state_dict`).

        ``estimate_pass_rates(prompts) -> [len(prompts)] floats in [0, 1]``: each prompt's
        pass rate under the starting policy. ``fingerprint()`` identifies the starting
        weights and ``settings`` (a JSON-like dict) how rates are estimated; both feed the
        on-disk cache key (`pass_rate_cache_key`). A curriculum restored from a checkpoint
        must call neither: the weights are no longer the starting ones.
        """

    def next_prompts(self, count: int) -> list[Example]:
        """This rank's next ``count`` prompts (disjoint from the other ranks')."""
        return self.cursor.take(count)

    def keep_groups(self, scores: torch.Tensor, correct: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
        """[B] bool: which samples' groups stay in the batch.

        ``scores``: [B] total rewards; ``correct``: [B] float verifier accuracy (NaN when
        the reward has no accuracy term); ``group_index``: [B] group of each sample.
        """
        return torch.ones_like(group_index, dtype=torch.bool)

    def on_step_end(self, step: int, train_accuracy: float | None) -> dict[str, float]:
        """After optimiser step ``step`` (1-based); returns metrics to log.

        ``train_accuracy`` is the PRE-filter accuracy of the step's first sampling round
        (None without an accuracy reward): after dynamic sampling drops uniform groups the
        kept batch's accuracy is pulled towards 0.5, which would bias difficulty decisions.
        """
        return {}

    def state_dict(self) -> dict:
        return {"cursor": self.cursor.position}

    def load_state_dict(self, state: dict) -> None:
        self.cursor.position = state["cursor"]


class DynamicSampling(Curriculum):
    """DAPO dynamic sampling: keep only groups with a non-zero spread of ``filter_on``.

    ``reward`` (default) filters on total scores; ``accuracy`` on verifier correctness, so
    shaping terms (length, format) cannot keep a group whose answers are all right or all
    wrong."""

    FILTER_ON = ("accuracy", "reward")

    def __init__(self, cursor: ExampleCursor, max_extra_rounds: int = 3, filter_on: str = "reward"):
        super().__init__(cursor)
        if filter_on not in self.FILTER_ON:
            raise ConfigError(f"data_curriculum.filter_on={filter_on!r} is not one of {list(self.FILTER_ON)}")
        self.max_extra_rounds = max_extra_rounds
        self.filter_on = filter_on

    def keep_groups(self, scores: torch.Tensor, correct: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
        if self.filter_on == "reward":
            return informative_groups(scores, group_index)
        if correct is None or torch.isnan(correct.float()).any():
            raise ConfigError("data_curriculum.filter_on=accuracy needs a verifier accuracy for every sample, but the "
                              "reward has no accuracy term (correct is NaN); add one or set "
                              "data_curriculum.filter_on=reward")
        return informative_groups(correct, group_index)


class PassRateFilter(Curriculum):
    """Keep prompts whose pass rate under the starting policy lies in [low, high].

    A pool of ``pool_size`` prompts (the first of the single-process stream, the same on
    every rank) is scored once; the in-band prompts then become the training set,
    reshuffled (seeded) on every pass. Rank r of W takes positions r, r+W, ... of that
    shuffled order. The rates and kept pool indices go into the checkpoint, so a resumed
    run trains on the same prompts instead of re-scoring them with trained weights.
    """

    def __init__(self, cursor: ExampleCursor, low: float = 0.1, high: float = 0.9, pool_size: int = 512,
                 cache_dir: str | None = None):
        super().__init__(cursor)
        if not 0.0 <= low <= high <= 1.0:
            raise ConfigError(f"data_curriculum: need 0 <= low <= high <= 1, got low={low}, high={high}")
        self.low, self.high, self.pool_size = low, high, pool_size
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.kept: list[Example] = []
        self.position = 0  # prompts this rank has taken
        self.rates: list[float] = []
        self.kept_indices: list[int] | None = None  # set by setup or by load_state_dict
        self.pool_digest: str | None = None

    def build_pool(self) -> list[Example]:
        return ExampleCursor(self.cursor.source, "train", self.cursor.seed, position=0).take(self.pool_size)

    def setup(self, estimate_pass_rates: EstimatePassRates, fingerprint: WeightsFingerprint,
              settings: dict) -> None:
        pool = self.build_pool()
        digest = pool_digest(pool)
        if self.kept_indices is not None:  # restored (or already set up): never re-score
            if digest != self.pool_digest:
                raise ConfigError(
                    "data_curriculum=pass_rate_filter: the prompt pool rebuilt from this run's data config and seed "
                    "differs from the one in the checkpoint (data, seed or data_curriculum.pool_size changed); "
                    "resume with the same settings or start a new run")
        else:
            self.rates = self.load_or_estimate(pool, estimate_pass_rates, fingerprint, settings)
            self.kept_indices = [i for i, r in enumerate(self.rates) if self.low <= r <= self.high]
            self.pool_digest = digest
        self.kept = [pool[i] for i in self.kept_indices]
        if not self.kept:
            raise ConfigError(
                f"data_curriculum=pass_rate_filter kept no prompt: all {len(pool)} pass rates fall outside "
                f"[{self.low}, {self.high}] (mean rate {sum(self.rates) / len(self.rates):.2f}); widen the band"
            )

    def load_or_estimate(self, pool, estimate_pass_rates, fingerprint: WeightsFingerprint,
                         settings: dict) -> list[float]:
        start_weights = fingerprint()
        key = pass_rate_cache_key(pool, start_weights, settings)
        cache = self.cache_dir / f"pass_rates-{key}.json" if self.cache_dir else None
        if cache is not None and cache.is_file():
            stored = json.loads(cache.read_text())
            if stored.get("key") == key and len(stored.get("rates", [])) == len(pool):
                return [float(r) for r in stored["rates"]]
        rates = [float(r) for r in estimate_pass_rates(pool)]
        if len(rates) != len(pool):
            raise ValueError(f"estimate_pass_rates returned {len(rates)} rates for {len(pool)} prompts")
        if any(math.isnan(r) for r in rates):
            raise ConfigError("data_curriculum=pass_rate_filter needs a reward with a verifier accuracy term: "
                              "the pass rates came back NaN")
        if cache is not None:
            write_json_atomic(cache, {"rates": rates, "key": key, "start_weights": start_weights,
                                      "settings": _plain(settings)})
        return rates

    def next_prompts(self, count: int) -> list[Example]:
        if not self.kept:
            raise RuntimeError("PassRateFilter.next_prompts called before setup")
        chosen, rank, world = [], self.cursor.rank, self.cursor.world_size
        for _ in range(count):
            epoch, offset = divmod(rank + self.position * world, len(self.kept))
            order = torch.randperm(len(self.kept), generator=torch.Generator().manual_seed(self.cursor.seed + epoch))
            chosen.append(self.kept[int(order[offset])])
            self.position += 1
        return chosen

    def metrics(self) -> dict[str, float]:
        return {"curriculum/kept_frac": len(self.kept) / max(1, len(self.rates)),
                "curriculum/pool_pass_rate": sum(self.rates) / max(1, len(self.rates))}

    def state_dict(self) -> dict:
        state = {**super().state_dict(), "position": self.position}
        if self.kept_indices is not None:
            state.update(kept_indices=list(self.kept_indices), rates=list(self.rates), pool_digest=self.pool_digest)
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.position = state["position"]
        if "kept_indices" in state:  # older checkpoints lack them: setup then scores the pool
            self.kept_indices = list(state["kept_indices"])
            self.rates = list(state["rates"])
            self.pool_digest = state["pool_digest"]


class DifficultySchedule(Curriculum):
    """Raise the task's difficulty knob by one at each milestone step, or whenever the mean
    training accuracy of the last step (pre-filter, see `on_step_end`) passes
    ``accuracy_threshold``, up to ``max_level`` times. The knob is the source's
    ``difficulty_knob``: ``max_digits`` (data=arithmetic, the default), ``max_steps``
    (data=word_problems)."""

    def __init__(self, cursor: ExampleCursor, milestones: list[int] | None = None,
                 accuracy_threshold: float | None = None, max_level: int = 2):
        super().__init__(cursor)
        if not hasattr(cursor.source, "set_difficulty"):
            raise ConfigError("data_curriculum=difficulty_schedule needs a source with a difficulty knob "
                              "(data=arithmetic or data=word_problems)")
        if not milestones and accuracy_threshold is None:
            raise ConfigError("data_curriculum=difficulty_schedule needs milestones or accuracy_threshold")
        self.milestones = sorted(milestones or [])
        self.accuracy_threshold = accuracy_threshold
        self.max_level = max_level
        self.knob = getattr(cursor.source, "difficulty_knob", "max_digits")
        self.base = getattr(cursor.source.task, self.knob)
        self.level = 0

    def on_step_end(self, step: int, train_accuracy: float | None) -> dict[str, float]:
        raise_now = step in self.milestones or (
            self.accuracy_threshold is not None and train_accuracy is not None
            and train_accuracy >= self.accuracy_threshold)
        if raise_now and self.level < self.max_level:
            self.level += 1
            self.cursor.source.set_difficulty(**{self.knob: self.base + self.level})
        return {"curriculum/difficulty_level": float(self.level)}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "level": self.level}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.level = state["level"]
        self.cursor.source.set_difficulty(**{self.knob: self.base + self.level})


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
