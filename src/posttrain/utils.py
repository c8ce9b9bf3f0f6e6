"""Small run utilities: the config tree, atomic file writes, run names."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

PRINT_ORDER = ("algorithm", "kl_estimator", "advantage", "reward", "data_curriculum", "model", "data",
               "rollout", "trainer", "logger", "callbacks", "eval", "paths")


def print_config_tree(cfg: DictConfig) -> None:
    """The resolved config as a rich tree, one branch per config group."""
    import rich
    import rich.syntax
    import rich.tree

    tree = rich.tree.Tree("config", style="dim")
    keys = [k for k in PRINT_ORDER if k in cfg] + [k for k in cfg if k not in PRINT_ORDER]
    for key in keys:
        branch = tree.add(str(key), style="bold")
        value = cfg[key]
        text = OmegaConf.to_yaml(value, resolve=True) if isinstance(value, DictConfig) else str(value)
        branch.add(rich.syntax.Syntax(text, "yaml", theme="ansi_dark"))
    rich.print(tree)


def write_json_atomic(path: Path, data: dict) -> None:
    """Write JSON to a temporary file beside `path`, then rename: never a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        json.dump(data, handle, indent=2, sort_keys=True)
    os.replace(tmp, path)


def save_pretrained_atomic(model, tokenizer, directory: Path) -> None:
    """Hugging Face export (model + tokenizer) through a temporary directory and a rename."""
    tmp = directory.with_name(f".{directory.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if directory.exists():
        shutil.rmtree(directory)
    os.replace(tmp, directory)
