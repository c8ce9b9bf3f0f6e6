import math

import pytest
import torch

from torch.autograd import gradcheck

from posttrain.core.distill import (
    DISTILL_DIVERGENCES,
    distill_divergence,
    forward_kl,
    generalized_jsd,
    kdrl_loss,
    kdrl_reward_mask,
    reverse_kl,
    reverse_kl_sampled,
)

D = torch.float64
PS = torch.log(torch.tensor([[[0.5, 0.5]]], dtype=D))
PT = torch.log(torch.tensor([[[0.25, 0.75]]], dtype=D))


def test_reverse_and_forward_kl_hand_values():
    rkl = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    fkl = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert reverse_kl(PS, PT).item() == pytest.approx(rkl)
    assert forward_kl(PS, PT).item() == pytest.approx(fkl)
    assert reverse_kl(PS, PS).item() == pytest.approx(0.0, abs=1e-15)
    # logits need not be normalised
    assert reverse_kl(PS + 3.0, PT - 1.0).item() == pytest.approx(rkl)


def test_generalized_jsd():
    p, q = torch.tensor([0.5, 0.5], dtype=D), torch.tensor([0.25, 0.75], dtype=D)
    m = 0.5 * (p + q)
    jsd = 0.5 * (q * (q / m).log()).sum() + 0.5 * (p * (p / m).log()).sum()
    assert generalized_jsd(PS, PT, 0.5).item() == pytest.approx(jsd.item())
    assert generalized_jsd(PT, PS, 0.5).item() == pytest.approx(jsd.item())  # symmetric at 0.5
    assert generalized_jsd(PS, PS, 0.3).item() == pytest.approx(0.0, abs=1e-15)
    torch.manual_seed(0)
    wide_s, wide_t = torch.randn(3, 4, 9, dtype=D) * 5, torch.randn(3, 4, 9, dtype=D) * 5
    assert (generalized_jsd(wide_s, wide_t, 0.5) <= math.log(2) + 1e-12).all()
    # limits: ~beta * forward KL near 0, ~(1 - beta) * reverse KL near 1 (O(beta) corrections)
    s, t = torch.randn(3, 4, 9, dtype=D), torch.randn(3, 4, 9, dtype=D)
    b = 1e-6
    torch.testing.assert_close(generalized_jsd(s, t, b) / b, forward_kl(s, t), rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(generalized_jsd(s, t, 1 - b) / b, reverse_kl(s, t), rtol=1e-3, atol=1e-6)
    for bad in (0.0, 1.0):
        with pytest.raises(ValueError, match="beta"):
            generalized_jsd(s, t, bad)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_banned_tokens_are_finite_with_finite_grads(temperature):
    s = torch.tensor([[[0.0, 1.0, float("-inf")]]], dtype=D, requires_grad=True)
    t = torch.tensor([[[0.5, 0.0, float("-inf")]]], dtype=D)
    for name in DISTILL_DIVERGENCES:
        out = distill_divergence(name, s, t, temperature=temperature)
        assert torch.isfinite(out).all(), name
        (g,) = torch.autograd.grad(out.sum(), s)
        assert torch.isfinite(g).all(), name
        assert g[..., 2].item() == 0.0, name
        # a banned token is the same as a token with no mass: dropping it changes nothing
        dropped = distill_divergence(name, s[..., :2], t[..., :2], temperature=temperature)
        torch.testing.assert_close(out, dropped)
    # student mass where the teacher bans a token: reverse KL is +inf at any temperature
    t_ban = torch.tensor([[[0.5, float("-inf"), 0.0]]], dtype=D)
    s_all = torch.zeros(1, 1, 3, dtype=D)
    assert reverse_kl(s_all, t_ban, temperature=temperature).item() == float("inf")
    assert math.isfinite(forward_kl(s_all, t_ban, temperature=temperature).item())
    with pytest.raises(ValueError, match="student_logits contain NaN"):
        reverse_kl(torch.full((1, 1, 2), float("nan")), t[..., :2])
    with pytest.raises(ValueError, match="teacher_logits"):
        reverse_kl(s, t[..., :2])
    with pytest.raises(ValueError, match="unknown distillation divergence"):
        distill_divergence("tvd", s, t)


def test_sampled_reverse_kl_is_unbiased_for_reverse_kl():
    torch.manual_seed(0)
    s_logits, t_logits = torch.randn(6, dtype=D), torch.randn(6, dtype=D)
    ls, lt = torch.log_softmax(s_logits, -1), torch.log_softmax(t_logits, -1)
    exact = (ls.exp() * reverse_kl_sampled(ls, lt)).sum()
    assert exact.item() == pytest.approx(reverse_kl(s_logits.view(1, 1, -1), t_logits.view(1, 1, -1)).item())


def test_kdrl_loss_k2_and_reward_masking():
    s = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]], dtype=D, requires_grad=True)
    t = torch.tensor([[-2.0, -2.0, -9.0], [-1.5, -0.5, -1.0]], dtype=D)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss, stats = kdrl_loss(s, t, mask, estimator="k2")
    k2 = [0.5, 0.0, 0.125, 0.125, 0.0]
    assert loss.item() == pytest.approx(sum(k2) / 5)
    rm = kdrl_reward_mask(torch.tensor([1.0, 0.0]))  # positive reward -> no distillation
    assert rm.tolist() == [0.0, 1.0]
    assert kdrl_reward_mask(torch.tensor([1, 0, -1])).tolist() == [0.0, 1.0, 1.0]
    loss, stats = kdrl_loss(s, t, mask, reward_mask=rm, estimator="k2")
    assert loss.item() == pytest.approx(0.25 / 5)  # counts still from the full mask
    assert stats["masked_frac"].item() == 0.5
    assert stats["kl"].item() == pytest.approx(0.25 / 3)
    loss.backward()
    assert (s.grad[0] == 0).all()
    torch.testing.assert_close(s.grad[1], (s.detach()[1] - t[1]) / 5)
    with pytest.raises(ValueError, match="teacher_logp"):
        kdrl_loss(s, torch.full_like(t, float("nan")), mask)


