"""The train-inference mismatch: how far the sampler mu is from the trainer's pi_old, and the
importance-sampling corrections of it.

The sampler (another engine, another precision) draws y ~ mu, the trainer scores the same
tokens under pi_old. Per valid token, with lr_t = log pi_old(y_t) - log mu(y_t) and
r_t = exp(lr_t), a correction level gives the log-ratio L_t shared by a group of tokens:

  token       L_t = lr_t                                   (per token)
  sequence    L_t = sum_s lr_s        = log prod_s r_s      (the response's product ratio)
  geometric   L_t = mean_s lr_s       = log of the geometric mean (empty row: 0)

with s over the valid tokens of t's row, so a sequence-level value is the same on every token
of its row. The corrections, both detached (they change the measure, not the objective):

  TIS (truncated IS)   w_t = exp(min(L_t, log C))           cap C > 0; taken in log space, so a
                                                             long response's product never overflows
  MIS (masked IS,      keep_t = [log low <= L_t <= log high] 0 < low <= 1 <= high, bounds
       IcePop-style)                                         inclusive; dropped tokens weigh 0

``correction_weights`` multiplies the two (1 where a correction is off). Both enter the loss as
per-token weights and leave its normalising counts unchanged, like DeepSeek-V3.2's off-policy
sequence mask: a dropped token still counts in the token-mean's denominator (the policy loss
applies them, see ``policy_loss.py``'s ``is_weights``).

Metrics, over the valid tokens (n of them), from sums that add over micro-batches and ranks
(``abs_log_ratio_max`` takes the max instead, ``MISMATCH_MAX_KEYS``):

  abs_log_ratio_mean   sum |lr_t| / n;  abs_log_ratio_max = max |lr_t|   (0 with no token)
  kl                   sum k3_t / n, k3 = r - 1 - log r, with log r = clamp(lr, +-20): as y ~ mu
                       this estimates KL(mu || pi_old) (Schulman 2020), unbiased and >= 0
  capped_frac          share of tokens whose TIS level ratio exceeds C (0 without TIS)
  masked_frac          share of tokens MIS drops (0 without MIS)
  ess                  (sum r_t)^2 / (n sum r_t^2) in (0, 1], the normalised effective sample
                       size of the raw token ratios (1 with no token)

A mask here only says which tokens are real: a float mask counts every nonzero entry once.
"""

from __future__ import annotations

import math

import torch

from .checks import check_finite, check_shape, valid_mask
from .masked import zero_padding

CORRECTION_LEVELS = ("token", "sequence", "geometric")
MISMATCH_MAX_KEYS = ("abs_log_ratio_max",)
# the other keys of ``mismatch_sums``, which add over micro-batches and ranks, in a fixed order
# (every rank packs them into one tensor for its all-reduce)
MISMATCH_SUM_KEYS = ("tokens", "abs_log_ratio", "kl", "capped", "masked", "ratio", "ratio_sq")

# exp(+-20) stays finite in fp32 and its square in fp64 (the ESS sums); beyond it the KL and
# ESS metrics saturate instead of turning into inf.
_METRIC_LOG_RATIO_CLAMP = 20.0


def _check_level(name: str, level: str) -> None:
    if level not in CORRECTION_LEVELS:
        raise ValueError(f"unknown {name} {level!r}; valid levels: {', '.join(CORRECTION_LEVELS)}")


def _check_cap(name: str, cap: float) -> float:
    if not cap > 0:  # also catches NaN
        raise ValueError(f"{name} must be > 0 (the largest importance weight), got {cap!r}")
    return math.log(cap)


def _check_bounds(low_name: str, low: float, high_name: str, high: float) -> tuple[float, float]:
    # A band that excluded ratio 1 would drop the tokens on which sampler and trainer agree.
    if not 0 < low <= 1:
        raise ValueError(f"{low_name} must satisfy 0 < {low_name} <= 1, got {low!r}")
    if not high >= 1:
        raise ValueError(f"{high_name} must satisfy {high_name} >= 1, got {high!r}")
    return math.log(low), math.log(high)


