import math

import pytest
import torch

from posttrain.core import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    aggregate_loss,
    apply_kl_in_reward,
    build_kl_controller,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_k3_unbiased,
    kl_penalty,
    kl_straight_through,
)
from posttrain.core.kl import kl_abs, kl_unbiased_gradient

D = torch.float64
LOGP = torch.tensor([[math.log(0.5), math.log(0.2)]], dtype=torch.float64)
REF = torch.tensor([[math.log(0.25), math.log(0.4)]], dtype=torch.float64)


def test_hand_values():
    # d = log ref - log pi = [-ln 2, ln 2]
    d = torch.tensor([-math.log(2), math.log(2)], dtype=torch.float64)
    torch.testing.assert_close(kl_k1(LOGP, REF)[0], -d)
    torch.testing.assert_close(kl_k2(LOGP, REF)[0], 0.5 * d**2)
    torch.testing.assert_close(kl_k3(LOGP, REF)[0], torch.tensor([0.5 + math.log(2) - 1, 2 - math.log(2) - 1], dtype=torch.float64))
    old = torch.tensor([[math.log(0.25), math.log(0.4)]], dtype=torch.float64)  # w = [2, 0.5]
    torch.testing.assert_close(kl_k3_unbiased(LOGP, REF, old)[0], torch.tensor([2.0, 0.5], dtype=torch.float64) * kl_k3(LOGP, REF)[0])


def test_k3_is_clamped():
    logp = torch.tensor([[-40.0, -1.0]])
    ref = torch.tensor([[-1.0, -40.0]])
    k = kl_k3(logp, ref)
    assert k[0, 0].item() == 10.0  # exp(20) - 21 clamped to 10
    assert k[0, 1].item() == 10.0  # e^-20 + 20 - 1 = 19 clamped to 10
    assert torch.isfinite(k).all()


def _random_categorical(seed, n=12):
    g = torch.Generator().manual_seed(seed)
    # Moderate spread keeps every ref/pi ratio below ~12, where k3's +-10 value clamp is inactive
    # (the clamp is a deliberate, documented bias for extreme tokens).
    return torch.softmax(torch.randn(n, generator=g, dtype=torch.float64) * 0.8, -1)


def _exact_kl(p, q):
    return (p * (p.log() - q.log())).sum()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_k1_k3_unbiased_monte_carlo(seed):
    """E_{x~pi}[k1] = E[k3] = KL(pi||ref): MC mean within 5 standard errors (N = 200k)."""
    pi, ref = _random_categorical(seed), _random_categorical(seed + 100)
    kl = _exact_kl(pi, ref).item()
    assert kl_k3(pi.log(), ref.log()).max() < 10  # clamp inactive
    g = torch.Generator().manual_seed(seed + 7)
    x = torch.multinomial(pi, 200_000, replacement=True, generator=g)
    logp, ref_logp = pi.log()[x], ref.log()[x]
    for name in ("k1", "k3"):
        samples = KL_ESTIMATORS[name](logp, ref_logp)
        se = samples.std().item() / math.sqrt(samples.numel())
        assert abs(samples.mean().item() - kl) < 5 * se + 1e-12, name
    # k2 is biased: its exact expectation differs from KL on these distributions
    exact_k2 = (pi * kl_k2(pi.log(), ref.log())).sum().item()
    assert abs(exact_k2 - kl) > 1e-3


@pytest.mark.parametrize("seed", [0, 1])
def test_k3_unbiased_off_policy_monte_carlo(seed):
    """E_{x~pi_old}[(pi/pi_old) k3] = KL(pi||ref) although samples come from pi_old."""
    pi, ref, old = _random_categorical(seed), _random_categorical(seed + 100), _random_categorical(seed + 200)
    kl = _exact_kl(pi, ref).item()
    g = torch.Generator().manual_seed(seed + 11)
    x = torch.multinomial(old, 200_000, replacement=True, generator=g)
    samples = kl_k3_unbiased(pi.log()[x], ref.log()[x], old.log()[x])
    se = samples.std().item() / math.sqrt(samples.numel())
    assert abs(samples.mean().item() - kl) < 5 * se
    # plain k3 on pi_old samples estimates something else (the bias the IS weight removes)
    exact_plain = (old * kl_k3(pi.log(), ref.log())).sum().item()
    assert abs(exact_plain - kl) > 20 * se


