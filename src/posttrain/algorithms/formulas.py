"""The formulas of an online-RL run, from its config: the policy loss, the advantage estimator
and the KL estimator, each a built-in (by name) or a researcher's own (by `_target_`), with its
options checked against its declaration (core.policy_loss, core.advantages, core.kl).

  algorithm.policy_loss: ppo_clip                     a built-in loss; its options are `algorithm.<key>`
  algorithm.policy_loss: {_target_: my_losses.soft_clip, <its own options>}
  advantage: {name: group_norm, <options>}            a built-in estimator
  advantage: {name: median_baseline, _target_: my_adv.median_baseline, <options>}
  kl_estimator: {name: k3, coef, placement, controller, target, horizon, <options>}
  kl_estimator: {name: my_kl, _target_: my_kl.my_kl, coef, placement, ..., <options>}

A `_target_` names a function declared with the same decorator as the built-ins
(`posttrain.core.policy_loss`, `advantage_estimator`, `kl_estimator`), imported as every user
component is (run/user_components.py: the launch directory is on the path). The module, its
parts and the start-up check (config/dry_run.py) all read `resolve_formulas`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial

import torch
from omegaconf import OmegaConf

from posttrain import core
from posttrain.algorithms import rules
from posttrain.core.kl import GRADIENT_OPTIONS
from posttrain.core.options import POSITIVE, Option, boolean, choice, option_problems, optional
from posttrain.core.policy_loss import SHARED_OPTIONS
from posttrain.errors import ConfigError
from posttrain.run.user_components import TARGET, import_function

# Keys of the kl_estimator group that place and weigh the KL; every other key is an estimator option.
KL_PLACEMENT_KEYS = ("name", "coef", "placement", "controller", "target", "horizon")
# How the policy loss is aggregated (algorithm.<name>; the learner's options, learner.LEARNER_OPTIONS).
AGGREGATION_OPTIONS = (
    Option("loss_agg_mode", "seq-mean-token-mean", choice(*core.AGGREGATION_MODES), "how token losses are averaged"),
    Option("norm_constant", None, optional(POSITIVE), "null: the generation budget"),
    Option("count_empty_rows", False, boolean(), "sequence means also count all-padding rows (TRL)"),
)


@dataclass(frozen=True)
class Formulas:
    """What the update computes, resolved: each callable takes what `partial(core.<fn>, name)`
    takes (`policy_loss(logp, old_logp, advantages, mask, **options)`, `advantage(token_rewards,
    mask, group_index, values=None, **options)`, `kl(logp, ref_logp, old_logp, **options)`)."""

    policy_loss: Callable
    policy_loss_name: str
    loss_options: dict
    aggregation: dict
    advantage: Callable
    advantage_name: str
    advantage_options: dict
    kl: Callable | None = None  # None: no KL term (kl_estimator=none or coef 0)
    kl_name: str = "none"
    kl_options: dict = field(default_factory=dict)


def plain(node):
    """A config node (DictConfig, or a mapping that may hold some) as plain Python."""
    if OmegaConf.is_config(node):
        return OmegaConf.to_container(node, resolve=True)
    return {key: plain(value) for key, value in node.items()} if isinstance(node, Mapping) else node


def refuse(problems: list[str]) -> None:
    if problems:
        raise ConfigError("; ".join(problems))


def declared_function(key: str, target, attribute: str, decorator: str) -> Callable:
    """The function `key._target_` names, which must carry its declaration (`attribute`)."""
    fn = import_function(key, target)
    if not hasattr(fn, attribute):
        raise ConfigError(f"{key}.{TARGET}={target!r} is not declared with @posttrain.core.{decorator}(...): "
                          f"decorate it so that its options are known and checked")
    return fn


def loss_keys(algorithm: Mapping) -> list[str]:
    """The keys of the `algorithm` node that are the policy loss's: `policy_loss` and the
    options the losses declare (shared, and each built-in loss's own)."""
    declared = core.loss_options()
    return [key for key in algorithm if key == "policy_loss" or key in declared]


def resolve_policy_loss(algorithm: Mapping) -> tuple[Callable, str, dict]:
    """(the loss, its name, its options) of `algorithm.policy_loss` and the algorithm's loss keys."""
    chosen = algorithm.get("policy_loss", "ppo_clip")
    if isinstance(chosen, Mapping):
        given = {key: value for key, value in chosen.items() if key != TARGET}
        fn = declared_function("algorithm.policy_loss", chosen.get(TARGET), "loss_name", "policy_loss")
        refuse(option_problems("algorithm.policy_loss", fn.own_options, given))
    elif chosen in core.POLICY_LOSSES:
        fn = core.POLICY_LOSSES[chosen]
        given = {option.name: algorithm[option.name] for option in fn.own_options if option.name in algorithm}
    else:
        raise ConfigError(f"algorithm.policy_loss={chosen!r} is not one of {sorted(core.POLICY_LOSSES)} (or a mapping "
                          f"{{{TARGET}: my_module.my_loss, <its options>}})")
    options = {key: algorithm[key] for key in loss_keys(algorithm) if key in SHARED_OPTIONS}
    declared = core.loss_options()
    for key in loss_keys(algorithm):  # another loss's own option: refused unless left at its default
        if key not in options and key != "policy_loss" and key not in given:
            if algorithm[key] != declared[key].default:
                raise ConfigError(f"algorithm.{key}={algorithm[key]!r} is an option of another policy loss, not of "
                                  f"algorithm.policy_loss={fn.loss_name}; leave it at {declared[key].default!r}")
    return partial(core.compute_policy_loss, fn.loss_name), fn.loss_name, {**options, **given}


def resolve_estimator(key: str, node: Mapping, registry: Mapping, ignored: tuple[str, ...], decorator: str):
    """(the estimator's name, its declared function, its options) of the `advantage` or
    `kl_estimator` node: `name` a built-in, or with `_target_` the user's function of that name."""
    name, target = node.get("name"), node.get(TARGET)
    given = {k: v for k, v in node.items() if k not in ignored and k != TARGET}
    if target is not None:
        fn = declared_function(key, target, "estimator_name", decorator)
        if fn.estimator_name != name:
            raise ConfigError(f"{key}.name={name!r}, but {key}.{TARGET}={target!r} is declared as "
                              f"{fn.estimator_name!r}: set {key}.name={fn.estimator_name}")
    elif name in registry:
        fn = registry[name]
    else:
        raise ConfigError(f"{key}={name!r} is not one of {sorted(registry)} (or name your own with {key}.{TARGET})")
    extra = GRADIENT_OPTIONS.values() if key == "kl_estimator" else ()
    refuse(option_problems(key, [*fn.options, *extra], given))
    return name, fn, given


def resolve_kl(kl_estimator: Mapping) -> tuple[Callable, str, dict]:
    """(the KL callable, its name, its options) of a `kl_estimator` node that is in use."""
    name, _, options = resolve_estimator("kl_estimator", plain(kl_estimator), core.KL_ESTIMATORS, KL_PLACEMENT_KEYS,
                                         "kl_estimator")
    return partial(core.kl_penalty, name), name, options


def resolve_formulas(algorithm: Mapping, advantage: Mapping, kl_estimator: Mapping, max_new_tokens: int) -> Formulas:
    """The run's formulas from its `algorithm`, `advantage` and `kl_estimator` nodes, each
    option checked against its declaration (a ConfigError naming the key). Aggregation keys
    the node leaves out take the learner's defaults; `norm_constant` null is the budget."""
    algorithm, advantage, kl_estimator = plain(algorithm), plain(advantage), plain(kl_estimator)
    loss, loss_name, loss_options = resolve_policy_loss(algorithm)
    settings = {o.name: algorithm.get(o.name, o.default) for o in AGGREGATION_OPTIONS}
    aggregation = dict(agg_mode=settings["loss_agg_mode"], count_empty_rows=settings["count_empty_rows"],
                       norm_constant=settings["norm_constant"] or max_new_tokens)  # Dr. GRPO: the budget
    advantage_name, _, advantage_options = resolve_estimator("advantage", advantage, core.ADVANTAGE_ESTIMATORS,
                                                             ("name",), "advantage_estimator")
    kl = {}
    if rules.uses_kl(kl_estimator.get("name", "none"), kl_estimator.get("coef", 0)):
        kl = dict(zip(("kl", "kl_name", "kl_options"), resolve_kl(kl_estimator)))
    return Formulas(loss, loss_name, loss_options, aggregation, partial(core.compute_advantages, advantage_name),
                    advantage_name, advantage_options, **kl)


def check_formulas(formulas: Formulas) -> None:
    """Run the advantage, the policy loss and the KL estimator once on a dummy batch of two
    one-token samples, so that an option a formula does not take (dual_clip with gspo, a clamp
    on an estimator without one) or a bad value is a ConfigError at start-up, not a crash at
    the first step."""
    ones = torch.ones(2, 1)
    values = ones if formulas.advantage_name == "gae" else None
    steps = {"step_mask": ones.bool()} if formulas.advantage_name == "prm_step" else {}
    try:
        formulas.advantage(ones, ones, torch.tensor([0, 0]), values=values, **formulas.advantage_options, **steps)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"advantage={formulas.advantage_name}: {err}") from None
    if formulas.aggregation["agg_mode"] not in core.AGGREGATION_MODES:
        raise ConfigError(f"algorithm.loss_agg_mode={formulas.aggregation['agg_mode']!r} is not one of "
                          f"{core.AGGREGATION_MODES}")
    try:
        formulas.policy_loss(ones, ones, ones, ones, **formulas.loss_options, **formulas.aggregation)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"algorithm.policy_loss={formulas.policy_loss_name}: {err}") from None
    if formulas.kl is not None:
        try:
            formulas.kl(ones, ones, ones, **formulas.kl_options)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"kl_estimator={formulas.kl_name}: {err}") from None
