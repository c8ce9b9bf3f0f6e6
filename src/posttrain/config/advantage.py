"""What `advantage.*` accepts (conf/advantage/: the advantage estimator and its options), and
the rules that an online algorithm has an advantage that fits it and its groups."""

from __future__ import annotations

from posttrain.algorithms import rules
from posttrain.config.spec import Spec, Values, option_specs, rule, text
from posttrain.core.advantages import ADVANTAGE_ESTIMATORS, estimator_options

# Advantages that compare the samples of one prompt's group with each other.
GROUP_ADVANTAGES = ("group_norm", "group_mean", "rloo", "reinforce_pp_baseline")

# The keys the estimators declare (a user's estimator named by `_target_` declares its own).
OPTION_KEYS = tuple(estimator_options())
SPECS: dict[str, Spec] = {
    # a built-in, or the name a user's estimator is declared with (advantage._target_; algorithms/formulas.py)
    "advantage.name": text().about(f"none, {', '.join(ADVANTAGE_ESTIMATORS)}, or the name of your own "
                                   f"estimator with advantage._target_"),
    "advantage._target_": text().about("a function declared with @posttrain.core.advantage_estimator"),
    **option_specs("advantage", estimator_options().values()),
}


@rule
def online_algorithm_needs_an_advantage(v: Values):
    if v.online() and v["advantage.name"] == "none":
        algorithm = v.algorithm()
        yield (f"algorithm={algorithm} is an online RL algorithm and needs an advantage estimator "
               f"(advantage=none was chosen)")


@rule
def advantage_fits_the_algorithm(v: Values):
    if not v.online():
        return
    advantage, critic = v["advantage.name"], v.get("algorithm.critic")
    # the process reward (its component's weight) is read for prm_step only: a refused weight
    # must not silence the critic rule of another advantage
    has_process_reward = advantage == "prm_step" and bool(v.get("reward.components.prm.weight"))
    if problem := rules.prm_step_problem(advantage, has_process_reward):
        yield problem
    elif problem := rules.gae_critic_problem(advantage, critic is not None):
        yield problem


@rule
def groups_of_one_carry_no_signal(v: Values):
    """A group-based advantage compares a sample with the other samples of its prompt: with
    one sample per prompt every advantage is 0 and the run trains on nothing."""
    if not v.online() or v["algorithm.group_size"] != 1:
        return
    advantage = v["advantage.name"]
    if advantage in GROUP_ADVANTAGES and v.get("advantage.singleton", "zero") == "zero":
        yield (f"algorithm.group_size=1 with advantage={advantage} gives every sample an advantage of 0 (a group "
               f"of one sample has nothing to be compared with), so nothing would be trained: set "
               f"algorithm.group_size >= 2, or advantage.singleton=raw or unit_std to score groups of one, or use "
               f"advantage=reinforce_pp")
    if v.get("data_curriculum.name") == "dynamic_sampling":
        yield ("data_curriculum=dynamic_sampling keeps only groups whose rewards differ, which a group of "
               "algorithm.group_size=1 never does, so every batch would be dropped: set algorithm.group_size >= 2")
