"""The `dapo` preset is DAPO's (Yu et al. 2025): correctness +1 / -1 beside the soft overlong
punishment, and dynamic sampling that keeps a group when 0 < #right < G.

Samples are addition problems ("12+30=", right answer "42"); lengths are in tokens against the
preset's generation budget (rollout.max_new_tokens), so the longest is fully penalised.
"""

from __future__ import annotations

import pytest
import torch

from posttrain.data.curriculum import build_curriculum
from posttrain.data.datamodule import ExampleCursor
from posttrain.data.examples import Example
from posttrain.data.sources import ArithmeticSource
from posttrain.errors import ConfigError
from posttrain.rewards import AccuracyReward, ScoredSample, build_reward

SOURCE = ArithmeticSource(style="concise")
EXAMPLE = Example(prompt="12+30=", response="42", answer="42")
RIGHT, WRONG = "42", "43"


def sample(response: str, length: int, group: int = 0) -> ScoredSample:
    return ScoredSample(example=EXAMPLE, response=response, length=length, truncated=False, group=group)


@pytest.fixture
def dapo(make_config):
    cfg = make_config("algorithm=dapo")
    reward = build_reward(cfg.reward, SOURCE, cfg.rollout.max_new_tokens)
    return cfg, reward


def test_a_fully_penalised_right_answer_beats_a_short_wrong_one(dapo):
    cfg, reward = dapo
    budget = cfg.rollout.max_new_tokens
    out = reward([sample(RIGHT, length=budget), sample(WRONG, length=1)], SOURCE)
    assert out.components["overlong"][0] == -1.0 and out.components["overlong"][1] == 0.0  # full penalty, none
    assert out.correct.tolist() == [True, False]
    right, wrong = out.total.tolist()
    assert right > wrong


def test_dynamic_sampling_drops_an_all_right_group_of_varied_lengths(dapo):
    cfg, reward = dapo
    budget = cfg.rollout.max_new_tokens
    # group 0: all right, one short and one fully penalised (their totals differ);
    # group 1: one right, one wrong, of equal length (its totals differ too)
    samples = [sample(RIGHT, 2, group=0), sample(RIGHT, budget, group=0),
               sample(RIGHT, 2, group=1), sample(WRONG, 2, group=1)]
    out = reward(samples, SOURCE)
    assert out.total[0] != out.total[1]  # the length term alone parts group 0
    curriculum = build_curriculum(cfg.data_curriculum, ExampleCursor(SOURCE, "train", 0))
    keep = curriculum.keep_groups(out.total, out.correct.float(), torch.tensor([s.group for s in samples]))
    assert keep.tolist() == [False, False, True, True]


def test_accuracy_reward_scores_a_wrong_answer_at_wrong_score():
    scores = AccuracyReward(wrong_score=-1.0)([sample(RIGHT, 2), sample(WRONG, 2)], SOURCE)
    assert scores.tolist() == [1.0, -1.0]
    assert AccuracyReward()([sample(WRONG, 2)], SOURCE).tolist() == [0.0]  # the default is unchanged


@pytest.mark.parametrize("wrong_score", [1.0, 2.0, float("nan"), "low", True])
def test_a_wrong_score_that_is_not_below_a_right_answer_is_refused(wrong_score):
    with pytest.raises(ConfigError, match=r"reward\.components\.accuracy: wrong_score"):
        build_reward({"components": {"accuracy": {"weight": 1.0, "wrong_score": wrong_score}}}, SOURCE, 8)


def test_the_dynamic_sampling_of_dapo_can_be_ablated_alone(make_config):
    """`algorithm=dapo data_curriculum=none`: DAPO's reward and loss, no filter."""
    cfg = make_config("algorithm=dapo", "data_curriculum=none")
    assert dict(cfg.data_curriculum) == {"name": "none"} and cfg.reward.name == "overlong"