# Logits whose softmax at T = 2 is exact: logits / 2 = log of the probabilities (up to a constant).
S2 = torch.tensor([[[0.0, 2 * math.log(2), 2 * math.log(3)]]], dtype=D)  # T=2 -> [1, 2, 3] / 6
T2 = torch.tensor([[[0.0, 0.0, 2 * math.log(2)]]], dtype=D)  # T=2 -> [1, 1, 2] / 4


def test_temperature_hand_values_at_t2():
    ps, pt = [1 / 6, 2 / 6, 3 / 6], [1 / 4, 1 / 4, 2 / 4]
    rkl = sum(a * math.log(a / b) for a, b in zip(ps, pt))
    fkl = sum(b * math.log(b / a) for a, b in zip(ps, pt))
    beta = 0.3
    m = [beta * b + (1 - beta) * a for a, b in zip(ps, pt)]
    jsd = beta * sum(b * math.log(b / c) for b, c in zip(pt, m)) + (1 - beta) * sum(
        a * math.log(a / c) for a, c in zip(ps, m)
    )
    assert reverse_kl(S2, T2, temperature=2.0).item() == pytest.approx(rkl, rel=1e-12)
    assert forward_kl(S2, T2, temperature=2.0).item() == pytest.approx(fkl, rel=1e-12)
    assert generalized_jsd(S2, T2, beta, temperature=2.0).item() == pytest.approx(jsd, rel=1e-12)
    # no T^2 factor, and T matters: at T = 1 the same logits give other distributions
    assert reverse_kl(S2, T2).item() != pytest.approx(rkl)
    ps1 = torch.softmax(S2[0, 0], -1)
    pt1 = torch.softmax(T2[0, 0], -1)
    assert reverse_kl(S2, T2).item() == pytest.approx((ps1 * (ps1 / pt1).log()).sum().item())