def _exact_expected_grad(estimator, theta, ref, sample_probs=None, old=None):
    """grad_theta of sum_x sg(q(x)) k(x): the expected gradient of the estimator used as a loss."""
    logp = torch.log_softmax(theta, -1)
    q = logp.exp().detach() if sample_probs is None else sample_probs
    args = (logp, ref.log()) if old is None else (logp, ref.log(), old.log())
    (g,) = torch.autograd.grad((q * estimator(*args)).sum(), theta)
    return g


def _true_kl_grad(theta, ref):
    logp = torch.log_softmax(theta, -1)
    (g,) = torch.autograd.grad(_exact_kl(logp.exp(), ref), theta)
    return g


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_k2_gradient_equals_exact_kl_gradient(seed):
    theta = 0.8 * torch.randn(9, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)).requires_grad_(True)
    ref = _random_categorical(seed + 50, 9)
    torch.testing.assert_close(_exact_expected_grad(kl_k2, theta, ref), _true_kl_grad(theta, ref))
    # k3 as a loss is biased: its expected gradient is that of KL(ref || pi) instead
    g3 = _exact_expected_grad(kl_k3, theta, ref)
    assert not torch.allclose(g3, _true_kl_grad(theta, ref), atol=1e-4)
    logp = torch.log_softmax(theta, -1)
    (g_fwd,) = torch.autograd.grad(_exact_kl(ref, logp.exp()), theta)
    torch.testing.assert_close(g3, g_fwd)
    # k1 as a loss has zero expected gradient
    torch.testing.assert_close(_exact_expected_grad(kl_k1, theta, ref), torch.zeros_like(theta))


@pytest.mark.parametrize("seed", [0, 1])
def test_k3_unbiased_gradient_is_exact_off_policy(seed):
    theta = 0.8 * torch.randn(7, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)).requires_grad_(True)
    ref, old = _random_categorical(seed + 5, 7), _random_categorical(seed + 9, 7)
    g = _exact_expected_grad(kl_k3_unbiased, theta, ref, sample_probs=old, old=old)
    torch.testing.assert_close(g, _true_kl_grad(theta, ref))
    detached = lambda a, b, c: kl_k3_unbiased(a, b, c, detach_weight=True)  # noqa: E731
    g_det = _exact_expected_grad(detached, theta, ref, sample_probs=old, old=old)
    assert not torch.allclose(g_det, _true_kl_grad(theta, ref), atol=1e-4)


def test_straight_through_value_of_one_gradient_of_k2():
    logp = LOGP.clone().requires_grad_(True)
    for name, value_fn in (("k1_st", kl_k1), ("k3_st", kl_k3)):
        out = KL_ESTIMATORS[name](logp, REF)
        torch.testing.assert_close(out, value_fn(LOGP, REF))
        (g,) = torch.autograd.grad(out.sum(), logp)
        (g2,) = torch.autograd.grad(kl_k2(logp, REF).sum(), logp)
        torch.testing.assert_close(g, g2)
    out = kl_penalty("k3", logp, REF, straight_through=True)
    torch.testing.assert_close(out, kl_k3(LOGP, REF))
    (g,) = torch.autograd.grad(out.sum(), logp)
    torch.testing.assert_close(g, (LOGP - REF)[0].unsqueeze(0))
    custom = kl_straight_through(kl_k1, kl_k3)
    torch.testing.assert_close(custom(LOGP, REF), kl_k1(LOGP, REF))


def test_kl_penalty_registry_and_errors():
    assert set(KL_ESTIMATORS) >= {"k1", "k2", "k3", "k3_unbiased"}
    with pytest.raises(ValueError, match=r"unknown KL estimator 'k4'.*k1, k1_st, k2"):
        kl_penalty("k4", LOGP, REF)
    with pytest.raises(ValueError, match="old_logp"):
        kl_penalty("k3_unbiased", LOGP, REF)
    bad = REF.clone()
    bad[0, 1] = float("nan")
    mask = torch.tensor([[1, 1]])
    with pytest.raises(ValueError, match="ref_logp"):
        kl_penalty("k3", LOGP, bad, mask=mask)
    # NaN only in padding: fine, and the padded output is 0
    out = kl_penalty("k3", LOGP, bad, mask=torch.tensor([[1, 0]]))
    assert out[0, 1] == 0 and torch.isfinite(out).all()


