"""Built-in reward components and their registry.

Each component is a small class: its constructor takes the options of its config entry
(`reward.components.<name>`), its call scores a whole batch. The formulas of the length
rewards live in `posttrain.core.length`; here they only get their inputs.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from posttrain.core.options import Option, boolean, choice, integer, number, optional
from posttrain.core.length import dapo_overlong_penalty, kimi_length_reward, linear_length_penalty
from posttrain.rewards.base import RewardFunction, ScoredSample
from posttrain.rewards.prm import ProcessReward
from posttrain.rewards.reward_model import RewardModelScorer


def verify(samples: Sequence[ScoredSample], source) -> torch.Tensor:
    """[B] bool: the verdict on each final answer: an environment's where its episode gave one,
    else the task source's."""
    return torch.tensor([bool(s.env_correct) if s.env_correct is not None else bool(source.is_correct(s.example, s.response))
                         for s in samples], dtype=torch.bool)


# What a length may be divided by (a reward's normalize_by): the generation budget.
LENGTH_NORMALIZERS = ("max_new_tokens",)


class AccuracyReward:
    """Verifiable outcome reward (DeepSeek-R1 "accuracy reward"): 1 if the final answer
    is right, else `wrong_score`. DAPO scores a wrong answer -1, so that a right answer
    still beats it after the full overlong penalty (-1). The composite also reads
    correctness from this component: a score of 1 is a right answer."""

    name = "accuracy"
    options = (Option("wrong_score", 0.0, number(), "the score of a wrong answer (DAPO: -1)"),)

    def __init__(self, wrong_score: float = 0.0):
        # below 1, or a wrong answer would score (and be counted) as a right one
        if isinstance(wrong_score, bool) or not isinstance(wrong_score, (int, float)) \
                or not math.isfinite(wrong_score) or wrong_score >= 1.0:
            raise ValueError(f"wrong_score must be a finite number below 1 (a right answer's score), "
                             f"got {wrong_score!r}")
        self.wrong_score = float(wrong_score)

    def __call__(self, samples: Sequence[ScoredSample], source) -> torch.Tensor:
        right = verify(samples, source)
        return torch.where(right, torch.tensor(1.0), torch.tensor(self.wrong_score))


class FormatReward:
    """Format reward (DeepSeek-R1): `match_score` when the response has the task's
    expected shape (`source.has_style`), else `miss_score`. With `partial`, the share s of the
    shape the response has (`source.format_score`, in [0, 1]; the r1 template's tags on the
    arithmetic task) scores miss_score + s * (match_score - miss_score): a signal for a model
    that never writes the whole shape by chance (RL from a random model, experiment=r1_zero)."""

    name = "format"
    options = (
        Option("match_score", 1.0, number(), "the score of a response of the task's shape"),
        Option("miss_score", 0.0, number(), "the score of one without it"),
        Option("partial", False, boolean(), "score the share of the shape a response has (the arithmetic task's "
                                            "r1 tags)"),
    )

    def __init__(self, match_score: float = 1.0, miss_score: float = 0.0, partial: bool = False):
        if not isinstance(partial, bool):
            raise ValueError(f"partial must be true or false, got {partial!r}")
        self.match_score = float(match_score)
        self.miss_score = float(miss_score)
        self.partial = partial

    def __call__(self, samples: Sequence[ScoredSample], source) -> torch.Tensor:
        if self.partial:
            if not hasattr(source, "format_score"):
                raise ValueError("reward.components.format.partial=true reads the task's partial format score, "
                                 "which only data.source=arithmetic has; set it to false")
            share = torch.tensor([float(source.format_score(s.response)) for s in samples])
            return self.miss_score + share * (self.match_score - self.miss_score)
        matched = torch.tensor([bool(source.has_style(s.response)) for s in samples], dtype=torch.bool)
        return torch.where(matched, torch.tensor(self.match_score), torch.tensor(self.miss_score))


