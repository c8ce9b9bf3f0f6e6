"""What `kl_estimator.*` accepts (conf/kl_estimator/: the KL to the reference, its weight,
placement and controller), and the rule that a KL in use is placed and controlled."""

from __future__ import annotations

from posttrain.algorithms import rules
from posttrain.config.spec import POSITIVE, Spec, Values, choice, number, option_specs, optional, rule, text
from posttrain.core.kl import KL_CONTROLLERS, KL_ESTIMATORS, estimator_options

# The keys the estimators declare (a user's estimator named by `_target_` declares its own).
OPTION_KEYS = tuple(estimator_options())
SPECS: dict[str, Spec] = {
    # a built-in, or the name a user's estimator is declared with (kl_estimator._target_; algorithms/formulas.py)
    "kl_estimator.name": text().about(f"none, {', '.join(KL_ESTIMATORS)}, or the name of your own estimator "
                                      f"with kl_estimator._target_"),
    "kl_estimator._target_": text().about("a function declared with @posttrain.core.kl_estimator"),
    "kl_estimator.coef": number(0),
    "kl_estimator.placement": choice("in_reward", "as_loss", "none"),
    "kl_estimator.controller": choice(*KL_CONTROLLERS),
    "kl_estimator.target": optional(POSITIVE).about("the adaptive controller's target KL"),
    "kl_estimator.horizon": optional(POSITIVE).about("the adaptive controller's horizon"),
    **option_specs("kl_estimator", estimator_options().values()),
}


@rule
def kl_term_is_placed_and_controlled(v: Values):
    if not v.online():
        return
    name, coef = v["kl_estimator.name"], v.get("kl_estimator.coef", 0)
    if not rules.uses_kl(name, coef):
        return
    if problem := rules.kl_placement_problem(name, coef, v.get("kl_estimator.placement")):
        yield problem
    if v.get("kl_estimator.controller", "fixed") == "adaptive":
        target, horizon = v.get("kl_estimator.target"), v.get("kl_estimator.horizon")
        if target is None or horizon is None:
            yield (f"kl_estimator.controller=adaptive needs kl_estimator.target (the KL to hold) and "
                   f"kl_estimator.horizon (steps to adapt over), both > 0; got target={target!r}, horizon={horizon!r}")
