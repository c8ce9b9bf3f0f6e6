"""Start-up checks of the composed config: incompatible group choices are refused with a
message that names the keys, before anything is built or written."""

from __future__ import annotations

from omegaconf import DictConfig

from posttrain.errors import ConfigError

ONLINE_ONLY_GROUPS = ("advantage", "kl_estimator", "data_curriculum")


def check_config(cfg: DictConfig, choices: dict[str, str]) -> None:
    """Raise ConfigError for combinations that make no sense."""
    algorithm = choices.get("algorithm", cfg.algorithm.name)
    if cfg.algorithm.kind == "offline":
        for group in ONLINE_ONLY_GROUPS:
            option = cfg[group].name
            if option != "none":
                raise ConfigError(
                    f"algorithm={algorithm} trains offline on fixed data, so {group}={option} has no effect; "
                    f"drop the override or set {group}=none"
                )
    elif cfg.advantage.name == "none":
        raise ConfigError(f"algorithm={algorithm} is an online RL algorithm and needs an advantage estimator "
                          f"(advantage=none was chosen)")
    if cfg.trainer.max_steps is None or cfg.trainer.max_steps <= 0:
        raise ConfigError(f"trainer.max_steps must be a positive number of steps, got {cfg.trainer.max_steps}")
