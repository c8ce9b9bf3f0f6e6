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
  k3_unbiased = w * k3         DeepSeek-V3.2 eq. 7 for samples drawn from pi_old, with
                               w = pi_theta / pi_old; the weight carries gradient, which is what
                               makes E_old[grad(w k3)] = grad KL(pi_theta || pi_ref) exactly

``ref_logp`` and ``old_logp`` are constants: they are detached here, so gradient only ever
flows through ``logp``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .checks import check_finite, check_shape, lookup, valid_mask
from .masked import zero_padding

KLFn = Callable[..., torch.Tensor]


def clamped_log_ratio(logp: torch.Tensor, other_logp: torch.Tensor, clamp: float = 20.0) -> torch.Tensor:
    """clamp(log pi - log pi_other, -c, c): bounded before any ``exp`` so e^x never overflows."""
    if clamp is None or clamp <= 0:
        raise ValueError(f"log_ratio_clamp must be a positive number, got {clamp!r}")
    return torch.clamp(logp - other_logp.detach(), -clamp, clamp)


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor, old_logp: torch.Tensor | None = None) -> torch.Tensor:
    """k1 = log pi_theta - log pi_ref (Schulman 2020)."""
    return logp - ref_logp.detach()


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor, old_logp: torch.Tensor | None = None) -> torch.Tensor:
    """k2 = 0.5 (log pi_theta - log pi_ref)^2 (Schulman 2020)."""
    return 0.5 * (logp - ref_logp.detach()) ** 2


def kl_k3(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    old_logp: torch.Tensor | None = None,
    *,
    log_ratio_clamp: float = 20.0,
    value_clamp: float = 10.0,
) -> torch.Tensor:
    """k3 = exp(d) - d - 1, d = clamp(log pi_ref - log pi_theta, +-20); result clamped to +-10.

    Both clamps follow the reference implementations: the first keeps ``exp`` finite, the
    second bounds the penalty of tokens the policy has almost abandoned (k3 grows like e^d).
    Clamped entries carry no gradient.
    """
    if log_ratio_clamp is None or log_ratio_clamp <= 0:
        raise ValueError(f"log_ratio_clamp must be a positive number, got {log_ratio_clamp!r}")
    d = torch.clamp(ref_logp.detach() - logp, -log_ratio_clamp, log_ratio_clamp)
    k = torch.exp(d) - d - 1.0
    return torch.clamp(k, -value_clamp, value_clamp)


def kl_k3_unbiased(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    old_logp: torch.Tensor | None = None,
    *,
    log_ratio_clamp: float = 20.0,
    detach_weight: bool = False,
) -> torch.Tensor:
    """k3_unbiased = (pi_theta / pi_old) * k3 (DeepSeek-V3.2, eq. 7), for samples from pi_old.

    The IS weight keeps its gradient by default: grad(w k3) = w log(pi_theta/pi_ref) grad log
    pi_theta, the importance-weighted exact KL gradient. Detaching it (``detach_weight=True``)
    would give E_old[w grad k3] = grad KL(pi_ref || pi_theta), i.e. k3's old bias again.
    """
    if old_logp is None:
        raise ValueError("KL estimator 'k3_unbiased' needs old_logp (log-probs of the sampling policy)")
    w = torch.exp(clamped_log_ratio(logp, old_logp, log_ratio_clamp))
    if detach_weight:
        w = w.detach()
    return w * kl_k3(logp, ref_logp, log_ratio_clamp=log_ratio_clamp)


def kl_straight_through(value_fn: KLFn, grad_fn: KLFn = kl_k2) -> KLFn:
    """Estimator whose forward value is ``value_fn`` and whose gradient is ``grad_fn`` (k2):
    kl = g + sg(v - g). Gives e.g. k3's unbiased, low-variance *value* (for logging and
    in-reward use) with k2's exact on-policy *gradient*."""

    def straight_through(logp, ref_logp, old_logp=None):
        g = grad_fn(logp, ref_logp, old_logp)
        v = value_fn(logp, ref_logp, old_logp)
        return g + (v - g).detach()

    straight_through.__name__ = f"{getattr(value_fn, '__name__', 'kl')}_st"
    straight_through.__doc__ = f"value of {value_fn.__name__}, gradient of {grad_fn.__name__}"
    return straight_through


# One signature: fn(logp [B,T], ref_logp [B,T], old_logp [B,T] | None) -> per-token [B,T].
# "<name>_st" = value of <name>, gradient of k2 (see kl_straight_through).
# The config option "none" means no KL term at all: the algorithm skips this path (and the
# reference model), so it has no entry here.
KL_ESTIMATORS: dict[str, KLFn] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
    "k3_unbiased": kl_k3_unbiased,
    "k1_st": kl_straight_through(kl_k1),
    "k3_st": kl_straight_through(kl_k3),
}


def kl_penalty(
    name: str,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    old_logp: torch.Tensor | None = None,
    *,
    mask: torch.Tensor | None = None,
    straight_through: bool = False,
) -> torch.Tensor:
    """Per-token KL estimate ``KL_ESTIMATORS[name]``; with ``straight_through`` its gradient
    is replaced by k2's. With ``mask`` the inputs are checked for NaN/inf at valid tokens and
    padded positions of the result are 0."""
    fn = lookup(KL_ESTIMATORS, name, "KL estimator")
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
    kl = fn(logp, ref_logp, old_logp)
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
