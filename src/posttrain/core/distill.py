"""Distillation divergences between a student and a teacher.

Full-distribution divergences take logits [B, T, V] (same vocabulary) and return a
per-token [B, T] tensor; aggregate with ``aggregate_loss``. One signature for the registry::

    fn(student_logits [B,T,V], teacher_logits [B,T,V], *, beta=0.5, temperature=1.0) -> [B, T]

(``beta`` is used by "generalized_jsd" only). Both distributions are softmax(logits / T),
T = ``temperature`` > 0 (TRL GKD's convention); the result is *not* multiplied by T^2.
Hinton-style KD multiplies the soft-target loss by T^2 so its gradient keeps the T = 1
scale; a caller that wants that puts T^2 into its coefficient. The teacher is a constant:
its logits are detached. Logits may be -inf for banned tokens; such tokens contribute 0,
except that reverse KL is +inf when the student puts mass where the teacher has none (that
is its value).

Sample-based forms work on the log-probs of the sampled tokens only (no vocabulary pass):
``reverse_kl_sampled`` for on-policy distillation and ``kdrl_loss`` (k2 or k3) for KDRL.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import torch

from .aggregation import aggregate_loss
from .checks import check_finite, check_shape, finite_checks_enabled, lookup, valid_mask
from .kl import kl_k1, kl_k2, kl_k3
from .masked import masked_mean, zero_padding

DivergenceFn = Callable[..., torch.Tensor]
_HALF = (torch.float16, torch.bfloat16)


def _check_temperature(temperature) -> float:
    ok = isinstance(temperature, numbers.Real) and not isinstance(temperature, bool)
    if not (ok and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    return float(temperature)


def _log_softmax(logits: torch.Tensor, name: str, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature) over the last dim, in float32 for half inputs."""
    # -inf is allowed (banned tokens; -inf / T stays -inf); NaN and +inf are not.
    if finite_checks_enabled() and bool((torch.isnan(logits) | torch.isposinf(logits)).any()):
        raise ValueError(f"{name} contain NaN or +inf")
    x = logits.float() if logits.dtype in _HALF else logits
    if temperature != 1.0:  # upcast first: dividing in half precision would round again
        x = x / temperature
    return torch.log_softmax(x, dim=-1)


def _pair(student_logits, teacher_logits, temperature=1.0):
    t = _check_temperature(temperature)
    check_shape("teacher_logits", teacher_logits, student_logits.shape, "student_logits")
    return (
        _log_softmax(student_logits, "student_logits", t),
        _log_softmax(teacher_logits.detach(), "teacher_logits", t),
    )


