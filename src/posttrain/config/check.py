"""Start-up validation of the composed config, before anything is built or written.

One pass, three layers, every problem found reported together in one `ConfigError`:

1. **values**: each key has a `Spec` in `SPECS` (type, range or allowed choices); a value
   that does not fit is named with the key, its repr and what is allowed, e.g.
   `trainer.max_steps='abc' is not valid: expected a positive integer (optimiser steps).`
   Keys without a spec pass (`+trainer.max_time=...` is Lightning's to check), but every
   key of conf/ has one: tests/config/test_config_validation.py composes every option and fails
   on a key without a spec.
2. **rules across keys** (`RULES`): combinations that crash late or train on nothing,
   e.g. a group-based advantage with groups of one sample.
3. **dry runs** of the checks the builders do themselves (dry_run.py), which would otherwise
   fail only after the SFT warm start has trained. They run only when 1 and 2 pass, so
   they never see a value of the wrong type.

What a key accepts, and the rules about it, live in the file of its concept: `rollout.*` in
rollout.py, `algorithm.*` in algorithm.py, the model roles in roles.py, the models (policy,
teacher) in models.py, the data (task, curriculum, preference pairs) in data.py, the rewards in
rewards.py, a run's own keys (trainer, callbacks, logger, paths, eval, the top-level scalars) in
run.py. This file gathers them and runs the pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from omegaconf import DictConfig, ListConfig, OmegaConf

from posttrain.config import (advantage, algorithm, data, env, kl_estimator, models, numerics, rewards, roles, rollout, run,
                              verifiers)
from posttrain.config.dry_run import dry_run_problems
from posttrain.config.spec import MISSING, Rule, Spec, Unusable, Values
from posttrain.errors import ConfigError

# The files that say what the keys of conf/ accept, one a config group (or top-level node).
GROUP_FILES = (run, roles, models, algorithm, rollout, data, kl_estimator, advantage, rewards, numerics, env, verifiers)


def gather_specs() -> dict[str, Spec]:
    """Every key of conf/, by dotted path: the group files' SPECS, each key in one file."""
    specs: dict[str, Spec] = {}
    for group in GROUP_FILES:
        twice = specs.keys() & group.SPECS.keys()
        if twice:
            raise RuntimeError(f"{group.__name__} repeats the spec of {sorted(twice)}")
        specs.update(group.SPECS)
    return specs


# `*` stands for any one key (reward components, roles). An exact key wins over a pattern;
# patterns are tried in this order.
SPECS = gather_specs()
PATTERNS = [key for key in SPECS if "*" in key]

# The cross-key rules, in the order their problems are reported (the numbered list of one
# ConfigError reads in this order). Each lives in the file of the group it is about.
RULES: tuple[Rule, ...] = (
    algorithm.offline_algorithm_takes_no_online_components,
    rollout.repetition_window_holds_two_blocks,
    rollout.sampler_precision_is_supported,
    rollout.mismatch_options_need_an_online_algorithm,
    rollout.producer_can_sample_ahead,
    rollout.async_options_need_an_online_algorithm,
    rollout.masked_share_budget_needs_a_mask,
    algorithm.preference_algorithm_reads_no_reward,
    algorithm.preference_algorithm_samples_in_process,
    algorithm.preference_options_fit_the_loss,
    data.preference_dataset_is_named,
    data.embedded_pairs_label_the_heads,
    advantage.online_algorithm_needs_an_advantage,
    advantage.advantage_fits_the_algorithm,
    advantage.groups_of_one_carry_no_signal,
    algorithm.minibatches_split_the_batch_evenly,
    algorithm.delta_lies_above_the_clip_range,
    algorithm.sampling_mask_needs_a_sampling_filter,
    kl_estimator.kl_term_is_placed_and_controlled,
    data.digit_range_is_ordered,
    run.eval_split_has_data,
    run.eval_suites_are_well_formed,
    data.dataset_columns_are_named,
    data.reasoning_gym_tasks_are_known,
    data.mixture_sources_are_valid,
    data.curriculum_has_what_it_reads,
    rewards.a_reward_model_path_needs_the_reward_model_component,
    rewards.a_constraint_reads_a_weightless_component,
    roles.a_role_with_its_own_model_does_not_copy_the_policy,
    roles.a_sharded_policy_has_no_shared_critic,
    roles.a_role_in_use_is_configured,
    models.a_pretrained_model_is_named,
    models.trainable_weights_are_not_half_precision,
    models.a_pretrained_model_ignores_no_setting,
    models.tiny_model_heads_fit,
    run.several_devices_need_the_data_parallel_strategy,
    models.lora_export_and_start_are_loadable,
    models.lora_is_not_sharded,
    models.distillation_reads_a_teacher,
    algorithm.a_distillation_reward_is_its_own_advantage,
    algorithm.ptx_data_is_a_file_that_exists,
    run.online_rl_steps_its_own_optimiser,
    run.accelerator_is_present,
    rollout.vllm_rollout_can_run,
    rollout.vllm_server_can_run,
    env.env_options_fit_the_environment,
    env.an_episode_fits_its_turn,
    verifiers.verifiers_data_and_environment_go_together,
)


