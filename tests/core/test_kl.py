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
