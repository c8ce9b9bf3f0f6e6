"""Shared test helpers: compose the real config tree the way `posttrain` does."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from posttrain.train import CONFIG_DIR

torch.set_num_threads(int(os.environ.get("POSTTRAIN_TEST_THREADS", "2")))


def compose_config(overrides: list[str], output_dir: Path | None = None):
    """The config `posttrain <overrides>` would run, with the run dir set to `output_dir`."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    HydraConfig().set_config(cfg)
    with open_dict(cfg):
        cfg.paths.output_dir = str(output_dir) if output_dir else "/nonexistent-test-output"
        del cfg["hydra"]
    return cfg


@pytest.fixture
def make_config(tmp_path):
    def make(*overrides: str, output_dir: Path | None = None):
        return compose_config(list(overrides), output_dir or tmp_path)

    return make


FAST_RUN = ("logger=none", "callbacks.progress_bar=none", "eval.num_prompts=64", "eval.batch_size=64")
