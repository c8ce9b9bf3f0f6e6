"""`build_reward`: the `reward` config group -> a `CompositeReward`.

    reward:
      on_error: raise        # raise | fail
      failure_score: 0.0     # score of a failed sample when on_error=fail
      components:
        accuracy: {weight: 1.0}
        overlong: {weight: 1.0, cache_len: 4}
        mine: {weight: 0.5, target: my_pkg.rewards.brevity, scale: 2}

A component is a built-in (`REWARD_FUNCTIONS`) named by its key, or a user function named
by `target:`; every option besides `weight` and `target` is a keyword argument to it.
"""

from __future__ import annotations

import importlib
import inspect
import math
from typing import Any, Callable, Sequence

from omegaconf import DictConfig, OmegaConf

from posttrain.errors import ConfigError, RewardError
from posttrain.rewards.base import RewardFunction, ScoredSample
from posttrain.rewards.components import REWARD_FUNCTIONS
from posttrain.rewards.composite import ON_ERROR_MODES, CompositeReward

# path / paths: the reward model preset's shorthands (reward.path=<dir>), read by its component;
# constraint: a Lagrangian constraint on one component, applied by the trainer (online.py), not here
TOP_LEVEL_KEYS = ("name", "on_error", "failure_score", "components", "path", "paths", "constraint")
# A built-in constructor with this parameter gets the generation budget (rollout.max_new_tokens).
BUDGET_PARAM = "max_new_tokens"
# ... and with these, the run's policy and tokenizer (a learned scorer runs on the policy's
# device and may tokenise as it does); None where none exists yet (the start-up config check).
RUN_PARAMS = ("policy", "tokenizer")


class TargetReward:
    """A user's reward function `fn(samples, source, **options) -> [B] scores`, found by config."""

    def __init__(self, name: str, fn: Callable[..., Any], options: dict[str, Any]):
        self.name = name
        self.fn = fn
        self.options = options

    def __call__(self, samples: Sequence[ScoredSample], source):
        return self.fn(samples, source, **self.options)


def build_reward(reward_cfg: DictConfig, source, max_new_tokens: int, *, policy=None,
                 tokenizer=None) -> CompositeReward:
    """The composite reward the `reward` config describes.

    `source` is the task source the rewards will judge with (kept for scorers that need to
    know it when built); `max_new_tokens` is the generation budget, the default `max_len`
    of `overlong`; `policy` and `tokenizer` go to the built-ins that declare them (RUN_PARAMS).
    """
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
    """Call the user's reward functions (`target:` components) once on stand-in samples of
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
                      if isinstance(entry, dict) and entry.get("target") is not None]
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
    target = options.pop("target", None)
    if target is not None:
        fn = _import_function(target, key)
        _check_options(key, fn, options, supplied=2)  # (samples, source) come from the composite
        return TargetReward(name, fn, options), float(weight)
    if name not in REWARD_FUNCTIONS:
        raise ConfigError(f"{key}: unknown reward component {name!r}; valid names: {', '.join(sorted(REWARD_FUNCTIONS))} "
                          f"(or give `target: package.module.function` for your own)")
    factory = REWARD_FUNCTIONS[name]
    if BUDGET_PARAM in options:
        raise ConfigError(f"{key}.{BUDGET_PARAM} is set from the generation budget (rollout.max_new_tokens), "
                          f"not by the reward config")
    taken = [param for param in RUN_PARAMS if param in options]
    if taken:
        raise ConfigError(f"{key}.{taken[0]} is the run's own (given by the training module), not a config option")
    _check_options(key, factory, options, supplied=0, hidden=tuple(run))
    declared = inspect.signature(factory).parameters
    options.update({param: value for param, value in run.items() if param in declared})
    try:
        fn = factory(**options)
    except ValueError as err:
        raise ConfigError(f"{key}: {err}") from None
    return fn, float(weight)


def _import_function(path: Any, key: str) -> Callable[..., Any]:
    """The callable at a dotted path `package.module.function`, or a ConfigError naming `key`."""
    if not isinstance(path, str) or "." not in path:
        raise ConfigError(f"{key}.target must be a dotted path like 'package.module.function', got {path!r}")
    module_path, _, attribute = path.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module_path), attribute)
    except Exception as err:  # a missing module, a missing name, or the module failing on import
        raise ConfigError(f"{key}.target={path!r} cannot be imported: {type(err).__name__}: {err}") from err
    if not callable(fn):
        raise ConfigError(f"{key}.target={path!r} is a {type(fn).__name__}, not a function")
    return fn


def _check_options(key: str, fn: Callable[..., Any], options: dict[str, Any], supplied: int,
                   hidden: tuple[str, ...] = ()) -> None:
    """Refuse options `fn` does not take, and required ones left out, before the run starts.

    `supplied` leading parameters and the `hidden` ones are filled in by the code, not the config.
    """
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return  # a callable without an inspectable signature: it will complain when called
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < supplied and not any(p.kind == p.VAR_POSITIONAL for p in params):
        raise ConfigError(f"{key}: {getattr(fn, '__name__', fn)} must take (samples, source) as its first arguments")
    named = [p for p in params[supplied:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
             and p.name not in hidden]
    if not any(p.kind == p.VAR_KEYWORD for p in params):
        valid = [p.name for p in named]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ConfigError(f"{key}: unknown option(s) {unknown}; valid options: "
                              f"{', '.join(['weight', 'target'] + valid)}")
    missing = [p.name for p in named if p.default is p.empty and p.name not in options]
    if missing:
        raise ConfigError(f"{key}: missing required option(s) {missing}")


def _is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
