"""The dry runs: the checks the builders do themselves (the algorithm's arguments, the core
formulas' options on a dummy batch, the reward's components, the curriculum's options), run on
the config at start-up. Without them such a problem would surface only when the builder runs,
after the SFT warm start has trained. config/check.py runs them only when every value and
rule passed, so they never see a value of the wrong type.
"""

from __future__ import annotations

import inspect

from omegaconf import DictConfig

from posttrain.data.curriculum import CURRICULA
from posttrain.errors import ConfigError
from posttrain.rewards import build_reward
from posttrain.run.user_components import import_target

# Arguments `train.build_module` passes to the algorithm's module itself, and algorithm keys
# it does not pass (train.py reads them).
SUPPLIED_ARGUMENTS = ("self", "policy", "tokenizer", "source", "rollout", "eval_max_new_tokens", "kl_estimator",
                      "advantage", "reward", "data_curriculum", "roles", "cache_dir", "seed")
NOT_MODULE_ARGUMENTS = ("_target_", "name", "kind", "warm_start")


def unknown_arguments(key: str, constructor, given: list[str], supplied: tuple[str, ...] = ()) -> list[str]:
    """Keys of a node that `constructor` does not take (it would fail with a TypeError)."""
    params = inspect.signature(constructor).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return []
    valid = [name for name in params if name not in supplied]
    unknown = sorted(set(given) - set(valid))
    if not unknown:
        return []
    return [f"{key}: unknown key(s) {unknown}; valid keys: {', '.join(valid)}"]


def algorithm_problems(cfg: DictConfig) -> list[str]:
    target = cfg.algorithm.get("_target_")
    try:  # found as every user component is (run/user_components.py: the launch directory too)
        module_class = import_target("algorithm", target)
    except ConfigError as err:  # a missing module or name, or the module failing on import
        return [str(err)]
    given = [k for k in cfg.algorithm if k not in NOT_MODULE_ARGUMENTS]
    problems = unknown_arguments("algorithm", module_class, given, SUPPLIED_ARGUMENTS)
    # An SFT run (the warm start) never imports the RL modules, so that editing them keeps the
    # cached warm starts (prepare/source_key.py follows no import marked so): imported here for the cache key
    from posttrain.algorithms.online.module import OnlineRLModule, refuse_unknown_keys

    if isinstance(module_class, type) and issubclass(module_class, OnlineRLModule):
        try:
            named = inspect.signature(module_class).parameters  # optim: a constructor argument of its own
            refuse_unknown_keys({key: None for key in given if key not in named})
        except ConfigError as err:
            problems.append(str(err))
    params = inspect.signature(module_class).parameters
    missing = [name for name, p in params.items()
               if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               and name not in SUPPLIED_ARGUMENTS and name not in given]
    if missing:
        problems.append(f"algorithm: missing key(s) {missing} that {target} needs")
    return problems


def core_option_problems(cfg: DictConfig) -> list[str]:
    """The policy loss, advantage and KL estimator as the module resolves them (formulas.py:
    a built-in or a user's `_target_`, each option against its declaration), then run on a
    dummy batch, from the config rather than from a built module."""
    # An SFT run (the warm start) never imports the RL modules, so that editing them keeps the
    # cached warm starts (prepare/source_key.py follows no import marked so): imported here for the cache key
    from posttrain.algorithms.formulas import check_formulas, resolve_formulas

    try:
        check_formulas(resolve_formulas(cfg.algorithm, cfg.advantage, cfg.kl_estimator, cfg.rollout.max_new_tokens))
    except ConfigError as err:
        return [str(err)]
    return []


def reward_problems(cfg: DictConfig) -> list[str]:
    """Build the reward (imports user functions, checks each component's options); scoring
    needs no task source, so none is given."""
    try:
        build_reward(cfg.reward, None, cfg.rollout.max_new_tokens)
    except ConfigError as err:
        return [str(err)]
    return []


def curriculum_problems(cfg: DictConfig) -> list[str]:
    name = cfg.data_curriculum.name
    given = [k for k in cfg.data_curriculum if k != "name"]
    return unknown_arguments(f"data_curriculum={name}", CURRICULA[name], given, ("self", "cursor", "cache_dir"))


def dry_run_problems(cfg: DictConfig) -> list[str]:
    problems = algorithm_problems(cfg)
    if problems or cfg.algorithm.kind != "online":
        return problems
    # An SFT run (the warm start) never imports the RL modules, so that editing them keeps the
    # cached warm starts (prepare/source_key.py follows no import marked so): imported here for the cache key
    from posttrain.algorithms.online import OnlineRLModule

    if not issubclass(import_target("algorithm", cfg.algorithm._target_), OnlineRLModule):
        return problems  # another online module: its own checks apply
    return core_option_problems(cfg) + reward_problems(cfg) + curriculum_problems(cfg)
