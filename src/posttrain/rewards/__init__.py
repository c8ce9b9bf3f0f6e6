"""Rewards for online RL: verifiers, length shaping and user functions, combined by weight.

The RL module builds a `ScoredSample` per completion and calls the `CompositeReward` from
`build_reward(cfg.reward, source, max_new_tokens)`; it gets back the weighted total, each
component's scores (logged apart as `rewards/<name>/mean`) and the correctness mask.
"""

from posttrain.rewards.base import RewardFunction, RewardOutput, ScoredSample
from posttrain.rewards.build import TargetReward, build_reward
from posttrain.rewards.components import (
    REWARD_FUNCTIONS,
    AccuracyReward,
    FormatReward,
    LengthPenaltyReward,
    LinearLengthPenalty,
    OverlongReward,
    ResponseLength,
)
from posttrain.rewards.composite import CompositeReward

__all__ = [
    "REWARD_FUNCTIONS",
    "AccuracyReward",
    "CompositeReward",
    "FormatReward",
    "LengthPenaltyReward",
    "LinearLengthPenalty",
    "OverlongReward",
    "ResponseLength",
    "RewardFunction",
    "RewardOutput",
    "ScoredSample",
    "TargetReward",
    "build_reward",
]
