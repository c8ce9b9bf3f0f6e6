"""`build_reward`: the `reward` config group -> a `CompositeReward`.

    reward:
      on_error: raise        # raise | fail
      failure_score: 0.0     # score of a failed sample when on_error=fail
      components:
        accuracy: {weight: 1.0}
        overlong: {weight: 1.0, cache_len: 4}
        mine: {weight: 0.5, _target_: my_pkg.rewards.brevity, scale: 2}

A component is a built-in (`REWARD_FUNCTIONS`) named by its key, or a user function named
by `_target_:` (the convention of every user component: run/user_components.py); every option
besides `weight` and `_target_` is a keyword argument to it.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Sequence

from omegaconf import DictConfig, OmegaConf

from posttrain.data.mixture import MixtureSource
from posttrain.errors import ConfigError, RewardError
from posttrain.rewards.base import RewardFunction, ScoredSample
from posttrain.rewards.components import REWARD_FUNCTIONS
from posttrain.rewards.composite import ON_ERROR_MODES, CompositeReward
from posttrain.rewards.mixture import MixtureReward, build_mixture_reward
from posttrain.run.user_components import TARGET, check_options, import_function

# path / paths: the reward model preset's shorthands (reward.path=<dir>), read by its component;
# constraint: a Lagrangian constraint on one component, applied by the trainer (online.py), not here
TOP_LEVEL_KEYS = ("name", "on_error", "failure_score", "components", "path", "paths", "constraint")
# A built-in constructor with this parameter gets the generation budget (rollout.max_new_tokens).
BUDGET_PARAM = "max_new_tokens"
# ... and with these, the run's policy and tokenizer (a learned scorer runs on the policy's
# device and may tokenise as it does); None where none exists yet (the start-up config check).
RUN_PARAMS = ("policy", "tokenizer")
# The arguments the composite passes a user's function first, and the keys of a component that
# are no arguments of its function.
USER_FUNCTION_ARGUMENTS = ("samples", "source")
COMPONENT_KEYS = ("weight", TARGET)
# The key a user function was named by before `_target_` became the one convention.
OLD_TARGET = "target"


class TargetReward:
    """A user's reward function `fn(samples, source, **options) -> [B] scores`, found by config."""

    def __init__(self, name: str, fn: Callable[..., Any], options: dict[str, Any]):
        self.name = name
        self.fn = fn
        self.options = options

    def __call__(self, samples: Sequence[ScoredSample], source):
        return self.fn(samples, source, **self.options)


def build_reward(reward_cfg: DictConfig, source, max_new_tokens: int, *, policy=None,
                 tokenizer=None) -> CompositeReward | MixtureReward:
    """The composite reward the `reward` config describes.

    `source` is the task source the rewards will judge with (kept for scorers that need to
    know it when built); `max_new_tokens` is the generation budget, the default `max_len`
    of `overlong`; `policy` and `tokenizer` go to the built-ins that declare them (RUN_PARAMS).
    A mixture of sources (data=mixture) gets each source's samples scored by that source's own
    reward, with that source (rewards/mixture.py).
    """
    if isinstance(source, MixtureSource):
        return build_mixture_reward(reward_cfg, source, lambda cfg, member: build_reward(
            cfg, member, max_new_tokens, policy=policy, tokenizer=tokenizer))
    cfg = OmegaConf.to_container(reward_cfg, resolve=True) if isinstance(reward_cfg, DictConfig) else dict(reward_cfg)
    unknown = sorted(set(cfg) - set(TOP_LEVEL_KEYS))
    if unknown:
        raise ConfigError(f"reward: unknown key(s) {unknown}; valid keys: {', '.join(TOP_LEVEL_KEYS)}")
    on_error = cfg.get("on_error", "raise")
    if on_error not in ON_ERROR_MODES:
        raise ConfigError(f"reward.on_error={on_error!r} is not one of {list(ON_ERROR_MODES)}")
    failure_score = cfg.get("failure_score", 0.0)
    if not _is_finite_number(failure_score):
        raise ConfigError(f"reward.failure_score must be a finite number, got {failure_score!r}")
    entries = cfg.get("components")
    if not isinstance(entries, dict) or not entries:
        raise ConfigError(f"reward.components must map component names to options, e.g. "
                          f"{{accuracy: {{weight: 1.0}}}}; got {entries!r}")
    run = {BUDGET_PARAM: max_new_tokens, **dict(zip(RUN_PARAMS, (policy, tokenizer)))}
    components = [_build_component(name, entry, run) for name, entry in entries.items()]
    return CompositeReward(components, on_error=on_error, failure_score=float(failure_score))


