"""The rules of an online-RL configuration, each stated once over plain values.

Two places enforce them: the online module's parts (algorithms/online/) raise a broken rule
as a ConfigError when a module is built (tests and scripts build modules without the start-up
check), and config/ reports it beside every other problem of the composed config before
anything is built. Each function answers with the problem in words, or None when the values
fit; `refuse` raises the first problem. The words are the start-up check's, so a user reads
the same sentence whichever side finds it first.
"""

from __future__ import annotations

import math

from posttrain.errors import ConfigError


def refuse(*problems: str | None) -> None:
    """Raise the first problem found, as a ConfigError; nothing when every rule holds."""
    for problem in problems:
        if problem:
            raise ConfigError(problem)


def uses_kl(name: str, coef: float) -> bool:
    """Whether the run has a KL term: an estimator is chosen and its weight is above 0."""
    return name != "none" and coef > 0


def gae_critic_problem(advantage: str, has_critic: bool) -> str | None:
    """GAE reads a critic's values, and a critic learns only from GAE's returns: one needs the other."""
    if (advantage == "gae") == has_critic:
        return None
    return ("advantage=gae needs a critic and a critic needs advantage=gae: use algorithm=ppo, or another "
            f"advantage (got advantage={advantage}, algorithm.critic={'set' if has_critic else 'null'})")


def sampling_mask_problem(keep_sampling_mask: bool, top_k: int, top_p: float) -> str | None:
    """The kept sampling mask is the sampler's top-k / top-p support: without a filter there is none."""
    if not (keep_sampling_mask and top_k == 0 and top_p >= 1.0):
        return None
    return ("algorithm.keep_sampling_mask=true renormalises over the sampler's top-k / top-p support, but "
            "neither filter is on: set rollout.top_k > 0 or rollout.top_p < 1, or keep_sampling_mask=false")


def kl_placement_problem(name: str, coef: float, placement) -> str | None:
    """A KL term in use is either subtracted from the reward or added to the loss."""
    if not uses_kl(name, coef) or placement in ("in_reward", "as_loss"):
        return None
    return (f"kl_estimator.placement={placement!r} is not valid with kl_estimator={name}: expected 'in_reward' "
            f"or 'as_loss'")


def prm_step_problem(advantage: str, has_process_reward: bool) -> str | None:
    """advantage=prm_step credits each step with the reward a process reward model gave it."""
    if advantage != "prm_step" or has_process_reward:
        return None
    return ("advantage=prm_step credits each step with a process reward model's reward, but the reward has none: use "
            "reward=prm (prm=oracle | learned), or group_norm, group_mean, rloo, reinforce_pp, "
            "reinforce_pp_baseline, or gae with a critic (algorithm=ppo)")


def teacher_problem(distilling: bool, has_teacher: bool, subject: str) -> str | None:
    """A distillation weight above 0 reads a teacher. `subject` names what distils, e.g. algorithm=opd."""
    if not distilling or has_teacher:
        return None
    return (f"{subject} distils from a teacher, but none is configured: set teacher=<an HF directory, "
            f"a checkpoint or run directory, or tiny_concise / tiny_verbose>")


def distill_reward_problem(mode, advantage: str) -> str | None:
    """A per-token distillation reward is added to the advantage as it is: a critic's returns never see it."""
    if mode != "reward" or advantage != "gae":
        return None
    return ("algorithm.distill.mode=reward adds each token's distillation reward to its advantage as it is, but "
            "advantage=gae would need it in a critic's returns: use a group advantage (group_norm, group_mean, "
            "rloo), or algorithm.distill.mode=full or loss")


def distills(distill) -> bool:
    """Whether an `algorithm.distill` node (a mapping or None) reads the teacher: it is set and
    its weight is above 0 at some rollout batch (at the start, or at the end of its schedule)."""
    if not distill:
        return False
    schedule = distill.get("coef_schedule") or {}
    end = schedule.get("end", 0.0) if schedule.get("name", "constant") != "constant" else 0.0
    return (distill_weight("algorithm.distill.coef", distill.get("coef", 0.0)) > 0
            or distill_weight("algorithm.distill.coef_schedule.end", end) > 0)


def distill_weight(key: str, value) -> float:
    """A distillation weight as read by `distills`; a ConfigError naming `key` when it is no number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}={value!r} is not valid: expected a number >= 0")
    return value


# reward.constraint: the keys it takes, and those without a default (init: lambda starts at 0)
CONSTRAINT_KEYS = ("cost", "limit", "lr", "init", "kp", "kd")
CONSTRAINT_REQUIRED = ("cost", "limit", "lr")


def constraint_problem(constraint, components) -> str | None:
    """reward.constraint (a mapping or None) reads the cost from one component of reward.components,
    weighted 0: the cost enters the reward through lambda alone, never also through a weight."""
    if constraint is None:
        return None
    if not isinstance(constraint, dict):
        return (f"reward.constraint={constraint!r} is not valid: expected null or a mapping such as "
                f"{{cost: response_length, limit: 0.5, lr: 1.0, init: 0.0}}")
    unknown = sorted(set(constraint) - set(CONSTRAINT_KEYS))
    if unknown:
        return f"reward.constraint: unknown key(s) {unknown}; valid keys: {', '.join(CONSTRAINT_KEYS)}"
    missing = [key for key in CONSTRAINT_REQUIRED if key not in constraint]
    if missing:
        return f"reward.constraint: missing key(s) {missing} (cost: a component's name, limit: epsilon, lr: eta)"
    for key, low in (("limit", None), ("lr", 0.0), ("init", 0.0), ("kp", 0.0), ("kd", 0.0)):
        value = constraint.get(key, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or (low is not None and value < low):
            return (f"reward.constraint.{key}={value!r} is not valid: expected a finite number"
                    f"{'' if low is None else f' >= {low:g}'}")
    cost = constraint["cost"]
    components = components or {}
    if cost not in components:
        return (f"reward.constraint.cost={cost!r} names no component of reward.components ({sorted(components)}); "
                f"add it with weight 0, e.g. +reward.components.{cost}='{{weight: 0.0}}'")
    weight = (components[cost] or {}).get("weight", 1.0)
    if weight != 0:
        return (f"reward.constraint.cost={cost!r} is a component with weight {weight}: it would count in the total "
                f"and again through the constraint; set reward.components.{cost}.weight=0")
    return None


PRODUCERS = ("inline", "process")  # rollout.producer (algorithms/online/producer.py); null: by max_staleness


def producer_problem(producer: str, max_staleness: int) -> str | None:
    """Who collects: a producer in the trainer's own process cannot sample ahead of it."""
    if producer not in PRODUCERS:
        return f"rollout.producer={producer!r} is not one of {list(PRODUCERS)} (or null: chosen by max_staleness)"
    if producer == "inline" and max_staleness:
        return (f"rollout.max_staleness={max_staleness} samples ahead of the trainer, which needs a producer "
                f"process: use rollout.producer=process (or null), or rollout.max_staleness=0")
    return None