# The groups whose node may name the user's own estimator (`_target_`): the keys the built-ins
# declare are then that estimator's own, checked against its declaration by the dry run
# (algorithms/formulas.py), not against the built-ins' specs of the same name.
USER_TARGET_GROUPS = {"advantage": advantage.OPTION_KEYS, "kl_estimator": kl_estimator.OPTION_KEYS}


def declared_by_the_users_target(cfg: DictConfig, key: str) -> bool:
    group, _, name = key.partition(".")
    return name in USER_TARGET_GROUPS.get(group, ()) and OmegaConf.select(cfg, f"{group}._target_") is not None


def spec_for(key: str) -> Spec | None:
    """The spec of a dotted key: its own, else the first pattern that matches it."""
    if key in SPECS:
        return SPECS[key]
    parts = key.split(".")
    for candidate in PATTERNS:
        wanted = candidate.split(".")
        if len(wanted) == len(parts) and all(w in ("*", p) for w, p in zip(wanted, parts)):
            return SPECS[candidate]
    return None


# --- reading the config -------------------------------------------------------------------

@dataclass
class Entry:
    key: str
    value: Any          # plain Python (containers converted), or MISSING
    is_leaf: bool       # a value checked against its spec; False: a node whose keys are checked


def entries(node: DictConfig, prefix: str = "") -> Iterator[Entry]:
    """Every key of the config, depth first: nodes (with their plain value, for the rules)
    and leaves. A node is descended into unless its spec says it is one value."""
    for key in node.keys():
        path = f"{prefix}{key}"
        if path == "hydra":
            continue
        if OmegaConf.is_missing(node, key):
            yield Entry(path, MISSING, is_leaf=True)
            continue
        value = node[key]
        if isinstance(value, (DictConfig, ListConfig)):
            plain = OmegaConf.to_container(value, resolve=True)
            spec = spec_for(path)
            if isinstance(value, DictConfig) and len(value) and (spec is None or spec.descend):
                yield Entry(path, plain, is_leaf=False)
                yield from entries(value, f"{path}.")
                continue
            value = plain
        yield Entry(path, value, is_leaf=True)


def keys_without_spec(cfg: DictConfig) -> list[str]:
    """The leaf keys of `cfg` that have no spec (tests: every key of conf/ must have one)."""
    return [e.key for e in entries(cfg) if e.is_leaf and spec_for(e.key) is None]


def value_problems(cfg: DictConfig) -> tuple[list[str], set[str]]:
    """A message per value that its spec refuses, and the keys that were refused."""
    problems, bad = [], set()
    for entry in entries(cfg):
        spec = spec_for(entry.key)
        if not entry.is_leaf or spec is None or declared_by_the_users_target(cfg, entry.key):
            continue
        if entry.value is MISSING:
            problems.append(f"{entry.key} has no value (???): expected {spec.expected}")
            bad.add(entry.key)
        elif not spec.accepts(entry.value):
            problems.append(f"{entry.key}={entry.value!r} is not valid: expected {spec.expected}")
            bad.add(entry.key)
    return problems, bad


def rule_problems(cfg: DictConfig, bad: set[str], choices: dict[str, str]) -> list[str]:
    values = Values({e.key: e.value for e in entries(cfg)}, bad, choices)
    problems = []
    for check in RULES:
        try:
            problems.extend(list(check(values)))
        except Unusable:
            continue  # a key it reads is absent or already reported
    return problems


# --- the one entry point ------------------------------------------------------------------

def as_sentence(message: str) -> str:
    message = message.strip()
    return message if message.endswith(".") else f"{message}."


def check_config(cfg: DictConfig, choices: dict[str, str] | None = None) -> None:
    """Raise one ConfigError listing every bad value and combination of `cfg` (a composed,
    resolved config). `choices`: Hydra's group choices, used to name the algorithm in messages."""
    choices = choices or {}
    problems, bad = value_problems(cfg)
    problems += rule_problems(cfg, bad, choices)
    if not problems:
        problems = dry_run_problems(cfg)
    if len(problems) == 1:
        raise ConfigError(as_sentence(problems[0]))
    if problems:
        numbered = " ".join(f"({i}) {as_sentence(p)}" for i, p in enumerate(problems, start=1))
        raise ConfigError(f"the config has {len(problems)} problems: {numbered}")
