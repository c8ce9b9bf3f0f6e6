import math

import pytest
import torch

from posttrain.core import (
    POLICY_LOSSES,
    cispo_loss,
    compute_policy_loss,
    gspo_loss,
    gspo_sequence_log_ratio,
    offpolicy_sequence_mask,
    ppo_clip_loss,
    reinforce_loss,
)

D = torch.float64


def worked_example():
    """Seed document example: token ratios 2.0 and 0.4, A = 1."""
    old = torch.zeros(1, 2, dtype=D)
    logp = torch.log(torch.tensor([[2.0, 0.4]], dtype=D)).requires_grad_(True)
    return logp, old, torch.ones(1, 2, dtype=D), torch.ones(1, 2, dtype=D)


def test_ppo_clip_worked_example():
    logp, old, adv, mask = worked_example()
    loss, stats = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    # per-token objective min(rA, clip(r)A) = [min(2, 1.2), min(0.4, 0.8)] = [1.2, 0.4], mean 0.8
    assert loss.item() == pytest.approx(-0.8)
    assert loss.item() != pytest.approx(-1.0)  # the source text's number drops the min
    loss.backward()
    assert logp.grad[0, 0].item() == 0.0  # clipped token: no gradient
    assert logp.grad[0, 1].item() == pytest.approx(-0.4 / 2)  # d(-r A)/dlogp / N = -r / 2
    assert stats["clip_frac"].item() == 0.5 and stats["clip_frac_high"].item() == 0.5
    assert stats["clip_frac_low"].item() == 0.0
    assert stats["ratio_mean"].item() == pytest.approx(1.2)
    expected_kl = ((2 - 1 - math.log(2)) + (0.4 - 1 - math.log(0.4))) / 2
    assert stats["approx_kl"].item() == pytest.approx(expected_kl)


def test_gspo_worked_example_ratio_is_geometric_mean():
    logp, old, adv, mask = worked_example()
    s = gspo_sequence_log_ratio(logp, old, mask).exp()
    assert s.item() == pytest.approx(math.sqrt(0.8))
    assert s.item() == pytest.approx(0.894, abs=5e-4)
    loss, stats = gspo_loss(logp, old, adv, mask, agg_mode="seq-mean-token-mean")
    assert loss.item() == pytest.approx(-math.sqrt(0.8))  # 0.894 is inside [0.8, 1.2]: unclipped
    assert stats["ratio_mean"].item() == pytest.approx(math.sqrt(0.8))
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.full((1, 2), -math.sqrt(0.8) / 2, dtype=D))


def test_gspo_ratio_is_geometric_mean_random():
    torch.manual_seed(0)
    logp, old = torch.randn(5, 7, dtype=D) * 0.3, torch.randn(5, 7, dtype=D) * 0.3
    lengths = torch.tensor([7, 1, 4, 0, 6])
    mask = torch.arange(7) < lengths.unsqueeze(1)
    s = gspo_sequence_log_ratio(logp, old, mask).exp()
    for i in range(5):
        n = int(lengths[i])
        ratios = (logp[i, :n] - old[i, :n]).exp()
        geo = ratios.prod() ** (1.0 / n) if n else torch.tensor(1.0, dtype=D)
        assert s[i].item() == pytest.approx(geo.item())


def test_gspo_token_gradient_equals_sequence_gradient():
    """With one advantage per sequence, GSPO-token's gradient equals the sequence-level one."""
    torch.manual_seed(1)
    B, T = 4, 5
    logp = (torch.randn(B, T, dtype=D) * 0.05 - 1).requires_grad_(True)
    old = logp.detach() + torch.randn(B, T, dtype=D) * 0.05
    mask = torch.arange(T) < torch.tensor([5, 3, 2, 4]).unsqueeze(1)
    a_seq = torch.tensor([1.0, -0.5, 2.0, -1.0], dtype=D)
    adv = a_seq.unsqueeze(1).expand(B, T).clone()
    loss, _ = gspo_loss(logp, old, adv, mask, clip_low=None, clip_high=None, agg_mode="seq-mean-token-mean")
    (g_tok,) = torch.autograd.grad(loss, logp)
    s = torch.exp(((logp - old) * mask).sum(-1) / mask.sum(-1))  # differentiable sequence ratio
    (g_seq,) = torch.autograd.grad(-(s * a_seq).mean(), logp)
    torch.testing.assert_close(g_tok, g_seq)


