"""Policy-gradient losses on per-token log-probs.

One signature for the whole family::

    fn(logp, old_logp, advantages, mask, *, clip_low=0.2, clip_high=0.2, dual_clip=None,
       agg_mode="token-mean", num_tokens=None, num_seqs=None, norm_constant=None,
       log_ratio_clamp=20.0, seq_mask=None) -> (loss scalar, stats dict of detached scalars)

All tensors are [B, T] except ``seq_mask`` [B]. The loss is a quantity to *minimise*
(the negated surrogate objective). ``clip_low``/``clip_high`` = None removes that side of
the clip. Token log-ratios are clamped to +-``log_ratio_clamp`` before ``exp``.

``seq_mask`` (e.g. from ``offpolicy_sequence_mask``) zeroes whole sequences' terms while
leaving the normalising counts unchanged, as in DeepSeek-V3.2's masked objective.

Stats (over the valid, unmasked tokens of this call):
  clip_frac_low   tokens whose gradient is cut by the lower clip (A < 0, r < 1 - eps_low)
  clip_frac_high  tokens whose gradient is cut by the upper clip (A > 0, r > 1 + eps_high)
                  (for CISPO: tokens whose IS weight is clipped, whatever the sign of A)
  clip_frac       their sum
  approx_kl       mean of k3 for KL(pi_old || pi_theta): r - 1 - log r (>= 0, low variance)
  ratio_mean      mean token ratio (GSPO: mean sequence ratio over sequences)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .aggregation import aggregate_loss
from .checks import check_finite, check_shape, lookup, valid_mask
from .kl import clamped_log_ratio
from .masked import masked_mean, zero_padding

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


def _validate(logp, old_logp, advantages, mask, seq_mask):
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    check_shape("mask", mask, logp.shape, "logp")
    check_shape("advantages", advantages, logp.shape, "logp")
    check_finite("logp", logp, mask)
    check_finite("advantages", advantages, mask)
    if old_logp is not None:
        check_shape("old_logp", old_logp, logp.shape, "logp")
        check_finite("old_logp", old_logp, mask)
    valid = valid_mask(mask)
    # Padding may hold garbage (NaN/inf): zero it on the inputs so no NaN reaches logp.grad.
    logp, advantages = zero_padding(logp, valid), zero_padding(advantages, valid)
    if old_logp is not None:
        old_logp = zero_padding(old_logp, valid)
    used = valid
    if seq_mask is not None:
        check_shape("seq_mask", seq_mask, logp.shape[:1], "logp[:, 0]")
        used = valid & valid_mask(seq_mask).unsqueeze(-1)
    return logp, old_logp, advantages, used


def _need_old(loss, old_logp):
    if old_logp is None:
        raise ValueError(f"policy loss {loss!r} needs old_logp (log-probs of the sampling policy)")


def _clip_bounds(clip_low, clip_high):
    for name, eps in (("clip_low", clip_low), ("clip_high", clip_high)):
        if eps is not None and not eps >= 0:
            raise ValueError(f"{name} must be >= 0 or None, got {eps!r}")
    lo = None if clip_low is None else 1.0 - clip_low
    hi = None if clip_high is None else 1.0 + clip_high
    return lo, hi


def _clip(x, lo, hi):
    return x if lo is None and hi is None else torch.clamp(x, min=lo, max=hi)


def _finish(loss_mat, mask, used, agg_mode, num_tokens, num_seqs, norm_constant, stats):
    # Terms of masked-out sequences are zeroed, but the counts come from the full ``mask``.
    loss_mat = torch.where(used, loss_mat, torch.zeros_like(loss_mat))
    loss = aggregate_loss(
        loss_mat, mask, agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, norm_constant=norm_constant
    )
    return loss, {k: v.detach() for k, v in stats.items()}


def _ratio_stats(log_ratio, used, low_cut, high_cut):
    ratio = torch.exp(log_ratio)
    f = lambda b: masked_mean(b.to(log_ratio.dtype), used)  # noqa: E731
    low, high = f(low_cut), f(high_cut)
    return {
        "clip_frac": low + high,
        "clip_frac_low": low,
        "clip_frac_high": high,
        "approx_kl": masked_mean(ratio - 1.0 - log_ratio, used),
        "ratio_mean": masked_mean(ratio, used),
    }


def ppo_clip_loss(
    logp, old_logp, advantages, mask, *, clip_low=0.2, clip_high=0.2, dual_clip=None,
    agg_mode="token-mean", num_tokens=None, num_seqs=None, norm_constant=None,
    log_ratio_clamp=20.0, seq_mask=None,
):
    """PPO-clip (Schulman et al. 2017) with clip-higher (DAPO) and dual clip (Ye et al. 2020):
    l_t = max(-r A, -clip(r, 1-eps_low, 1+eps_high) A)  (= -min(r A, clip(r) A));
    dual clip (c > 1), A < 0 only: l_t = min(max(-r A, -clip(r) A), -c A), i.e. the objective
    is max(min(r A, clip(r) A), c A). Tokens with A >= 0 are unaffected by c."""
    _need_old("ppo_clip", old_logp)
    logp, old_logp, advantages, used = _validate(logp, old_logp, advantages, mask, seq_mask)
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip!r}")
    lo, hi = _clip_bounds(clip_low, clip_high)
    log_ratio = clamped_log_ratio(logp, old_logp, log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    a = advantages.detach()
    unclipped = -a * ratio
    clipped = -a * _clip(ratio, lo, hi)
    loss_mat = torch.maximum(unclipped, clipped)  # = -min(r A, clip(r) A)
    r = ratio.detach()
    low_cut = (a < 0) & (r < lo) if lo is not None else torch.zeros_like(used)
    high_cut = (a > 0) & (r > hi) if hi is not None else torch.zeros_like(used)
    stats = _ratio_stats(log_ratio.detach(), used, low_cut, high_cut)
    if dual_clip is not None:
        # For A < 0 a huge ratio makes -rA unbounded; cap the loss at -c A (c > 1).
        capped = torch.minimum(loss_mat, -a * dual_clip)
        dual_cut = (a < 0) & (loss_mat.detach() > (-a * dual_clip))
        loss_mat = torch.where(a < 0, capped, loss_mat)
        stats["dual_clip_frac"] = masked_mean(dual_cut.to(logp.dtype), used)
    return _finish(loss_mat, mask, used, agg_mode, num_tokens, num_seqs, norm_constant, stats)


def gspo_sequence_log_ratio(logp, old_logp, mask, log_ratio_clamp=20.0):
    """log s_i = (1/|y_i|) sum_t log(pi_theta / pi_old)_it -> [B] (GSPO's length-normalised ratio;
    s_i is the geometric mean of the token ratios). Empty rows give 0 (s = 1)."""
    return masked_mean(clamped_log_ratio(logp, old_logp, log_ratio_clamp), mask, dim=-1)


def gspo_loss(
    logp, old_logp, advantages, mask, *, clip_low=0.2, clip_high=0.2, dual_clip=None,
    agg_mode="token-mean", num_tokens=None, num_seqs=None, norm_constant=None,
    log_ratio_clamp=20.0, seq_mask=None,
):
    """GSPO-token (Zheng et al. 2025): s_it = sg[s_i] * pi_it / sg[pi_it],
    l_t = -min(s_it A_it, clip(s_it, 1-eps_low, 1+eps_high) A_it).

    s_it has the value of the sequence ratio s_i and the gradient s_i grad log pi_it; with
    one advantage per sequence this equals GSPO's sequence-level gradient. The paper
    aggregates with "seq-mean-token-mean" and uses tiny clip ranges (3e-4 / 4e-4); both are
    set by the caller.
    """
    _need_old("gspo", old_logp)
    logp, old_logp, advantages, used = _validate(logp, old_logp, advantages, mask, seq_mask)
    if dual_clip is not None:
        raise ValueError("dual_clip applies to 'ppo_clip' only; set it to None for 'gspo'")
    lo, hi = _clip_bounds(clip_low, clip_high)
    seq_log_ratio = gspo_sequence_log_ratio(logp, old_logp, mask, log_ratio_clamp)
    token_log_ratio = seq_log_ratio.detach().unsqueeze(-1) + (logp - logp.detach())
    ratio = torch.exp(token_log_ratio)
    a = advantages.detach()
    loss_mat = torch.maximum(-a * ratio, -a * _clip(ratio, lo, hi))
    r = ratio.detach()
    low_cut = (a < 0) & (r < lo) if lo is not None else torch.zeros_like(used)
    high_cut = (a > 0) & (r > hi) if hi is not None else torch.zeros_like(used)
    stats = _ratio_stats(clamped_log_ratio(logp, old_logp, log_ratio_clamp).detach(), used, low_cut, high_cut)
    has_tokens = used.any(-1)
    stats["ratio_mean"] = masked_mean(seq_log_ratio.detach().exp(), has_tokens)
    return _finish(loss_mat, mask, used, agg_mode, num_tokens, num_seqs, norm_constant, stats)


def cispo_loss(
    logp, old_logp, advantages, mask, *, clip_low=0.2, clip_high=0.2, dual_clip=None,
    agg_mode="token-mean", num_tokens=None, num_seqs=None, norm_constant=None,
    log_ratio_clamp=20.0, seq_mask=None,
):
    """CISPO (MiniMax-M1, 2025): l_t = -sg[clip(r_t, 1-eps_low, 1+eps_high)] A_t log pi_theta(y_t).

    REINFORCE with a clipped, detached IS weight: every token keeps a gradient. MiniMax-M1
    bounds only the upper side (its eps_low is effectively infinite): pass ``clip_low=None``
    for that; a number clips both sides. The paper aggregates with "token-mean".
    """
    _need_old("cispo", old_logp)
    logp, old_logp, advantages, used = _validate(logp, old_logp, advantages, mask, seq_mask)
    if dual_clip is not None:
        raise ValueError("dual_clip applies to 'ppo_clip' only; set it to None for 'cispo'")
    lo, hi = _clip_bounds(clip_low, clip_high)
    log_ratio = clamped_log_ratio(logp, old_logp, log_ratio_clamp).detach()
    ratio = torch.exp(log_ratio)
    weight = _clip(ratio, lo, hi)
    a = advantages.detach()
    loss_mat = -weight * a * logp
    low_cut = ratio < lo if lo is not None else torch.zeros_like(used)
    high_cut = ratio > hi if hi is not None else torch.zeros_like(used)
    stats = _ratio_stats(log_ratio, used, low_cut, high_cut)
    return _finish(loss_mat, mask, used, agg_mode, num_tokens, num_seqs, norm_constant, stats)


def reinforce_loss(
    logp, old_logp, advantages, mask, *, clip_low=0.2, clip_high=0.2, dual_clip=None,
    agg_mode="token-mean", num_tokens=None, num_seqs=None, norm_constant=None,
    log_ratio_clamp=20.0, seq_mask=None,
):
    """REINFORCE (Williams 1992): l_t = -A_t log pi_theta(y_t); no ratio, no clipping.

    ``old_logp`` may be None; when given it only feeds the ratio statistics.
    """
    logp, old_logp, advantages, used = _validate(logp, old_logp, advantages, mask, seq_mask)
    if dual_clip is not None:
        raise ValueError("dual_clip applies to 'ppo_clip' only; set it to None for 'reinforce'")
    loss_mat = -advantages.detach() * logp
    if old_logp is not None:
        log_ratio = clamped_log_ratio(logp, old_logp, log_ratio_clamp).detach()
    else:
        log_ratio = torch.zeros_like(logp)
    none = torch.zeros_like(used)
    stats = _ratio_stats(log_ratio, used, none, none)
    return _finish(loss_mat, mask, used, agg_mode, num_tokens, num_seqs, norm_constant, stats)


POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "ppo_clip": ppo_clip_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
    "reinforce": reinforce_loss,
}


def compute_policy_loss(name: str, logp, old_logp, advantages, mask, **kwargs):
    """``POLICY_LOSSES[name](logp, old_logp, advantages, mask, **kwargs)``."""
    return lookup(POLICY_LOSSES, name, "policy loss")(logp, old_logp, advantages, mask, **kwargs)


@torch.no_grad()
def offpolicy_sequence_mask(logp, old_logp, advantages, mask, delta: float) -> torch.Tensor:
    """DeepSeek-V3.2 off-policy sequence masking -> [B] float:
    M_i = 0 if A_i < 0 and (1/|y_i|) sum_t (log pi_old - log pi_theta) > delta, else 1.

    ``old_logp`` is the sampling (inference) policy. A_i is the mean advantage over the
    sequence's valid tokens (``advantages`` may be [B] or [B, T]). Empty rows keep 1.
    """
    check_shape("old_logp", old_logp, logp.shape, "logp")
    check_shape("mask", mask, logp.shape, "logp")
    check_finite("logp", logp, mask)
    check_finite("old_logp", old_logp, mask)
    if advantages.dim() == 2:
        check_shape("advantages", advantages, logp.shape, "logp")
        seq_adv = masked_mean(advantages, mask, dim=-1)
    else:
        check_shape("advantages", advantages, logp.shape[:1], "logp[:, 0]")
        seq_adv = advantages
    divergence = masked_mean(old_logp - logp, mask, dim=-1)
    drop = (seq_adv < 0) & (divergence > delta)
    return (~drop).to(logp.dtype)
