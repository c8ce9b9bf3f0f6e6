import math

import pytest
import torch

from posttrain.core.preference import (
    PREFERENCE_LOSSES,
    PreferenceOutput,
    bradley_terry_loss,
    ensemble_lower_bound,
    ipo_loss,
    per_token_log_ratios,
    preference_loss,
)

D = torch.float64
C, R = torch.tensor([-10.0], dtype=D), torch.tensor([-12.0], dtype=D)
RC, RR = torch.tensor([-11.0], dtype=D), torch.tensor([-11.0], dtype=D)


def softplus(x):
    return math.log1p(math.exp(x))


def refs(name):
    """Reference log-probs for the losses that take them (SimPO is reference-free and refuses them)."""
    return () if name == "simpo" else (RC, RR)


def test_dpo_hand_pair():
    # h = beta * ((-10 + 11) - (-12 + 11)) = 0.1 * 2 = 0.2
    out = preference_loss("dpo", C, R, RC, RR, beta=0.1)
    assert isinstance(out, PreferenceOutput)
    loss, stats = out.loss, out.stats
    assert loss.item() == pytest.approx(softplus(-0.2))
    assert stats["rewards/chosen"].item() == pytest.approx(0.1)
    assert stats["rewards/rejected"].item() == pytest.approx(-0.1)
    assert stats["rewards/margins"].item() == pytest.approx(0.2)
    assert stats["rewards/accuracy"].item() == 1.0
    smoothed = preference_loss("dpo", C, R, RC, RR, beta=0.1, label_smoothing=0.1).loss
    assert smoothed.item() == pytest.approx(0.9 * softplus(-0.2) + 0.1 * softplus(0.2))


def test_dpo_gradient_matches_closed_form():
    c = torch.tensor([-10.0, -5.0], dtype=D, requires_grad=True)
    r = torch.tensor([-12.0, -4.0], dtype=D, requires_grad=True)
    rc, rr = torch.tensor([-11.0, -5.0], dtype=D), torch.tensor([-11.0, -5.0], dtype=D)
    beta = 0.5
    loss, _, _, stats = preference_loss("dpo", c, r, rc, rr, beta=beta)
    loss.backward()
    h = beta * ((c - rc) - (r - rr)).detach()
    torch.testing.assert_close(c.grad, -beta * torch.sigmoid(-h) / 2)
    torch.testing.assert_close(r.grad, beta * torch.sigmoid(-h) / 2)
    assert stats["rewards/accuracy"].item() == 0.5  # second pair: chosen reward 0 < rejected 0.5


def test_ipo_and_hinge_hand_pair():
    out = preference_loss("ipo", C, R, RC, RR, beta=0.1)
    assert out.loss.item() == pytest.approx((2.0 - 1 / (2 * 0.1)) ** 2)  # (2 - 5)^2 = 9
    assert out.stats["rewards/margins"].item() == pytest.approx(0.2)
    loss = preference_loss("hinge", C, R, RC, RR, beta=0.1).loss
    assert loss.item() == pytest.approx(1 - 0.2)
    loss = preference_loss("hinge", C, R, RC, RR, beta=1.0).loss
    assert loss.item() == 0.0  # margin 2 > 1


# Two pairs with different lengths on each side, for IPO by hand.
IC, IR = torch.tensor([-10.0, -6.0], dtype=D), torch.tensor([-12.0, -3.0], dtype=D)
IRC, IRR = torch.tensor([-14.0, -5.0], dtype=D), torch.tensor([-9.0, -5.0], dtype=D)
# log-ratios: chosen [4, -1], rejected [-3, 2]
ILC, ILR = torch.tensor([4, 2]), torch.tensor([6, 4])