def test_gspo_clips_whole_sequence():
    old = torch.zeros(2, 2, dtype=D)
    logp = torch.log(torch.tensor([[1.5, 1.5], [1.01, 1.01]], dtype=D)).requires_grad_(True)
    loss, stats = gspo_loss(logp, old, torch.ones(2, 2, dtype=D), torch.ones(2, 2), clip_low=3e-4, clip_high=4e-4)
    loss.backward()
    assert (logp.grad == 0).all()  # both sequences beyond 1 + 4e-4 with A > 0
    assert stats["clip_frac_high"].item() == 1.0


def test_clip_higher_and_clip_fractions():
    old = torch.zeros(1, 4, dtype=D)
    logp = torch.log(torch.tensor([[1.25, 1.5, 0.5, 1.5]], dtype=D))
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=D)
    mask = torch.ones(1, 4)
    loss, stats = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # 1.25 < 1.28 unclipped; 1.5 -> 1.28; 0.5 with A<0 -> 0.8 (max picks the clipped loss 0.8);
    # 1.5 with A<0 -> unclipped loss 1.5 (pessimistic side)
    expected = (-1.25 - 1.28 + 0.8 + 1.5) / 4
    assert loss.item() == pytest.approx(expected)
    assert stats["clip_frac_high"].item() == 0.25 and stats["clip_frac_low"].item() == 0.25
    assert stats["clip_frac"].item() == 0.5
    loss_sym, _ = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert loss_sym.item() == pytest.approx((-1.2 - 1.2 + 0.8 + 1.5) / 4)


def test_dual_clip_caps_negative_advantage_loss():
    old = torch.zeros(1, 2, dtype=D)
    logp = torch.log(torch.tensor([[5.0, 2.0]], dtype=D)).requires_grad_(True)
    adv = torch.tensor([[-1.0, -1.0]], dtype=D)
    mask = torch.ones(1, 2)
    plain, _ = ppo_clip_loss(logp, old, adv, mask)
    assert plain.item() == pytest.approx((5.0 + 2.0) / 2)
    loss, stats = ppo_clip_loss(logp, old, adv, mask, dual_clip=3.0)
    assert loss.item() == pytest.approx((3.0 + 2.0) / 2)
    loss.backward()
    assert logp.grad[0, 0].item() == 0.0 and logp.grad[0, 1].item() == pytest.approx(2.0 / 2)
    assert stats["dual_clip_frac"].item() == 0.5
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_loss(logp, old, adv, mask, dual_clip=0.9)
    with pytest.raises(ValueError, match="dual_clip"):
        gspo_loss(logp, old, adv, mask, dual_clip=3.0)


def test_cispo_clipped_detached_weight():
    logp, old, adv, mask = worked_example()
    loss, stats = cispo_loss(logp, old, adv, mask, clip_low=None, clip_high=0.2)  # MiniMax-M1: upper only
    w = torch.tensor([1.2, 0.4], dtype=D)
    assert loss.item() == pytest.approx(-(w * logp.detach()[0]).sum().item() / 2)
    loss.backward()
    torch.testing.assert_close(logp.grad[0], -w / 2)  # clipped token keeps a gradient (unlike PPO)
    assert stats["clip_frac_high"].item() == 0.5 and stats["clip_frac_low"].item() == 0.0
    logp.grad = None
    loss2, stats2 = cispo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)  # both sides
    loss2.backward()
    torch.testing.assert_close(logp.grad[0], -torch.tensor([1.2, 0.8], dtype=D) / 2)
    assert stats2["clip_frac"].item() == 1.0


def test_reinforce():
    logp = torch.tensor([[-1.0, -2.0, -3.0]], dtype=D, requires_grad=True)
    adv = torch.tensor([[2.0, 2.0, 9.0]], dtype=D)
    mask = torch.tensor([[1, 1, 0]])
    loss, stats = reinforce_loss(logp, None, adv, mask)
    assert loss.item() == pytest.approx(-(2 * -1 + 2 * -2) / 2)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, -1.0, 0.0]], dtype=D))
    assert stats["clip_frac"].item() == 0.0 and stats["ratio_mean"].item() == 1.0


