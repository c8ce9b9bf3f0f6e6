"""Composition rules of preference algorithms (dpo, ipo, hinge, simpo, reward_model): they train on
fixed pairs, so a component of online RL beside them is refused at start-up, by check_config,
with a message naming both keys."""

import pytest

from posttrain.config.check import check_config
from posttrain.errors import ConfigError

from conftest import compose_config


def refusal(*overrides: str) -> str:
    """check_config's message for `posttrain <overrides>`, with the choices Hydra would record."""
    choices = dict(override.split("=", 1) for override in overrides if "." not in override.split("=")[0])
    with pytest.raises(ConfigError) as err:
        check_config(compose_config(list(overrides)), choices)
    return str(err.value)


@pytest.mark.parametrize("overrides", [
    ("algorithm=dpo", "advantage=gae"),
    ("algorithm=simpo", "kl_estimator=k3"),
    ("algorithm=dpo", "data_curriculum=dynamic_sampling"),
    ("algorithm=reward_model", "kl_estimator=k1"),
])
def test_an_online_component_beside_a_preference_algorithm_is_refused(overrides):
    message = refusal(*overrides)
    for override in overrides:
        assert override in message


@pytest.mark.parametrize("overrides", [("algorithm=reward_model", "reward=reward_model"),
                                       ("algorithm=dpo", "reward=reward_model")])
def test_a_reward_beside_a_preference_algorithm_is_refused(overrides, tmp_path):
    message = refusal(*overrides, f"reward.path={tmp_path}")
    for override in overrides:
        assert override in message


def test_vllm_beside_a_preference_algorithm_is_refused():
    message = refusal("algorithm=dpo", "rollout=vllm")
    assert "algorithm=dpo" in message and "rollout=vllm" in message


@pytest.mark.parametrize("algorithm", ["dpo", "ipo", "hinge", "simpo", "reward_model"])
def test_the_preference_presets_pass_as_composed(algorithm):
    check_config(compose_config([f"algorithm={algorithm}"]), {"algorithm": algorithm})


@pytest.mark.parametrize("overrides", [("algorithm=dpo", "algorithm.length_normalize=true"),
                                       ("algorithm=ipo", "algorithm.length_normalize=true")])
def test_length_normalised_dpo_and_ipo_are_accepted(overrides):
    cfg = compose_config(list(overrides))
    assert cfg.algorithm.length_normalize is True
    check_config(cfg, {"algorithm": overrides[0].split("=")[1]})


def test_dpo_is_not_length_normalised_by_default():
    assert compose_config(["algorithm=dpo"]).algorithm.length_normalize is False


@pytest.mark.parametrize("overrides, loss", [
    (("algorithm=hinge", "+algorithm.length_normalize=true"), "hinge"),  # hinge has no length-normalised form
    (("algorithm=simpo", "+algorithm.length_normalize=true"), "simpo"),  # simpo always normalises
    (("algorithm=dpo", "algorithm.loss=hinge", "algorithm.length_normalize=true"), "hinge"),
])
def test_length_normalize_is_refused_where_it_means_nothing(overrides, loss):
    message = refusal(*overrides)
    assert "algorithm.length_normalize=true" in message and f"algorithm.loss={loss}" in message