def test_kl_in_reward_placement():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]], dtype=torch.float64)
    kl = torch.tensor([[0.1, 0.2, 0.3, 9.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0]])
    shaped = apply_kl_in_reward(rewards, kl, 0.5, mask)
    torch.testing.assert_close(shaped, torch.tensor([[-0.05, -0.1, 0.85, 0.0]], dtype=torch.float64))
    assert not shaped.requires_grad  # rewards are constants to the policy gradient


def test_kl_as_loss_placement():
    logp = LOGP.clone().requires_grad_(True)
    mask = torch.ones(1, 2)
    loss = aggregate_loss(0.1 * kl_penalty("k2", logp, REF), mask, "token-mean")
    loss.backward()
    torch.testing.assert_close(logp.grad, 0.1 * (LOGP - REF) / 2)


def test_fixed_and_adaptive_controllers():
    fixed = FixedKLController(0.05)
    assert fixed.update(123.0, 10) == 0.05 and fixed.value == 0.05
    ctl = AdaptiveKLController(init_beta=0.1, target_kl=6.0, horizon=10_000)
    ctl.update(12.0, n_steps=100)  # error 1.0 clipped to 0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 100 / 10_000))
    ctl2 = AdaptiveKLController(0.1, 6.0, 10_000)
    ctl2.update(torch.tensor(6.6), n_steps=100)  # error 0.1, not clipped
    assert ctl2.value == pytest.approx(0.1 * (1 + 0.1 * 0.01))
    ctl3 = AdaptiveKLController(0.1, 6.0, 10_000)
    ctl3.update(0.0, n_steps=100)  # error -1 clipped to -0.2
    assert ctl3.value == pytest.approx(0.1 * (1 - 0.2 * 0.01))
    restored = build_kl_controller("adaptive", init_beta=1.0, target_kl=1.0, horizon=1.0)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value
    with pytest.raises(ValueError, match="current_kl"):
        ctl.update(float("nan"), 1)
    with pytest.raises(ValueError, match="unknown KL controller"):
        build_kl_controller("pid", beta=1.0)


def _per_sample_grads(estimator, theta, ref, old=None):
    """[n, n]: row x is grad_theta of the estimator at category x (the gradient of one sample)."""
    logp = torch.log_softmax(theta, -1)
    k = estimator(logp, ref.log()) if old is None else estimator(logp, ref.log(), old.log())
    return torch.stack([torch.autograd.grad(k[x], theta, retain_graph=True)[0] for x in range(k.numel())])


def _mc_mean_and_se(per_sample, probs, n, seed):
    """Monte-Carlo mean over n draws from ``probs`` of the per-sample rows, and its standard error."""
    x = torch.multinomial(probs, n, replacement=True, generator=torch.Generator().manual_seed(seed))
    freq = torch.bincount(x, minlength=probs.numel()).to(per_sample.dtype) / n
    mean = freq @ per_sample
    var = freq @ per_sample**2 - mean**2
    return mean, (var / n).sqrt()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_k3_unbiased_gradient_monte_carlo(seed):
    """E_{x~pi_old}[grad (pi/pi_old) k3] = grad KL(pi_theta||pi_ref): Monte-Carlo (N = 200k) mean of
    per-sample gradients within 5 standard errors per component; the unweighted k3 gradient on the
    same samples misses it by far more."""
    theta = 0.8 * torch.randn(7, dtype=D, generator=torch.Generator().manual_seed(seed)).requires_grad_(True)
    ref, old = _random_categorical(seed + 5, 7), _random_categorical(seed + 9, 7)
    true = _true_kl_grad(theta, ref)
    per = _per_sample_grads(kl_k3_unbiased, theta, ref, old)
    mean, se = _mc_mean_and_se(per, old, 200_000, seed + 3)
    assert ((mean - true).abs() <= 5 * se + 1e-12).all(), (mean, true, se)
    plain_mean, plain_se = _mc_mean_and_se(_per_sample_grads(kl_k3, theta, ref), old, 200_000, seed + 3)
    assert ((plain_mean - true).abs() > 20 * plain_se).any()