class OverlongReward:
    """DAPO soft overlong punishment on the response length in tokens.

    `max_len` defaults to the generation budget, so a truncated response (length ==
    budget) gets -1 and the ramp covers the last `cache_len` tokens before it.
    """

    name = "overlong"
    options = (
        Option("cache_len", None, integer(0), "tokens"),  # no default: the preset sets it
        Option("max_len", None, optional(integer(1)), "tokens; null: rollout.max_new_tokens"),
    )

    def __init__(self, cache_len: int, max_len: int | None = None, *, max_new_tokens: int):
        self.max_len = max_new_tokens if max_len is None else max_len
        for key, value in (("cache_len", cache_len), ("max_len", self.max_len)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{key} must be an integer number of tokens, got {value!r}")
        if not 0 <= cache_len <= self.max_len:
            raise ValueError(f"need 0 <= cache_len <= max_len, got cache_len={cache_len}, max_len={self.max_len}")
        self.cache_len = cache_len

    def __call__(self, samples: Sequence[ScoredSample], source) -> torch.Tensor:
        lengths = torch.tensor([s.length for s in samples], dtype=torch.float32)
        return dapo_overlong_penalty(lengths, self.max_len, self.cache_len)


class LengthPenaltyReward:
    """Kimi k1.5 length reward: within each prompt's group, shorter correct responses
    earn up to +0.5, longer ones down to -0.5; wrong ones are never rewarded for length.

    `warmup`: rollout batches before it switches on (it scores 0 until then). Kimi k1.5 warms
    up first: a length reward from the start stalls learning, since the shortest answers are
    at first mostly the wrong ones. `only_groups_with_a_correct_answer`: score 0 in a group
    with no right answer (see `kimi_length_reward`); false is Kimi's formula as published."""

    name = "length_penalty"
    options = (
        Option("warmup", 0, integer(0), "rollout batches before the length reward switches on"),
        Option("only_groups_with_a_correct_answer", False, boolean(), "0 in a group with no right answer "
                                                                      "(false: Kimi's formula)"),
    )

    def __init__(self, warmup: int = 0, only_groups_with_a_correct_answer: bool = False):
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
            raise ValueError(f"warmup must be a number of rollout batches >= 0, got {warmup!r}")
        if not isinstance(only_groups_with_a_correct_answer, bool):
            raise ValueError(f"only_groups_with_a_correct_answer must be true or false, "
                             f"got {only_groups_with_a_correct_answer!r}")
        self.warmup = warmup
        self.only_groups_with_a_correct_answer = only_groups_with_a_correct_answer
        self.step = 0  # the rollout batch being scored (CompositeReward.set_step)

    def set_step(self, step: int) -> None:
        self.step = step

    def __call__(self, samples: Sequence[ScoredSample], source) -> torch.Tensor:
        if self.step < self.warmup:
            return torch.zeros(len(samples))
        lengths = torch.tensor([s.length for s in samples], dtype=torch.float32)
        groups = torch.tensor([s.group for s in samples], dtype=torch.long)
        return kimi_length_reward(lengths, verify(samples, source), groups, self.only_groups_with_a_correct_answer)


# What a length score may be divided by (`normalize_by`): nothing (null, a score in tokens) or the
# generation budget (a share of rollout.max_new_tokens).


def length_normalizer(normalize_by: str | None, max_new_tokens: int) -> float:
    """The number a length is divided by: 1 (tokens), or the generation budget."""
    if normalize_by is None:
        return 1.0
    if normalize_by not in LENGTH_NORMALIZERS:
        raise ValueError(f"normalize_by must be null (tokens) or one of {list(LENGTH_NORMALIZERS)}, "
                         f"got {normalize_by!r}")
    return float(max_new_tokens)


class LinearLengthPenalty:
    """The linear length penalty r - lambda * |y| of the seeds (a per-token cost, paid once at the
    last step, as alpha_len * T): -coef * length, `coef` per token, or per share of the generation
    budget with `normalize_by: max_new_tokens` (then -coef is the score of a response that fills
    it). Every response pays, right or wrong, and a group whose lengths agree pays alike: the
    pressure is towards shorter responses everywhere, at the price of the accuracy they cost."""

    name = "length_linear"
    options = (
        Option("coef", None, number(0), "the penalty of one token, or of a budget-long response with "
                                        "normalize_by: max_new_tokens"),  # no default: the preset sets it
        Option("normalize_by", None, optional(choice(*LENGTH_NORMALIZERS)), "what the length is divided by; "
                                                                            "null: tokens"),
    )

    def __init__(self, coef: float, normalize_by: str | None = None, *, max_new_tokens: int):
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not math.isfinite(coef) or coef < 0:
            raise ValueError(f"coef must be a finite number >= 0 (the penalty of one token), got {coef!r}")
        self.coef = float(coef)
        self.normalizer = length_normalizer(normalize_by, max_new_tokens)

    def __call__(self, samples: Sequence[ScoredSample], source) -> torch.Tensor:
        lengths = torch.tensor([s.length for s in samples], dtype=torch.float32)
        return linear_length_penalty(lengths, self.coef, self.normalizer)


class ResponseLength:
    """The response's length as a cost, for reward.constraint ({cost: response_length}) with
    weight 0 (logged as rewards/response_length/mean, out of the total): its share of the generation
    budget by default (a number in [0, 1]), or tokens with `normalize_by: null`."""

    name = "response_length"
    options = (Option("normalize_by", "max_new_tokens", optional(choice(*LENGTH_NORMALIZERS)),
                      "what the length is divided by; null: tokens"),)

    def __init__(self, normalize_by: str | None = "max_new_tokens", *, max_new_tokens: int):
        self.normalizer = length_normalizer(normalize_by, max_new_tokens)

    def __call__(self, samples: Sequence[ScoredSample], source) -> torch.Tensor:
        return torch.tensor([s.length for s in samples], dtype=torch.float32) / self.normalizer


class RepetitionReward:
    """-1 for a response the rollout stopped because it started looping (`ScoredSample.repeated`,
    rollout.repetition), else 0: its weight is the penalty. A component of `reward=composite`
    like any other; with rollout.repetition.ngram=null nothing is ever flagged."""

    name = "repetition"

    def __call__(self, samples: Sequence[ScoredSample], source) -> torch.Tensor:
        return -torch.tensor([s.repeated for s in samples], dtype=torch.float32)


class EnvironmentReward:
    """The rewards an environment's episode gave (envs/), summed over its turns. Algorithms that
    give credit per token (advantage=gae, prm_step) see each turn's share at that turn's end,
    times this component's weight. A sample that ran no episode is an error."""

    name = "environment"

    def __call__(self, samples: Sequence[ScoredSample], source) -> torch.Tensor:
        missing = [i for i, s in enumerate(samples) if s.env_return is None]
        if missing:
            raise ValueError(f"reward component 'environment' scores an environment's episodes, but sample "
                             f"{missing[0]} ran none: set env=<an environment> or drop the component")
        return torch.tensor([s.env_return for s in samples], dtype=torch.float32)


# Config name -> constructor. A constructor that declares a `max_new_tokens` parameter is given the
# generation budget by `build_reward`; every other parameter is a config option.
REWARD_FUNCTIONS: dict[str, Callable[..., RewardFunction]] = {
    "accuracy": AccuracyReward,
    "format": FormatReward,
    "overlong": OverlongReward,
    "length_penalty": LengthPenaltyReward,
    "length_linear": LinearLengthPenalty,
    "response_length": ResponseLength,
    "repetition": RepetitionReward,
    "environment": EnvironmentReward,
    "reward_model": RewardModelScorer,
    "prm": ProcessReward,
}
