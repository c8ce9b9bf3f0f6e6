"""Advantage estimators: rewards (and values) -> per-token advantages and returns.

One signature for the whole family::

    fn(token_rewards [B,T], mask [B,T], group_index [B], values=None [B,T], **options)
        -> (advantages [B,T], returns [B,T])

Outcome (sequence) rewards arrive as ``token_rewards`` with the score at the last valid
token; group estimators use the sequence score R_i = sum_t token_rewards[i, t] over valid
tokens, so a per-token KL-in-reward shaping is summed into it. Advantages and returns are
0 on padded tokens, are computed without gradient, and for outcome estimators
``returns == advantages`` (there is no critic to regress).

Degenerate groups are defined, never NaN:
  * zero-variance group (all scores equal): advantage 0 for every group estimator;
  * group of size 1: no baseline can be formed from the others, advantage 0 for
    group_norm, group_mean, rloo, reinforce_pp_baseline and prm_step (the sample carries no
    relative signal) -- by default, see ``singleton`` below;
  * all-padding rows: advantage 0, and they are left out of their group's statistics.

Peer conventions as options (defaults are ours):
  * ``singleton`` (group_norm, group_mean, rloo, reinforce_pp_baseline): a group of one gets
    "zero" (default) 0; "raw" its score R (baseline 0, no std division: verl's GRPO without
    std, verl's RLOO); "unit_std" mean 0 and std 1, then the usual scaling: R / (1 + eps) for
    group_norm (verl's GRPO with std), R for group_mean and rloo. For reinforce_pp_baseline
    both mean baseline 0 (verl).
  * ``scale`` (group_norm): "group" (default, GRPO), "batch" (TRL ``scale_rewards="batch"``:
    divide by the unbiased std of all sequence scores of the batch), "none" (Dr. GRPO, TRL
    ``scale_rewards="none"``). TRL's eps is 1e-4 (``eps=1e-4``).
  * ``keep_degenerate`` (reinforce_pp_baseline): keep the whitened values of degenerate
    groups instead of resetting them to 0 (verl).

Batch statistics under data parallelism: whitening (gae, reinforce_pp, reinforce_pp_baseline)
and group_norm's ``scale="batch"`` read the whole batch's mean and std. A caller whose batch is
split over ranks passes ``batch_sum`` (a function summing a tensor over the ranks, see
``masked.BatchSum``) and gets the statistics of the union batch, as the peers do (verl
computes advantages on the whole batch in its driver; TRL gathers the rewards of every process
before scaling); group statistics need none (a group lives on one rank).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable

import torch

from .checks import check_finite, check_shape, lookup, valid_mask
from .groups import GroupIndex, group_ids, group_max, group_mean, group_min, group_std, group_sum
from .masked import BatchSum, masked_sum, masked_var, masked_whiten
from .options import POSITIVE, PROBABILITY, Option, boolean, choice, declaring, merged, number

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {}  # filled by @advantage_estimator


def advantage_estimator(name: str, *, options: Iterable[Option] = ()):
    """Declare and register the advantage estimator ``name`` (``fn(token_rewards, mask,
    group_index, values=None, *, <options>) -> (advantages, returns)``) with its keyword
    options, each an ``Option(name, default, spec, doc)`` whose default is the function's own.
    The function is returned as it is, carrying ``.estimator_name`` and ``.options``."""
    return declaring(ADVANTAGE_ESTIMATORS, "advantage estimator", name, options)


def estimator_options() -> dict[str, Option]:
    """Every option of the registered estimators by name (the keys of the `advantage` group)."""
    return merged(fn.options for fn in ADVANTAGE_ESTIMATORS.values())


def _validate(token_rewards, mask, values=None) -> torch.Tensor:
    if token_rewards.dim() != 2:
        raise ValueError(f"token_rewards must be [B, T], got shape {tuple(token_rewards.shape)}")
    check_shape("mask", mask, token_rewards.shape, "token_rewards")
    check_finite("token_rewards", token_rewards, mask)
    if values is not None:
        check_shape("values", values, token_rewards.shape, "token_rewards")
        check_finite("values", values, mask)
    return valid_mask(mask)


def _groups(group_index, valid: torch.Tensor) -> GroupIndex:
    """Group ids in which all-padding rows are singletons: they have no score (it would sit
    on their last valid token), so they must not shift their group's mean or std."""
    g = group_ids(group_index, valid.shape[0])  # validates shape and dtype
    has_tokens = valid.any(-1)
    if bool(has_tokens.all()):
        return g
    fresh = g.num_groups + torch.arange(valid.shape[0], device=g.inverse.device)
    return group_ids(torch.where(has_tokens, g.inverse, fresh), valid.shape[0])