@pytest.mark.parametrize("seed", [0, 1])
def test_k2_gradient_monte_carlo_on_policy(seed):
    """On samples from pi_theta itself, the mean k2 gradient estimates grad KL(pi_theta||pi_ref)."""
    theta = 0.8 * torch.randn(9, dtype=D, generator=torch.Generator().manual_seed(seed)).requires_grad_(True)
    ref = _random_categorical(seed + 50, 9)
    pi = torch.softmax(theta, -1).detach()
    mean, se = _mc_mean_and_se(_per_sample_grads(kl_k2, theta, ref), pi, 200_000, seed + 13)
    assert ((mean - _true_kl_grad(theta, ref)).abs() <= 5 * se + 1e-12).all()


# --- peer conventions: abs, value clamps, unclamped k3, unbiased gradient ----------------------


def _t(*rows):
    return torch.tensor([list(rows)], dtype=D)


def test_abs_hand_values():
    # log pi - log ref = [ln 2, -ln 2]
    torch.testing.assert_close(kl_abs(LOGP, REF), _t(math.log(2), math.log(2)))
    assert KL_ESTIMATORS["abs"] is kl_abs
    torch.testing.assert_close(kl_penalty("abs", LOGP, REF), _t(math.log(2), math.log(2)))
    logp = LOGP.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(kl_abs(logp, REF).sum(), logp)
    torch.testing.assert_close(g, _t(1.0, -1.0))  # sign(log pi - log ref)


def test_value_clamp_k1_k2_abs():
    logp, ref = _t(3.0, -4.0, 0.25), _t(0.0, 0.0, 0.0)  # log-ratio [3, -4, 0.25]
    # None (the default): no clamp at all
    torch.testing.assert_close(kl_k1(logp, ref), _t(3.0, -4.0, 0.25))
    torch.testing.assert_close(kl_k2(logp, ref), _t(4.5, 8.0, 0.03125))
    torch.testing.assert_close(kl_abs(logp, ref), _t(3.0, 4.0, 0.25))
    torch.testing.assert_close(kl_k1(100 * logp, ref, value_clamp=None), _t(300.0, -400.0, 25.0))
    # a number clamps to [-c, c]; values inside stay exact
    torch.testing.assert_close(kl_k1(logp, ref, value_clamp=2.0), _t(2.0, -2.0, 0.25))
    torch.testing.assert_close(kl_k2(logp, ref, value_clamp=5.0), _t(4.5, 5.0, 0.03125))
    torch.testing.assert_close(kl_abs(logp, ref, value_clamp=3.5), _t(3.0, 3.5, 0.25))
    # OpenRLHF: +-10 on every estimator
    torch.testing.assert_close(kl_k2(logp, ref, value_clamp=10.0), _t(4.5, 8.0, 0.03125))
    torch.testing.assert_close(kl_k1(5 * logp, ref, value_clamp=10.0), _t(10.0, -10.0, 1.25))
    # clamped entries carry no gradient
    x = logp.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(kl_k1(x, ref, value_clamp=2.0).sum(), x)
    torch.testing.assert_close(g, _t(0.0, 0.0, 1.0))
    for fn in (kl_k1, kl_k2, kl_abs, kl_k3, kl_k3_unbiased):
        for bad in (0.0, -1.0, float("nan")):
            with pytest.raises(ValueError, match="value_clamp"):
                fn(logp, ref, ref, value_clamp=bad)


