"""The loss of an online-RL update as a sum of terms. Each term is a small object that calls
`core`, returns (loss, stats) and logs under its own prefix: `policy/`, `critic/`, `distill/`, `ptx/`.

A term reads a `MicroBatch`: the rows of the annotated Experience, the loss mask, the
training forward's outputs, and the global counts every aggregation uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain import core
from posttrain.algorithms.experience import Experience


@dataclass
class MicroBatch:
    exp: Experience                 # annotated rows (old/ref log-probs, values, advantages, returns)
    mask: torch.Tensor              # [b, T] the loss mask (response tokens, less overlong-filtered rows)
    logp: torch.Tensor              # [b, T] log pi_theta, with gradient
    old_logp: torch.Tensor          # [b, T] pi_old (the forward's own, detached, when on-policy)
    entropy: torch.Tensor | None    # [b, T] (with gradient only when a term is weighted by it)
    values: torch.Tensor | None     # [b, T] critic prediction, with gradient
    aggregation: dict               # agg_mode, norm_constant, count_empty_rows, dp_size, num_tokens, num_seqs
    logits: torch.Tensor | None = None          # [b, T, V] student logits, with gradient (distill mode full)
    teacher_logits: torch.Tensor | None = None  # [b, T, V] teacher logits, no gradient (distill mode full)


# Stats of PolicyTerm that are sums over tokens (the mismatch's, core.mismatch_sums): the update
# adds them over micro-batches and ranks (the max ones: takes the max) before it turns them into
# the `rollout/mismatch/*` metrics.
MISMATCH_SUMS = "mismatch_sum/"


class PolicyTerm:
    """The policy-gradient surrogate (`algorithm.policy_loss`), with DeepSeek-V3.2's off-policy
    sequence mask when `offpolicy_mask_delta` is set, and the train-inference correction
    (`rollout.correction`: core.correction_weights of pi_old / mu) when one is configured.

    pi_old is the trainer's: annotated off-policy, else this forward's own log-probs, detached
    (the same weights as at sampling time, the same forward, before any step). mu is the
    sampler's: the gap between the two is measured on every batch, corrected or not."""

    prefix = "policy"

    def __init__(self, name: str, options: dict, offpolicy_mask_delta: float | None = None,
                 correction: dict | None = None):
        self.name, self.options, self.offpolicy_mask_delta = name, options, offpolicy_mask_delta
        self.correction = correction or {}

    def __call__(self, mb: MicroBatch):
        seq_mask, stats = None, {}
        # compare like with like: the sampler's and the trainer's log-probs over the same support
        sampler_logp = mb.exp.support_logprobs if mb.exp.support_logprobs is not None else mb.exp.rollout_logprobs
        if self.offpolicy_mask_delta is not None:
            seq_mask = core.offpolicy_sequence_mask(mb.logp.detach(), sampler_logp, mb.exp.advantages, mb.mask,
                                                    self.offpolicy_mask_delta)
            stats["offpolicy_masked_frac"] = 1.0 - seq_mask.float().mean()
        log_ratio = core.mismatch_log_ratio(mb.old_logp, sampler_logp, mb.exp.response_mask)
        is_weights = core.correction_weights(log_ratio, mb.mask, **self.correction)
        sums = core.mismatch_sums(log_ratio, mb.exp.response_mask, **self.correction)
        stats.update({MISMATCH_SUMS + key: value for key, value in sums.items()})
        loss, loss_stats = core.compute_policy_loss(self.name, mb.logp, mb.old_logp, mb.exp.advantages, mb.mask,
                                                    seq_mask=seq_mask, is_weights=is_weights, **self.options,
                                                    **mb.aggregation)
        return loss, {"loss": loss.detach(), **loss_stats, **stats}


class KLTerm:
    """beta * aggregate(k) against the frozen reference. As a loss only with `placement:
    as_loss`; with `in_reward` the KL is already in the rewards and this term only logs it."""

    prefix = "policy"

    def __init__(self, estimator: str, options: dict, controller, as_loss: bool):
        self.estimator, self.options, self.controller, self.as_loss = estimator, options, controller, as_loss

    def __call__(self, mb: MicroBatch):
        kl = core.kl_penalty(self.estimator, mb.logp, mb.exp.ref_logp, mb.old_logp, **self.options)
        value = core.aggregate_loss(kl, mb.mask, **_renamed(mb.aggregation))
        loss = self.controller.value * value if self.as_loss else value.detach() * 0.0
        return loss, {"kl": value.detach()}


class EntropyTerm:
    """-coef * token-mean entropy (a bonus). With coef 0 the entropy is only logged, computed
    without gradient."""

    prefix = "policy"

    def __init__(self, coef: float):
        self.coef = coef

    def __call__(self, mb: MicroBatch):
        counts = {k: mb.aggregation[k] for k in ("num_tokens", "dp_size")}
        entropy = core.aggregate_loss(mb.entropy, mb.mask, "token-mean", **counts)
        loss = -self.coef * entropy if self.coef else entropy.detach() * 0.0
        return loss, {"entropy": entropy.detach()}


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
            value = core.aggregate_loss(divergence, mb.mask, **_renamed(mb.aggregation))
        else:
            reward_mask = (core.kdrl_reward_mask(mb.exp.scores, self.reward_threshold)
                           if self.mask == "low_reward" else None)
            value, kd_stats = core.kdrl_loss(mb.logp, teacher_logp, mb.mask, reward_mask, estimator=self.estimator,
                                             **mb.aggregation)
            stats.update(kl=kd_stats["kl"], masked_frac=kd_stats["masked_frac"])
        return coef * value, {**stats, "loss": value.detach()}


class ValueTerm:
    """PPO's clipped value loss, vf_coef * 0.5 max((V - R)^2, (V_old + clip(V - V_old) - R)^2)."""

    prefix = "critic"

    def __init__(self, clip_range: float | None, coef: float = 1.0):
        self.clip_range, self.coef = clip_range, coef

    def __call__(self, mb: MicroBatch):
        loss, stats = core.value_loss(mb.values, mb.exp.values, mb.exp.returns, mb.mask, self.clip_range,
                                      **mb.aggregation)
        return self.coef * loss, {"value_loss": loss.detach(), "vf_clipfrac": stats["vf_clip_frac"],
                                  "value_mean": stats["vpred_mean"]}


def _renamed(aggregation: dict) -> dict:
    """`aggregate_loss` spells the mode `mode`; the policy losses spell it `agg_mode`."""
    out = dict(aggregation)
    out["mode"] = out.pop("agg_mode")
    return out
