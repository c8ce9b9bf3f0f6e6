"""Critic loss (PPO value clipping) and the PPO-ptx pretraining term."""

from __future__ import annotations

import torch

from .aggregation import aggregate_loss
from .checks import check_finite, check_shape, valid_mask
from .logprobs import logprobs_from_logits
from .masked import masked_mean, masked_var, zero_padding


def value_loss(
    values, old_values, returns, mask, clip_range=None, agg_mode="token-mean", *,
    num_tokens=None, num_seqs=None, norm_constant=None, dp_size=1, count_empty_rows=False,
):
    """PPO value loss: l_t = 0.5 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2).

    Without ``clip_range`` it is 0.5 (V - R)^2. ``agg_mode`` and the keywords after it are
    those of ``aggregate_loss``. Returns (loss, stats) with stats
    ``vf_clip_frac`` (tokens where the clipped error is the larger one, i.e. the gradient is
    cut), ``vpred_mean`` and ``value_mse`` (unclipped squared error), over valid tokens.
    """
    check_shape("old_values", old_values, values.shape, "values")
    check_shape("returns", returns, values.shape, "values")
    check_shape("mask", mask, values.shape, "values")
    for name, x in (("values", values), ("old_values", old_values), ("returns", returns)):
        check_finite(name, x, mask)
    valid = valid_mask(mask)
    values, old_values = zero_padding(values, valid), zero_padding(old_values, valid)
    target = zero_padding(returns.detach(), valid)
    err = (values - target) ** 2
    if clip_range is None:
        loss_mat = 0.5 * err
        clip_frac = torch.zeros((), dtype=values.dtype, device=values.device)
    else:
        if not clip_range > 0:
            raise ValueError(f"clip_range must be > 0 or None, got {clip_range!r}")
        old = old_values.detach()
        clipped = old + torch.clamp(values - old, -clip_range, clip_range)
        err_clipped = (clipped - target) ** 2
        loss_mat = 0.5 * torch.maximum(err, err_clipped)
        clip_frac = masked_mean((err_clipped > err).to(values.dtype), valid)
    loss = aggregate_loss(
        torch.where(valid, loss_mat, torch.zeros_like(loss_mat)), mask, agg_mode,
        num_tokens=num_tokens, num_seqs=num_seqs, norm_constant=norm_constant,
        dp_size=dp_size, count_empty_rows=count_empty_rows,
    )
    stats = {
        "vf_clip_frac": clip_frac.detach(),
        "vpred_mean": masked_mean(values.detach(), valid),
        "value_mse": masked_mean(err.detach(), valid),
    }
    return loss, stats


def ptx_loss(
    logp_or_logits, mask, labels=None, *, agg_mode="token-mean",
    num_tokens=None, num_seqs=None, norm_constant=None, dp_size=1, count_empty_rows=False,
):
    """PPO-ptx (Ouyang et al. 2022): L_ptx = -mean_t log pi_theta(x_t) on pretraining text.

    Pass per-token log-probs [B, T], or logits [B, T, V] with ``labels`` [B, T]. The caller
    scales it by the ptx coefficient (gamma in InstructGPT) and adds it to the RL loss.
    ``agg_mode`` and the keywords after it are those of ``aggregate_loss``.
    """
    if labels is not None:
        logp = logprobs_from_logits(logp_or_logits, labels)
    else:
        logp = logp_or_logits
        if logp.dim() != 2:
            raise ValueError(
                f"ptx_loss takes log-probs [B, T] (or logits [B, T, V] with labels); got shape "
                f"{tuple(logp.shape)} without labels"
            )
    check_shape("mask", mask, logp.shape, "log-probs")
    check_finite("ptx log-probs", logp, mask)
    return aggregate_loss(
        -zero_padding(logp, mask), mask, agg_mode,
        num_tokens=num_tokens, num_seqs=num_seqs, norm_constant=norm_constant,
        dp_size=dp_size, count_empty_rows=count_empty_rows,
    )


def explained_variance(predictions, targets, mask) -> torch.Tensor:
    """1 - Var(targets - predictions) / Var(targets) over valid tokens (the critic's fit: 1 is
    perfect, 0 no better than the mean, < 0 worse); 0 when the targets do not vary."""
    check_shape("targets", targets, predictions.shape, "predictions")
    check_shape("mask", mask, predictions.shape, "predictions")
    var_targets = masked_var(targets, mask, unbiased=False)
    var_residual = masked_var(targets - predictions, mask, unbiased=False)
    return torch.where(var_targets > 0, 1.0 - var_residual / var_targets.clamp_min(1e-30), torch.zeros_like(var_targets))