def _float(x: torch.Tensor) -> torch.Tensor:
    """x in fp32 at least: a bf16 sum over a long response would lose the ratio's digits."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _validate(log_ratio: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_ratio in fp32+ with 0 on padding, bool mask) after the shape and finiteness checks."""
    check_shape("mask", mask, log_ratio.shape, "log_ratio")
    check_finite("log_ratio", log_ratio, mask)
    valid = valid_mask(mask)
    return zero_padding(_float(log_ratio.detach()), valid), valid


def _level(log_ratio: torch.Tensor, valid: torch.Tensor, level: str) -> torch.Tensor:
    """level_log_ratio on already validated, zero-padded input."""
    if level == "token":
        return log_ratio
    row = log_ratio.sum(dim=-1, keepdim=True)
    if level == "geometric":
        count = valid.sum(dim=-1, keepdim=True).to(log_ratio.dtype)
        row = row / count.clamp(min=1.0)  # an empty row sums to 0 and stays 0
    return torch.where(valid, row.expand_as(log_ratio), torch.zeros_like(log_ratio))


def _tis(levelled: torch.Tensor, valid: torch.Tensor, log_cap: float) -> torch.Tensor:
    weights = torch.exp(torch.clamp(levelled, max=log_cap))
    return torch.where(valid, weights, torch.zeros_like(weights))


def _keep(levelled: torch.Tensor, valid: torch.Tensor, log_low: float, log_high: float) -> torch.Tensor:
    return valid & (levelled >= log_low) & (levelled <= log_high)