def test_ipo_summed_vs_length_normalised_hand_values():
    beta = 0.25  # 1 / (2 beta) = 2
    summed = preference_loss("ipo", IC, IR, IRC, IRR, beta=beta)
    # h = [4 - (-3), -1 - 2] = [7, -3] -> ((7 - 2)^2 + (-3 - 2)^2) / 2 = 25
    assert summed.loss.item() == pytest.approx(25.0)
    normed = preference_loss(
        "ipo", IC, IR, IRC, IRR, beta=beta, chosen_len=ILC, rejected_len=ILR, length_normalize=True,
    )
    # h = [4/4 - (-3)/6, -1/2 - 2/4] = [1.5, -1] -> ((1.5 - 2)^2 + (-1 - 2)^2) / 2 = (0.25 + 9) / 2
    assert normed.loss.item() == pytest.approx(4.625)
    # the rewards are beta * summed log-ratios in both modes (what TRL reports)
    for out in (summed, normed):
        torch.testing.assert_close(out.chosen_rewards, torch.tensor([1.0, -0.25], dtype=D))
        torch.testing.assert_close(out.rejected_rewards, torch.tensor([-0.75, 0.5], dtype=D))
    # each side is divided by its own length, not by a shared one
    same_len = preference_loss(
        "ipo", IC, IR, IRC, IRR, beta=beta, chosen_len=ILC, rejected_len=ILC, length_normalize=True,
    )
    # h = [4/4 + 3/4, -1/2 - 2/2] = [1.75, -1.5] -> (0.0625 + 12.25) / 2
    assert same_len.loss.item() == pytest.approx(6.15625)
    # lengths of 1 reduce to the summed form
    ones = torch.ones(2, dtype=torch.long)
    unit = preference_loss(
        "ipo", IC, IR, IRC, IRR, beta=beta, chosen_len=ones, rejected_len=ones, length_normalize=True,
    )
    assert unit.loss.item() == pytest.approx(summed.loss.item())


def test_length_normalised_dpo_hand_values():
    # log-ratios: chosen [4, -1], rejected [-3, 2]; lengths chosen [4, 2], rejected [6, 4]
    # per token: chosen [4/4, -1/2] = [1, -0.5], rejected [-3/6, 2/4] = [-0.5, 0.5]
    beta = 2.0
    out = preference_loss("dpo", IC, IR, IRC, IRR, beta=beta, chosen_len=ILC, rejected_len=ILR,
                          length_normalize=True)
    # rewards beta * per-token log-ratio: chosen [2, -1], rejected [-1, 1]; margins [3, -2]
    torch.testing.assert_close(out.chosen_rewards, torch.tensor([2.0, -1.0], dtype=D))
    torch.testing.assert_close(out.rejected_rewards, torch.tensor([-1.0, 1.0], dtype=D))
    # loss = mean(-log sigma(3), -log sigma(-2)) = (softplus(-3) + softplus(2)) / 2
    assert out.loss.item() == pytest.approx((softplus(-3.0) + softplus(2.0)) / 2)
    assert out.stats["rewards/margins"].item() == pytest.approx(0.5)
    assert out.stats["rewards/accuracy"].item() == 0.5
    # the summed form of the same pairs: margins beta * [7, -3] = [14, -6]
    summed = preference_loss("dpo", IC, IR, IRC, IRR, beta=beta)
    assert summed.loss.item() == pytest.approx((softplus(-14.0) + softplus(6.0)) / 2)
    # cDPO label smoothing applies to the normalised margin
    smoothed = preference_loss("dpo", IC, IR, IRC, IRR, beta=beta, chosen_len=ILC, rejected_len=ILR,
                               length_normalize=True, label_smoothing=0.1)
    want = (0.9 * (softplus(-3.0) + softplus(2.0)) + 0.1 * (softplus(3.0) + softplus(-2.0))) / 2
    assert smoothed.loss.item() == pytest.approx(want)
    # lengths of 1 reduce to plain DPO
    ones = torch.ones(2, dtype=torch.long)
    unit = preference_loss("dpo", IC, IR, IRC, IRR, beta=beta, chosen_len=ones, rejected_len=ones,
                           length_normalize=True)
    assert unit.loss.item() == pytest.approx(summed.loss.item())


