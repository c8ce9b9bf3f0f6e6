"""Reward layer: each component on hand-built samples, composition, error handling, configs.

Samples are addition problems from `ArithmeticSource` (concise style: the right response to
"12+30=" is "42"); every expected number below is worked out by hand in a comment.
"""

from __future__ import annotations

import math
import sys
import types
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from posttrain.data.examples import Example
from posttrain.data.sources import ArithmeticSource
from posttrain.errors import ConfigError, RewardError
from posttrain.rewards import (
    REWARD_FUNCTIONS,
    AccuracyReward,
    CompositeReward,
    FormatReward,
    LengthPenaltyReward,
    LinearLengthPenalty,
    OverlongReward,
    ResponseLength,
    ScoredSample,
    build_reward,
)
from posttrain.conf import CONFIG_DIR

SOURCE = ArithmeticSource(style="concise")
EXAMPLE = Example(prompt="12+30=", response="42", answer="42")


def sample(response: str, length: int = 3, group: int = 0, truncated: bool = False, example=EXAMPLE):
    return ScoredSample(example=example, response=response, length=length, truncated=truncated, group=group)


def scores(x) -> list[float]:
    return [round(float(v), 6) for v in torch.as_tensor(x)]


class NamedFunction:
    """A test reward function: `fn(samples)` under a name, like a registry component."""

    def __init__(self, name, fn):
        self.name, self.fn = name, fn

    def __call__(self, samples, source):
        return self.fn(samples)


# --- components ------------------------------------------------------------------------

def test_accuracy_scores_the_verifier_verdict():
    batch = [sample("42"), sample("43"), sample(""), sample(" 42 "), sample("7+5=12>42")]
    # right, wrong, empty, right with spaces, verbose shape with the right final answer
    assert scores(AccuracyReward()(batch, SOURCE)) == [1.0, 0.0, 0.0, 1.0, 1.0]


def test_format_scores_the_style_check_with_configurable_values():
    batch = [sample("42"), sample("43"), sample("7+5=12>42"), sample("4 2")]
    # concise style = digits only, right or wrong
    assert scores(FormatReward()(batch, SOURCE)) == [1.0, 1.0, 0.0, 0.0]
    assert scores(FormatReward(match_score=0.5, miss_score=-0.5)(batch, SOURCE)) == [0.5, 0.5, -0.5, -0.5]


def test_overlong_matches_dapo_by_hand():
    # max_len 10, cache 4: 0 up to 6 tokens, then (6 - len)/4, and -1 beyond 10
    fn = OverlongReward(cache_len=4, max_len=10, max_new_tokens=99)
    batch = [sample("42", length=n) for n in (3, 6, 7, 9, 10, 11)]
    assert scores(fn(batch, SOURCE)) == [0.0, 0.0, -0.25, -0.75, -1.0, -1.0]


def test_overlong_max_len_defaults_to_the_generation_budget():
    # budget 8, cache 3: 0 up to 5 tokens; 6 -> -1/3, 7 -> -2/3, 8 (truncated) -> -1
    fn = OverlongReward(cache_len=3, max_new_tokens=8)
    batch = [sample("42", length=n) for n in (5, 6, 7, 8)]
    assert scores(fn(batch, SOURCE)) == scores([0.0, -1 / 3, -2 / 3, -1.0])


def test_length_penalty_matches_kimi_by_hand():
    batch = [
        sample("42", length=3, group=7),  # group 7: lengths 3, 5, 7 -> lambda 0.5, 0, -0.5
        sample("43", length=2, group=1),  # group 1: lengths 2, 6 -> lambda 0.5, -0.5
        sample("42", length=5, group=7),
        sample("42", length=4, group=3),  # group 3: equal lengths -> 0
        sample("99", length=7, group=7),
        sample("42", length=6, group=1),
        sample("43", length=4, group=3),
    ]
    # correct -> lambda; wrong -> min(0, lambda): the wrong shortest answer of group 1 earns 0, not 0.5
    assert scores(LengthPenaltyReward()(batch, SOURCE)) == [0.5, 0.0, 0.0, 0.0, -0.5, -0.5, 0.0]


