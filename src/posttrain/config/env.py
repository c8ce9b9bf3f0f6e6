"""What the env keys accept: env.name, env._target_ (the Environment class), env.turn_tokens
(the collector's), and each environment's own options, checked against its constructor."""

from __future__ import annotations

from posttrain.config.spec import Spec, Values, anything, integer, optional, pattern, rule, text
from posttrain.envs.build import COLLECTOR_KEYS
from posttrain.errors import ConfigError
from posttrain.run.user_components import TARGET, check_options, import_target

SPECS: dict[str, Spec] = {
    "env.name": text(),
    "env._target_": optional(pattern(r"[\w.]+\.\w+", "a dotted path 'package.module.Environment'")).about(
        "the environment class; null: one response per prompt"),
    "env.turn_tokens": optional(integer(1)).about("a policy turn's token budget; null: the rest of the episode's"),
    "env.*": anything(),  # the environment's own options: checked against its constructor (below)
}


@rule
def env_options_fit_the_environment(v: Values):
    """The env node's options are arguments of its class; an environment needs an online algorithm."""
    target = v.get("env._target_")
    if target is None or not v.online():  # an offline algorithm with an env: algorithm.py's rule says so
        return
    options = [key.partition(".")[2] for key in v.values if key.startswith("env.") and key.count(".") == 1]
    try:
        check_options("env", import_target("env", target), [o for o in options if o not in COLLECTOR_KEYS],
                      named=f"environment {target}")
    except ConfigError as err:
        yield str(err)


@rule
def an_episode_fits_its_turn(v: Values):
    """env.turn_tokens leaves room in rollout.max_new_tokens, the budget of the whole episode."""
    turn, total = v.get("env.turn_tokens"), v.get("rollout.max_new_tokens")
    if v.get("env._target_") is not None and turn is not None and isinstance(total, int) and turn > total:
        yield (f"env.turn_tokens={turn} is more than rollout.max_new_tokens={total}, the budget of a whole episode "
               f"(all its turns and replies); raise rollout.max_new_tokens or lower env.turn_tokens")
