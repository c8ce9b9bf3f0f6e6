"""Pure tensor math of every post-training algorithm (no Lightning, no transformers, no I/O).

Each formula lives here once, under its paper's name, and is selectable by the string the
config groups use through one registry per family:

  KL_ESTIMATORS         kl_estimator group   fn(logp, ref_logp, old_logp=None) -> [B,T]
  ADVANTAGE_ESTIMATORS  advantage group      fn(token_rewards, mask, group_index, values=None, **opts)
  POLICY_LOSSES         algorithm.loss       fn(logp, old_logp, advantages, mask, *, clip...) -> (loss, stats)
  AGGREGATION_MODES     algorithm.agg_mode   aggregate_loss(loss_mat, mask, mode, ...)
  PREFERENCE_LOSSES     dpo/ipo/hinge/simpo  fn(chosen, rejected, ref_chosen, ref_rejected, *, beta, ...)
  DISTILL_DIVERGENCES   opd / kd             fn(student_logits, teacher_logits, *, beta=0.5) -> [B,T]
  KL_CONTROLLERS        kl coefficient       fixed | adaptive

See README.md in this folder for the table of functions, papers and formulas.
"""

from .advantages import (
    ADVANTAGE_ESTIMATORS,
    advantage_estimator,
    compute_advantages,
    discounted_returns,
    dr_grpo_advantages,
    gae_advantages,
    grpo_advantages,
    prm_step_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    sequence_scores,
)
from .aggregation import AGGREGATION_MODES, aggregate_loss, count_tokens_and_seqs
from .calibration import calibration_bins, calibration_error, expected_calibration_error, reliability
from .checks import check_finite, set_finite_checks
from .constraint import Multiplier, constrained_reward, dual_ascent_step, pid_multiplier_step
from .distill import (
    DISTILL_DIVERGENCES,
    distill_divergence,
    forward_kl,
    generalized_jsd,
    KDRL_ESTIMATORS,
    kdrl_loss,
    kdrl_reward_mask,
    reverse_kl,
    reverse_kl_sampled,
)
from .groups import group_ids, informative_groups
from .kl import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_in_reward,
    build_kl_controller,
    clamped_log_ratio,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_abs,
    kl_estimator,
    kl_k3_unbiased,
    kl_penalty,
    kl_straight_through,
    kl_unbiased_gradient,
)
from .length import dapo_overlong_penalty, kimi_length_reward, linear_length_penalty
from .logprobs import entropy_from_logits, logprobs_from_logits, token_logprobs_and_entropy
from .masked import drop_truncated, masked_mean, masked_sum, masked_var, masked_whiten, zero_padding
from .metrics import pass_at_k
from .mismatch import (
    MISMATCH_SUM_KEYS,
    accumulate_mismatch_sum,
    CORRECTION_LEVELS,
    MISMATCH_MAX_KEYS,
    correction_weights,
    level_log_ratio,
    masked_is_keep,
    mismatch_log_ratio,
    mismatch_metrics,
    mismatch_sums,
    truncated_is_weights,
)
from .policy_loss import (
    POLICY_LOSSES,
    cispo_loss,
    compute_policy_loss,
    gspo_loss,
    gspo_sequence_log_ratio,
    kimi_loss,
    loss_options,
    offpolicy_sequence_mask,
    policy_loss,
    ppo_clip_loss,
    reinforce_loss,
    sapo_loss,
)
from .schedules import SCHEDULES, scheduled_coef
from .process import (
    STEP_AGGREGATES,
    STEP_REWARD_FORMS,
    aggregate_step_scores,
    best_of_n_expected_accuracy,
    majority_vote_expected_accuracy,
    monte_carlo_step_labels,
    process_step_rewards,
)
from .preference import (
    PREFERENCE_LOSSES,
    PreferenceOutput,
    bradley_terry_loss,
    dpo_loss,
    ensemble_lower_bound,
    hinge_loss,
    ipo_loss,
    per_token_log_ratios,
    preference_loss,
    simpo_loss,
    weighted_head_sum,
)
from .value import explained_variance, ptx_loss, value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AGGREGATION_MODES", "DISTILL_DIVERGENCES", "KL_CONTROLLERS",
    "KL_ESTIMATORS", "POLICY_LOSSES", "PREFERENCE_LOSSES",
    "AdaptiveKLController", "FixedKLController", "PreferenceOutput",
    "aggregate_loss", "apply_kl_in_reward", "bradley_terry_loss", "build_kl_controller",
    "calibration_bins", "calibration_error", "expected_calibration_error", "reliability",
    "check_finite", "cispo_loss", "clamped_log_ratio", "compute_advantages",
    "compute_policy_loss", "count_tokens_and_seqs", "dapo_overlong_penalty",
    "discounted_returns", "distill_divergence", "dpo_loss", "ensemble_lower_bound", "dr_grpo_advantages", "drop_truncated",
    "entropy_from_logits", "explained_variance", "forward_kl", "gae_advantages", "generalized_jsd", "group_ids",
    "informative_groups",
    "grpo_advantages", "gspo_loss", "gspo_sequence_log_ratio", "hinge_loss", "ipo_loss", "per_token_log_ratios",
    "KDRL_ESTIMATORS", "SCHEDULES", "kdrl_loss", "kdrl_reward_mask", "scheduled_coef",
    "kimi_length_reward", "kl_abs", "kl_k1", "kl_k2", "kl_k3",
    "kl_k3_unbiased", "kl_penalty", "kl_straight_through", "kl_unbiased_gradient", "logprobs_from_logits",
    "masked_mean", "masked_sum", "masked_var", "masked_whiten", "offpolicy_sequence_mask", "pass_at_k",
    "ppo_clip_loss", "preference_loss", "prm_step_advantages", "ptx_loss",
    "policy_loss", "loss_options", "advantage_estimator", "kl_estimator",
    "reinforce_loss", "reinforce_pp_advantages", "reinforce_pp_baseline_advantages",
    "reverse_kl", "reverse_kl_sampled", "rloo_advantages", "sapo_loss", "sequence_scores",
    "set_finite_checks", "simpo_loss", "weighted_head_sum", "token_logprobs_and_entropy", "value_loss", "zero_padding",
    "STEP_AGGREGATES", "STEP_REWARD_FORMS", "aggregate_step_scores", "best_of_n_expected_accuracy",
    "majority_vote_expected_accuracy", "monte_carlo_step_labels", "process_step_rewards",
    "CORRECTION_LEVELS", "MISMATCH_MAX_KEYS", "MISMATCH_SUM_KEYS", "correction_weights", "level_log_ratio", "masked_is_keep",
    "accumulate_mismatch_sum", "mismatch_log_ratio", "mismatch_metrics", "mismatch_sums", "truncated_is_weights",
    "Multiplier", "constrained_reward", "dual_ascent_step", "pid_multiplier_step", "linear_length_penalty",
]
