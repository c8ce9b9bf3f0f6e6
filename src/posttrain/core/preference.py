"""Pairwise preference losses: Bradley–Terry reward models and direct preference optimisation.

One signature for the policy-side family::

    fn(chosen_logp [B], rejected_logp [B], ref_chosen_logp=None, ref_rejected_logp=None, *,
       beta, chosen_len=None, rejected_len=None, gamma=0.0, label_smoothing=0.0,
       length_normalize=False)
        -> PreferenceOutput(loss scalar, chosen_rewards [B], rejected_rewards [B], stats)

``*_logp`` are sequence log-probs (sum of the response's token log-probs); ``*_len`` [B]
are response lengths in tokens (> 0). Per-pair implicit rewards (detached) are
beta * (log pi - log pi_ref) for DPO/IPO/hinge (summed log-ratios, also for length-normalised
IPO; per-token log-ratios for length-normalised DPO, the margin inside its sigmoid) and
beta * log pi / |y| for SimPO; ``stats`` holds their batch means:
``rewards/chosen``, ``rewards/rejected``, ``rewards/margins`` (chosen - rejected) and
``rewards/accuracy`` (fraction with chosen > rejected).

An option a loss does not use raises instead of being silently ignored (None, False and 0
count as unset): ``gamma`` outside SimPO; label smoothing for IPO/hinge; lengths and
``length_normalize`` for hinge; lengths for DPO and IPO unless ``length_normalize=True``;
``length_normalize`` and reference log-probs for SimPO (always length-normalised,
reference-free). ``per_token_log_ratios`` is the one length normalisation DPO and IPO share.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .checks import check_finite, check_shape, lookup


class PreferenceOutput(NamedTuple):
    """What every preference loss returns.

    ``chosen_rewards`` / ``rejected_rewards`` are the detached per-pair implicit rewards [B]
    (the scores themselves for ``bradley_terry_loss``); ``stats`` their batch means.
    """

    loss: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    stats: dict[str, torch.Tensor]


PreferenceFn = Callable[..., PreferenceOutput]


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


def _lengths(chosen_len, rejected_len, like, loss):
    """Response lengths as [B] tensors of ``like``'s dtype; both required, finite and > 0."""
    if chosen_len is None or rejected_len is None:
        raise ValueError(f"preference loss {loss!r} needs chosen_len and rejected_len (response lengths)")
    out = []
    for name, value in (("chosen_len", chosen_len), ("rejected_len", rejected_len)):
        value = torch.as_tensor(value, device=like.device).detach().to(like.dtype)
        check_shape(name, value, like.shape, "chosen_logp")
        check_finite(name, value)
        if bool((value <= 0).any()):
            raise ValueError(f"{loss}: {name} must be > 0 (empty responses cannot be length-normalised)")
        out.append(value)
    return out


def per_token_log_ratios(chosen_log_ratio, rejected_log_ratio, chosen_len, rejected_len, loss="dpo"):
    """Length normalisation of DPO (Tulu 3's length-normalised DPO) and IPO (TRL): each side's
    summed log-ratio log pi(y|x) - log ref(y|x) divided by its own response length |y| in
    tokens, i.e. the mean log-ratio per token: ((log pi_w - log ref_w)/|y_w|, (log pi_l - log ref_l)/|y_l|).
    ``loss`` names the caller in errors (lengths missing, not [B], not finite or not > 0)."""
    len_c, len_r = _lengths(chosen_len, rejected_len, chosen_log_ratio, loss)
    return chosen_log_ratio / len_c, rejected_log_ratio / len_r


def _lengths_only_if_normalized(loss, length_normalize, chosen_len, rejected_len):
    """Lengths without ``length_normalize=True`` would be silently unused: they raise."""
    if not length_normalize:
        _no_option(
            loss, hint=" or pass length_normalize=True to divide each log-ratio by its length",
            chosen_len=chosen_len, rejected_len=rejected_len,
        )


def _output(loss, chosen_rewards, rejected_rewards):
    c, r = chosen_rewards.detach(), rejected_rewards.detach()
    stats = {
        "rewards/chosen": c.mean(),
        "rewards/rejected": r.mean(),
        "rewards/margins": (c - r).mean(),
        "rewards/accuracy": (c > r).to(c.dtype).mean(),
    }
    return PreferenceOutput(loss, c, r, stats)


def _is_unset(value) -> bool:
    if value is None or value is False:
        return True
    if torch.is_tensor(value):
        return False  # a tensor was passed on purpose, whatever it holds
    return isinstance(value, (int, float)) and value == 0