def test_temperature_one_is_today_and_t_divides_the_logits():
    torch.manual_seed(0)
    s, t = torch.randn(2, 3, 7, dtype=D), torch.randn(2, 3, 7, dtype=D)
    ls, lt = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
    today = {
        "reverse_kl": (ls.exp() * (ls - lt)).sum(-1),
        "forward_kl": (lt.exp() * (lt - ls)).sum(-1),
    }
    for name, expected in today.items():
        torch.testing.assert_close(distill_divergence(name, s, t, temperature=1.0), expected, rtol=1e-12, atol=1e-14)
    for name in DISTILL_DIVERGENCES:
        base = distill_divergence(name, s, t, beta=0.3)
        assert torch.equal(distill_divergence(name, s, t, beta=0.3, temperature=1.0), base), name
        assert torch.equal(distill_divergence(name, s, t, beta=0.3, temperature=1), base), name
        # T is applied to both logits before the softmax
        torch.testing.assert_close(
            distill_divergence(name, s, t, beta=0.3, temperature=2.5),
            distill_divergence(name, s / 2.5, t / 2.5, beta=0.3), rtol=1e-12, atol=1e-14,
        )


def test_registry_passes_temperature():
    for name, fn in (("reverse_kl", reverse_kl), ("forward_kl", forward_kl)):
        torch.testing.assert_close(distill_divergence(name, S2, T2, temperature=2.0), fn(S2, T2, temperature=2.0))
        assert not torch.allclose(distill_divergence(name, S2, T2, temperature=2.0), fn(S2, T2))
        torch.testing.assert_close(DISTILL_DIVERGENCES[name](S2, T2, temperature=2.0), fn(S2, T2, temperature=2.0))
    torch.testing.assert_close(
        distill_divergence("generalized_jsd", S2, T2, beta=0.3, temperature=2.0),
        generalized_jsd(S2, T2, 0.3, temperature=2.0),
    )


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), "2", None, True, torch.tensor(2.0)])
def test_bad_temperature_raises(bad):
    for name in DISTILL_DIVERGENCES:
        with pytest.raises(ValueError, match="temperature"):
            distill_divergence(name, S2, T2, temperature=bad)
    for fn in (reverse_kl, forward_kl, generalized_jsd):
        with pytest.raises(ValueError, match="temperature"):
            fn(S2, T2, temperature=bad)


def test_temperature_with_half_logits_is_computed_in_float32():
    s, t = S2.to(torch.bfloat16), T2.to(torch.bfloat16)
    out = reverse_kl(s, t, temperature=2.0)
    assert out.dtype == torch.float32
    expected = reverse_kl(s.to(torch.float32), t.to(torch.float32), temperature=2.0)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("name", sorted(DISTILL_DIVERGENCES))
@pytest.mark.parametrize("temperature", [0.6, 2.5])
def test_gradcheck_with_temperature(name, temperature):
    torch.manual_seed(2)
    s = torch.randn(2, 3, 5, dtype=D, requires_grad=True)
    t = torch.randn(2, 3, 5, dtype=D)
    t[0, 1, 2] = float("-inf")  # a banned teacher token (forward KL / JSD stay finite there)
    if name == "reverse_kl":
        t[0, 1, 2] = 0.0
    assert gradcheck(lambda x: distill_divergence(name, x, t, beta=0.3, temperature=temperature), (s,))


def test_kdrl_loss_k3_and_reward_threshold():
    s = torch.tensor([[-1.0, -2.0], [-1.0, -3.0]], dtype=D, requires_grad=True)
    t = torch.tensor([[-2.0, -2.0], [-0.5, -3.0]], dtype=D)
    mask = torch.ones(2, 2)
    # k3 = exp(d) - d - 1, d = log p_t - log p_s: d = -1, 0, 0.5, 0
    k3 = [math.exp(-1) + 1 - 1, 0.0, math.exp(0.5) - 0.5 - 1, 0.0]
    loss, stats = kdrl_loss(s, t, mask, estimator="k3")
    assert loss.item() == pytest.approx(sum(k3) / 4)
    assert stats["kl"].item() == pytest.approx(sum(k3) / 4)
    # k2 is the default
    assert kdrl_loss(s, t, mask)[0].item() == pytest.approx(kdrl_loss(s, t, mask, estimator="k2")[0].item())
    assert kdrl_loss(s, t, mask)[0].item() == pytest.approx((0.5 + 0.0 + 0.125 + 0.0) / 4)  # k2 = (s - t)^2 / 2
    # the threshold: distil on rewards at or below it
    assert kdrl_reward_mask(torch.tensor([0.2, 0.5, 0.9]), threshold=0.5).tolist() == [1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="unknown KDRL estimator"):
        kdrl_loss(s, t, mask, estimator="k1")
