"""What data=verifiers accepts besides the keys other sources share (data.heldout_size, data.chat,
...), and the rules that env=verifiers and data=verifiers go together. env=verifiers' own options
(env.load, env.args, env.correct_threshold) are its constructor's, checked by config/env.py."""

from __future__ import annotations

from posttrain.config.spec import Spec, Values, integer, optional, rule, text

ENVIRONMENT = "posttrain.envs.verifiers_env.VerifiersEnvironment"

SPECS: dict[str, Spec] = {
    "data.load": optional(text()).about("data=verifiers: the environment's module (follows env.load)"),
    # one value (not descended into): the environment's own arguments, checked by its taskset or function
    "data.args": Spec(lambda v: v is None or isinstance(v, dict), "null or a mapping").about("data=verifiers: its arguments (follow env.args)"),
    "data.limit": optional(integer(1)).about("data=verifiers: the tasks read, in order; null: all"),
}


@rule
def verifiers_data_and_environment_go_together(v: Values):
    """data=verifiers is played by env=verifiers (its rubric judges), and env=verifiers plays data=verifiers."""
    data_is_verifiers = v.get("data.source") == "verifiers"
    env_is_verifiers = v.get("env._target_") == ENVIRONMENT
    if data_is_verifiers and not env_is_verifiers:
        yield ("data=verifiers holds a verifiers environment's tasks, which only its rubric judges: add env=verifiers "
               "env.load=<your environment's module> (docs/environments.md#verifiers-environments)")
    if env_is_verifiers and not data_is_verifiers:
        yield (f"env=verifiers plays the tasks of its own environment, not data.source={v.get('data.source')!r}: "
               f"add data=verifiers")
    if env_is_verifiers and v.get("env.load") is None:
        yield ("env.load is not set: name your verifiers environment, env.load=<module> (exporting its Taskset, or "
               "with load_environment) or env.load=<module:function>")