def test_linear_length_penalty_by_hand():
    batch = [sample("42", length=3, group=0), sample("43", length=8, group=0, truncated=True),
             sample("42", length=3, group=1)]
    # per token, coef 0.05: -0.05 * [3, 8, 3]; right or wrong, any group, the same length pays the same
    assert scores(LinearLengthPenalty(coef=0.05, max_new_tokens=8)(batch, SOURCE)) == [-0.15, -0.4, -0.15]
    # per share of the budget (8 tokens), coef 0.5: -0.5 * [3, 8, 3] / 8
    fn = LinearLengthPenalty(coef=0.5, normalize_by="max_new_tokens", max_new_tokens=8)
    assert scores(fn(batch, SOURCE)) == [-0.1875, -0.5, -0.1875]


def test_response_length_is_the_share_of_the_budget_or_tokens():
    batch = [sample("42", length=2), sample("43", length=8, truncated=True)]
    assert scores(ResponseLength(max_new_tokens=8)(batch, SOURCE)) == [0.25, 1.0]
    assert scores(ResponseLength(normalize_by=None, max_new_tokens=8)(batch, SOURCE)) == [2.0, 8.0]


@pytest.mark.parametrize("options,match", [
    ({"coef": -0.1}, "coef must be a finite number >= 0"),
    ({"coef": True}, "coef must be a finite number >= 0"),
    ({"coef": 0.1, "normalize_by": "budget"}, r"normalize_by must be null \(tokens\) or one of \['max_new_tokens'\]"),
])
def test_bad_linear_length_options_are_config_errors_naming_the_component(options, match):
    with pytest.raises(ConfigError, match=rf"reward\.components\.length_linear: {match}"):
        build({"accuracy": {}, "length_linear": options})


def test_registry_holds_the_config_names():
    assert set(REWARD_FUNCTIONS) >= {"accuracy", "format", "overlong", "length_penalty", "length_linear",
                                     "response_length"}


# --- composition -----------------------------------------------------------------------

def test_composite_weights_components_and_logs_each():
    reward = CompositeReward([(AccuracyReward(), 1.0), (FormatReward(), 0.1),
                              (OverlongReward(cache_len=2, max_new_tokens=6), 0.5)])
    batch = [sample("42", length=3), sample("43", length=5), sample("x42", length=6)]
    out = reward(batch, SOURCE)
    # accuracy [1, 0, 0]; format [1, 1, 0]; overlong (0 up to 4; (4 - len)/2): [0, -0.5, -1]
    assert scores(out.components["accuracy"]) == [1.0, 0.0, 0.0]
    assert scores(out.components["format"]) == [1.0, 1.0, 0.0]
    assert scores(out.components["overlong"]) == [0.0, -0.5, -1.0]
    # total = acc + 0.1 fmt + 0.5 overlong = [1.1, 0.1 - 0.25, -0.5]
    assert scores(out.total) == [1.1, -0.15, -0.5]
    assert out.total.dtype == torch.float32 and out.total.shape == (3,)
    assert out.correct.tolist() == [True, False, False]
    assert set(out.metrics) == {"rewards/accuracy/mean", "rewards/format/mean", "rewards/overlong/mean",
                                "rewards/total/mean"}
    assert out.metrics["rewards/accuracy/mean"] == pytest.approx(1 / 3)
    assert out.metrics["rewards/overlong/mean"] == pytest.approx(-0.5)
    assert out.metrics["rewards/total/mean"] == pytest.approx((1.1 - 0.15 - 0.5) / 3)
    assert all(isinstance(v, float) for v in out.metrics.values())


def test_without_accuracy_component_correct_is_none():
    out = CompositeReward([(FormatReward(), 1.0)])([sample("42")], SOURCE)
    assert out.correct is None


def test_fail_mode_logs_zero_error_counts_when_nothing_fails():
    out = CompositeReward([(AccuracyReward(), 1.0)], on_error="fail")([sample("42"), sample("1")], SOURCE)
    assert out.metrics["rewards/accuracy/errors"] == 0.0


def test_list_and_bool_returns_are_accepted():
    reward = CompositeReward([(NamedFunction("listy", lambda s: [0.25] * len(s)), 2.0),
                              (NamedFunction("booly", lambda s: [True, False]), 1.0)])
    out = reward([sample("42"), sample("1")], SOURCE)
    assert scores(out.components["booly"]) == [1.0, 0.0]
    assert scores(out.total) == [1.5, 0.5]


