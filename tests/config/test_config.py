"""Every option of every config group composes, and bad combinations are refused."""

from pathlib import Path

import pytest

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


# Each option of each group is composed, resolved and validated (with what it needs beside it)
# in test_config_validation.py, once for its spec test and its validation test.


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
