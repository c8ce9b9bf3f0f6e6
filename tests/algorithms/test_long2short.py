"""Long2Short (Kimi k1.5): the preset's task puts shorter right answers within the warm start's
reach, its length reward cannot collapse a failing prompt to an empty answer, and (slow) the
preset cuts the held-out response length by >= 30% while keeping accuracy within 3 points.

    python -m pytest -m slow tests/algorithms/test_long2short.py
"""

import pytest

from posttrain.data.arithmetic import Problem, matches_style
from posttrain.data.sources import build_source
from posttrain.errors import ConfigError
from posttrain.rewards import ScoredSample, build_reward
from posttrain.train import run

LENGTH_REWARD = {"accuracy": {"weight": 1.0},
                 "length_penalty": {"weight": 1.0, "warmup": 0, "only_groups_with_a_correct_answer": True}}


def test_the_preset_trains_on_long_and_short_solutions_within_its_budget(make_config):
    cfg = make_config("algorithm=long2short")
    source = build_source(cfg.data)
    examples = [source.example("train", i) for i in range(400)]
    verbose = sum(matches_style(e.response, "verbose") for e in examples) / len(examples)
    assert 0.5 <= verbose < 0.95  # mostly long, some short: a shorter right answer is within reach
    assert all(matches_style(e.response, "concise") for e in examples if not matches_style(e.response, "verbose"))
    # the longest verbose solution (every digit 9: the widest totals) and its EOS fit the budget
    nines = 10 ** cfg.data.max_digits - 1
    longest = Problem((nines,) * cfg.data.num_operands).solution("verbose")
    assert len(longest) + 1 <= cfg.data.max_response_tokens


class AlwaysRightOn:
    """A source that judges a response right when it is one of `right`."""

    def __init__(self, *right: str):
        self.right = set(right)

    def is_correct(self, example, response):
        return response in self.right


def score(responses_by_group: list[list[str]], source) -> list[float]:
    reward = build_reward({"components": LENGTH_REWARD}, source, 16)
    samples = [ScoredSample(None, text, len(text), False, group)
               for group, texts in enumerate(responses_by_group) for text in texts]
    return reward(samples, source).components["length_penalty"].tolist()


def test_the_guard_scores_no_length_in_a_group_without_a_right_answer():
    source = AlwaysRightOn("12", "5+7=12>12")
    # group 0, all wrong: Kimi's min(0, lambda) would give [0, -0.5] (the empty answer wins): the guard gives 0
    # group 1: lengths 2, 9, 0 -> lambda = 0.5 - (len - 0) / 9 = [5/18, -0.5, 0.5]; the empty one is wrong -> 0
    assert score([["", "5+7=13>13"], ["12", "5+7=12>12", ""]], source) == pytest.approx(
        [0.0, 0.0, 0.5 - 2 / 9, -0.5, 0.0])


def test_the_guard_is_a_boolean():
    with pytest.raises(ConfigError, match="only_groups_with_a_correct_answer"):
        build_reward({"components": {"length_penalty": {"only_groups_with_a_correct_answer": "yes"}}},
                     AlwaysRightOn(), 16)


@pytest.mark.slow
def test_long2short_cuts_response_length_by_30_percent_keeping_accuracy(make_config, tmp_path):
    """The issue's figure, with the preset as it is (about 3 minutes of SFT warm start, then 2 of RL)."""
    cfg = make_config("algorithm=long2short", "logger=none", "callbacks.progress_bar=none", "num_threads=1",
                      f"paths.cache_dir={tmp_path}/cache")
    summary = run(cfg)
    assert summary["eval/response_len"] <= 0.7 * summary["eval/response_len_start"], summary
    assert summary["eval/accuracy"] >= summary["eval/accuracy_start"] - 0.03, summary