def check_user_functions(reward_cfg: DictConfig, source, max_new_tokens: int) -> None:
    """Call the user's reward functions (`_target_:` components) once on stand-in samples of
    `source`, before anything is trained: a function that raises or returns NaN or no number
    stops the run in seconds with the error training would give, not after the warm start
    (with reward.on_error=fail as in training: only an answer that is no [B] scores stops it).
    The samples are two responses to the first training prompt, one group: its reference
    solution, ended, and that solution's first half, cut by the budget (a reward comparing a
    group's responses sees two). No tokenizer exists yet: a response's length in characters
    stands in for its tokens, and with data.step_separators its steps are cut at characters."""
    cfg = OmegaConf.to_container(reward_cfg, resolve=True) if isinstance(reward_cfg, DictConfig) else dict(reward_cfg)
    run = {BUDGET_PARAM: max_new_tokens, **dict.fromkeys(RUN_PARAMS)}
    user_functions = [_build_component(name, entry, run) for name, entry in (cfg.get("components") or {}).items()
                      if isinstance(entry, dict) and entry.get(TARGET) is not None]
    if not user_functions:
        return
    example = source.example("train", 0)
    solution = example.response or example.answer or ""  # a prompt-and-answer task has no written solution
    samples = [ScoredSample(example, solution, len(solution), truncated=False, group=0),
               ScoredSample(example, solution[: len(solution) // 2], len(solution) // 2, truncated=True, group=0)]
    step_rule = getattr(source, "step_rule", None)
    if step_rule is not None:
        for sample in samples:
            ends = step_rule.step_ends(list(sample.response))  # each character a token
            sample.steps = [sample.response[start + 1: end + 1] for start, end in zip([-1, *ends], ends)]
    checked = CompositeReward(user_functions, on_error=cfg.get("on_error", "raise"),
                              failure_score=float(cfg.get("failure_score", 0.0)))
    try:
        checked(samples, source)  # the checks training makes
    except RewardError as err:
        raise RewardError(f"a reward function failed when called once before training on stand-in samples "
                          f"(a training prompt and its reference solution): {err}") from err


def _build_component(name: str, entry: Any, run: dict[str, Any]) -> tuple[RewardFunction, float]:
    key = f"reward.components.{name}"
    if not isinstance(entry, dict):
        raise ConfigError(f"{key} must be a mapping of options such as {{weight: 1.0}}, got {entry!r} "
                          f"(to drop a component, override with ~{key})")
    options = dict(entry)
    weight = options.pop("weight", 1.0)
    if not _is_finite_number(weight):
        raise ConfigError(f"{key}.weight must be a finite number, got {weight!r}")
    if OLD_TARGET in options:
        raise ConfigError(f"{key}.{OLD_TARGET} is now written {key}.{TARGET} (the one convention of user components: "
                          f"`{TARGET}: package.module.function`)")
    target = options.pop(TARGET, None)
    if target is not None:
        fn = import_function(key, target)
        check_options(key, fn, options, named=target, supplied=USER_FUNCTION_ARGUMENTS, config_keys=COMPONENT_KEYS)
        return TargetReward(name, fn, options), float(weight)
    if name not in REWARD_FUNCTIONS:
        raise ConfigError(f"{key}: unknown reward component {name!r}; valid names: "
                          f"{', '.join(sorted(REWARD_FUNCTIONS))} (or give `{TARGET}: package.module.function` for "
                          f"your own)")
    factory = REWARD_FUNCTIONS[name]
    if BUDGET_PARAM in options:
        raise ConfigError(f"{key}.{BUDGET_PARAM} is set from the generation budget (rollout.max_new_tokens), "
                          f"not by the reward config")
    taken = [param for param in RUN_PARAMS if param in options]
    if taken:
        raise ConfigError(f"{key}.{taken[0]} is the run's own (given by the training module), not a config option")
    check_options(key, factory, options, named=f"the {name} reward", hidden=tuple(run), config_keys=("weight",))
    declared = inspect.signature(factory).parameters
    options.update({param: value for param, value in run.items() if param in declared})
    try:
        fn = factory(**options)
    except ValueError as err:
        raise ConfigError(f"{key}: {err}") from None
    return fn, float(weight)


def _is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