# --- errors ----------------------------------------------------------------------------

def raise_on_boom(samples):
    for s in samples:
        if "boom" in s.response:
            raise ValueError("cannot parse")
    return [1.0] * len(samples)


def nan_on_boom(samples):
    return torch.tensor([math.nan if "boom" in s.response else 1.0 for s in samples])


BOOM = [sample("42"), sample("41"), sample("boom" + "x" * 200, group=3), sample("40")]


@pytest.mark.parametrize("fn", [raise_on_boom, nan_on_boom])
def test_failing_component_raises_naming_function_and_sample(fn):
    reward = CompositeReward([(AccuracyReward(), 1.0), (NamedFunction("parser", fn), 1.0)])
    with pytest.raises(RewardError) as err:
        reward(BOOM, SOURCE)
    message = str(err.value)
    assert "'parser'" in message and "sample 2" in message and "group 3" in message and "'12+30='" in message
    assert "boom" + "x" * 76 + "..." in message and "x" * 100 not in message  # response clipped to 80 chars


@pytest.mark.parametrize("fn", [raise_on_boom, nan_on_boom])
def test_fail_mode_scores_only_the_culprit_with_failure_score(fn):
    reward = CompositeReward([(AccuracyReward(), 1.0), (NamedFunction("parser", fn), 1.0)],
                             on_error="fail", failure_score=-2.0)
    out = reward(BOOM, SOURCE)
    assert scores(out.components["parser"]) == [1.0, 1.0, -2.0, 1.0]
    assert scores(out.total) == [2.0, 1.0, -2.0, 1.0]
    assert out.metrics["rewards/parser/errors"] == 1.0
    assert out.metrics["rewards/accuracy/errors"] == 0.0


def test_fail_mode_rescores_survivors_together_so_group_rewards_stay_real():
    kimi = LengthPenaltyReward()

    def fragile_kimi(samples):
        raise_on_boom(samples)
        return kimi(samples, SOURCE)

    batch = [sample("42", length=2), sample("42", length=4), sample("42", length=6), sample("boom", length=9)]
    out = CompositeReward([(NamedFunction("kimi", fragile_kimi), 1.0)], on_error="fail")(batch, SOURCE)
    # the survivors form the group (lengths 2, 4, 6 -> 0.5, 0, -0.5), not groups of one (all 0)
    assert scores(out.components["kimi"]) == [0.5, 0.0, -0.5, 0.0]
    assert out.metrics["rewards/kimi/errors"] == 1.0


def test_failed_verifier_never_counts_as_correct():
    def verifier(samples):
        raise_on_boom(samples)
        return [1.0] * len(samples)

    reward = CompositeReward([(NamedFunction("accuracy", verifier), 1.0)], on_error="fail", failure_score=1.0)
    out = reward([sample("42"), sample("boom")], SOURCE)
    assert scores(out.components["accuracy"]) == [1.0, 1.0]
    assert out.correct.tolist() == [True, False]


@pytest.mark.parametrize("on_error", ["raise", "fail"])
def test_wrong_length_is_an_error_in_both_modes(on_error):
    reward = CompositeReward([(NamedFunction("short", lambda s: [1.0]), 1.0)], on_error=on_error)
    with pytest.raises(RewardError, match=r"'short' returned shape \(1,\) for 2 samples"):
        reward([sample("42"), sample("1")], SOURCE)


def test_failure_only_in_the_whole_batch_is_an_error_in_fail_mode():
    def batch_only(samples):
        if len(samples) > 1:
            raise RuntimeError("batched call broken")
        return [1.0]

    reward = CompositeReward([(NamedFunction("batchy", batch_only), 1.0)], on_error="fail")
    with pytest.raises(RewardError, match="'batchy'.*none of them alone.*batched call broken"):
        reward([sample("42"), sample("1")], SOURCE)


def test_verifier_error_on_a_malformed_prompt_names_the_sample():
    bad = Example(prompt="twelve plus thirty", response="42", answer="42")
    reward = CompositeReward([(AccuracyReward(), 1.0)])
    with pytest.raises(RewardError, match="'accuracy' raised on sample 1 .*'twelve plus thirty'.*malformed"):
        reward([sample("42"), sample("42", example=bad)], SOURCE)


