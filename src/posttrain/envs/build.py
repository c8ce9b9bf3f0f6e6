"""The `env` config group -> an Environment (or None: one response per prompt).

    env:
      name: guess_number
      _target_: posttrain.envs.guess_number.GuessNumber   # or your own class
      max_turns: 4          # the constructor's options ...
      turn_tokens: null     # ... besides this one, the collector's: a policy turn's token budget

Every key besides `name`, `_target_` and `turn_tokens` is a keyword argument of the class.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from posttrain.envs.base import Environment
from posttrain.errors import ConfigError
from posttrain.run.user_components import TARGET, check_options, import_class

COLLECTOR_KEYS = ("name", TARGET, "turn_tokens")


def env_options(env_cfg) -> dict:
    """The env node as a plain dict ({} when the group is `none`)."""
    if env_cfg is None:
        return {}
    return OmegaConf.to_container(env_cfg, resolve=True) if isinstance(env_cfg, DictConfig) else dict(env_cfg)


def build_env(env_cfg, source) -> Environment | None:
    """The configured environment, checked (`Environment.check`) and attached to the run's task
    `source` (`Environment.attach`): None for `env=none`."""
    cfg = env_options(env_cfg)
    target = cfg.get(TARGET)
    if target is None:
        extra = sorted(set(cfg) - {"name", TARGET})
        if extra:
            raise ConfigError(f"env: {extra} set, but no environment is chosen (env.{TARGET} is null); "
                              f"pick one with env=<name> (docs/environments.md)")
        return None
    cls = import_class("env", target, Environment, "posttrain.envs.base.Environment")
    options = {k: v for k, v in cfg.items() if k not in COLLECTOR_KEYS}
    check_options("env", cls, options, named=f"environment {target}")
    try:
        env = cls(**options)
    except TypeError as err:
        raise ConfigError(f"env ({target}): {err}") from None
    env.check()
    env.attach(source)
    return env


def turn_tokens(env_cfg) -> int | None:
    """env.turn_tokens: a policy turn's token budget (None: the rest of rollout.max_new_tokens)."""
    value = env_options(env_cfg).get("turn_tokens")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ConfigError(f"env.turn_tokens must be an integer >= 1 or null, got {value!r}")
    return value