def test_offpolicy_sequence_mask_and_seq_mask():
    logp = torch.tensor([[-2.0, -2.0], [-1.0, -1.0], [-3.0, -3.0], [-1.0, -1.0]], dtype=D)
    old = torch.tensor([[-1.0, -1.5], [-1.0, -1.05], [-1.0, -1.0], [0.0, 0.0]], dtype=D)
    adv = torch.tensor([-1.0, -1.0, 1.0, -1.0], dtype=D)
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [0, 0]])
    # mean(old - logp) = [0.75, 0.025, 2.0, n/a]; drop only A < 0 and divergence > 0.1
    m = offpolicy_sequence_mask(logp, old, adv, mask, delta=0.1)
    assert m.tolist() == [0.0, 1.0, 1.0, 1.0]
    m2 = offpolicy_sequence_mask(logp, old, adv.unsqueeze(1).expand(4, 2), mask, delta=0.1)
    assert m2.tolist() == m.tolist()
    # seq_mask zeroes the terms of masked sequences but keeps the normalising counts
    lp = logp.clone().requires_grad_(True)
    adv_t = adv.unsqueeze(1).expand(4, 2)
    loss, _ = reinforce_loss(lp, old, adv_t, mask, seq_mask=m)
    kept = torch.tensor([[0, 0], [1, 1], [1, 1], [0, 0]], dtype=D)
    assert loss.item() == pytest.approx((-(adv_t * logp) * kept).sum().item() / 6)
    loss.backward()
    assert (lp.grad[0] == 0).all()


def test_log_ratio_clamp_keeps_loss_finite():
    old = torch.zeros(1, 2, dtype=D)
    logp = torch.tensor([[50.0, -1e4]], dtype=D, requires_grad=True)
    adv = torch.tensor([[1.0, -1.0]], dtype=D)
    for name in POLICY_LOSSES:
        loss, stats = compute_policy_loss(name, logp, old, adv, torch.ones(1, 2))
        assert torch.isfinite(loss), name
        assert all(torch.isfinite(v) for v in stats.values()), name
    loss, _ = ppo_clip_loss(logp, old, -adv.abs(), torch.ones(1, 2), log_ratio_clamp=20.0, clip_low=None, clip_high=None)
    assert loss.item() == pytest.approx((math.exp(20) + math.exp(-20)) / 2)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_edges_every_policy_loss(name):
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]], dtype=D, requires_grad=True)
    old = torch.tensor([[-1.1, -1.9], [-0.5, -0.4]], dtype=D)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=D)
    # empty mask: loss 0, zero grad, finite stats
    loss, stats = compute_policy_loss(name, logp, old, adv, torch.zeros(2, 2))
    assert loss.item() == 0.0
    loss.backward()
    assert (logp.grad == 0).all()
    assert all(torch.isfinite(v) for v in stats.values())
    expected_keys = {"clip_frac", "clip_frac_low", "clip_frac_high", "approx_kl", "ratio_mean"}
    assert expected_keys <= set(stats)
    # an all-padding row with NaN/inf garbage does not matter
    lp = logp.detach().clone()
    lp[1] = float("nan")
    o = old.clone()
    o[1] = float("-inf")
    mask = torch.tensor([[1, 1], [0, 0]])
    loss, stats = compute_policy_loss(name, lp, o, adv, mask)
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in stats.values())
    # NaN at a valid token: clear error naming the argument
    with pytest.raises(ValueError, match="logp"):
        compute_policy_loss(name, lp, old, adv, torch.ones(2, 2))
    bad_adv = adv.clone()
    bad_adv[0, 0] = float("inf")
    with pytest.raises(ValueError, match="advantages"):
        compute_policy_loss(name, logp, old, bad_adv, torch.ones(2, 2))


