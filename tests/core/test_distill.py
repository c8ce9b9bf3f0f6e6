import math

import pytest
import torch

from posttrain.core import (
    DISTILL_DIVERGENCES,
    distill_divergence,
    forward_kl,
    generalized_jsd,
    kdrl_k2_loss,
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


def test_banned_tokens_are_finite_with_finite_grads():
    s = torch.tensor([[[0.0, 1.0, float("-inf")]]], dtype=D, requires_grad=True)
    t = torch.tensor([[[0.5, 0.0, float("-inf")]]], dtype=D)
    for name in DISTILL_DIVERGENCES:
        out = distill_divergence(name, s, t)
        assert torch.isfinite(out).all(), name
        (g,) = torch.autograd.grad(out.sum(), s)
        assert torch.isfinite(g).all(), name
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


def test_kdrl_k2_loss_and_reward_masking():
    s = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]], dtype=D, requires_grad=True)
    t = torch.tensor([[-2.0, -2.0, -9.0], [-1.5, -0.5, -1.0]], dtype=D)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss, stats = kdrl_k2_loss(s, t, mask)
    k2 = [0.5, 0.0, 0.125, 0.125, 0.0]
    assert loss.item() == pytest.approx(sum(k2) / 5)
    rm = kdrl_reward_mask(torch.tensor([1.0, 0.0]))  # positive reward -> no distillation
    assert rm.tolist() == [0.0, 1.0]
    assert kdrl_reward_mask(torch.tensor([1, 0, -1])).tolist() == [0.0, 1.0, 1.0]
    loss, stats = kdrl_k2_loss(s, t, mask, reward_mask=rm)
    assert loss.item() == pytest.approx(0.25 / 5)  # counts still from the full mask
    assert stats["distill/masked_frac"].item() == 0.5
    assert stats["distill/k2"].item() == pytest.approx(0.25 / 3)
    loss.backward()
    assert (s.grad[0] == 0).all()
    torch.testing.assert_close(s.grad[1], (s.detach()[1] - t[1]) / 5)
    with pytest.raises(ValueError, match="teacher_logp"):
        kdrl_k2_loss(s, torch.full_like(t, float("nan")), mask)