def test_length_normalised_dpo_gradient_matches_closed_form():
    c = IC.clone().requires_grad_()
    r = IR.clone().requires_grad_()
    beta = 2.0
    out = preference_loss("dpo", c, r, IRC, IRR, beta=beta, chosen_len=ILC, rejected_len=ILR, length_normalize=True)
    out.loss.backward()
    h = torch.tensor([3.0, -2.0], dtype=D)  # the margins above
    # d/dc_i of mean_i -log sigma(h_i), h_i = beta (c_i - rc_i)/|y_w,i| - beta (r_i - rr_i)/|y_l,i|
    torch.testing.assert_close(c.grad, -beta / ILC.to(D) * torch.sigmoid(-h) / 2)
    torch.testing.assert_close(r.grad, beta / ILR.to(D) * torch.sigmoid(-h) / 2)


def test_per_token_log_ratios_divides_each_side_by_its_own_length():
    chosen, rejected = per_token_log_ratios(torch.tensor([4.0, -1.0]), torch.tensor([-3.0, 2.0]),
                                            torch.tensor([4, 2]), torch.tensor([6, 4]))
    torch.testing.assert_close(chosen, torch.tensor([1.0, -0.5]))
    torch.testing.assert_close(rejected, torch.tensor([-0.5, 0.5]))
    with pytest.raises(ValueError, match="dpo: chosen_len must be > 0"):
        per_token_log_ratios(torch.tensor([1.0]), torch.tensor([1.0]), torch.tensor([0]), torch.tensor([1]))


def _trl_ipo_float64(chosen_tok, rejected_tok, ref_chosen_tok, ref_rejected_tok, chosen_mask, rejected_mask, beta):
    """My transcription of TRL DPOTrainer loss_type="ipo": token-summed log-ratios, each divided
    by its own completion-token count (clamped at 1), then (delta - 1/(2 beta))^2, batch mean."""
    chosen_scores = (chosen_tok * chosen_mask).sum(1) - (ref_chosen_tok * chosen_mask).sum(1)
    rejected_scores = (rejected_tok * rejected_mask).sum(1) - (ref_rejected_tok * rejected_mask).sum(1)
    chosen_avg = chosen_scores / chosen_mask.sum(1).clamp(min=1.0)
    rejected_avg = rejected_scores / rejected_mask.sum(1).clamp(min=1.0)
    per_pair = (chosen_avg - rejected_avg - 1 / (2 * beta)) ** 2
    rewards = beta * chosen_scores.detach(), beta * rejected_scores.detach()
    return per_pair.mean(), rewards


def test_ipo_length_normalised_matches_trl_transcription_with_gradients():
    torch.manual_seed(0)
    B, T, beta = 4, 7, 0.3
    chosen_len, rejected_len = torch.tensor([7, 3, 5, 1]), torch.tensor([2, 6, 4, 7])
    pos = torch.arange(T)
    cm, rm = (pos < chosen_len[:, None]).to(D), (pos < rejected_len[:, None]).to(D)
    tok = [(-3 * torch.rand(B, T, dtype=D)).requires_grad_() for _ in range(2)]
    ref = [-3 * torch.rand(B, T, dtype=D) for _ in range(2)]

    expected, (exp_c, exp_r) = _trl_ipo_float64(tok[0], tok[1], ref[0], ref[1], cm, rm, beta)
    exp_grads = torch.autograd.grad(expected, tok)

    out = ipo_loss(
        (tok[0] * cm).sum(1), (tok[1] * rm).sum(1), (ref[0] * cm).sum(1), (ref[1] * rm).sum(1),
        beta=beta, chosen_len=chosen_len, rejected_len=rejected_len, length_normalize=True,
    )
    grads = torch.autograd.grad(out.loss, tok)
    torch.testing.assert_close(out.loss, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(out.chosen_rewards, exp_c, rtol=1e-12, atol=0)
    torch.testing.assert_close(out.rejected_rewards, exp_r, rtol=1e-12, atol=0)
    for g, e in zip(grads, exp_grads):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-15)
    assert (grads[0][cm == 0] == 0).all()  # padding gets no gradient


