"""Per-token estimators of KL(pi_theta || pi_ref) from sampled-token log-probs, their
placement (in the reward or as a loss) and the KL coefficient controllers.

Estimators (Schulman 2020, "Approximating KL divergence"), with d = log pi_ref - log pi_theta
evaluated at a token sampled from pi_theta:

  k1 = -d                      unbiased value; as a loss its expected gradient is 0, so it
                               belongs in the reward (PPO / RLHF style)
  k2 = d^2 / 2                 biased value; as a loss its expected gradient is exactly
                               grad KL(pi_theta || pi_ref) on on-policy samples
  k3 = exp(d) - d - 1          unbiased, non-negative, low variance value; as a loss its
                               expected gradient is grad KL(pi_ref || pi_theta) (GRPO's choice)
  abs = |d|                    verl's "abs" estimator (a biased value, bounded slope)
  k3_unbiased = w * k3         DeepSeek-V3.2 eq. 7 for samples drawn from pi_old, with
                               w = pi_theta / pi_old; the weight carries gradient, which is what
                               makes E_old[grad(w k3)] = grad KL(pi_theta || pi_ref) exactly

Clamps (keyword options of the estimators; ``None`` = no clamp):

  value_clamp c       result clamped to [-c, c]. Default None for k1, k2, abs; 10 for k3 and
                      k3_unbiased. OpenRLHF clamps k1/k2/k3 to +-10; TRL and verl do not clamp
                      k1/k2/abs (verl clamps k3 to +-10).
  log_ratio_clamp c   (k3, k3_unbiased) d and log(pi_theta/pi_old) clamped to [-c, c] before
                      ``exp``. Default 20 (ours). OpenRLHF: None (value clamp only); TRL: None
                      together with value_clamp None (unclamped k3, and TRL's
                      ``use_bias_correction_kl`` = k3_unbiased with both None).

Gradient surrogates (``kl_straight_through``; forward value of one estimator, gradient of
sg(w) * k2):

  straight-through    w = 1: value of k1/k3 (logging, in-reward use), exact on-policy gradient of
                      k2 ("k1_st", "k3_st", ``kl_penalty(..., straight_through=True)``)
  unbiased gradient   w = min(pi_theta / pi_old, cap), detached (OpenRLHF
                      ``--algo.kl.unbiased_gradient``, cap 10): E_old[grad] = grad KL(pi_theta
                      || pi_ref) off-policy too (``kl_penalty(..., unbiased_gradient=True)``)

``ref_logp`` and ``old_logp`` are constants: they are detached here, so gradient only ever
flows through ``logp``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import replace

import torch

from .checks import check_finite, check_shape, lookup, valid_mask
from .masked import zero_padding
from .options import POSITIVE, Option, boolean, declared, declaring, merged, optional

KLFn = Callable[..., torch.Tensor]
# One signature: fn(logp [B,T], ref_logp [B,T], old_logp [B,T] | None, **options) -> per-token [B,T].
# The config option "none" means no KL term at all: the algorithm skips this path (and the
# reference model), so it has no entry here.
KL_ESTIMATORS: dict[str, KLFn] = {}  # filled by @kl_estimator


def kl_estimator(name: str, *, options: Iterable[Option] = ()):
    """Declare and register the KL estimator ``name`` (``fn(logp, ref_logp, old_logp=None, *,
    <options>) -> [B, T]``) with its keyword options, each an ``Option(name, default, spec, doc)``
    whose default is the function's own. The function is returned as it is, carrying
    ``.estimator_name`` and ``.options``; ``kl_penalty`` adds the gradient options
    (GRADIENT_OPTIONS) to every estimator."""
    return declaring(KL_ESTIMATORS, "KL estimator", name, options)


# Options the estimators share, declared once (a default may differ: k3 clamps its value by default).
VALUE_CLAMP = Option("value_clamp", None, optional(POSITIVE), "clamp of the per-token value; null: none")
LOG_RATIO_CLAMP = Option("log_ratio_clamp", 20.0, optional(POSITIVE), "clamp of log(pi_ref/pi) before exp; null: none")
K3_OPTIONS = (LOG_RATIO_CLAMP, replace(VALUE_CLAMP, default=10.0))
# kl_penalty's own options, which replace any estimator's gradient.
GRADIENT_OPTIONS = declared((
    Option("straight_through", False, boolean(), "value of the estimator, gradient of k2"),
    Option("unbiased_gradient", False, boolean(), "OpenRLHF: gradient of sg(min(pi/pi_old, is_weight_cap)) * k2"),
    Option("is_weight_cap", 10.0, optional(POSITIVE), "unbiased_gradient: cap of the IS weight; null: none"),
))


def estimator_options() -> dict[str, Option]:
    """Every option of the registered estimators by name, and the gradient options."""
    return merged([*(fn.options for fn in KL_ESTIMATORS.values()), GRADIENT_OPTIONS.values()])


def clamped_log_ratio(logp: torch.Tensor, other_logp: torch.Tensor, clamp: float = 20.0) -> torch.Tensor:
    """clamp(log pi - log pi_other, -c, c): bounded before any ``exp`` so e^x never overflows."""
    if clamp is None or clamp <= 0:
        raise ValueError(f"log_ratio_clamp must be a positive number, got {clamp!r}")
    return torch.clamp(logp - other_logp.detach(), -clamp, clamp)


def _check_clamp(name: str, c: float | None) -> None:
    if c is not None and not c > 0:
        raise ValueError(f"{name} must be a positive number or None (no clamp), got {c!r}")


def _clamp_value(k: torch.Tensor, value_clamp: float | None) -> torch.Tensor:
    """clamp(k, -c, c); ``None`` leaves k as it is."""
    _check_clamp("value_clamp", value_clamp)
    return k if value_clamp is None else torch.clamp(k, -value_clamp, value_clamp)


def _clamp_log_ratio(x: torch.Tensor, log_ratio_clamp: float | None) -> torch.Tensor:
    """clamp(x, -c, c) for a log-ratio x; ``None`` leaves it as it is."""
    _check_clamp("log_ratio_clamp", log_ratio_clamp)
    return x if log_ratio_clamp is None else torch.clamp(x, -log_ratio_clamp, log_ratio_clamp)


@kl_estimator("k1", options=(VALUE_CLAMP,))
def kl_k1(
    logp: torch.Tensor, ref_logp: torch.Tensor, old_logp: torch.Tensor | None = None, *,
    value_clamp: float | None = None,
) -> torch.Tensor:
    """k1 = log pi_theta - log pi_ref (Schulman 2020), clamped to +-value_clamp if given."""
    return _clamp_value(logp - ref_logp.detach(), value_clamp)


@kl_estimator("k2", options=(VALUE_CLAMP,))
def kl_k2(
    logp: torch.Tensor, ref_logp: torch.Tensor, old_logp: torch.Tensor | None = None, *,
    value_clamp: float | None = None,
) -> torch.Tensor:
    """k2 = 0.5 (log pi_theta - log pi_ref)^2 (Schulman 2020), clamped to +-value_clamp if given."""
    return _clamp_value(0.5 * (logp - ref_logp.detach()) ** 2, value_clamp)


@kl_estimator("abs", options=(VALUE_CLAMP,))
def kl_abs(
    logp: torch.Tensor, ref_logp: torch.Tensor, old_logp: torch.Tensor | None = None, *,
    value_clamp: float | None = None,
) -> torch.Tensor:
    """abs = |log pi_theta - log pi_ref| (verl's "abs"), clamped to +-value_clamp if given."""
    return _clamp_value(torch.abs(logp - ref_logp.detach()), value_clamp)


@kl_estimator("k3", options=K3_OPTIONS)
def kl_k3(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    old_logp: torch.Tensor | None = None,
    *,
    log_ratio_clamp: float | None = 20.0,
    value_clamp: float | None = 10.0,
) -> torch.Tensor:
    """k3 = exp(d) - d - 1, d = clamp(log pi_ref - log pi_theta, +-20); result clamped to +-10.

    Both clamps follow the reference implementations: the first keeps ``exp`` finite, the
    second bounds the penalty of tokens the policy has almost abandoned (k3 grows like e^d).
    Clamped entries carry no gradient. ``None`` turns a clamp off (both None: TRL's k3).
    With a value clamp c, d is also capped at log(4(c + 1)), beyond which k3 > c anyway: the
    same values, but no overflowing ``exp`` whose inf would turn the zero gradient into NaN.
    """
    d = _clamp_log_ratio(ref_logp.detach() - logp, log_ratio_clamp)
    _check_clamp("value_clamp", value_clamp)
    if value_clamp is not None and math.isfinite(value_clamp):
        d = torch.clamp(d, max=math.log(4.0 * (value_clamp + 1.0)))
    k = torch.exp(d) - d - 1.0
    return _clamp_value(k, value_clamp)


@kl_estimator("k3_unbiased", options=(
    *K3_OPTIONS, Option("detach_weight", False, boolean(), "detach the IS weight: k3's bias again")))
def kl_k3_unbiased(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    old_logp: torch.Tensor | None = None,
    *,
    log_ratio_clamp: float | None = 20.0,
    value_clamp: float | None = 10.0,
    detach_weight: bool = False,
) -> torch.Tensor:
    """k3_unbiased = (pi_theta / pi_old) * k3 (DeepSeek-V3.2, eq. 7), for samples from pi_old.

    w = exp(clamp(log pi_theta - log pi_old, +-log_ratio_clamp)); k3 takes the same
    ``log_ratio_clamp`` and ``value_clamp`` (the product itself is not clamped). Both None:
    TRL's ``use_bias_correction_kl``, (exp(ref - logp) - (ref - logp) - 1) * exp(logp - old).

    The IS weight keeps its gradient by default: grad(w k3) = w log(pi_theta/pi_ref) grad log
    pi_theta, the importance-weighted exact KL gradient. Detaching it (``detach_weight=True``)
    would give E_old[w grad k3] = grad KL(pi_ref || pi_theta), i.e. k3's old bias again.
    """
    if old_logp is None:
        raise ValueError("KL estimator 'k3_unbiased' needs old_logp (log-probs of the sampling policy)")
    w = torch.exp(_clamp_log_ratio(logp - old_logp.detach(), log_ratio_clamp))
    if detach_weight:
        w = w.detach()
    return w * kl_k3(logp, ref_logp, log_ratio_clamp=log_ratio_clamp, value_clamp=value_clamp)


def kl_straight_through(
    value_fn: KLFn,
    grad_fn: KLFn = kl_k2,
    *,
    importance_weighted: bool = False,
    is_weight_cap: float | None = 10.0,
) -> KLFn:
    """Estimator whose forward value is ``value_fn`` and whose gradient is that of sg(w) * ``grad_fn``:
    kl = sg(v) + (g - sg(g)), g = sg(w) * grad_fn (the value is v exactly, no round-off).

    w = 1 by default: e.g. k3's unbiased, low-variance *value* (for logging and in-reward use)
    with k2's exact on-policy *gradient*. ``importance_weighted``: w = min(pi_theta / pi_old,
    is_weight_cap) (no cap if None; w = 1 when old_logp is None), which makes the gradient
    unbiased for samples from pi_old too (OpenRLHF's unbiased KL gradient, see
    ``kl_unbiased_gradient``). Options of the returned estimator go to ``value_fn``.
    """
    if importance_weighted:
        _check_clamp("is_weight_cap", is_weight_cap)

    def estimator(logp, ref_logp, old_logp=None, **options):
        v = value_fn(logp, ref_logp, old_logp, **options)
        g = grad_fn(logp, ref_logp, old_logp)
        if importance_weighted and old_logp is not None:
            w = torch.exp(logp.detach() - old_logp.detach())
            if is_weight_cap is not None:
                w = torch.clamp(w, max=is_weight_cap)
            g = w * g
        return v.detach() + (g - g.detach())

    suffix = "ug" if importance_weighted else "st"
    estimator.__name__ = f"{getattr(value_fn, '__name__', 'kl')}_{suffix}"
    estimator.__doc__ = (
        f"value of {getattr(value_fn, '__name__', 'kl')}, gradient of "
        f"{'sg(min(pi/pi_old, cap)) * ' if importance_weighted else ''}{getattr(grad_fn, '__name__', 'kl')}"
    )
    estimator.__wrapped__ = value_fn  # inspect.signature -> value_fn's options
    return estimator


def kl_unbiased_gradient(value_fn: KLFn, *, is_weight_cap: float | None = 10.0) -> KLFn:
    """OpenRLHF's unbiased KL gradient: value of ``value_fn``, gradient of
    sg(min(pi_theta / pi_old, cap)) * k2 with k2 unclamped (w = 1 without old_logp).

    On samples from pi_old, E[sg(w) grad k2] = E_theta[(log pi_theta - log pi_ref) grad log
    pi_theta] = grad KL(pi_theta || pi_ref) while the cap is inactive."""
    return kl_straight_through(value_fn, kl_k2, importance_weighted=True, is_weight_cap=is_weight_cap)


# "<name>_st" = value of <name> (taking <name>'s options), gradient of k2 (see kl_straight_through).
kl_estimator("k1_st", options=kl_k1.options)(kl_straight_through(kl_k1))
kl_estimator("k3_st", options=kl_k3.options)(kl_straight_through(kl_k3))


def kl_penalty(
    name: str,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    old_logp: torch.Tensor | None = None,
    *,
    mask: torch.Tensor | None = None,
    straight_through: bool = False,
    unbiased_gradient: bool = False,
    is_weight_cap: float | None = 10.0,
    **estimator_options,
) -> torch.Tensor:
    """Per-token KL estimate ``KL_ESTIMATORS[name](..., **estimator_options)``.

    ``straight_through``: the gradient is replaced by k2's. ``unbiased_gradient``: by that of
    sg(min(pi/pi_old, is_weight_cap)) * k2 (OpenRLHF; w = 1 without old_logp). The value stays
    the estimator's either way. With ``mask`` the inputs are checked for NaN/inf at valid tokens
    and padded positions of the result are 0. An option the estimator does not take (e.g.
    ``log_ratio_clamp`` for k1) raises a ValueError.
    """
    fn = lookup(KL_ESTIMATORS, name, "KL estimator")
    accepted = {option.name: option for option in fn.options}
    given = {**estimator_options, "is_weight_cap": is_weight_cap}
    for option, value in given.items():
        if option not in accepted and option not in GRADIENT_OPTIONS:
            valid = ", ".join(sorted(accepted)) or "none"
            raise ValueError(f"KL estimator {name!r} takes no option {option!r}; its options: {valid}")
        declared_as = accepted.get(option) or GRADIENT_OPTIONS[option]
        if not declared_as.spec.accepts(value):
            raise ValueError(f"{option}={value!r} is not valid for KL estimator {name!r}: "
                             f"expected {declared_as.expected}")
    if straight_through and unbiased_gradient:
        raise ValueError("straight_through and unbiased_gradient are exclusive (both replace the gradient)")
    check_shape("ref_logp", ref_logp, logp.shape, "logp")
    if old_logp is not None:
        check_shape("old_logp", old_logp, logp.shape, "logp")
    if mask is not None:
        check_shape("mask", mask, logp.shape, "logp")
        check_finite("logp", logp, mask)
        check_finite("ref_logp", ref_logp, mask)
        if old_logp is not None:
            check_finite("old_logp", old_logp, mask)
        # Garbage in padding must not reach logp.grad (0 * d/dx of NaN is NaN): zero it first.
        logp, ref_logp = zero_padding(logp, mask), zero_padding(ref_logp, mask)
        if old_logp is not None:
            old_logp = zero_padding(old_logp, mask)
    if straight_through and not name.endswith("_st"):
        fn = kl_straight_through(fn)
    if unbiased_gradient:
        fn = kl_unbiased_gradient(fn, is_weight_cap=is_weight_cap)
    kl = fn(logp, ref_logp, old_logp, **estimator_options)
    if mask is not None:
        kl = torch.where(valid_mask(mask), kl, torch.zeros_like(kl))
    return kl


def apply_kl_in_reward(
    token_rewards: torch.Tensor, kl: torch.Tensor, beta: float, mask: torch.Tensor
) -> torch.Tensor:
    """KL-in-reward placement: r_t <- r_t - beta * sg(k_t) at valid tokens (padding untouched).

    The KL becomes part of the return, so it is detached: rewards are constants to the
    policy gradient. (KL-as-loss placement is ``aggregate_loss(beta * kl, mask, mode)``.)
    """
    check_shape("kl", kl, token_rewards.shape, "token_rewards")
    check_shape("mask", mask, token_rewards.shape, "token_rewards")
    check_finite("token_rewards", token_rewards, mask)
    check_finite("kl", kl, mask)
    shaped = token_rewards - beta * kl.detach().to(token_rewards.dtype)
    return torch.where(valid_mask(mask), shaped, token_rewards)


def _as_float(name: str, x) -> float:
    value = float(x.detach().float().mean()) if torch.is_tensor(x) else float(x)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


class FixedKLController:
    """Constant KL coefficient beta."""

    def __init__(self, beta: float):
        self.value = _as_float("beta", beta)

    def update(self, current_kl=None, n_steps: int = 1) -> float:
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller (Ziegler et al. 2019):
    beta <- beta * (1 + clip(KL / KL_target - 1, -0.2, 0.2) * n_steps / horizon)."""

    def __init__(self, init_beta: float, target_kl: float, horizon: float):
        if not target_kl > 0 or not horizon > 0:
            raise ValueError(f"target_kl and horizon must be > 0, got {target_kl}, {horizon}")
        self.value = _as_float("init_beta", init_beta)
        self.target_kl = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl, n_steps: int = 1) -> float:
        kl = _as_float("current_kl", current_kl)
        error = min(max(kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict:
        # Saved in checkpoints so a resumed run continues with the same beta.
        return {"value": self.value, "target_kl": self.target_kl, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
        self.target_kl = float(state["target_kl"])
        self.horizon = float(state["horizon"])


KL_CONTROLLERS = {"fixed": FixedKLController, "adaptive": AdaptiveKLController}


def build_kl_controller(kind: str, **kwargs):
    """``KL_CONTROLLERS[kind](**kwargs)``: fixed(beta) or adaptive(init_beta, target_kl, horizon)."""
    return lookup(KL_CONTROLLERS, kind, "KL controller")(**kwargs)
