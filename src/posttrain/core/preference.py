"""Pairwise preference losses: Bradley–Terry reward models and direct preference optimisation.

One signature for the policy-side family::

    fn(chosen_logp [B], rejected_logp [B], ref_chosen_logp=None, ref_rejected_logp=None, *,
       beta, chosen_len=None, rejected_len=None, gamma=0.0, label_smoothing=0.0)
        -> (loss scalar, stats)

``*_logp`` are sequence log-probs (sum of the response's token log-probs). Implicit
rewards are beta * (log pi - log pi_ref) for DPO/IPO/hinge and beta * log pi / |y| for
SimPO; stats report their batch means: ``rewards/chosen``, ``rewards/rejected``,
``rewards/margins`` (chosen - rejected) and ``rewards/accuracy`` (fraction with chosen >
rejected). Options that a loss does not define (``gamma`` outside SimPO, label smoothing
for IPO/hinge) raise instead of being silently ignored.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .checks import check_finite, check_shape, lookup

PreferenceFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


def _validate_pair(chosen, rejected, names=("chosen_logp", "rejected_logp")):
    if chosen.dim() != 1 or chosen.numel() == 0:
        raise ValueError(f"{names[0]} must be a non-empty [B] tensor, got shape {tuple(chosen.shape)}")
    check_shape(names[1], rejected, chosen.shape, names[0])
    check_finite(names[0], chosen)
    check_finite(names[1], rejected)


def _reference_log_ratios(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, loss):
    _validate_pair(chosen_logp, rejected_logp)
    if ref_chosen_logp is None or ref_rejected_logp is None:
        raise ValueError(f"preference loss {loss!r} needs ref_chosen_logp and ref_rejected_logp")
    _validate_pair(ref_chosen_logp, ref_rejected_logp, ("ref_chosen_logp", "ref_rejected_logp"))
    check_shape("ref_chosen_logp", ref_chosen_logp, chosen_logp.shape, "chosen_logp")
    return chosen_logp - ref_chosen_logp.detach(), rejected_logp - ref_rejected_logp.detach()


def _reward_stats(chosen_rewards, rejected_rewards):
    c, r = chosen_rewards.detach(), rejected_rewards.detach()
    return {
        "rewards/chosen": c.mean(),
        "rewards/rejected": r.mean(),
        "rewards/margins": (c - r).mean(),
        "rewards/accuracy": (c > r).to(c.dtype).mean(),
    }


def _no_option(loss, **options):
    for key, value in options.items():
        if value:
            raise ValueError(f"preference loss {loss!r} does not use {key} (got {value!r}); set it to 0")


def _smoothed_sigmoid_loss(logits, label_smoothing):
    """-(1 - ls) log sigma(h) - ls log sigma(-h): conservative DPO (cDPO) label smoothing."""
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing!r}")
    return -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)


def dpo_loss(
    chosen_logp, rejected_logp, ref_chosen_logp=None, ref_rejected_logp=None, *,
    beta, chosen_len=None, rejected_len=None, gamma=0.0, label_smoothing=0.0,
):
    """DPO (Rafailov et al. 2023): -log sigma(beta [(log pi_w - log ref_w) - (log pi_l - log ref_l)])."""
    _no_option("dpo", gamma=gamma)
    rc, rr = _reference_log_ratios(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, "dpo")
    chosen_rewards, rejected_rewards = beta * rc, beta * rr
    loss = _smoothed_sigmoid_loss(chosen_rewards - rejected_rewards, label_smoothing).mean()
    return loss, _reward_stats(chosen_rewards, rejected_rewards)


def ipo_loss(
    chosen_logp, rejected_logp, ref_chosen_logp=None, ref_rejected_logp=None, *,
    beta, chosen_len=None, rejected_len=None, gamma=0.0, label_smoothing=0.0,
):
    """IPO (Azar et al. 2023): (h - 1/(2 beta))^2, h = (log pi_w - log ref_w) - (log pi_l - log ref_l).

    ``beta`` plays the paper's tau (regularisation strength).
    """
    _no_option("ipo", gamma=gamma, label_smoothing=label_smoothing)
    if not beta > 0:
        raise ValueError(f"ipo needs beta > 0, got {beta!r}")
    rc, rr = _reference_log_ratios(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, "ipo")
    loss = ((rc - rr) - 1.0 / (2.0 * beta)).pow(2).mean()
    return loss, _reward_stats(beta * rc, beta * rr)


def hinge_loss(
    chosen_logp, rejected_logp, ref_chosen_logp=None, ref_rejected_logp=None, *,
    beta, chosen_len=None, rejected_len=None, gamma=0.0, label_smoothing=0.0,
):
    """Hinge / SLiC (Zhao et al. 2023): max(0, 1 - beta h), h = reference-relative log-ratio margin."""
    _no_option("hinge", gamma=gamma, label_smoothing=label_smoothing)
    rc, rr = _reference_log_ratios(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, "hinge")
    chosen_rewards, rejected_rewards = beta * rc, beta * rr
    loss = torch.relu(1.0 - (chosen_rewards - rejected_rewards)).mean()
    return loss, _reward_stats(chosen_rewards, rejected_rewards)


def simpo_loss(
    chosen_logp, rejected_logp, ref_chosen_logp=None, ref_rejected_logp=None, *,
    beta, chosen_len=None, rejected_len=None, gamma=0.0, label_smoothing=0.0,
):
    """SimPO (Meng et al. 2024): -log sigma(beta/|y_w| log pi_w - beta/|y_l| log pi_l - gamma).

    Reference-free (ref log-probs are ignored). ``gamma`` is the paper's target reward margin
    gamma, in reward units: it is subtracted as is, *not* multiplied by beta. (The SimPO and
    TRL code bases take ``gamma_beta_ratio`` = gamma / beta instead; convert with
    gamma = beta * gamma_beta_ratio.)
    """
    _validate_pair(chosen_logp, rejected_logp)
    if chosen_len is None or rejected_len is None:
        raise ValueError("preference loss 'simpo' needs chosen_len and rejected_len (response lengths)")
    chosen_len = torch.as_tensor(chosen_len, dtype=chosen_logp.dtype, device=chosen_logp.device)
    rejected_len = torch.as_tensor(rejected_len, dtype=chosen_logp.dtype, device=chosen_logp.device)
    check_shape("chosen_len", chosen_len, chosen_logp.shape, "chosen_logp")
    check_shape("rejected_len", rejected_len, chosen_logp.shape, "chosen_logp")
    if bool((chosen_len <= 0).any()) or bool((rejected_len <= 0).any()):
        raise ValueError("simpo: chosen_len and rejected_len must be > 0 (empty responses cannot be length-normalised)")
    chosen_rewards = beta * chosen_logp / chosen_len
    rejected_rewards = beta * rejected_logp / rejected_len
    logits = chosen_rewards - rejected_rewards - gamma
    loss = _smoothed_sigmoid_loss(logits, label_smoothing).mean()
    return loss, _reward_stats(chosen_rewards, rejected_rewards)


PREFERENCE_LOSSES: dict[str, PreferenceFn] = {
    "dpo": dpo_loss,
    "ipo": ipo_loss,
    "hinge": hinge_loss,
    "simpo": simpo_loss,
}


def preference_loss(name: str, chosen_logp, rejected_logp, ref_chosen_logp=None, ref_rejected_logp=None, **kwargs):
    """``PREFERENCE_LOSSES[name](...)``."""
    fn = lookup(PREFERENCE_LOSSES, name, "preference loss")
    return fn(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, **kwargs)


def bradley_terry_loss(chosen_scores, rejected_scores, margin=None, center_coef: float = 0.0):
    """Bradley–Terry RM loss: -log sigma(s_w - s_l - m) + center_coef (s_w + s_l)^2.

    ``margin`` m (Llama 2; scalar or [B]) demands a larger gap on clearer pairs; the
    centering term (Eisenstein et al. 2023) pins the otherwise free reward offset near 0.
    """
    _validate_pair(chosen_scores, rejected_scores, ("chosen_scores", "rejected_scores"))
    diff = chosen_scores - rejected_scores
    if margin is not None:
        margin = torch.as_tensor(margin, dtype=diff.dtype, device=diff.device)
        check_finite("margin", margin)
        diff = diff - margin
    loss = -F.logsigmoid(diff).mean()
    if center_coef:
        loss = loss + center_coef * (chosen_scores + rejected_scores).pow(2).mean()
    return loss, _reward_stats(chosen_scores, rejected_scores)