def _broadcast(seq_adv: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, T] on valid tokens, 0 on padding."""
    full = seq_adv.unsqueeze(-1).expand(valid.shape)
    return torch.where(valid, full, torch.zeros_like(full))


def sequence_scores(token_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """R_i = sum_t r_it over valid tokens -> [B]."""
    return masked_sum(token_rewards, mask, dim=-1)


def _zero_variance(scores: torch.Tensor, g: GroupIndex) -> torch.Tensor:
    # Compare extremes instead of testing std == 0: the float mean of equal numbers need not
    # equal them exactly, which would leave tiny nonzero "advantages".
    return group_max(scores, g) == group_min(scores, g)


SINGLETON_MODES = ("zero", "raw", "unit_std")
SCALE_MODES = ("group", "batch", "none")
# Options several estimators share, declared once.
EPS = Option("eps", 1e-6, number(0), "added to the std before dividing")
SINGLETON = Option("singleton", "zero", choice(*SINGLETON_MODES), "what a group of one sample gets")
GAMMA = Option("gamma", 1.0, PROBABILITY, "discount")
WHITEN_EPS = Option("whiten_eps", 1e-8, POSITIVE, "added to the batch std when whitening")


def _check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


def _singletons(g: GroupIndex) -> torch.Tensor:
    """[B] bool: the sample is alone in its group."""
    return g.counts[g.inverse] < 2


def _degenerate(scores: torch.Tensor, g: GroupIndex, singleton: str = "zero") -> torch.Tensor:
    """[B] bool: the sample's group has zero variance or -- when ``singleton`` is "zero" -- a
    single member (no relative signal). Other singleton modes give singletons a baseline of 0."""
    degenerate = _zero_variance(scores, g)  # true for every singleton too
    if singleton != "zero":
        degenerate = degenerate & ~_singletons(g)
    return degenerate


@advantage_estimator("group_norm", options=(
    EPS, Option("scale", "group", choice(*SCALE_MODES), "divide by the group's std, the batch's, or none"), SINGLETON))
@torch.no_grad()
def grpo_advantages(
    token_rewards, mask, group_index, values=None, *, eps: float = 1e-6, scale: str = "group",
    singleton: str = "zero", batch_sum: BatchSum | None = None,
):
    """GRPO (Shao et al. 2024): A_i = (R_i - mean_G R) / (std_G R + eps), unbiased std.

    ``scale``: "group" divides by the group's std; "batch" by the unbiased std of the sequence
    scores of the whole batch (non-empty rows; TRL ``scale_rewards="batch"``; a batch std of 0
    gives 0); "none" does not divide (Dr. GRPO, see ``dr_grpo_advantages``). Zero-variance
    groups give 0. ``singleton``: "zero" 0, "raw" R, "unit_std" group mean 0 and std 1, then
    the scaling above (R / (1 + eps) with "group").
    """
    _check_choice("scale", scale, SCALE_MODES)
    _check_choice("singleton", singleton, SINGLETON_MODES)
    valid = _validate(token_rewards, mask)
    scores = sequence_scores(token_rewards, mask)
    g = _groups(group_index, valid)
    single = _singletons(g)
    baseline = group_mean(scores, g)
    if singleton != "zero":
        baseline = torch.where(single, torch.zeros_like(baseline), baseline)
    centred = scores - baseline
    if scale == "group":
        std = group_std(scores, g, unbiased=True)
        if singleton == "unit_std":
            std = torch.where(single, torch.ones_like(std), std)
        centred = centred / (std + eps)
    elif scale == "batch":
        std = masked_var(scores, valid.any(-1), unbiased=True, batch_sum=batch_sum).sqrt()
        centred = torch.where(std > 0, centred / (std + eps), torch.zeros_like(centred))
    if singleton == "raw":
        centred = torch.where(single, scores, centred)
    adv = torch.where(_degenerate(scores, g, singleton), torch.zeros_like(centred), centred)
    adv = _broadcast(adv, valid)
    return adv, adv.clone()


@advantage_estimator("group_mean", options=(SINGLETON,))
@torch.no_grad()
def dr_grpo_advantages(token_rewards, mask, group_index, values=None, *, singleton: str = "zero"):
    """Dr. GRPO (Liu et al. 2025): A_i = R_i - mean_G R (no std normalisation); a group of one
    gives 0 ("zero") or R ("raw", "unit_std")."""
    return grpo_advantages(token_rewards, mask, group_index, scale="none", singleton=singleton)


@advantage_estimator("rloo", options=(SINGLETON,))
@torch.no_grad()
def rloo_advantages(token_rewards, mask, group_index, values=None, *, singleton: str = "zero"):
    """RLOO (Ahmadian et al. 2024): A_i = R_i - (sum_{j != i} R_j) / (G - 1); 0 when the
    group's scores are all equal (set explicitly: (sum - R_i) / (G - 1) of equal floats need
    not round back to R_i). A group of one (G = 1) gives 0 ("zero") or R with baseline 0
    ("raw", "unit_std": verl's RLOO)."""
    _check_choice("singleton", singleton, SINGLETON_MODES)
    valid = _validate(token_rewards, mask)
    scores = sequence_scores(token_rewards, mask)
    g = _groups(group_index, valid)
    n = g.counts[g.inverse].to(scores.dtype)
    others = (group_sum(scores, g)[g.inverse] - scores) / (n - 1).clamp_min(1)
    others = torch.where(_singletons(g), torch.zeros_like(others), others)
    adv = torch.where(_degenerate(scores, g, singleton), torch.zeros_like(scores), scores - others)
    adv = _broadcast(adv, valid)
    return adv, adv.clone()


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1} over valid tokens; padding neither adds nor discounts.

    Masked positions inside a response (e.g. tool output in a multi-turn rollout) are
    skipped, so the return flows across them unchanged; padding gets 0.
    """
    valid = valid_mask(mask)
    out = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in range(token_rewards.shape[1] - 1, -1, -1):
        m = valid[:, t]
        running = torch.where(m, token_rewards[:, t] + gamma * running, running)
        out[:, t] = running
    return torch.where(valid, out, torch.zeros_like(out))


@advantage_estimator("reinforce_pp", options=(GAMMA, WHITEN_EPS))
@torch.no_grad()
def reinforce_pp_advantages(
    token_rewards, mask, group_index=None, values=None, *, gamma: float = 1.0, whiten_eps: float = 1e-8,
    batch_sum: BatchSum | None = None,
):
    """REINFORCE++ (Hu 2025): A_t = whiten_batch(sum_{k>=t} gamma^(k-t) r_k), global whitening.

    Returns are the un-whitened discounted returns.
    """
    valid = _validate(token_rewards, mask)
    returns = discounted_returns(token_rewards, valid, gamma)
    adv = masked_whiten(returns, valid, shift_mean=True, eps=whiten_eps, batch_sum=batch_sum)
    return adv, returns


@advantage_estimator("reinforce_pp_baseline", options=(
    WHITEN_EPS, SINGLETON, Option("keep_degenerate", False, boolean(), "verl: keep flat groups' whitened values")))
@torch.no_grad()
def reinforce_pp_baseline_advantages(
    token_rewards, mask, group_index, values=None, *, whiten_eps: float = 1e-8,
    singleton: str = "zero", keep_degenerate: bool = False, batch_sum: BatchSum | None = None,
):
    """REINFORCE++-baseline (Hu 2025): A_i = whiten_batch(R_i - mean_G R) over valid tokens.

    The whitening statistics (mean, unbiased std) are taken over every valid token of the
    batch; afterwards samples of degenerate groups (zero variance, or a single member) are
    set back to 0. Whitening alone would give them -mean/std, a push in the direction of the
    length-weighted batch imbalance although they carry no relative signal.
    ``keep_degenerate=True`` keeps those whitened values (verl). ``singleton`` "raw" or
    "unit_std": a group of one is centred with baseline 0 (value R before whitening, verl)
    and keeps its whitened value.
    """
    _check_choice("singleton", singleton, SINGLETON_MODES)
    valid = _validate(token_rewards, mask)
    scores = sequence_scores(token_rewards, mask)
    g = _groups(group_index, valid)
    adv, _ = dr_grpo_advantages(token_rewards, mask, group_index, singleton=singleton)
    adv = masked_whiten(adv, valid, shift_mean=True, eps=whiten_eps, batch_sum=batch_sum)
    if not keep_degenerate:
        adv = torch.where(_degenerate(scores, g, singleton).unsqueeze(-1), torch.zeros_like(adv), adv)
    return adv, adv.clone()


@advantage_estimator("gae", options=(
    GAMMA, Option("lam", 0.95, PROBABILITY, "GAE lambda"),
    Option("whiten", True, boolean(), "whiten the advantages over the batch"), WHITEN_EPS))
@torch.no_grad()
def gae_advantages(
    token_rewards,
    mask,
    group_index=None,
    values=None,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    whiten: bool = True,
    whiten_eps: float = 1e-8,
    batch_sum: BatchSum | None = None,
):
    """GAE (Schulman et al. 2016): A_t = sum_l (gamma lam)^l delta_{t+l},
    delta_t = r_t + gamma V_{t+1} - V_t; returns = A + V (computed before optional whitening).

    V after the last valid token is 0 (the response ends the episode). Masked positions
    inside a response are skipped, as in ``discounted_returns``. ``whiten`` (default on, as
    in PPO implementations) whitens the advantages over all valid tokens.
    """
    if values is None:
        raise ValueError("advantage estimator 'gae' needs values (critic predictions [B, T])")
    valid = _validate(token_rewards, mask, values=values)
    values = torch.where(valid, values, torch.zeros_like(values)).to(token_rewards.dtype)
    adv = torch.zeros_like(token_rewards)
    next_value = torch.zeros_like(token_rewards[:, 0])
    running = torch.zeros_like(next_value)
    for t in range(token_rewards.shape[1] - 1, -1, -1):
        m = valid[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(m, delta + gamma * lam * running, running)
        next_value = torch.where(m, values[:, t], next_value)
        adv[:, t] = running
    adv = torch.where(valid, adv, torch.zeros_like(adv))
    returns = torch.where(valid, adv + values, torch.zeros_like(adv))
    if whiten:
        adv = masked_whiten(adv, valid, shift_mean=True, eps=whiten_eps, batch_sum=batch_sum)
    return adv, returns


@advantage_estimator("prm_step", options=(EPS,))
@torch.no_grad()
def prm_step_advantages(
    token_rewards, mask, group_index, values=None, *, step_mask=None, eps: float = 1e-6
):
    """Process supervision (DeepSeekMath, Shao et al. 2024):
    r~ = (r_step - mean_G) / (std_G + eps) over all steps of the group; A_t = sum of r~ of
    the steps ending at or after t.

    ``token_rewards`` holds each step's reward at the step's last token and ``step_mask``
    (bool [B, T], required) marks those step-end tokens. Steps outside ``mask`` are ignored.
    A group whose step rewards are all equal, or that has fewer than 2 steps, gets 0.
    """
    if step_mask is None:
        raise ValueError(
            "advantage estimator 'prm_step' needs step_mask (bool [B, T], True at the last "
            "token of each reasoning step, where token_rewards holds that step's reward)"
        )
    valid = _validate(token_rewards, mask)
    check_shape("step_mask", step_mask, token_rewards.shape, "token_rewards")
    steps = valid & valid_mask(step_mask)
    g = _groups(group_index, valid)
    r = torch.where(steps, token_rewards, torch.zeros_like(token_rewards))

    n = group_sum(steps.sum(-1).to(r.dtype), g)[g.inverse]  # steps in my group, [B]
    mean = (group_sum(r.sum(-1), g)[g.inverse] / n.clamp_min(1)).unsqueeze(-1)
    sq = torch.where(steps, (r - mean) ** 2, torch.zeros_like(r)).sum(-1)
    var = group_sum(sq, g)[g.inverse] / (n - 1).clamp_min(1)
    std = var.sqrt().unsqueeze(-1)
    big = torch.finfo(r.dtype).max
    lo = group_min(torch.where(steps, r, torch.full_like(r, big)).amin(-1), g)
    hi = group_max(torch.where(steps, r, torch.full_like(r, -big)).amax(-1), g)
    degenerate = ((n < 2) | (hi == lo)).unsqueeze(-1)

    normed = torch.where(steps & ~degenerate, (r - mean) / (std + eps), torch.zeros_like(r))
    # Reverse cumulative sum: each token collects the normalised rewards of steps ending later.
    adv = normed.flip(-1).cumsum(-1).flip(-1)
    adv = torch.where(valid, adv, torch.zeros_like(adv))
    return adv, adv.clone()


def compute_advantages(name: str, token_rewards, mask, group_index, values=None, batch_sum: BatchSum | None = None,
                       **options):
    """``ADVANTAGE_ESTIMATORS[name](token_rewards, mask, group_index, values, **options)``;
    ``batch_sum`` reaches the estimators with batch statistics (see the module doc), the
    others have none to sum."""
    fn = lookup(ADVANTAGE_ESTIMATORS, name, "advantage estimator")
    if batch_sum is not None and "batch_sum" in inspect.signature(fn).parameters:
        options["batch_sum"] = batch_sum
    return fn(token_rewards, mask, group_index, values, **options)