def _no_option(loss, hint="", **options):
    """Raise if any of ``options`` is set (None, False and 0 count as unset)."""
    for key, value in options.items():
        if not _is_unset(value):
            shown = f"a tensor of shape {tuple(value.shape)}" if torch.is_tensor(value) else repr(value)
            raise ValueError(
                f"preference loss {loss!r} does not use {key} (got {shown}); leave it unset{hint}"
            )


def _smoothed_sigmoid_loss(logits, label_smoothing):
    """-(1 - ls) log sigma(h) - ls log sigma(-h): conservative DPO (cDPO) label smoothing."""
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing!r}")
    return -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)


def dpo_loss(
    chosen_logp, rejected_logp, ref_chosen_logp=None, ref_rejected_logp=None, *,
    beta, chosen_len=None, rejected_len=None, gamma=0.0, label_smoothing=0.0, length_normalize=False,
):
    """DPO (Rafailov et al. 2023): -log sigma(beta [(log pi_w - log ref_w) - (log pi_l - log ref_l)]).

    ``length_normalize=True``: length-normalised DPO (Tulu 3, open-instruct's ``dpo_norm``),
    each side's log-ratio divided by its own response length (``per_token_log_ratios``),
    -log sigma(beta [(log pi_w - log ref_w)/|y_w| - (log pi_l - log ref_l)/|y_l|]); needs
    ``chosen_len`` and ``rejected_len`` (given without it, they raise). The per-token margin
    is about 1/|y| of the summed one, so the normalised loss takes a larger beta (Tulu 3: 5).
    Its rewards are beta * per-token log-ratio: their margin is the sigmoid's argument.
    """
    _no_option("dpo", gamma=gamma)
    _lengths_only_if_normalized("dpo", length_normalize, chosen_len, rejected_len)
    rc, rr = _reference_log_ratios(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, "dpo")
    if length_normalize:
        rc, rr = per_token_log_ratios(rc, rr, chosen_len, rejected_len, "dpo")
    chosen_rewards, rejected_rewards = beta * rc, beta * rr
    loss = _smoothed_sigmoid_loss(chosen_rewards - rejected_rewards, label_smoothing).mean()
    return _output(loss, chosen_rewards, rejected_rewards)


def ipo_loss(
    chosen_logp, rejected_logp, ref_chosen_logp=None, ref_rejected_logp=None, *,
    beta, chosen_len=None, rejected_len=None, gamma=0.0, label_smoothing=0.0, length_normalize=False,
):
    """IPO (Azar et al. 2023): (h - 1/(2 beta))^2. ``beta`` plays the paper's tau.

    ``length_normalize=False`` (default; OpenRLHF): summed log-ratios,
    h = (log pi_w - log ref_w) - (log pi_l - log ref_l).
    ``length_normalize=True`` (TRL ``loss_type="ipo"``): each side's log-ratio divided by its
    own response length (``per_token_log_ratios``),
    h = (log pi_w - log ref_w)/|y_w| - (log pi_l - log ref_l)/|y_l|;
    needs ``chosen_len`` and ``rejected_len`` (given without it, they raise). The squared
    loss of summed log-ratios grows with response length, so the two take different betas.

    The returned rewards are beta * summed log-ratio in both modes (as TRL reports them),
    so with ``length_normalize=True`` their margin is not the h inside the loss.
    """
    _no_option("ipo", gamma=gamma, label_smoothing=label_smoothing)
    _lengths_only_if_normalized("ipo", length_normalize, chosen_len, rejected_len)
    if not beta > 0:
        raise ValueError(f"ipo needs beta > 0, got {beta!r}")
    rc, rr = _reference_log_ratios(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, "ipo")
    if length_normalize:
        per_token_c, per_token_r = per_token_log_ratios(rc, rr, chosen_len, rejected_len, "ipo")
        h = per_token_c - per_token_r
    else:
        h = rc - rr
    loss = (h - 1.0 / (2.0 * beta)).pow(2).mean()
    return _output(loss, beta * rc, beta * rr)


def hinge_loss(
    chosen_logp, rejected_logp, ref_chosen_logp=None, ref_rejected_logp=None, *,
    beta, chosen_len=None, rejected_len=None, gamma=0.0, label_smoothing=0.0, length_normalize=False,
):
    """Hinge / SLiC (Zhao et al. 2023): max(0, 1 - beta h), h = reference-relative log-ratio margin."""
    _no_option(
        "hinge", gamma=gamma, label_smoothing=label_smoothing,
        chosen_len=chosen_len, rejected_len=rejected_len, length_normalize=length_normalize,
    )
    rc, rr = _reference_log_ratios(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, "hinge")
    chosen_rewards, rejected_rewards = beta * rc, beta * rr
    loss = torch.relu(1.0 - (chosen_rewards - rejected_rewards)).mean()
    return _output(loss, chosen_rewards, rejected_rewards)


