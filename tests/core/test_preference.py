import math

import pytest
import torch

from posttrain.core import PREFERENCE_LOSSES, bradley_terry_loss, preference_loss

D = torch.float64
C, R = torch.tensor([-10.0], dtype=D), torch.tensor([-12.0], dtype=D)
RC, RR = torch.tensor([-11.0], dtype=D), torch.tensor([-11.0], dtype=D)


def softplus(x):
    return math.log1p(math.exp(x))


def test_dpo_hand_pair():
    # h = beta * ((-10 + 11) - (-12 + 11)) = 0.1 * 2 = 0.2
    loss, stats = preference_loss("dpo", C, R, RC, RR, beta=0.1)
    assert loss.item() == pytest.approx(softplus(-0.2))
    assert stats["rewards/chosen"].item() == pytest.approx(0.1)
    assert stats["rewards/rejected"].item() == pytest.approx(-0.1)
    assert stats["rewards/margins"].item() == pytest.approx(0.2)
    assert stats["rewards/accuracy"].item() == 1.0
    smoothed, _ = preference_loss("dpo", C, R, RC, RR, beta=0.1, label_smoothing=0.1)
    assert smoothed.item() == pytest.approx(0.9 * softplus(-0.2) + 0.1 * softplus(0.2))


def test_dpo_gradient_matches_closed_form():
    c = torch.tensor([-10.0, -5.0], dtype=D, requires_grad=True)
    r = torch.tensor([-12.0, -4.0], dtype=D, requires_grad=True)
    rc, rr = torch.tensor([-11.0, -5.0], dtype=D), torch.tensor([-11.0, -5.0], dtype=D)
    beta = 0.5
    loss, stats = preference_loss("dpo", c, r, rc, rr, beta=beta)
    loss.backward()
    h = beta * ((c - rc) - (r - rr)).detach()
    torch.testing.assert_close(c.grad, -beta * torch.sigmoid(-h) / 2)
    torch.testing.assert_close(r.grad, beta * torch.sigmoid(-h) / 2)
    assert stats["rewards/accuracy"].item() == 0.5  # second pair: chosen reward 0 < rejected 0.5


def test_ipo_and_hinge_hand_pair():
    loss, stats = preference_loss("ipo", C, R, RC, RR, beta=0.1)
    assert loss.item() == pytest.approx((2.0 - 1 / (2 * 0.1)) ** 2)  # (2 - 5)^2 = 9
    assert stats["rewards/margins"].item() == pytest.approx(0.2)
    loss, _ = preference_loss("hinge", C, R, RC, RR, beta=0.1)
    assert loss.item() == pytest.approx(1 - 0.2)
    loss, _ = preference_loss("hinge", C, R, RC, RR, beta=1.0)
    assert loss.item() == 0.0  # margin 2 > 1


def test_simpo_hand_pair_is_reference_free_and_length_normalised():
    # avg logp: chosen -10/5 = -2, rejected -12/4 = -3; beta 2 -> rewards -4, -6; gamma 0.5
    kw = dict(beta=2.0, chosen_len=torch.tensor([5]), rejected_len=torch.tensor([4]), gamma=0.5)
    loss, stats = preference_loss("simpo", C, R, **kw)
    assert loss.item() == pytest.approx(softplus(-(2.0 - 0.5)))
    assert stats["rewards/chosen"].item() == pytest.approx(-4.0)
    assert stats["rewards/rejected"].item() == pytest.approx(-6.0)
    assert stats["rewards/margins"].item() == pytest.approx(2.0)
    with_ref, _ = preference_loss("simpo", C, R, RC - 100, RR + 100, **kw)
    assert with_ref.item() == loss.item()  # references are ignored
    # length normalisation matters: same sums, different lengths flip the preference
    flipped, st = preference_loss("simpo", C, R, beta=2.0, chosen_len=torch.tensor([2]), rejected_len=torch.tensor([6]))
    assert st["rewards/accuracy"].item() == 0.0 and flipped.item() > loss.item()


