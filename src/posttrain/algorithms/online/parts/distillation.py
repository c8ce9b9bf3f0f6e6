"""Distillation from a frozen teacher on the student's own samples (algorithm.distill: opd,
kdrl, long2short). The teacher scores every sampled token; how that enters the update is
`distill.mode` (DistillTerm below): a per-token reward added to the advantages, a
full-vocabulary divergence in the loss (the teacher's logits per micro-batch, never stored),
or KDRL's sampled k2/k3 loss. The weight follows `distill.coef_schedule` over rollout batches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from omegaconf import OmegaConf

from posttrain import core
from posttrain.algorithms import rules
from posttrain.algorithms.online.part import Part
from posttrain.algorithms.online.terms import MicroBatch, renamed_aggregation
from posttrain.core.options import POSITIVE, Option, choice, number, option_problems
from posttrain.errors import ConfigError
from posttrain.models.forward import sequence_logits
from posttrain.models.roles import build_role

# algorithm.distill: how the teacher's scores enter the update (see DistillTerm) ...
DISTILL_MODES = ("reward", "full", "loss")
# ... and which samples a loss-mode distillation keeps: all, or those with reward <= reward_threshold (KDRL).
DISTILL_MASKS = ("none", "low_reward")
TERM_KEYS = ("divergence", "beta", "temperature", "estimator", "mask", "reward_threshold")
# algorithm.distill.<name>, declared once (its `coef_schedule` node is core.scheduled_coef's, config/algorithm.py)
OPTIONS = (
    Option("mode", "reward", choice(*DISTILL_MODES), "per-token reward | full-vocabulary loss | sampled k2/k3 loss"),
    Option("coef", 0.0, number(0), "the distillation weight at rollout batch 0"),
    Option("divergence", "reverse_kl", choice(*core.DISTILL_DIVERGENCES), "mode=full: the divergence"),
    Option("beta", 0.5, number(0, 1, low_open=True), "generalized_jsd's teacher weight, in (0, 1)"),
    Option("temperature", 1.0, POSITIVE, "mode=full: both distributions are softmax(logits / temperature)"),
    Option("estimator", "k2", choice(*core.KDRL_ESTIMATORS), "mode=loss: KDRL's sampled estimator"),
    Option("mask", "none", choice(*DISTILL_MASKS), "mode=loss: which samples are distilled"),
    Option("reward_threshold", 0.0, number(), "mask=low_reward distils samples with reward <= this"),
)


class DistillTerm:
    """Distillation from the frozen teacher on the student's own samples (`algorithm.distill`),
    weighted by coef = `coef_fn()` (the schedule's value at this rollout batch):

      reward  on-policy distillation, the per-token reward coef * (log p_T(y_t) - log p_S(y_t))
              is already in the advantages (OnlineRLModule.compute_advantages): no loss here
      full    coef * aggregate(D(p_S || p_T)) over the full vocabulary, D = `divergence`
              (reverse_kl | forward_kl | generalized_jsd) at `temperature`
      loss    KDRL: coef * aggregate(k) of a sampled estimator k (k2 | k3) of KL(student, teacher),
              on the sequences `reward_mask` keeps (mask=low_reward: reward <= reward_threshold)

    Every mode logs the sampled reverse KL, mean over tokens of log p_S(y_t) - log p_T(y_t)."""

    prefix = "distill"

    def __init__(self, mode: str, coef_fn, *, divergence: str = "reverse_kl", beta: float = 0.5,
                 temperature: float = 1.0, estimator: str = "k2", mask: str = "none", reward_threshold: float = 0.0):
        self.mode, self.coef_fn = mode, coef_fn
        self.divergence, self.beta, self.temperature = divergence, beta, temperature
        self.estimator, self.mask, self.reward_threshold = estimator, mask, reward_threshold

    def __call__(self, mb: MicroBatch):
        coef = self.coef_fn()
        teacher_logp = mb.exp.teacher_logp
        stats = {"coef": coef, "reverse_kl": core.masked_mean(core.reverse_kl_sampled(mb.logp.detach(), teacher_logp),
                                                              mb.mask)}
        if self.mode == "reward":
            return mb.logp.new_zeros(()), stats
        if self.mode == "full":
            divergence = core.distill_divergence(self.divergence, mb.logits, mb.teacher_logits, beta=self.beta,
                                                 temperature=self.temperature)
            value = core.aggregate_loss(divergence, mb.mask, **renamed_aggregation(mb.aggregation))
        else:
            reward_mask = (core.kdrl_reward_mask(mb.exp.scores, self.reward_threshold)
                           if self.mask == "low_reward" else None)
            value, kd_stats = core.kdrl_loss(mb.logp, teacher_logp, mb.mask, reward_mask, estimator=self.estimator,
                                             **mb.aggregation)
            stats.update(kl=kd_stats["kl"], masked_frac=kd_stats["masked_frac"])
        return coef * value, {**stats, "loss": value.detach()}



def check_distill(distill: dict, advantage_name: str, teacher_role) -> None:
    """ConfigErrors naming the key for an `algorithm.distill` node that cannot run, before
    the teacher is loaded."""
    has_teacher = bool(teacher_role.get("name_or_path") or teacher_role.get("init_from"))
    rules.refuse(rules.teacher_problem(True, has_teacher, "algorithm.distill"))
    if "mode" not in distill:
        raise ConfigError(f"algorithm.distill.mode is not set: one of {list(DISTILL_MODES)}")
    settings = {key: value for key, value in distill.items() if key != "coef_schedule"}
    problems = option_problems("algorithm.distill", OPTIONS, settings)
    if problems:
        raise ConfigError("; ".join(problems))
    rules.refuse(rules.distill_reward_problem(distill["mode"], advantage_name))
    schedule = dict(distill.get("coef_schedule") or {"name": "constant"})
    try:
        core.scheduled_coef(schedule.pop("name", None), 0, start=distill.get("coef", 0.0), **schedule)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"algorithm.distill.coef_schedule: {err}") from None


def distill_settings(distill) -> dict | None:
    """The `algorithm.distill` node as a plain dict, or None when no distillation is configured."""
    distill = OmegaConf.to_container(distill, resolve=True) if OmegaConf.is_config(distill) else distill
    return dict(distill) if rules.distills(distill) else None


class Distillation(Part):
    name = "distillation"

    def __init__(self, distill: dict, policy, teacher_role, advantage_name: str, scoring,
                 batches_seen: Callable[[], int]):
        check_distill(distill, advantage_name, teacher_role)
        self.distill, self.mode, self.scoring, self.batches_seen = distill, distill["mode"], scoring, batches_seen
        self.teacher = build_role("teacher", teacher_role, policy)
        if self.teacher.config.vocab_size != policy.config.vocab_size:
            raise ConfigError(f"teacher: its vocabulary ({self.teacher.config.vocab_size} tokens) is not the "
                              f"policy's ({policy.config.vocab_size}); distillation needs a teacher with the "
                              f"policy's tokenizer")
        self.needs_old_logp = self.mode == "reward"  # the reward is log p_T - log p_S of the sampling policy
        self.needs_logits = self.mode == "full"      # the full-vocabulary divergence reads the student's logits
        self.term = DistillTerm(self.mode, self.coef, **{key: distill[key] for key in TERM_KEYS if key in distill})

    def roles(self) -> dict:
        return {"teacher": self.teacher}

    def coef(self) -> float:
        """The distillation weight at this rollout batch: `distill.coef`, annealed by
        `distill.coef_schedule` (core.scheduled_coef)."""
        schedule = dict(self.distill.get("coef_schedule") or {"name": "constant"})
        return core.scheduled_coef(schedule.pop("name"), self.batches_seen(), start=self.distill["coef"], **schedule)

    def scorers(self):
        if self.mode == "full":  # mode full reads the teacher's logits in the update
            return []
        return [("teacher_logp", lambda exp: self.scoring.logprobs(self.teacher, exp))]

    def after_advantages(self, exp):
        if self.mode != "reward":
            return {}
        # on-policy distillation: each token's own reward coef * (log p_T(y_t) - log p_S(y_t)),
        # the negated sample of reverse KL, is added to its advantage as it is (no baseline,
        # no discount): E[grad] of the policy loss is then -coef * grad KL(p_S || p_T)
        mask = exp.response_mask
        distill_reward = -self.coef() * core.reverse_kl_sampled(exp.old_logp, exp.teacher_logp)
        exp.advantages = exp.advantages + distill_reward * mask
        return {"distill/reward_mean": float(core.masked_mean(distill_reward, mask))}

    def policy_terms(self):
        return [self.term]

    @torch.no_grad()
    def micro_batch(self, exp, train_policy):
        """distill.mode=full: the teacher's logits [b, T, V] on this micro-batch, and its log-probs."""
        if self.mode != "full" or not train_policy:
            return {}
        logits = sequence_logits(self.teacher, *exp.model_inputs())
        exp.teacher_logp = self.scoring.logprobs_from(logits, exp, with_entropy=False)[0]
        return {"teacher_logits": logits}