# --- config ----------------------------------------------------------------------------

def build(components: dict, max_new_tokens: int = 8, **top):
    return build_reward(OmegaConf.create({"name": "test", "components": components, **top}), SOURCE, max_new_tokens)


def test_build_passes_options_and_the_generation_budget():
    reward = build({"accuracy": {"weight": 2.0}, "overlong": {"weight": 0.5, "cache_len": 2}}, max_new_tokens=6)
    assert [(fn.name, w) for fn, w in reward.components] == [("accuracy", 2.0), ("overlong", 0.5)]
    overlong = reward.components[1][0]
    assert (overlong.max_len, overlong.cache_len) == (6, 2)
    assert build({"overlong": {"cache_len": 2, "max_len": 20}}).components[0][0].max_len == 20


@pytest.fixture
def user_module(monkeypatch):
    """A researcher's own reward module, importable as `user_rewards`."""
    module = types.ModuleType("user_rewards")

    def brevity(samples, source, scale=1.0):
        return [-scale * s.length for s in samples]

    module.brevity = brevity
    module.not_a_function = 3
    monkeypatch.setitem(sys.modules, "user_rewards", module)
    return module


def test_target_component_is_imported_and_given_its_options(user_module):
    reward = build({"accuracy": {"weight": 1.0},
                    "short": {"weight": 0.5, "_target_": "user_rewards.brevity", "scale": 0.1}})
    out = reward([sample("42", length=3), sample("4", length=10)], SOURCE)
    # short = -0.1 * len = [-0.3, -1.0]; total = acc + 0.5 short = [1 - 0.15, 0 - 0.5]
    assert scores(out.components["short"]) == [-0.3, -1.0]
    assert scores(out.total) == [0.85, -0.5]
    assert "rewards/short/mean" in out.metrics


def test_builtin_example_target_step_accuracy():
    reward = build({"steps": {"_target_": "posttrain.rewards.examples.step_accuracy", "empty_score": -1.0}})
    # "12+30=": columns "2+0=2", "1+3=4"
    batch = [sample("2+0=2,1+3=4>42"), sample("2+0=2,1+3=5>52"), sample("42"), sample("")]
    assert scores(reward(batch, SOURCE).components["steps"]) == [1.0, 0.5, 0.0, -1.0]


@pytest.mark.parametrize("target,match", [
    ("user_rewards.missing", r"reward\.components\.mine\._target_='user_rewards\.missing' cannot be imported"),
    ("no_such_package.fn", r"reward\.components\.mine\._target_='no_such_package\.fn' cannot be imported"),
    ("user_rewards.not_a_function", r"reward\.components\.mine\._target_=.*not a function"),
    ("brevity", r"reward\.components\.mine\._target_ must be a dotted path"),
])
def test_unimportable_target_is_a_config_error(user_module, target, match):
    with pytest.raises(ConfigError, match=match):
        build({"mine": {"_target_": target}})


def test_unknown_target_option_is_a_config_error(user_module):
    with pytest.raises(ConfigError, match=r"unknown option\(s\) reward\.components\.mine\.scael: .*scale"):
        build({"mine": {"_target_": "user_rewards.brevity", "scael": 2}})


@pytest.mark.parametrize("components,match", [
    ({"acuracy": {"weight": 1.0}}, r"reward\.components\.acuracy: unknown reward component.*accuracy, environment, format, "
                                   r"length_linear, length_penalty, overlong"),
    ({"overlong": {"cache_len": 2, "cache": 3}}, r"unknown option\(s\) reward\.components\.overlong\.cache: "
                                                 r".*cache_len, max_len"),
    ({"overlong": {"weight": 1.0}}, r"reward\.components\.overlong: missing required option\(s\) \['cache_len'\]"),
    ({"overlong": {"cache_len": 9}}, r"reward\.components\.overlong: need 0 <= cache_len <= max_len"),
    ({"overlong": {"cache_len": 2, "max_new_tokens": 9}}, r"reward\.components\.overlong\.max_new_tokens is set "
                                                          r"from the generation budget"),
    ({"accuracy": {"weight": "heavy"}}, r"reward\.components\.accuracy\.weight must be a finite number"),
    ({"accuracy": None}, r"reward\.components\.accuracy must be a mapping"),
    ({}, r"reward\.components must map"),
])
def test_bad_component_config_is_a_config_error(components, match):
    with pytest.raises(ConfigError, match=match):
        build(components)