def test_per_pair_rewards():
    c, r = torch.tensor([-10.0, -5.0], dtype=D, requires_grad=True), torch.tensor([-12.0, -4.0], dtype=D)
    rc, rr = torch.tensor([-11.0, -5.0], dtype=D), torch.tensor([-11.0, -6.0], dtype=D)
    for name in ("dpo", "ipo", "hinge"):
        out = preference_loss(name, c, r, rc, rr, beta=0.5)
        torch.testing.assert_close(out.chosen_rewards, torch.tensor([0.5, 0.0], dtype=D))
        torch.testing.assert_close(out.rejected_rewards, torch.tensor([-0.5, 1.0], dtype=D))
        assert not out.chosen_rewards.requires_grad and out.loss.requires_grad
        assert out.stats["rewards/margins"].item() == pytest.approx(((1.0) + (-1.0)) / 2)
        assert out.stats["rewards/accuracy"].item() == 0.5
    out = preference_loss("simpo", c, r, beta=2.0, chosen_len=torch.tensor([5, 2]), rejected_len=torch.tensor([4, 8]))
    torch.testing.assert_close(out.chosen_rewards, torch.tensor([-4.0, -5.0], dtype=D))
    torch.testing.assert_close(out.rejected_rewards, torch.tensor([-6.0, -1.0], dtype=D))
    assert not out.chosen_rewards.requires_grad
    assert out.stats["rewards/chosen"].item() == pytest.approx(-4.5)


def test_simpo_hand_pair_is_reference_free_and_length_normalised():
    # avg logp: chosen -10/5 = -2, rejected -12/4 = -3; beta 2 -> rewards -4, -6; gamma 0.5
    kw = dict(beta=2.0, chosen_len=torch.tensor([5]), rejected_len=torch.tensor([4]), gamma=0.5)
    loss, chosen_rewards, rejected_rewards, stats = preference_loss("simpo", C, R, **kw)
    assert loss.item() == pytest.approx(softplus(-(2.0 - 0.5)))
    assert chosen_rewards.item() == pytest.approx(-4.0) and rejected_rewards.item() == pytest.approx(-6.0)
    assert stats["rewards/chosen"].item() == pytest.approx(-4.0)
    assert stats["rewards/rejected"].item() == pytest.approx(-6.0)
    assert stats["rewards/margins"].item() == pytest.approx(2.0)
    with pytest.raises(ValueError, match="does not use ref_chosen_logp"):
        preference_loss("simpo", C, R, RC, RR, **kw)  # references raise instead of being ignored
    with pytest.raises(ValueError, match="does not use ref_rejected_logp"):
        preference_loss("simpo", C, R, None, RR, **kw)
    # length normalisation matters: same sums, different lengths flip the preference
    flipped = preference_loss("simpo", C, R, beta=2.0, chosen_len=torch.tensor([2]), rejected_len=torch.tensor([6]))
    assert flipped.stats["rewards/accuracy"].item() == 0.0 and flipped.loss.item() > loss.item()


def test_bradley_terry_with_margin_and_centering():
    c = torch.tensor([1.0, 0.0], dtype=D)
    r = torch.tensor([0.0, 0.5], dtype=D)
    out = bradley_terry_loss(c, r)
    assert isinstance(out, PreferenceOutput)
    assert out.loss.item() == pytest.approx((softplus(-1.0) + softplus(0.5)) / 2)
    assert out.stats["rewards/accuracy"].item() == 0.5
    assert out.stats["rewards/margins"].item() == pytest.approx(0.25)
    torch.testing.assert_close(out.chosen_rewards, c)
    torch.testing.assert_close(out.rejected_rewards, r)
    loss = bradley_terry_loss(c, r, margin=torch.tensor([0.5, 0.0], dtype=D), center_coef=0.01).loss
    expected = (softplus(-0.5) + softplus(0.5)) / 2 + 0.01 * (1.0 + 0.25) / 2
    assert loss.item() == pytest.approx(expected)
    s = c.clone().requires_grad_()
    assert not bradley_terry_loss(s, r).chosen_rewards.requires_grad


