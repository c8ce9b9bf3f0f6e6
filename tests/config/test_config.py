"""Every option of every config group composes, and bad combinations are refused."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from posttrain.config.check import check_config
from posttrain.errors import ConfigError
from posttrain.conf import CONFIG_DIR

from conftest import compose_config

GROUPS = ["algorithm", "kl_estimator", "advantage", "reward", "data_curriculum", "model", "data", "rollout",
          "trainer", "logger", "callbacks", "paths", "numerics", "experiment"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (Path(CONFIG_DIR) / group).glob("*.yaml"))


def test_every_design_group_exists_with_options():
    for group in GROUPS + ["hydra/launcher"]:
        assert options(group), f"conf/{group}/ has no options"


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_group_option_composes(group, option):
    cfg = compose_config([f"{group}={option}"])
    # interpolations resolve, except values the user must supply (???)
    OmegaConf.to_yaml(cfg)
    assert cfg[group] is not None if group != "experiment" else True


@pytest.mark.parametrize("launcher", options("hydra/launcher"))
def test_every_launcher_composes(launcher):
    cfg = compose_config([f"hydra/launcher={launcher}"])
    assert cfg.algorithm.name == "sft"


def test_offline_algorithm_refuses_online_components():
    cfg = compose_config(["algorithm=sft", "kl_estimator=k1"])
    with pytest.raises(ConfigError, match="kl_estimator=k1"):
        check_config(cfg, {"algorithm": "sft"})


def test_nonpositive_max_steps_is_refused():
    cfg = compose_config(["trainer.max_steps=0"])
    with pytest.raises(ConfigError, match="trainer.max_steps"):
        check_config(cfg, {})