def test_bad_top_level_config_is_a_config_error():
    with pytest.raises(ConfigError, match=r"reward\.on_error='ignore' is not one of \['raise', 'fail'\]"):
        build({"accuracy": {}}, on_error="ignore")
    with pytest.raises(ConfigError, match=r"reward: unknown key\(s\) \['on_errors'\]"):
        build({"accuracy": {}}, on_errors="fail")


EXPECTED_COMPONENTS = {
    "prm": ["prm", "accuracy"],
    "accuracy": ["accuracy"],
    "repetition": ["accuracy", "repetition"],
    "format": ["accuracy", "format"],
    "overlong": ["accuracy", "overlong"],
    "length_penalty": ["accuracy", "length_penalty"],
    "length_linear": ["accuracy", "length_linear"],
    "length_constraint": ["accuracy", "response_length"],
    "composite": ["accuracy", "format", "overlong"],
    "environment": ["environment"],
}


# reward=reward_model needs a trained reward model's directory: tests/rewards/test_learned_reward.py builds one
@pytest.mark.parametrize("path", sorted(p for p in (Path(CONFIG_DIR) / "reward").glob("*.yaml")
                                        if p.stem != "reward_model"), ids=lambda p: p.stem)
def test_every_reward_config_builds_and_scores(path):
    cfg = OmegaConf.load(path)
    if path.stem == "prm":  # its PRM's options come from the prm group
        cfg = OmegaConf.merge(cfg, {"components": {"prm": OmegaConf.load(Path(CONFIG_DIR) / "prm" / "oracle.yaml")}})
    assert cfg.name == path.stem
    reward = build_reward(cfg, SOURCE, max_new_tokens=8)
    assert [fn.name for fn, _ in reward.components] == EXPECTED_COMPONENTS[path.stem]
    batch = [sample("42", length=3, group=0), sample("43", length=8, truncated=True, group=0)]
    if path.stem == "environment":  # episodes: the environment's rewards and verdicts
        for one, (ret, right) in zip(batch, ((1.0, True), (0.0, False))):
            one.env_return, one.env_correct = ret, right
    out = reward(batch, SOURCE)
    assert out.correct.tolist() == [True, False]
    assert torch.isfinite(out.total).all()
    assert out.total[0] > out.total[1]  # a short right answer beats a truncated wrong one in every preset


def test_reward_group_builds_from_the_composed_config():
    from conftest import compose_config

    cfg = compose_config(["reward=composite"])
    reward = build_reward(cfg.reward, SOURCE, max_new_tokens=cfg.rollout.max_new_tokens)
    overlong = dict((fn.name, fn) for fn, _ in reward.components)["overlong"]
    assert overlong.max_len == cfg.rollout.max_new_tokens


def test_the_environment_component_sums_an_episode_and_its_verdict_is_the_accuracy():
    reward = build_reward({"components": {"environment": {"weight": 0.5}}}, SOURCE, max_new_tokens=8)
    episodes = [sample("anything", group=0), sample("42", group=0), sample("1", group=1)]
    for one, (ret, right) in zip(episodes, ((1.5, True), (-0.25, False), (0.0, None))):
        one.env_return, one.env_correct = ret, right
    out = reward(episodes, SOURCE)
    assert scores(out.total) == [0.75, -0.125, 0.0] and scores(out.components["environment"]) == [1.5, -0.25, 0.0]
    assert out.correct is None  # one episode gave no verdict: no accuracy without a verifier
    episodes[2].env_correct = True
    assert reward(episodes, SOURCE).correct.tolist() == [True, False, True]
    # with a verifier too, an episode's verdict comes first: "42" is right for the task, not for its episode
    both = build_reward({"components": {"accuracy": {"weight": 1.0}, "environment": {"weight": 1.0}}}, SOURCE, 8)
    assert both(episodes, SOURCE).correct.tolist() == [True, False, True]
    with pytest.raises(RewardError, match="ran none"):
        reward([sample("42")], SOURCE)