def test_k3_clamp_settings():
    # d = log ref - log pi
    logp, ref = _t(-25.0, -1.0, -30.0), _t(0.0, 0.0, 0.0)  # d = [25, 1, 30]
    e = math.e
    # defaults (ours, verl): d clamped to 20, value to 10
    torch.testing.assert_close(kl_k3(logp, ref), _t(10.0, e - 2, 10.0))
    # both None (TRL): no clamp at all, exp(25) - 26 in float64
    k = kl_k3(logp, ref, log_ratio_clamp=None, value_clamp=None)
    torch.testing.assert_close(k, _t(math.exp(25) - 26, e - 2, math.exp(30) - 31), rtol=1e-15, atol=0)
    # value clamp only (OpenRLHF)
    torch.testing.assert_close(kl_k3(logp, ref, log_ratio_clamp=None, value_clamp=10.0), _t(10.0, e - 2, 10.0))
    # log-ratio clamp only: exp(20) - 21
    torch.testing.assert_close(kl_k3(logp, ref, value_clamp=None), _t(math.exp(20) - 21, e - 2, math.exp(20) - 21))
    torch.testing.assert_close(kl_k3(logp, ref, log_ratio_clamp=0.5, value_clamp=None), _t(*[math.exp(0.5) - 1.5] * 3))
    # negative d: k3 ~ -d - 1
    neg = kl_k3(_t(0.0), _t(-30.0), log_ratio_clamp=None, value_clamp=None)
    torch.testing.assert_close(neg, _t(math.exp(-30) + 29))
    assert kl_k3(_t(0.0), _t(-30.0), log_ratio_clamp=None).item() == 10.0
    with pytest.raises(ValueError, match="log_ratio_clamp"):
        kl_k3(logp, ref, log_ratio_clamp=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_k3_value_clamp_without_log_ratio_clamp_has_finite_gradient(dtype):
    """d = 1000 overflows exp; with a value clamp the result is c and the gradient 0, not NaN."""
    logp = torch.tensor([[-1000.0, -0.5]], dtype=dtype, requires_grad=True)
    ref = torch.zeros(1, 2, dtype=dtype)
    k = kl_k3(logp, ref, log_ratio_clamp=None, value_clamp=10.0)
    assert k[0, 0].item() == 10.0
    (g,) = torch.autograd.grad(k.sum(), logp)
    assert g[0, 0].item() == 0.0
    torch.testing.assert_close(g[0, 1], torch.tensor(1.0 - math.exp(0.5), dtype=dtype))


def test_k3_unbiased_clamp_settings():
    logp, ref, old = _t(-25.0, -1.0), _t(0.0, 0.0), _t(-27.0, -1.5)  # d = [25, 1], log w = [2, 0.5]
    e = math.e
    torch.testing.assert_close(kl_k3_unbiased(logp, ref, old), _t(math.exp(2) * 10, math.exp(0.5) * (e - 2)))
    both_none = kl_k3_unbiased(logp, ref, old, log_ratio_clamp=None, value_clamp=None)
    torch.testing.assert_close(both_none, _t(math.exp(2) * (math.exp(25) - 26), math.exp(0.5) * (e - 2)), rtol=1e-15, atol=0)
    # log_ratio_clamp bounds both the weight and d
    small = kl_k3_unbiased(logp, ref, old, log_ratio_clamp=1.0, value_clamp=None)
    torch.testing.assert_close(small, _t(e * (e - 2), math.exp(0.5) * (e - 2)))
    # value_clamp bounds k3 (not the product)
    torch.testing.assert_close(
        kl_k3_unbiased(logp, ref, old, value_clamp=0.5), _t(math.exp(2) * 0.5, math.exp(0.5) * 0.5)
    )


def test_k3_unbiased_unclamped_is_trl_bias_correction_kl():
    """Both clamps None: (exp(ref - logp) - (ref - logp) - 1) * exp(logp - old), weight not detached."""
    gen = torch.Generator().manual_seed(3)
    logp0 = -torch.rand(4, 9, dtype=D, generator=gen) * 6
    ref, old = -torch.rand(4, 9, dtype=D, generator=gen) * 6, -torch.rand(4, 9, dtype=D, generator=gen) * 6
    a = logp0.clone().requires_grad_(True)
    b = logp0.clone().requires_grad_(True)
    ours = kl_k3_unbiased(a, ref, old, log_ratio_clamp=None, value_clamp=None)
    trl = (torch.exp(ref - b) - (ref - b) - 1) * torch.exp(b - old)
    torch.testing.assert_close(ours, trl, rtol=1e-15, atol=0)
    (ga,) = torch.autograd.grad(ours.sum(), a)
    (gb,) = torch.autograd.grad(trl.sum(), b)
    torch.testing.assert_close(ga, gb, rtol=1e-14, atol=0)
    via_penalty = kl_penalty("k3_unbiased", logp0, ref, old, log_ratio_clamp=None, value_clamp=None)
    torch.testing.assert_close(via_penalty, trl.detach(), rtol=1e-15, atol=0)


@pytest.mark.parametrize("name", ["k1", "k2", "k3", "abs"])
def test_unbiased_gradient_value_and_gradient(name):
    # log pi - log ref = [ln 2, -ln 2, 1.5]; log pi - log old = [0.3, -1.0, 3.0] (w = e^3 > 10: capped)
    logp0 = torch.tensor([[math.log(0.5), math.log(0.2), -0.5]], dtype=D)
    ref = torch.tensor([[math.log(0.25), math.log(0.4), -2.0]], dtype=D)
    old = logp0 - torch.tensor([[0.3, -1.0, 3.0]], dtype=D)
    logp = logp0.clone().requires_grad_(True)
    out = kl_penalty(name, logp, ref, old, unbiased_gradient=True)
    assert torch.equal(out, KL_ESTIMATORS[name](logp0, ref))  # the value is the estimator's, exactly
    (g,) = torch.autograd.grad(out.sum(), logp)
    w = torch.tensor([[math.exp(0.3), math.exp(-1.0), 10.0]], dtype=D)  # min(pi/pi_old, 10)
    torch.testing.assert_close(g, w * (logp0 - ref), rtol=1e-15, atol=0)
    # another cap; and no cap
    out = kl_penalty(name, logp, ref, old, unbiased_gradient=True, is_weight_cap=1.0)
    (g,) = torch.autograd.grad(out.sum(), logp)
    torch.testing.assert_close(g, torch.tensor([[1.0, math.exp(-1.0), 1.0]], dtype=D) * (logp0 - ref))
    out = kl_penalty(name, logp, ref, old, unbiased_gradient=True, is_weight_cap=None)
    (g,) = torch.autograd.grad(out.sum(), logp)
    torch.testing.assert_close(g, torch.exp(logp0 - old) * (logp0 - ref))
    # without old_logp: w = 1, i.e. the straight-through gradient of k2
    out = kl_penalty(name, logp, ref, unbiased_gradient=True)
    assert torch.equal(out, KL_ESTIMATORS[name](logp0, ref))
    (g,) = torch.autograd.grad(out.sum(), logp)
    torch.testing.assert_close(g, logp0 - ref)


def test_unbiased_gradient_keeps_the_estimator_options():
    logp0, ref, old = _t(-30.0, -0.5), _t(0.0, -1.0), _t(-30.5, -0.5)
    logp = logp0.clone().requires_grad_(True)
    out = kl_penalty("k3", logp, ref, old, unbiased_gradient=True, log_ratio_clamp=None, value_clamp=None)
    torch.testing.assert_close(out, kl_k3(logp0, ref, log_ratio_clamp=None, value_clamp=None), rtol=0, atol=0)
    assert out[0, 0].item() == pytest.approx(math.exp(30) - 31)
    (g,) = torch.autograd.grad(out.sum(), logp)
    torch.testing.assert_close(g, _t(math.exp(0.5) * -30.0, 0.5))  # k2 itself is never clamped
    out = kl_penalty("k1", logp, ref, old, unbiased_gradient=True, value_clamp=10.0)
    torch.testing.assert_close(out, _t(-10.0, 0.5))
    ug = kl_unbiased_gradient(kl_k3, is_weight_cap=10.0)
    torch.testing.assert_close(ug(logp, ref, old, value_clamp=2.0), kl_k3(logp0, ref, value_clamp=2.0))
    with pytest.raises(ValueError, match="is_weight_cap"):
        kl_penalty("k1", logp, ref, old, unbiased_gradient=True, is_weight_cap=0.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_unbiased_gradient_monte_carlo_off_policy(seed):
    """E_{x~pi_old}[grad sg(pi/pi_old) k2] = grad KL(pi_theta||pi_ref) (cap inactive): Monte-Carlo
    (N = 200k) mean of per-sample gradients w.r.t. the logits within 5 standard errors; the
    unweighted (straight-through) k2 gradient on the same samples misses it by far more."""
    theta = 0.8 * torch.randn(7, dtype=D, generator=torch.Generator().manual_seed(seed)).requires_grad_(True)
    ref, old = _random_categorical(seed + 5, 7), _random_categorical(seed + 9, 7)
    true = _true_kl_grad(theta, ref)
    estimator = kl_unbiased_gradient(kl_k3, is_weight_cap=1e6)
    assert (torch.softmax(theta, -1) / old).max() < 1e6
    mean, se = _mc_mean_and_se(_per_sample_grads(estimator, theta, ref, old), old, 200_000, seed + 17)
    assert ((mean - true).abs() <= 5 * se + 1e-12).all(), (mean, true, se)
    plain = KL_ESTIMATORS["k3_st"]
    plain_mean, plain_se = _mc_mean_and_se(_per_sample_grads(plain, theta, ref, old), old, 200_000, seed + 17)
    assert ((plain_mean - true).abs() > 20 * plain_se).any()


def test_straight_through_value_is_exact_and_takes_value_options():
    gen = torch.Generator().manual_seed(8)
    logp, ref = -torch.rand(3, 5, dtype=D, generator=gen) * 9, -torch.rand(3, 5, dtype=D, generator=gen) * 9
    assert torch.equal(KL_ESTIMATORS["k3_st"](logp, ref), kl_k3(logp, ref))
    assert torch.equal(kl_penalty("k1", logp, ref, straight_through=True), kl_k1(logp, ref))
    opts = {"log_ratio_clamp": None, "value_clamp": None}
    assert torch.equal(kl_penalty("k3_st", logp, ref, **opts), kl_k3(logp, ref, **opts))
    assert torch.equal(kl_penalty("k3", logp, ref, straight_through=True, **opts), kl_k3(logp, ref, **opts))
    assert torch.equal(kl_penalty("k1_st", logp, ref, value_clamp=0.5), kl_k1(logp, ref, value_clamp=0.5))
    # old_logp given: straight-through does not weight (w = 1)
    x = logp.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(kl_penalty("k3_st", x, ref, ref - 2.0).sum(), x)
    torch.testing.assert_close(g, logp - ref)


def test_kl_penalty_routes_options_and_rejects_foreign_ones():
    logp, ref, old = _t(3.0, -0.5), _t(0.0, 0.0), _t(2.0, -0.5)
    torch.testing.assert_close(kl_penalty("k1", logp, ref, value_clamp=1.0), _t(1.0, -0.5))
    torch.testing.assert_close(kl_penalty("k2", logp, ref, value_clamp=1.0), _t(1.0, 0.125))
    torch.testing.assert_close(kl_penalty("abs", logp, ref, value_clamp=1.0), _t(1.0, 0.5))
    torch.testing.assert_close(
        kl_penalty("k3", logp, ref, log_ratio_clamp=1.0, value_clamp=None), kl_k3(logp, ref, log_ratio_clamp=1.0, value_clamp=None)
    )
    x = logp.clone().requires_grad_(True)
    (g_det,) = torch.autograd.grad(kl_penalty("k3_unbiased", x, ref, old, detach_weight=True).sum(), x)
    (g,) = torch.autograd.grad(kl_penalty("k3_unbiased", x, ref, old).sum(), x)
    torch.testing.assert_close(g_det, torch.exp(logp - old) * (1 - torch.exp(ref - logp)))
    assert not torch.allclose(g, g_det)
    for name, option in (("k1", "log_ratio_clamp"), ("k2", "detach_weight"), ("abs", "log_ratio_clamp"),
                         ("k3", "detach_weight"), ("k1_st", "log_ratio_clamp"), ("k3", "value_clip")):
        with pytest.raises(ValueError, match=rf"KL estimator '{name}' takes no option '{option}'"):
            kl_penalty(name, logp, ref, old, **{option: 1.0})
    with pytest.raises(ValueError, match="straight_through and unbiased_gradient"):
        kl_penalty("k3", logp, ref, old, straight_through=True, unbiased_gradient=True)
    with pytest.raises(ValueError, match="value_clamp"):
        kl_penalty("k2", logp, ref, value_clamp=-1.0)
    # masked: options still apply, padding is 0
    out = kl_penalty("k1", logp, ref, mask=torch.tensor([[1, 0]]), value_clamp=1.0, unbiased_gradient=True)
    torch.testing.assert_close(out, _t(1.0, 0.0))