def simpo_loss(
    chosen_logp, rejected_logp, ref_chosen_logp=None, ref_rejected_logp=None, *,
    beta, chosen_len=None, rejected_len=None, gamma=0.0, label_smoothing=0.0, length_normalize=False,
):
    """SimPO (Meng et al. 2024): -log sigma(beta/|y_w| log pi_w - beta/|y_l| log pi_l - gamma).

    Reference-free and always length-normalised: ``chosen_len``/``rejected_len`` are required,
    while reference log-probs and ``length_normalize=True`` raise (neither changes anything).
    ``gamma`` is the paper's target reward margin, in reward units: subtracted as is, *not*
    multiplied by beta. TRL's CPOTrainer ``simpo_gamma`` is this same gamma (it computes
    -log sigma(beta (h - simpo_gamma/beta)) = -log sigma(beta h - gamma)); only the SimPO
    authors' reference code takes ``gamma_beta_ratio`` = gamma / beta, so convert that one
    with gamma = beta * gamma_beta_ratio.
    """
    _no_option(
        "simpo", hint=" (SimPO is reference-free and always length-normalised)",
        ref_chosen_logp=ref_chosen_logp, ref_rejected_logp=ref_rejected_logp, length_normalize=length_normalize,
    )
    _validate_pair(chosen_logp, rejected_logp)
    chosen_len, rejected_len = _lengths(chosen_len, rejected_len, chosen_logp, "simpo")
    chosen_rewards = beta * chosen_logp / chosen_len
    rejected_rewards = beta * rejected_logp / rejected_len
    logits = chosen_rewards - rejected_rewards - gamma
    loss = _smoothed_sigmoid_loss(logits, label_smoothing).mean()
    return _output(loss, chosen_rewards, rejected_rewards)


PREFERENCE_LOSSES: dict[str, PreferenceFn] = {
    "dpo": dpo_loss,
    "ipo": ipo_loss,
    "hinge": hinge_loss,
    "simpo": simpo_loss,
}


def preference_loss(
    name: str, chosen_logp, rejected_logp, ref_chosen_logp=None, ref_rejected_logp=None, **kwargs,
) -> PreferenceOutput:
    """``PREFERENCE_LOSSES[name](...)`` -> ``PreferenceOutput``."""
    fn = lookup(PREFERENCE_LOSSES, name, "preference loss")
    return fn(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, **kwargs)


def bradley_terry_loss(chosen_scores, rejected_scores, margin=None, center_coef: float = 0.0) -> PreferenceOutput:
    """Bradley–Terry RM loss: -log sigma(s_w - s_l - m) + center_coef (s_w + s_l)^2.

    ``margin`` m (Llama 2; scalar or [B]) demands a larger gap on clearer pairs; the
    centering term (Eisenstein et al. 2023) pins the otherwise free reward offset near 0.
    Returns ``PreferenceOutput`` with the (detached) scores as the per-pair rewards.
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
    return _output(loss, chosen_scores, rejected_scores)


def ensemble_lower_bound(scores: torch.Tensor, std_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Pessimistic reward of a reward-model ensemble (Coste et al. 2023, uncertainty-weighted
    optimisation): [M, B] scores of M models -> ([B] mean - std_coef * std over the models,
    [B] std). The std is unbiased, the project's convention for sample spreads; one model has
    no spread, so its std is 0 and its scores pass unchanged."""
    spread = scores.std(dim=0) if scores.shape[0] > 1 else torch.zeros_like(scores[0])
    return scores.mean(dim=0) - std_coef * spread, spread


def weighted_head_sum(scores: torch.Tensor, weights) -> torch.Tensor:
    """Multi-objective reward of a reward model with H heads, one score per objective
    (helpfulness, harmlessness, ...): [..., H] scores and H weights -> [...] sum_h w_h * r_h.
    A head weighted 0 is left out of the reward (its score is still computed)."""
    weights = torch.as_tensor(weights, dtype=scores.dtype, device=scores.device)
    if weights.dim() != 1 or scores.dim() == 0 or weights.shape[0] != scores.shape[-1]:
        raise ValueError(f"weights must be [H] for scores [..., H], got weights {tuple(weights.shape)} and scores "
                         f"{tuple(scores.shape)}")
    check_finite("weights", weights)
    check_finite("scores", scores)
    return (scores * weights).sum(dim=-1)
