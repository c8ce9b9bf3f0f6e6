"""The loss of an online-RL update as a sum of terms. Each term is a small object that calls
`core`, returns (loss, stats) and logs under its own prefix. The learner's own terms are here
(the policy-gradient surrogate and the entropy); a part adds its own (the KL in
parts/reference.py, the value loss in parts/critic.py, distillation in parts/distillation.py).

A term reads a `MicroBatch`: the rows of the annotated Experience, the loss mask, the
training forward's outputs, and the global counts every aggregation uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

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

    def __init__(self, loss, options: dict, offpolicy_mask_delta: float | None = None,
                 correction: dict | None = None):
        # the resolved loss (algorithms/formulas.py), or a built-in's name
        self.loss = partial(core.compute_policy_loss, loss) if isinstance(loss, str) else loss
        self.options, self.offpolicy_mask_delta = options, offpolicy_mask_delta
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
        loss, loss_stats = self.loss(mb.logp, mb.old_logp, mb.exp.advantages, mb.mask, seq_mask=seq_mask,
                                     is_weights=is_weights, **self.options, **mb.aggregation)
        return loss, {"loss": loss.detach(), **loss_stats, **stats}


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


def renamed_aggregation(aggregation: dict) -> dict:
    """`aggregate_loss` spells the mode `mode`; the policy losses spell it `agg_mode`."""
    out = dict(aggregation)
    out["mode"] = out.pop("agg_mode")
    return out