def test_registry_errors():
    logp, old, adv, mask = worked_example()
    with pytest.raises(ValueError, match=r"unknown policy loss 'ppo'.*cispo, gspo, ppo_clip, reinforce"):
        compute_policy_loss("ppo", logp, old, adv, mask)
    with pytest.raises(ValueError, match="clip_low"):
        ppo_clip_loss(logp, old, adv, mask, clip_low=-0.1)
    with pytest.raises(ValueError, match="advantages"):
        ppo_clip_loss(logp, old, adv[:, :1], mask)


@pytest.mark.parametrize("a", [-2.0, -0.5, 0.5, 2.0])
def test_dual_clip_matches_formula_on_a_ratio_grid(a):
    """Per token: A < 0 -> l = min(max(-rA, -clip(r)A), -cA), i.e. objective max(min(rA, clip(r)A), cA);
    A > 0 -> plain clip-higher PPO (the dual clip never applies). Ratios avoid every kink."""
    c = 3.0
    r = torch.tensor([0.3, 0.7, 0.9, 1.1, 1.2, 1.5, 2.0, 3.5, 6.0], dtype=D)
    logp = r.log().unsqueeze(0).requires_grad_(True)
    n = r.numel()
    loss, stats = ppo_clip_loss(
        logp, torch.zeros(1, n, dtype=D), torch.full((1, n), a, dtype=D), torch.ones(1, n),
        clip_low=0.2, clip_high=0.28, dual_clip=c, agg_mode="seq-mean-token-sum",
    )
    clipped = r.clamp(0.8, 1.28)
    if a < 0:
        per_token = torch.minimum(torch.maximum(-r * a, -clipped * a), torch.tensor(-c * a, dtype=D))
        objective = torch.maximum(torch.minimum(r * a, clipped * a), torch.tensor(c * a, dtype=D))
        torch.testing.assert_close(per_token, -objective)
        live = (r > 0.8) & (r < c)  # below 1 - eps_low: clipped; above c: dual-clipped
        assert stats["dual_clip_frac"].item() == pytest.approx(2 / n)  # 3.5 and 6.0
    else:
        per_token = -torch.minimum(r * a, clipped * a)
        live = r < 1.28
        assert stats["dual_clip_frac"].item() == 0.0
    assert loss.item() == pytest.approx(per_token.sum().item())
    loss.backward()
    torch.testing.assert_close(logp.grad[0], torch.where(live, -a * r, torch.zeros_like(r)))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_policy_loss_micro_batches_with_global_counts(name, mode):
    """Gradient accumulation: the sum of micro-batch losses with global counts is the full-batch loss."""
    from posttrain.core import count_tokens_and_seqs

    g = torch.Generator().manual_seed(3)
    B, T = 6, 5
    lengths = torch.tensor([5, 2, 0, 4, 1, 3])
    mask = torch.arange(T) < lengths.unsqueeze(1)
    old = torch.randn(B, T, dtype=D, generator=g) * 0.5 - 1
    logp = (old + torch.randn(B, T, dtype=D, generator=g) * 0.3).requires_grad_(True)
    adv = torch.randn(B, 1, dtype=D, generator=g).expand(B, T).clone()
    seq_mask = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 1.0], dtype=D)
    n_tok, n_seq = count_tokens_and_seqs(mask)
    kw = dict(agg_mode=mode, norm_constant=T, seq_mask=seq_mask)
    full, _ = compute_policy_loss(name, logp, old, adv, mask, **kw)
    total = sum(
        compute_policy_loss(name, logp[idx], old[idx], adv[idx], mask[idx], num_tokens=n_tok, num_seqs=n_seq,
                            **{**kw, "seq_mask": seq_mask[idx]})[0]
        for idx in ([0, 1], [2, 3], [4, 5])
    )
    torch.testing.assert_close(total, full)
    (g_full,) = torch.autograd.grad(full, logp)
    (g_micro,) = torch.autograd.grad(total, logp)
    torch.testing.assert_close(g_micro, g_full)


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "cispo"])
def test_ratio_losses_need_old_logp(name):
    logp, _, adv, mask = worked_example()
    with pytest.raises(ValueError, match="old_logp"):
        compute_policy_loss(name, logp, None, adv, mask)