def test_bradley_terry_with_margin_and_centering():
    c = torch.tensor([1.0, 0.0], dtype=D)
    r = torch.tensor([0.0, 0.5], dtype=D)
    loss, stats = bradley_terry_loss(c, r)
    assert loss.item() == pytest.approx((softplus(-1.0) + softplus(0.5)) / 2)
    assert stats["rewards/accuracy"].item() == 0.5
    assert stats["rewards/margins"].item() == pytest.approx(0.25)
    loss, _ = bradley_terry_loss(c, r, margin=torch.tensor([0.5, 0.0], dtype=D), center_coef=0.01)
    expected = (softplus(-0.5) + softplus(0.5)) / 2 + 0.01 * (1.0 + 0.25) / 2
    assert loss.item() == pytest.approx(expected)


@pytest.mark.parametrize("name", sorted(PREFERENCE_LOSSES))
def test_edges_and_errors(name):
    kw = {"beta": 0.1}
    if name == "simpo":
        kw.update(chosen_len=torch.tensor([3]), rejected_len=torch.tensor([3]))
    bad = torch.tensor([float("nan")], dtype=D)
    with pytest.raises(ValueError, match="chosen_logp"):
        preference_loss(name, bad, R, RC, RR, **kw)
    with pytest.raises(ValueError, match="non-empty"):
        preference_loss(name, C[:0], R[:0], RC[:0], RR[:0], **kw)
    with pytest.raises(ValueError, match="gamma" if name != "simpo" else "label_smoothing"):
        preference_loss(name, C, R, RC, RR, **{**kw, **({"gamma": 1.0} if name != "simpo" else {"label_smoothing": 0.7})})


def test_missing_inputs_raise():
    with pytest.raises(ValueError, match="ref_chosen_logp"):
        preference_loss("dpo", C, R, beta=0.1)
    with pytest.raises(ValueError, match="chosen_len"):
        preference_loss("simpo", C, R, beta=0.1)
    with pytest.raises(ValueError, match="> 0"):
        preference_loss("simpo", C, R, beta=0.1, chosen_len=torch.tensor([0]), rejected_len=torch.tensor([1]))
    with pytest.raises(ValueError, match="unknown preference loss 'kto'"):
        preference_loss("kto", C, R, beta=0.1)
    with pytest.raises(ValueError, match="chosen_scores"):
        bradley_terry_loss(torch.tensor([float("inf")]), torch.tensor([0.0]))


def test_simpo_gamma_is_the_reward_margin_not_gamma_over_beta():
    """Paper form: margin gamma is subtracted as is. (gamma_beta_ratio code forms use beta * (h - gamma/beta).)"""
    beta, gamma = 2.0, 0.5
    kw = dict(beta=beta, chosen_len=torch.tensor([5]), rejected_len=torch.tensor([4]), gamma=gamma)
    loss, _ = preference_loss("simpo", C, R, **kw)
    h = (-10.0 / 5) - (-12.0 / 4)  # 1.0: difference of average log-probs
    assert loss.item() == pytest.approx(softplus(-(beta * h - gamma)))  # softplus(-1.5)
    assert loss.item() != pytest.approx(softplus(-beta * (h - gamma)))  # softplus(-1.0): gamma read as gamma/beta
    # equivalently, a gamma_beta_ratio g corresponds to gamma = beta * g
    loss_ratio, _ = preference_loss("simpo", C, R, **{**kw, "gamma": beta * 0.25})
    assert loss_ratio.item() == pytest.approx(softplus(-beta * (h - 0.25)))
    # the margin shifts the logit only: with gamma = the reward margin the loss is log 2
    at_margin, _ = preference_loss("simpo", C, R, **{**kw, "gamma": beta * h})
    assert at_margin.item() == pytest.approx(math.log(2))


def test_dpo_is_invariant_to_a_common_shift_and_ipo_minimum():
    """DPO depends on log-ratio differences only; IPO is minimised (0) at h = 1/(2 beta)."""
    loss, _ = preference_loss("dpo", C, R, RC, RR, beta=0.1)
    shifted, _ = preference_loss("dpo", C + 3, R + 3, RC + 3, RR + 3, beta=0.1)
    assert shifted.item() == pytest.approx(loss.item())
    beta = 0.25  # 1/(2 beta) = 2 = h of the hand pair
    ipo, _ = preference_loss("ipo", C, R, RC, RR, beta=beta)
    assert ipo.item() == pytest.approx(0.0, abs=1e-12)