def _kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(p || q) = sum_v p (log p - log q) over the last dim; p = 0 terms are 0."""
    p = logp.exp()
    support = p > 0
    # Replace -inf before subtracting so neither the value nor the backward forms 0 * inf.
    diff = torch.where(support, logp - torch.where(support, logq, torch.zeros_like(logq)), torch.zeros_like(logp))
    return (p * diff).sum(-1)


def reverse_kl(student_logits, teacher_logits, *, temperature: float = 1.0):
    """Reverse KL (mode seeking; on-policy distillation): KL(p_s || p_t) = sum_v p_s (log p_s - log p_t).

    p = softmax(logits / temperature) for both; no T^2 factor (see the module docstring).
    """
    ls, lt = _pair(student_logits, teacher_logits, temperature)
    return _kl(ls, lt)


def forward_kl(student_logits, teacher_logits, *, temperature: float = 1.0):
    """Forward KL (mean seeking; classic KD): KL(p_t || p_s) = sum_v p_t (log p_t - log p_s).

    p = softmax(logits / temperature) for both; no T^2 factor: Hinton et al. (2015) multiply
    this soft-target term by T^2, which the caller does with its coefficient.
    """
    ls, lt = _pair(student_logits, teacher_logits, temperature)
    return _kl(lt, ls)


def generalized_jsd(student_logits, teacher_logits, beta: float = 0.5, *, temperature: float = 1.0):
    """Generalised JSD (GKD, Agarwal et al. 2024): beta KL(p_t || m) + (1 - beta) KL(p_s || m),
    m = beta p_t + (1 - beta) p_s, p = softmax(logits / temperature); no T^2 factor.

    beta = 0.5 is the symmetric JSD (bounded by log 2). Near beta = 0 it behaves like
    beta * forward KL, near 1 like (1 - beta) * reverse KL; at exactly 0 or 1 it is
    identically 0, so those values are refused (use forward_kl / reverse_kl).
    """
    if not 0.0 < beta < 1.0:
        raise ValueError(f"generalized_jsd needs 0 < beta < 1 (got {beta!r}); use forward_kl/reverse_kl at the ends")
    ls, lt = _pair(student_logits, teacher_logits, temperature)
    # Where both distributions ban a token, logsumexp sees only -inf and its gradient is NaN;
    # m has no mass there and neither KL term reads it, so any finite placeholder will do.
    support = torch.isfinite(lt) | torch.isfinite(ls)
    zero = torch.zeros_like(lt)
    stacked = torch.stack([torch.where(support, lt, zero) + math.log(beta), torch.where(support, ls, zero) + math.log(1.0 - beta)])
    log_m = torch.logsumexp(stacked, dim=0)
    return beta * _kl(lt, log_m) + (1.0 - beta) * _kl(ls, log_m)


DISTILL_DIVERGENCES: dict[str, DivergenceFn] = {
    "reverse_kl": lambda s, t, *, beta=0.5, temperature=1.0: reverse_kl(s, t, temperature=temperature),
    "forward_kl": lambda s, t, *, beta=0.5, temperature=1.0: forward_kl(s, t, temperature=temperature),
    "generalized_jsd": lambda s, t, *, beta=0.5, temperature=1.0: generalized_jsd(
        s, t, beta, temperature=temperature
    ),
}


def distill_divergence(name: str, student_logits, teacher_logits, *, beta: float = 0.5, temperature: float = 1.0):
    """``DISTILL_DIVERGENCES[name](student_logits, teacher_logits, beta=beta, temperature=temperature)`` -> [B, T]."""
    fn = lookup(DISTILL_DIVERGENCES, name, "distillation divergence")
    return fn(student_logits, teacher_logits, beta=beta, temperature=temperature)


def reverse_kl_sampled(student_logp, teacher_logp):
    """Per-token reverse-KL sample on student tokens: log p_s(y_t) - log p_t(y_t) (= k1).

    Its expectation over student samples is KL(p_s || p_t); on-policy distillation uses its
    negative as a per-token reward (detach it there).
    """
    return kl_k1(student_logp, teacher_logp)


def kdrl_reward_mask(rewards: torch.Tensor, threshold: float = 0.0) -> torch.Tensor:
    """KDRL reward-guided masking -> [B] float: 1 (distil) where reward <= threshold, else 0.

    Well-rewarded responses already get their signal from RL; pulling them towards the
    teacher as well over-regularises (Xu et al. 2025). The default threshold 0 distils only
    on responses with no positive reward.
    """
    check_finite("rewards", rewards)
    return (rewards <= threshold).to(rewards.dtype if rewards.is_floating_point() else torch.float32)


# Sampled KL estimators KDRL's distillation term takes (core.kl): k2's on-policy gradient is
# exactly grad KL(student || teacher); k3's is grad KL(teacher || student).
KDRL_ESTIMATORS = {"k2": kl_k2, "k3": kl_k3}


def kdrl_loss(
    student_logp, teacher_logp, mask, reward_mask=None, agg_mode="token-mean", *, estimator: str = "k2",
    num_tokens=None, num_seqs=None, norm_constant=None, dp_size: int = 1, count_empty_rows: bool = False,
):
    """KDRL KD term (Xu et al. 2025): aggregate of a sampled KL estimator between the student
    and the teacher on student samples; k2 = 0.5 (log p_s(y_t) - log p_t(y_t))^2 by default,
    k3 = exp(d) - d - 1 with d = log p_t(y_t) - log p_s(y_t) as an option.

    On-policy, grad E[k2] is exactly grad KL(p_s || p_t) (see ``kl_k2``). ``reward_mask`` [B]
    (e.g. ``kdrl_reward_mask(rewards)``) zeroes whole sequences; as for ``seq_mask`` in the
    policy losses the normalising counts still come from ``mask``, so the KD coefficient
    keeps the same scale as the RL term. Returns (loss, stats) with ``kl`` (mean estimator
    value over distilled tokens) and ``masked_frac`` (fraction of non-empty sequences masked).
    """
    check_shape("teacher_logp", teacher_logp, student_logp.shape, "student_logp")
    check_shape("mask", mask, student_logp.shape, "student_logp")
    check_finite("student_logp", student_logp, mask)
    check_finite("teacher_logp", teacher_logp, mask)
    kl_fn = lookup(KDRL_ESTIMATORS, estimator, "KDRL estimator")
    valid = valid_mask(mask)
    student_logp, teacher_logp = zero_padding(student_logp, valid), zero_padding(teacher_logp, valid)
    used = valid
    if reward_mask is not None:
        check_shape("reward_mask", reward_mask, student_logp.shape[:1], "student_logp[:, 0]")
        used = valid & valid_mask(reward_mask).unsqueeze(-1)
    kl = kl_fn(student_logp, teacher_logp)
    loss = aggregate_loss(
        torch.where(used, kl, torch.zeros_like(kl)), mask, agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
        norm_constant=norm_constant, dp_size=dp_size, count_empty_rows=count_empty_rows,
    )
    nonempty = valid.any(-1)
    stats = {
        "kl": masked_mean(kl.detach(), used),
        "masked_frac": masked_mean((~used.any(-1)).to(kl.dtype), nonempty),
    }
    return loss, stats