def mismatch_log_ratio(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B,T] log pi_old - log mu, 0 where mask is 0 (detached). Validates shapes and
    finiteness (on valid tokens)."""
    check_shape("sampler_logp", sampler_logp, old_logp.shape, "old_logp")
    check_shape("mask", mask, old_logp.shape, "old_logp")
    check_finite("old_logp", old_logp, mask)
    check_finite("sampler_logp", sampler_logp, mask)
    valid = valid_mask(mask)
    log_ratio = zero_padding(old_logp.detach(), valid) - zero_padding(sampler_logp.detach(), valid)
    return log_ratio


def level_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """[B,T]: token -> log_ratio; sequence -> the row's sum (log of the product ratio) on each
    valid token; geometric -> the row's masked mean on each valid token (empty row: 0). 0 on
    padding. ValueError for an unknown level naming CORRECTION_LEVELS."""
    _check_level("level", level)
    return _level(*_validate(log_ratio, mask), level)


def truncated_is_weights(
    log_ratio: torch.Tensor, mask: torch.Tensor, level: str = "token", cap: float = 2.0
) -> torch.Tensor:
    """[B,T] detached float weights exp(min(level_log_ratio, log cap)) (computed in log space,
    so a long sequence's product never overflows); 0 on padding. cap must be > 0 (ValueError)."""
    _check_level("level", level)
    log_cap = _check_cap("cap", cap)
    log_ratio, valid = _validate(log_ratio, mask)
    return _tis(_level(log_ratio, valid, level), valid, log_cap)


def masked_is_keep(
    log_ratio: torch.Tensor, mask: torch.Tensor, level: str = "token", low: float = 0.5, high: float = 2.0
) -> torch.Tensor:
    """[B,T] bool: valid token and low <= ratio <= high (compared in log space; bounds
    inclusive). Requires 0 < low <= 1 <= high (ValueError naming the bad bound)."""
    _check_level("level", level)
    log_low, log_high = _check_bounds("low", low, "high", high)
    log_ratio, valid = _validate(log_ratio, mask)
    return _keep(_level(log_ratio, valid, level), valid, log_low, log_high)


def correction_weights(
    log_ratio: torch.Tensor, mask: torch.Tensor, *, tis: str | None = None, tis_cap: float = 2.0,
    mis: str | None = None, mis_low: float = 0.5, mis_high: float = 2.0,
) -> torch.Tensor | None:
    """None when tis and mis are both None; else [B,T] detached float: the TIS weights (if tis
    is a level) times the MIS keep mask as 0/1 (if mis is a level); 0 on padding."""
    if tis is None and mis is None:
        return None
    log_ratio, valid = _validate(log_ratio, mask)
    weights = valid.to(log_ratio.dtype)
    if tis is not None:
        _check_level("tis", tis)
        weights = _tis(_level(log_ratio, valid, tis), valid, _check_cap("tis_cap", tis_cap))
    if mis is not None:
        _check_level("mis", mis)
        log_low, log_high = _check_bounds("mis_low", mis_low, "mis_high", mis_high)
        keep = _keep(_level(log_ratio, valid, mis), valid, log_low, log_high)
        weights = torch.where(keep, weights, torch.zeros_like(weights))
    return weights


def mismatch_sums(
    log_ratio: torch.Tensor, mask: torch.Tensor, *, tis: str | None = None, tis_cap: float = 2.0,
    mis: str | None = None, mis_low: float = 0.5, mis_high: float = 2.0,
) -> dict[str, torch.Tensor]:
    """0-d float64 tensors that add over micro-batches and ranks (except abs_log_ratio_max: max):
    tokens (number of valid tokens), abs_log_ratio (sum |lr|), abs_log_ratio_max (max |lr|, 0 with
    no token), kl (sum k3 with r = exp(lr clamped to +-20)), capped (tokens whose TIS level ratio
    > tis_cap; 0 if tis None), masked (valid tokens MIS drops; 0 if mis None), ratio (sum r),
    ratio_sq (sum r^2)."""
    log_ratio, valid = _validate(log_ratio, mask)
    lr = log_ratio.to(torch.float64)
    zero = torch.zeros((), dtype=torch.float64, device=lr.device)

    abs_lr = lr.abs()  # 0 on padding, and |lr| >= 0: a max over everything is the max over valid tokens
    clamped = torch.clamp(lr, -_METRIC_LOG_RATIO_CLAMP, _METRIC_LOG_RATIO_CLAMP)
    ratio = torch.where(valid, torch.exp(clamped), torch.zeros_like(clamped))
    k3 = torch.where(valid, ratio - 1.0 - clamped, torch.zeros_like(clamped))

    capped = masked = zero
    if tis is not None:
        _check_level("tis", tis)
        log_cap = _check_cap("tis_cap", tis_cap)
        capped = (valid & (_level(lr, valid, tis) > log_cap)).sum().to(torch.float64)
    if mis is not None:
        _check_level("mis", mis)
        log_low, log_high = _check_bounds("mis_low", mis_low, "mis_high", mis_high)
        keep = _keep(_level(lr, valid, mis), valid, log_low, log_high)
        masked = (valid & ~keep).sum().to(torch.float64)

    return {
        "tokens": valid.sum().to(torch.float64),
        "abs_log_ratio": abs_lr.sum(),
        "abs_log_ratio_max": abs_lr.max() if abs_lr.numel() else zero,
        "kl": k3.sum(),
        "capped": capped,
        "masked": masked,
        "ratio": ratio.sum(),
        "ratio_sq": (ratio * ratio).sum(),
    }


def accumulate_mismatch_sum(total: dict[str, float], key: str, value: float) -> None:
    """Add one micro-batch's (or rank's) sum `value` of ``mismatch_sums`` into ``total[key]``;
    a key ending in one of ``MISMATCH_MAX_KEYS`` (a prefix such as ``policy/mismatch_sum/`` may
    precede it) keeps the larger value instead."""
    if key.rsplit("/", 1)[-1] in MISMATCH_MAX_KEYS:
        total[key] = max(total.get(key, 0.0), value)
    else:
        total[key] = total.get(key, 0.0) + value


def mismatch_metrics(sums: dict) -> dict[str, float]:
    """From (reduced) sums: abs_log_ratio_mean, abs_log_ratio_max, kl, capped_frac, masked_frac,
    ess (means over tokens; 0 and ess 1 when tokens == 0)."""
    value = {key: float(v) for key, v in sums.items()}
    n = value["tokens"]
    if n <= 0:
        return {"abs_log_ratio_mean": 0.0, "abs_log_ratio_max": 0.0, "kl": 0.0,
                "capped_frac": 0.0, "masked_frac": 0.0, "ess": 1.0}
    # <= 1 by Cauchy-Schwarz; the min only removes a rounding excess when every ratio is equal
    ess = min(value["ratio"] ** 2 / (n * value["ratio_sq"]), 1.0) if value["ratio_sq"] > 0 else 1.0
    return {
        "abs_log_ratio_mean": value["abs_log_ratio"] / n,
        "abs_log_ratio_max": value["abs_log_ratio_max"],
        "kl": value["kl"] / n,
        "capped_frac": value["capped"] / n,
        "masked_frac": value["masked"] / n,
        "ess": ess,
    }