@pytest.mark.parametrize("name", sorted(PREFERENCE_LOSSES))
def test_edges_and_errors(name):
    kw = {"beta": 0.1}
    if name == "simpo":
        kw.update(chosen_len=torch.tensor([3]), rejected_len=torch.tensor([3]))
    ref, ref0 = refs(name), tuple(x[:0] for x in refs(name))
    bad = torch.tensor([float("nan")], dtype=D)
    with pytest.raises(ValueError, match="chosen_logp contains"):
        preference_loss(name, bad, R, *ref, **kw)
    with pytest.raises(ValueError, match="non-empty"):
        preference_loss(name, C[:0], R[:0], *ref0, **kw)
    with pytest.raises(ValueError, match="gamma" if name != "simpo" else "label_smoothing"):
        preference_loss(name, C, R, *ref, **{**kw, **({"gamma": 1.0} if name != "simpo" else {"label_smoothing": 0.7})})


LENGTHS = dict(chosen_len=torch.tensor([3]), rejected_len=torch.tensor([2]))


@pytest.mark.parametrize("name", ["dpo", "hinge"])
def test_dpo_and_hinge_refuse_lengths_and_hinge_length_normalize(name):
    for key, value in LENGTHS.items():
        with pytest.raises(ValueError, match=f"does not use {key}"):
            preference_loss(name, C, R, RC, RR, beta=0.1, **{key: value})
    if name == "hinge":
        with pytest.raises(ValueError, match="does not use length_normalize"):
            preference_loss(name, C, R, RC, RR, beta=0.1, length_normalize=True)
    else:  # dpo normalises, given the lengths
        with pytest.raises(ValueError, match="needs chosen_len and rejected_len"):
            preference_loss(name, C, R, RC, RR, beta=0.1, length_normalize=True)
    # unset values (None / False / 0) are accepted
    base = preference_loss(name, C, R, RC, RR, beta=0.1).loss
    same = preference_loss(
        name, C, R, RC, RR, beta=0.1, chosen_len=None, rejected_len=None, gamma=0, length_normalize=False,
    ).loss
    assert same.item() == base.item()


def test_ipo_raise_rules():
    # lengths without length_normalize=True would be silently unused
    for key, value in LENGTHS.items():
        with pytest.raises(ValueError, match=f"does not use {key}.*length_normalize=True"):
            preference_loss("ipo", C, R, RC, RR, beta=0.1, **{key: value})
    # length_normalize=True needs both lengths, [B], finite, > 0
    with pytest.raises(ValueError, match="needs chosen_len and rejected_len"):
        preference_loss("ipo", C, R, RC, RR, beta=0.1, length_normalize=True)
    with pytest.raises(ValueError, match="needs chosen_len and rejected_len"):
        preference_loss("ipo", C, R, RC, RR, beta=0.1, length_normalize=True, chosen_len=torch.tensor([3]))
    with pytest.raises(ValueError, match="rejected_len must be > 0"):
        preference_loss(
            "ipo", C, R, RC, RR, beta=0.1, length_normalize=True,
            chosen_len=torch.tensor([3]), rejected_len=torch.tensor([0]),
        )
    with pytest.raises(ValueError, match="chosen_len has shape"):
        preference_loss(
            "ipo", C, R, RC, RR, beta=0.1, length_normalize=True,
            chosen_len=torch.tensor([3, 4]), rejected_len=torch.tensor([2]),
        )
    with pytest.raises(ValueError, match="chosen_len contains"):
        preference_loss(
            "ipo", C, R, RC, RR, beta=0.1, length_normalize=True,
            chosen_len=torch.tensor([float("nan")]), rejected_len=torch.tensor([2.0]),
        )
    for key, value in (("gamma", 0.5), ("label_smoothing", 0.1)):
        with pytest.raises(ValueError, match=f"does not use {key}"):
            preference_loss("ipo", C, R, RC, RR, beta=0.1, length_normalize=True, **LENGTHS, **{key: value})
    with pytest.raises(ValueError, match="beta > 0"):
        preference_loss("ipo", C, R, RC, RR, beta=0.0)


