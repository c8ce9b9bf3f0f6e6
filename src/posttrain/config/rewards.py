"""What the reward keys accept: reward.* (the components of the composite reward, their weights
and options, the Lagrangian constraint on one of them) and prm.* (the process reward model
reward=prm reads, an oracle or a learned one); and the rules across them."""

from __future__ import annotations

from posttrain.algorithms import rules
from posttrain.config.spec import (Spec, Values, anything, boolean, choice, integer, is_number, list_of, mapping,
                                   number, option_specs, optional, pattern, rule, text)
from posttrain.rewards.components import REWARD_FUNCTIONS
from posttrain.rewards.composite import ON_ERROR_MODES


# --- reward -----------------------------------------------------------------------------

# `*` patterns are tried in the order written: reward.components.*.weight before .*.*
REWARD_SPECS: dict[str, Spec] = {
    "reward.name": text(),
    "reward.on_error": choice(*ON_ERROR_MODES),
    "reward.failure_score": number(),
    "reward.components": mapping("{accuracy: {weight: 1.0}}", non_empty=True),
    **{key: spec for name, fn in REWARD_FUNCTIONS.items()  # each built-in's declared options
       for key, spec in option_specs(f"reward.components.{name}", getattr(fn, "options", ())).items()},
    # a Lagrangian constraint E[cost] <= limit, lambda learned by dual ascent in the trainer (online.py)
    "reward.constraint": optional(mapping("{cost: response_length, limit: 0.5, lr: 1.0, init: 0.0}")).about(
        "null: none"),
    "reward.constraint.cost": text().about("the component whose score is the cost, weighted 0"),
    "reward.constraint.limit": number().about("epsilon: the mean cost the constraint allows"),
    "reward.constraint.lr": number(0).about("eta of lambda's dual ascent; 0: lambda stays at init"),
    "reward.constraint.init": number(0).about("lambda at the start"),
    "reward.constraint.kp": number(0).about("the PID multiplier's proportional gain on E[cost] - limit; 0: dual ascent"),
    "reward.constraint.kd": number(0).about("its derivative gain on the mean cost's rise; 0: none"),
    "reward.path": optional(text()).about("a reward model directory (reward=reward_model)"),
    "reward.paths": optional(list_of(text())).about("reward model directories: an ensemble"),
    "reward.components.reward_model.path": optional(text()).about("a reward model directory"),
    "reward.components.reward_model.paths": optional(list_of(text())).about("reward model directories: an ensemble"),
    "reward.components.reward_model.std_coef": number(0).about("k of an ensemble's mean - k * std"),
    "reward.components.reward_model.batch_size": integer(1).about("rows per reward-model forward"),
    "reward.components.reward_model.share_tokenizer": boolean(),
    "reward.components.reward_model.head_weights": Spec(
        lambda v: v is None or (isinstance(v, dict) and all(is_number(w) for w in v.values())),
        "null or a mapping head -> weight, e.g. {correct: 1.0, concise: 0.3}").about(
        "a multi-head reward model's sum_h w_h * r_h; a head not named weighs 0; null: all 1"),
    "reward.components.prm.step_reward": choice("marginal", "raw", "min").about(
        "step rewards from PRM scores: s_k - s_(k-1) | s_k | PURE's min-form"),
    "reward.components.prm.model": choice("oracle", "learned").about("the PRM (from the prm group)"),
    "reward.components.prm.path": optional(text()).about("a learned PRM's directory"),
    "reward.components.prm.oracle_score": choice("prefix", "step"),
    "reward.components.prm.batch_size": integer(1).about("rows per PRM forward"),
    "reward.components.*": mapping("{weight: 1.0} (drop a component with ~reward.components.<name>)"),
    "reward.components.*.weight": number(),
    "reward.components.*._target_": pattern(r"[\w.]+\.\w+", "a dotted path 'package.module.function' (your own "
                                                              "function; docs/extending.md)"),
    # the spelling before `_target_` became the one convention of user components (docs/extending.md)
    "reward.components.*.target": Spec(lambda v: False, "nothing: this key is now written `_target_` "
                                                        "(reward.components.<name>._target_=package.module.function)"),
    # a component's own options: checked against its function's signature by the dry run (dry_run.py)
    "reward.components.*.*": anything(),
}


@rule
def a_reward_model_path_needs_the_reward_model_component(v: Values):
    """reward.path / reward.paths only feed reward.components.reward_model: without it they'd be ignored."""
    components = v.get("reward.components")
    for key in ("reward.path", "reward.paths"):
        if v.get(key) and isinstance(components, dict) and "reward_model" not in components:
            yield (f"{key} is set, but the reward has no reward_model component to read it "
                   f"(reward.components: {sorted(components)}); use reward=reward_model, or add "
                   f"+reward.components.reward_model.{key.rpartition('.')[2]}=...")


@rule
def a_constraint_reads_a_weightless_component(v: Values):
    """reward.constraint's cost is one of the reward's components, weighted 0 (rules.constraint_problem)."""
    if problem := rules.constraint_problem(v.get("reward.constraint"), v.get("reward.components")):
        yield problem


# --- prm --------------------------------------------------------------------------------

PRM_SPECS: dict[str, Spec] = {
    "prm.model": choice("oracle", "learned").about("oracle: the task's step verifier | learned: an algorithm=prm export"),
    "prm.path": optional(text()).about("the hf_model/ of an algorithm=prm run (prm=learned)"),
    "prm.oracle_score": choice("prefix", "step").about("prefix: 1 while every step so far is right | step: each alone"),
    "prm.batch_size": integer(1).about("rows per PRM forward"),
}


SPECS: dict[str, Spec] = {**REWARD_SPECS, **PRM_SPECS}