def test_simpo_raise_rules():
    with pytest.raises(ValueError, match="does not use length_normalize"):
        preference_loss("simpo", C, R, beta=2.0, length_normalize=True, **LENGTHS)
    assert preference_loss("simpo", C, R, beta=2.0, length_normalize=False, **LENGTHS).loss.isfinite()
    with pytest.raises(ValueError, match="needs chosen_len and rejected_len"):
        preference_loss("simpo", C, R, beta=2.0, chosen_len=torch.tensor([3]))


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
    """Paper form (and TRL's simpo_gamma): gamma is subtracted as is. The SimPO authors' code
    takes gamma_beta_ratio = gamma / beta, i.e. the logit beta * (h - gamma_beta_ratio)."""
    beta, gamma = 2.0, 0.5
    kw = dict(beta=beta, chosen_len=torch.tensor([5]), rejected_len=torch.tensor([4]), gamma=gamma)
    loss = preference_loss("simpo", C, R, **kw).loss
    h = (-10.0 / 5) - (-12.0 / 4)  # 1.0: difference of average log-probs
    assert loss.item() == pytest.approx(softplus(-(beta * h - gamma)))  # softplus(-1.5)
    # TRL CPOTrainer: -logsigmoid(beta * (h - simpo_gamma / beta)) with simpo_gamma = gamma
    assert loss.item() == pytest.approx(softplus(-beta * (h - gamma / beta)))
    assert loss.item() != pytest.approx(softplus(-beta * (h - gamma)))  # softplus(-1.0): gamma misread as gamma/beta
    # a gamma_beta_ratio g (SimPO reference code) corresponds to gamma = beta * g
    loss_ratio = preference_loss("simpo", C, R, **{**kw, "gamma": beta * 0.25}).loss
    assert loss_ratio.item() == pytest.approx(softplus(-beta * (h - 0.25)))
    # the margin shifts the logit only: with gamma = the reward margin the loss is log 2
    at_margin = preference_loss("simpo", C, R, **{**kw, "gamma": beta * h}).loss
    assert at_margin.item() == pytest.approx(math.log(2))


def test_dpo_is_invariant_to_a_common_shift_and_ipo_minimum():
    """DPO depends on log-ratio differences only; IPO is minimised (0) at h = 1/(2 beta)."""
    loss = preference_loss("dpo", C, R, RC, RR, beta=0.1).loss
    shifted = preference_loss("dpo", C + 3, R + 3, RC + 3, RR + 3, beta=0.1).loss
    assert shifted.item() == pytest.approx(loss.item())
    beta = 0.25  # 1/(2 beta) = 2 = h of the hand pair
    ipo = preference_loss("ipo", C, R, RC, RR, beta=beta).loss
    assert ipo.item() == pytest.approx(0.0, abs=1e-12)
    # length-normalised: h = 1/2 - (-1)/2 = 1 -> minimum at beta = 0.5
    ipo_n = preference_loss(
        "ipo", C, R, RC, RR, beta=0.5, length_normalize=True,
        chosen_len=torch.tensor([2]), rejected_len=torch.tensor([2]),
    ).loss
    assert ipo_n.item() == pytest.approx(0.0, abs=1e-12)


def test_ensemble_lower_bound_by_hand():
    # two samples scored by three models: means 2 and 0, unbiased stds 1 and 3
    scores = torch.tensor([[1.0, 3.0], [2.0, 0.0], [3.0, -3.0]], dtype=D)
    lower, spread = ensemble_lower_bound(scores, std_coef=0.5)
    assert spread.tolist() == [1.0, 3.0]
    assert lower.tolist() == [2.0 - 0.5 * 1.0, 0.0 - 0.5 * 3.0]
    single, none = ensemble_lower_bound(scores[:1], std_coef=0.5)  # one model: no spread, scores unchanged
    assert single.tolist() == [1.0, 3.0] and none.tolist() == [0.0, 0.0]
