import math

import pytest
import torch

from posttrain.core.aggregation import AGGREGATION_MODES, count_tokens_and_seqs
from posttrain.core.policy_loss import (
    POLICY_LOSSES,
    cispo_loss,
    compute_policy_loss,
    gspo_loss,
    gspo_sequence_log_ratio,
    kimi_loss,
    offpolicy_sequence_mask,
    ppo_clip_loss,
    reinforce_loss,
    sapo_loss,
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
    with pytest.raises(ValueError, match=r"unknown policy loss 'ppo'.*cispo, gspo, kimi, ppo_clip, reinforce, sapo"):
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


@pytest.mark.parametrize("count_empty_rows", [False, True])
@pytest.mark.parametrize("mode", AGGREGATION_MODES)
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_policy_loss_micro_batches_with_global_counts(name, mode, count_empty_rows):
    """Gradient accumulation: the sum of micro-batch losses with global counts is the full-batch loss."""
    g = torch.Generator().manual_seed(3)
    B, T = 6, 5
    lengths = torch.tensor([5, 2, 0, 4, 1, 3])
    mask = torch.arange(T) < lengths.unsqueeze(1)
    old = torch.randn(B, T, dtype=D, generator=g) * 0.5 - 1
    logp = (old + torch.randn(B, T, dtype=D, generator=g) * 0.3).requires_grad_(True)
    adv = torch.randn(B, 1, dtype=D, generator=g).expand(B, T).clone()
    seq_mask = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 1.0], dtype=D)
    n_tok, n_seq = count_tokens_and_seqs(mask, count_empty_rows=count_empty_rows)
    kw = dict(agg_mode=mode, norm_constant=T, seq_mask=seq_mask, count_empty_rows=count_empty_rows)
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


# --- options for the numeric conventions of TRL, verl and OpenRLHF ------------------------------

# The options each loss reads (besides the aggregation ones, which every loss reads).
USES = {
    "ppo_clip": {"clip_low", "clip_high", "dual_clip", "delta", "log_ratio_clamp"},
    "gspo": {"clip_low", "clip_high", "delta", "log_ratio_clamp", "seq_log_ratio_clamp"},
    "cispo": {"clip_low", "clip_high", "log_ratio_clamp", "ratio_level", "seq_log_ratio_clamp"},
    "sapo": {"log_ratio_clamp", "tau_pos", "tau_neg"},
    "reinforce": {"log_ratio_clamp"},
    "kimi": {"log_ratio_clamp", "kimi_tau"},
}
NON_DEFAULT = {
    "clip_low": 0.1, "clip_high": 0.3, "dual_clip": 3.0, "delta": 5.0, "log_ratio_clamp": None,
    "seq_log_ratio_clamp": 10.0, "ratio_level": "sequence", "tau_pos": 2.0, "tau_neg": 2.0,
    "kimi_tau": 2.0,
}


def ratio_inputs(ratios, advantages):
    """One row of tokens with the given ratios (old_logp = 0) and advantages, float64."""
    logp = torch.log(torch.tensor([ratios], dtype=D)).requires_grad_(True)
    n = len(ratios)
    return logp, torch.zeros(1, n, dtype=D), torch.tensor([advantages], dtype=D), torch.ones(1, n)


def test_registry_lists_every_loss():
    assert set(POLICY_LOSSES) == set(USES)


@pytest.mark.parametrize("option", sorted(NON_DEFAULT))
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_foreign_option_raises_naming_loss_and_option(name, option):
    logp, old, adv, mask = worked_example()
    kw = {option: NON_DEFAULT[option]}
    if name == "cispo" and option == "seq_log_ratio_clamp":
        kw["ratio_level"] = "sequence"  # the sequence clamp needs the sequence ratio
    if option in USES[name]:
        loss, _ = compute_policy_loss(name, logp, old, adv, mask, **kw)
        assert torch.isfinite(loss)
    else:
        with pytest.raises(ValueError, match=rf"'{name}'.*{option}"):
            compute_policy_loss(name, logp, old, adv, mask, **kw)
    # the default value itself is always accepted, whatever the loss
    from posttrain.core.policy_loss import SHARED_OPTIONS

    compute_policy_loss(name, logp, old, adv, mask, **{option: SHARED_OPTIONS[option].default})


def test_option_errors():
    logp, old, adv, mask = worked_example()
    with pytest.raises(TypeError, match="clip_ratio"):
        ppo_clip_loss(logp, old, adv, mask, clip_ratio=0.2)
    with pytest.raises(ValueError, match=r"cispo.*ratio_level='token'.*seq_log_ratio_clamp"):
        cispo_loss(logp, old, adv, mask, seq_log_ratio_clamp=10.0)
    with pytest.raises(ValueError, match="ratio_level"):
        cispo_loss(logp, old, adv, mask, ratio_level="tokens")
    with pytest.raises(ValueError, match="delta"):
        ppo_clip_loss(logp, old, adv, mask, delta=1.2)  # must exceed 1 + clip_high = 1.2
    with pytest.raises(ValueError, match="delta"):
        gspo_loss(logp, old, adv, mask, clip_high=None, delta=1.0)
    ppo_clip_loss(logp, old, adv, mask, clip_high=None, delta=1.01)
    for option in ("log_ratio_clamp", "seq_log_ratio_clamp"):
        with pytest.raises(ValueError, match=option):
            gspo_loss(logp, old, adv, mask, **{option: 0.0})
    for option in ("tau_pos", "tau_neg"):
        with pytest.raises(ValueError, match=option):
            sapo_loss(logp, old, adv, mask, **{option: 0.0})
    for tau in (0.0, -1.0):
        with pytest.raises(ValueError, match="kimi_tau"):
            kimi_loss(logp, old, adv, mask, kimi_tau=tau)
    for option in ("dp_size", "count_empty_rows"):
        with pytest.raises(ValueError, match=option):
            reinforce_loss(logp, old, adv, mask, **{option: 0})


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_log_ratio_clamp_none_leaves_large_log_ratios(name):
    """TRL clamps nothing: |log r| = 25 and 30 reach exp as they are (float64 holds e^30)."""
    old = torch.zeros(1, 2, dtype=D)
    logp = torch.tensor([[25.0, -30.0]], dtype=D, requires_grad=True)
    adv = torch.tensor([[-1.0, 1.0]], dtype=D)
    mask = torch.ones(1, 2)
    kw = dict(clip_low=None, clip_high=None) if "clip_low" in USES[name] else {}
    _, clamped = compute_policy_loss(name, logp, old, adv, mask, **kw)
    loss, stats = compute_policy_loss(name, logp, old, adv, mask, log_ratio_clamp=None, **kw)
    assert stats["ppo_kl"].item() == pytest.approx((-25.0 + 30.0) / 2, rel=1e-12)
    assert clamped["ppo_kl"].item() == pytest.approx(0.0, abs=1e-12)  # +-20 cancel
    expected_approx_kl = ((math.exp(25) - 1 - 25) + (math.exp(-30) - 1 + 30)) / 2
    assert stats["approx_kl"].item() == pytest.approx(expected_approx_kl, rel=1e-12)
    if name == "ppo_clip":  # unclipped: l = -r A = [e^25, -e^-30], grad -r A / 2
        assert loss.item() == pytest.approx((math.exp(25) - math.exp(-30)) / 2, rel=1e-12)
        loss.backward()
        expected_grad = torch.tensor([[math.exp(25), -math.exp(-30)]], dtype=D) / 2
        torch.testing.assert_close(logp.grad, expected_grad, rtol=1e-12, atol=0)
    if name == "gspo":  # s = exp(mean(25, -30)) = e^-2.5 for both tokens
        s = math.exp(-2.5)
        assert loss.item() == pytest.approx((s - s) / 2, abs=1e-15)
        assert stats["ratio_mean"].item() == pytest.approx(s, rel=1e-12)


def test_ppo_kl_is_mean_negative_log_ratio():
    """verl / OpenRLHF ppo_kl = mean(-(log pi - log pi_old)), beside approx_kl (k3)."""
    logp, old, adv, mask = worked_example()  # ratios 2.0 and 0.4
    expected = -(math.log(2.0) + math.log(0.4)) / 2
    for name in POLICY_LOSSES:
        _, stats = compute_policy_loss(name, logp, old, adv, mask)
        assert stats["ppo_kl"].item() == pytest.approx(expected), name
    _, stats = reinforce_loss(logp, None, adv, mask)
    assert stats["ppo_kl"].item() == 0.0
    # only the tokens the loss uses count (seq_mask, padding)
    mask2 = torch.tensor([[1, 0]])
    _, stats = ppo_clip_loss(logp, old, adv, mask2)
    assert stats["ppo_kl"].item() == pytest.approx(-math.log(2.0))


def test_delta_caps_the_unclipped_ratio():
    """TRL delta (INTELLECT-2): l = -min(min(r, delta) A, clip(r) A)."""
    logp, old, adv, mask = ratio_inputs([0.5, 1.1, 2.0, 5.0, 5.0, 2.0], [1, 1, 1, 1, -1, -1])
    kw = dict(agg_mode="seq-mean-token-sum")  # one row: the loss is the sum over tokens
    loss, stats = ppo_clip_loss(logp, old, adv, mask, delta=3.0, **kw)
    # per token: -0.5, -1.1, -1.2 (clipped), -1.2 (clipped), -(-3) (delta), -(-2)
    assert loss.item() == pytest.approx(-0.5 - 1.1 - 1.2 - 1.2 + 3.0 + 2.0)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, -1.1, 0.0, 0.0, 0.0, 2.0]], dtype=D))
    assert stats["clip_frac_high"].item() == pytest.approx(2 / 6)  # definitions unchanged by delta
    assert stats["clip_frac_low"].item() == 0.0
    plain, _ = ppo_clip_loss(logp, old, adv, mask, **kw)
    assert plain.item() == pytest.approx(-0.5 - 1.1 - 1.2 - 1.2 + 5.0 + 2.0)
    # GSPO: TRL applies delta to the sequence ratio: s = 4 > delta = 3 with A = -1
    logp, old, adv, mask = ratio_inputs([4.0, 4.0], [-1, -1])
    loss, _ = gspo_loss(logp, old, adv, mask, delta=3.0, agg_mode="seq-mean-token-mean")
    assert loss.item() == pytest.approx(3.0)
    loss.backward()
    assert (logp.grad == 0).all()
    logp.grad = None
    loss, _ = gspo_loss(logp, old, adv, mask, agg_mode="seq-mean-token-mean")
    assert loss.item() == pytest.approx(4.0)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.full((1, 2), 4.0 / 2, dtype=D))


def test_gspo_seq_log_ratio_clamp():
    """verl: log s_it = logp - sg(logp) + sg(mean_t log r) clamped to <= 10, then exp;
    a clamped sequence has no gradient."""
    old = torch.zeros(2, 2, dtype=D)
    logp = torch.tensor([[12.0, 12.0], [0.2, 0.4]], dtype=D, requires_grad=True)
    adv = torch.ones(2, 2, dtype=D)
    mask = torch.ones(2, 2)
    kw = dict(clip_low=None, clip_high=None, agg_mode="seq-mean-token-mean")
    s1 = math.exp(0.3)
    loss, stats = gspo_loss(logp, old, adv, mask, seq_log_ratio_clamp=10.0, **kw)
    assert loss.item() == pytest.approx(-(math.exp(10) + s1) / 2)
    assert stats["ratio_mean"].item() == pytest.approx((math.exp(10) + s1) / 2)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0], [-s1 / 4, -s1 / 4]], dtype=D))
    # without the clamp the first sequence has its full ratio and gradient
    logp.grad = None
    loss, _ = gspo_loss(logp, old, adv, mask, **kw)
    assert loss.item() == pytest.approx(-(math.exp(12) + s1) / 2)
    loss.backward()
    torch.testing.assert_close(logp.grad[0], torch.full((2,), -math.exp(12) / 4, dtype=D))
    # the per-token clamp acts before the mean: [12, 12] -> [5, 5] with log_ratio_clamp = 5
    lr = gspo_sequence_log_ratio(logp, old, mask, log_ratio_clamp=5.0, seq_log_ratio_clamp=10.0)
    torch.testing.assert_close(lr, torch.tensor([5.0, 0.3], dtype=D))
    lr = gspo_sequence_log_ratio(logp, old, mask, log_ratio_clamp=None, seq_log_ratio_clamp=10.0)
    torch.testing.assert_close(lr, torch.tensor([10.0, 0.3], dtype=D))


def test_cispo_sequence_level_ratio():
    """ratio_level="sequence": every token of sequence i is weighted by sg[clip(s_i)],
    s_i = exp(mean_t log r_it)."""
    old = torch.zeros(3, 2, dtype=D)
    logp = torch.tensor([[0.5, 0.1], [-0.1, 0.1], [0.4, 0.4]], dtype=D, requires_grad=True)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0], [-2.0, -2.0]], dtype=D)
    mask = torch.ones(3, 2)
    loss, stats = cispo_loss(logp, old, adv, mask, clip_low=None, clip_high=0.2, ratio_level="sequence")
    # s = [e^0.3, 1, e^0.4] -> weights [1.2, 1, 1.2]
    w = torch.tensor([[1.2, 1.2], [1.0, 1.0], [1.2, 1.2]], dtype=D)
    assert loss.item() == pytest.approx((-(w * adv * logp.detach())).sum().item() / 6)
    loss.backward()
    torch.testing.assert_close(logp.grad, -w * adv / 6)
    assert stats["clip_frac_high"].item() == pytest.approx(4 / 6)
    assert stats["clip_frac_high_pos"].item() == pytest.approx(2 / 6)  # only the A > 0 sequence
    assert stats["clip_frac"].item() == pytest.approx(4 / 6)
    assert stats["ratio_mean"].item() == pytest.approx((math.exp(0.3) + 1 + math.exp(0.4)) / 3)
    # token level for comparison: ratios e^0.5 and e^0.1 weigh 1.2 and e^0.1
    logp.grad = None
    loss, stats = cispo_loss(logp, old, adv, mask, clip_low=None, clip_high=0.2)
    loss.backward()
    assert logp.grad[0, 1].item() == pytest.approx(-math.exp(0.1) / 6)
    # seq_log_ratio_clamp caps log s_i before the clip: 0.3, 0.4 -> 0.1
    logp.grad = None
    loss, stats = cispo_loss(logp, old, adv, mask, clip_low=None, clip_high=0.2, ratio_level="sequence",
                             seq_log_ratio_clamp=0.1)
    loss.backward()
    e = math.exp(0.1)
    torch.testing.assert_close(logp.grad, -torch.tensor([[e, e], [1.0, 1.0], [e, e]], dtype=D) * adv / 6)
    assert stats["clip_frac"].item() == 0.0


def test_cispo_clip_frac_high_pos():
    """TRL cispo_clip_ratio: tokens with (r > cap) and A > 0, over all tokens."""
    logp, old, adv, mask = ratio_inputs([2.0, 2.0, 0.4, 1.1], [1, -1, 1, 1])
    _, stats = cispo_loss(logp, old, adv, mask, clip_low=None, clip_high=0.2)
    assert stats["clip_frac_high"].item() == pytest.approx(2 / 4)
    assert stats["clip_frac_high_pos"].item() == pytest.approx(1 / 4)
    assert stats["clip_frac_low"].item() == 0.0
    _, stats = cispo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert stats["clip_frac_low"].item() == pytest.approx(1 / 4)  # 0.4 < 0.8
    assert stats["clip_frac_high_pos"].item() == pytest.approx(1 / 4)


def sapo_reference(r, a, tau_pos=1.0, tau_neg=1.05):
    """Per-token SAPO loss and its d/dlogp, from the formula with math (no torch)."""
    loss, grad = [], []
    for ri, ai in zip(r, a):
        tau = tau_pos if ai > 0 else tau_neg
        s = 1.0 / (1.0 + math.exp(-tau * (ri - 1.0)))
        loss.append(-s * 4.0 / tau * ai)
        grad.append(-ai * 4.0 * s * (1.0 - s) * ri)  # d/dlogp: sigmoid' * tau * (4/tau) * r
    return loss, grad


def test_sapo_values_and_gradient():
    r, a = [0.5, 1.0, 1.5, 1.5, 1.0, 3.0], [1.0, 1.0, 2.0, -1.0, -0.5, 0.0]
    logp, old, adv, mask = ratio_inputs(r, a)
    loss, stats = sapo_loss(logp, old, adv, mask, agg_mode="token-sum")
    ref_loss, ref_grad = sapo_reference(r, a)
    assert loss.item() == pytest.approx(sum(ref_loss))
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([ref_grad], dtype=D))
    # at r = 1 the gate is 2 / tau (not 1) and the gradient is -A, the policy gradient
    assert ref_loss[1] == pytest.approx(-2.0) and logp.grad[0, 1].item() == pytest.approx(-1.0)
    assert ref_loss[4] == pytest.approx(0.5 * 2 / 1.05) and logp.grad[0, 4].item() == pytest.approx(0.5)
    assert stats["clip_frac"].item() == stats["clip_frac_low"].item() == stats["clip_frac_high"].item() == 0.0
    assert stats["ratio_mean"].item() == pytest.approx(sum(r) / len(r))
    # temperatures
    logp.grad = None
    loss, _ = sapo_loss(logp, old, adv, mask, agg_mode="token-sum", tau_pos=2.0, tau_neg=0.5)
    assert loss.item() == pytest.approx(sum(sapo_reference(r, a, 2.0, 0.5)[0]))
    # the token log-ratio clamp applies: log r = 30 is read as 20 (a tiny tau keeps the gate unsaturated)
    big, o, one, m = ratio_inputs([1.0], [1.0])
    with torch.no_grad():
        big.fill_(30.0)
    tau = 1e-9
    for clamp, log_r in ((20.0, 20.0), (None, 30.0)):
        loss, _ = sapo_loss(big, o, one, m, agg_mode="token-sum", tau_pos=tau, log_ratio_clamp=clamp)
        expected = -4.0 / tau / (1.0 + math.exp(-tau * (math.exp(log_r) - 1.0)))
        assert loss.item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_dp_size_and_count_empty_rows_reach_the_aggregation(name):
    torch.manual_seed(4)
    logp = torch.randn(3, 4, dtype=D) * 0.1 - 1
    old = logp + torch.randn(3, 4, dtype=D) * 0.1
    adv = torch.randn(3, 4, dtype=D)
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0]])
    base, _ = compute_policy_loss(name, logp, old, adv, mask, agg_mode="seq-mean-token-mean")
    scaled, _ = compute_policy_loss(name, logp, old, adv, mask, agg_mode="seq-mean-token-mean", dp_size=4)
    assert scaled.item() == pytest.approx(4 * base.item())
    all_rows, _ = compute_policy_loss(name, logp, old, adv, mask, agg_mode="seq-mean-token-mean", count_empty_rows=True)
    assert all_rows.item() == pytest.approx(base.item() * 2 / 3)  # 2 non-empty rows of 3
    summed, _ = compute_policy_loss(name, logp, old, adv, mask, agg_mode="token-sum")
    mean, _ = compute_policy_loss(name, logp, old, adv, mask, agg_mode="token-mean")
    assert summed.item() == pytest.approx(5 * mean.item())


def _valid_mean(x, mask):
    m = mask.to(D)
    return ((x.to(D) * m).sum() / m.sum()).item()


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "cispo"])
def test_clip_frac_is_verl_pg_clipfrac(name):
    """clip_frac = verl's pg_clipfrac: mean of [-A clip(r) > -A r] (cispo: [r != clip(r)]);
    dual_clip_frac = pg_clipfrac_lower: mean of [max(-rA, -clip(r)A) > -cA and A < 0]."""
    g = torch.Generator().manual_seed(5)
    B, T = 6, 8
    mask = torch.arange(T) < torch.tensor([8, 5, 0, 3, 8, 1]).unsqueeze(1)
    old = torch.randn(B, T, dtype=D, generator=g) - 1
    logp = old + torch.randn(B, T, dtype=D, generator=g) * 0.5
    adv = torch.randn(B, T, dtype=D, generator=g)
    if name == "gspo":
        adv = adv[:, :1].expand(B, T).clone()
    kw = dict(clip_low=0.2, clip_high=0.28)
    if name == "ppo_clip":
        kw["dual_clip"] = 1.5
    _, stats = compute_policy_loss(name, logp, old, adv, mask, **kw)
    if name == "gspo":
        r = gspo_sequence_log_ratio(logp, old, mask).exp().unsqueeze(-1).expand(B, T)
    else:
        r = (logp - old).exp()
    clipped = r.clamp(0.8, 1.28)
    if name == "cispo":
        verl_clipfrac = _valid_mean(r != clipped, mask)
    else:
        verl_clipfrac = _valid_mean(-adv * clipped > -adv * r, mask)
    assert 0 < verl_clipfrac < 1
    assert stats["clip_frac"].item() == pytest.approx(verl_clipfrac, rel=1e-12)
    if name == "ppo_clip":
        clip_loss = torch.maximum(-adv * r, -adv * clipped)
        lower = _valid_mean((clip_loss > -adv * 1.5) & (adv < 0), mask)
        assert 0 < lower
        assert stats["dual_clip_frac"].item() == pytest.approx(lower, rel=1e-12)


# --- reference transcriptions (float64) of peers' losses ---------------------------------------


def verl_vanilla_ppo(logp, old, adv, mask, clip_low, clip_high, clip_ratio_c, agg_mode, dp_size=1,
                     batch_num_tokens=None, global_batch_size=None):
    """verl's vanilla PPO loss (core_algos, policy loss "vanilla" + agg_loss), transcribed:
    log-ratio clamped to +-20, dual clip c for A < 0, masked means with + 1e-8."""
    m = mask.to(logp.dtype)
    log_r = torch.clamp(logp - old, min=-20.0, max=20.0)
    r = torch.exp(log_r)
    l1 = -adv * r
    l2 = -adv * torch.clamp(r, 1 - clip_low, 1 + clip_high)
    l_clip = torch.maximum(l1, l2)
    l3 = -adv * clip_ratio_c
    per_token = torch.where(adv < 0, torch.minimum(l3, l_clip), l_clip)
    stats = {
        "ppo_kl": (-log_r * m).sum() / (m.sum() + 1e-8),
        "pg_clipfrac": ((l2 > l1).to(m.dtype) * m).sum() / (m.sum() + 1e-8),
        "pg_clipfrac_lower": (((l_clip > l3) & (adv < 0)).to(m.dtype) * m).sum() / (m.sum() + 1e-8),
    }
    if agg_mode == "token-mean":
        n = m.sum() if batch_num_tokens is None else batch_num_tokens
        loss = (per_token * m).sum() / n * dp_size
    elif agg_mode == "seq-mean-token-mean":
        count = m.sum(-1)
        seq_loss = (per_token * m).sum(-1) / (count + 1e-8)
        seq_mask = (count > 0).to(m.dtype)
        n = seq_mask.sum() if global_batch_size is None else global_batch_size
        loss = (seq_loss * seq_mask).sum() / n * dp_size
    else:
        raise NotImplementedError(agg_mode)
    return loss, stats


def trl_grpo(logp, old, adv, mask, epsilon_low, epsilon_high, delta=None):
    """TRL GRPOTrainer, loss_type "grpo" (token-level ratio, beta = 0), transcribed: no clamp,
    per-row mean over clamp(min=1) token counts, then mean over all B rows."""
    m = mask.to(logp.dtype)
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()


def peer_inputs(seed):
    """Random float64 inputs with an all-padding row (row 2) and one |log r| > 20 token."""
    g = torch.Generator().manual_seed(seed)
    B, T = 5, 7
    mask = torch.arange(T) < torch.tensor([7, 4, 0, 2, 6]).unsqueeze(1)
    old = torch.randn(B, T, dtype=D, generator=g) - 2
    logp = old + torch.randn(B, T, dtype=D, generator=g) * 0.4
    logp[3, 1] = old[3, 1] + 21.0  # beyond +-20: verl clamps it, TRL does not
    adv_seq = torch.randn(B, 1, dtype=D, generator=g)
    adv_seq[3] = -abs(adv_seq[3])  # A < 0 on the huge ratio: its loss is not clipped away
    adv = torch.where(mask, adv_seq.expand(B, T), torch.zeros(B, T, dtype=D))
    return logp, old, adv, mask


def _loss_and_grad(fn, logp):
    x = logp.clone().requires_grad_(True)
    out = fn(x)
    loss = out[0] if isinstance(out, tuple) else out
    (grad,) = torch.autograd.grad(loss, x)
    return loss, grad, (out[1] if isinstance(out, tuple) else None)


@pytest.mark.parametrize("counts", [False, True])
@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_reproduces_verl_vanilla_ppo(agg_mode, counts):
    logp, old, adv, mask = peer_inputs(6)
    kw = dict(dp_size=4, batch_num_tokens=90.0, global_batch_size=16.0) if counts else {}
    ref_loss, ref_grad, ref_stats = _loss_and_grad(
        lambda x: verl_vanilla_ppo(x, old, adv, mask, 0.2, 0.28, 3.0, agg_mode, **kw), logp)
    ours_kw = dict(dp_size=4, num_tokens=90.0, num_seqs=16.0) if counts else {}
    loss, grad, stats = _loss_and_grad(
        lambda x: ppo_clip_loss(x, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0,
                                log_ratio_clamp=20.0, agg_mode=agg_mode, **ours_kw), logp)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-7, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-7, atol=1e-300)
    names = (("ppo_kl", "ppo_kl"), ("clip_frac", "pg_clipfrac"), ("dual_clip_frac", "pg_clipfrac_lower"))
    for ours_name, verl_name in names:
        torch.testing.assert_close(stats[ours_name], ref_stats[verl_name], rtol=1e-7, atol=0)
    assert ref_stats["pg_clipfrac"] > 0 and ref_stats["pg_clipfrac_lower"] > 0


@pytest.mark.parametrize("delta", [None, 4.0])
def test_reproduces_trl_grpo(delta):
    logp, old, adv, mask = peer_inputs(7)
    ref_loss, ref_grad, _ = _loss_and_grad(lambda x: trl_grpo(x, old, adv, mask, 0.2, 0.28, delta), logp)
    loss, grad, _ = _loss_and_grad(
        lambda x: ppo_clip_loss(x, old, adv, mask, clip_low=0.2, clip_high=0.28, delta=delta, log_ratio_clamp=None,
                                agg_mode="seq-mean-token-mean", count_empty_rows=True), logp)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-7, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-7, atol=1e-300)
    if delta is None:  # the unclamped e^21 ratio dominates: a clamp at 20 would change the loss
        clamped, _ = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28,
                                   agg_mode="seq-mean-token-mean", count_empty_rows=True)
        assert not math.isclose(clamped.item(), loss.item(), rel_tol=1e-3)
    # the default (non-empty rows only) divides by 4 rows, not 5
    default, _ = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, delta=delta, log_ratio_clamp=None,
                               agg_mode="seq-mean-token-mean")
    assert default.item() == pytest.approx(loss.item() * 5 / 4, rel=1e-12)


def verl_gspo(logp, old, adv, mask, clip_low, clip_high):
    """verl's GSPO loss, transcribed: no token clamp, sequence log-ratio clamped to <= 10,
    "seq-mean-token-mean" aggregation with + 1e-8."""
    m = mask.to(logp.dtype)
    seq = ((logp - old) * m).sum(-1) / m.sum(-1).clamp(min=1)
    log_s = torch.clamp(logp - logp.detach() + seq.detach().unsqueeze(-1), max=10.0)
    s = torch.exp(log_s)
    l1, l2 = -adv * s, -adv * torch.clamp(s, 1 - clip_low, 1 + clip_high)
    per_token = torch.maximum(l1, l2)
    count = m.sum(-1)
    seq_loss = (per_token * m).sum(-1) / (count + 1e-8)
    seq_mask = (count > 0).to(m.dtype)
    clipfrac = ((l2 > l1).to(m.dtype) * m).sum() / (m.sum() + 1e-8)
    return (seq_loss * seq_mask).sum() / seq_mask.sum(), {"pg_clipfrac": clipfrac}


def verl_sapo(logp, old, adv, mask, tau_pos=1.0, tau_neg=1.05):
    """verl's SAPO loss, transcribed: token log-ratio clamped to +-20, sigmoid gate."""
    m = mask.to(logp.dtype)
    r = torch.exp(torch.clamp(logp - old, min=-20.0, max=20.0))
    tau = torch.where(adv > 0, torch.tensor(tau_pos, dtype=D), torch.tensor(tau_neg, dtype=D))
    per_token = -torch.sigmoid(tau * (r - 1.0)) * (4.0 / tau) * adv
    count = m.sum(-1)
    seq_loss = (per_token * m).sum(-1) / (count + 1e-8)
    seq_mask = (count > 0).to(m.dtype)
    return (seq_loss * seq_mask).sum() / seq_mask.sum()


def trl_cispo(logp, old, adv, mask, epsilon_high, level, num_items_in_batch, num_processes):
    """TRL GRPOTrainer, loss_type "cispo", transcribed: weight min(r, epsilon_high) detached (r
    per token, or exp of the per-sequence mean log-ratio), sum / (num_items / num_processes)."""
    m = mask.to(logp.dtype)
    log_ratio = logp - old
    if level == "sequence":
        log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    weight = torch.clamp(torch.exp(log_ratio), max=epsilon_high).detach()
    per_token = -weight * adv * logp
    return (per_token * m).sum() / (num_items_in_batch / num_processes)


def test_reproduces_verl_gspo_and_sapo():
    logp, old, adv, mask = peer_inputs(8)
    logp[0] = old[0] + 10.5  # a sequence log-ratio past verl's clamp at 10
    ref_loss, ref_grad, ref_stats = _loss_and_grad(lambda x: verl_gspo(x, old, adv, mask, 0.2, 0.28), logp)
    loss, grad, stats = _loss_and_grad(
        lambda x: gspo_loss(x, old, adv, mask, clip_low=0.2, clip_high=0.28, log_ratio_clamp=None,
                            seq_log_ratio_clamp=10.0, agg_mode="seq-mean-token-mean"), logp)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-7, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-7, atol=1e-300)
    torch.testing.assert_close(stats["clip_frac"], ref_stats["pg_clipfrac"], rtol=1e-7, atol=0)
    logp, old, adv, mask = peer_inputs(9)
    adv = adv + torch.randn(adv.shape, dtype=D, generator=torch.Generator().manual_seed(1)) * mask  # token advantages
    ref_loss, ref_grad, _ = _loss_and_grad(lambda x: verl_sapo(x, old, adv, mask), logp)
    loss, grad, _ = _loss_and_grad(lambda x: sapo_loss(x, old, adv, mask, agg_mode="seq-mean-token-mean"), logp)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-7, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-7, atol=1e-300)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_reproduces_trl_cispo(level):
    logp, old, adv, mask = peer_inputs(10)
    logp = old + (logp - old).clamp(max=3.0)  # keep sequence ratios moderate; some clip at 5
    logp[0] = old[0] + 2.0  # s = e^2 > 5: clipped at both levels
    n_items, procs = 57.0, 3
    ref_loss, ref_grad, _ = _loss_and_grad(lambda x: trl_cispo(x, old, adv, mask, 5.0, level, n_items, procs), logp)
    loss, grad, stats = _loss_and_grad(
        lambda x: cispo_loss(x, old, adv, mask, clip_low=None, clip_high=4.0, log_ratio_clamp=None, ratio_level=level,
                             agg_mode="token-mean", num_tokens=n_items, dp_size=procs), logp)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-7, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-7, atol=1e-300)
    assert stats["clip_frac_high"] > 0


# --- Kimi k1.5: squared surrogate with a mirror-descent pull towards pi_old ---------------------

def kimi_inputs():
    """Row 0: token log-ratios 0.1, 0.2 (l = 0.3), A = 1; row 1: one valid token with log-ratio
    -0.2 (l = -0.2) and a padded token, A = -0.5."""
    old = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], dtype=D)
    logp = (old + torch.tensor([[0.1, 0.2], [-0.2, 7.0]], dtype=D)).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0], [-0.5, 9.0]], dtype=D)
    mask = torch.tensor([[1, 1], [1, 0]])
    return logp, old, adv, mask


def test_kimi_hand_computed_values():
    logp, old, adv, mask = kimi_inputs()
    # tau = 0.5: L_i = (A_i - tau l_i)^2 / (2 tau) = (1 - 0.15)^2 = 0.7225 and (-0.5 + 0.1)^2 = 0.16
    expected = {
        "seq-mean-token-sum": (0.7225 + 0.16) / 2,           # each row's tokens sum to L_i
        "seq-mean-token-mean": (0.7225 / 2 + 0.16 / 1) / 2,  # per-token share L_i / |y_i|, then means
        "token-mean": (0.7225 + 0.16) / 3,                   # 3 valid tokens
        "token-sum": 0.7225 + 0.16,
    }
    for mode, value in expected.items():
        loss, stats = kimi_loss(logp, old, adv, mask, kimi_tau=0.5, agg_mode=mode)
        assert loss.item() == pytest.approx(value), mode
    assert stats["seq_log_ratio_mean"].item() == pytest.approx((0.3 - 0.2) / 2)
    assert stats["clip_frac"].item() == 0.0
    assert stats["ppo_kl"].item() == pytest.approx(-(0.1 + 0.2 - 0.2) / 3)
    # tau = 2: (1 - 0.6)^2 / 4 = 0.04 and (-0.5 + 0.4)^2 / 4 = 0.0025
    loss, _ = kimi_loss(logp, old, adv, mask, kimi_tau=2.0, agg_mode="seq-mean-token-sum")
    assert loss.item() == pytest.approx((0.04 + 0.0025) / 2)


def test_kimi_gradient_is_baselined_policy_gradient_minus_mirror_descent_term():
    """grad L_i = -[A_i grad l_i - tau/2 grad l_i^2], l_i the sequence log-ratio; per token of
    row i that is -(A_i - tau l_i) (seq-mean-token-sum, divided by the number of rows)."""
    g = torch.Generator().manual_seed(5)
    B, T, tau = 5, 6, 0.7
    lengths = torch.tensor([6, 3, 1, 0, 4])
    mask = torch.arange(T) < lengths.unsqueeze(1)
    old = torch.randn(B, T, dtype=D, generator=g) - 1
    logp = (old + torch.randn(B, T, dtype=D, generator=g) * 0.3).requires_grad_(True)
    a_seq = torch.randn(B, dtype=D, generator=g)
    adv = a_seq.unsqueeze(1).expand(B, T).clone()
    loss, _ = kimi_loss(logp, old, adv, mask, kimi_tau=tau, agg_mode="seq-mean-token-sum")
    (grad,) = torch.autograd.grad(loss, logp)
    seq_log_ratio = ((logp - old) * mask).sum(-1)  # differentiable l_i
    n_seq = int((lengths > 0).sum())
    surrogate = (a_seq * seq_log_ratio - tau / 2 * seq_log_ratio**2).sum() / n_seq
    (expected,) = torch.autograd.grad(-surrogate, logp)
    torch.testing.assert_close(grad, expected)
    by_hand = -(a_seq - tau * seq_log_ratio.detach()).unsqueeze(1) * mask / n_seq
    torch.testing.assert_close(grad, by_hand)
    assert (grad[3] == 0).all() and (grad[~mask] == 0).all()


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_kimi_on_policy_gradient_is_reinforce_with_group_mean_advantages(mode):
    """At pi_theta = pi_old (l = 0) the tau term has no gradient: what is left is REINFORCE with
    the group-mean advantages r - mean_group(r), under the same aggregation."""
    from posttrain.core import compute_advantages

    g = torch.Generator().manual_seed(6)
    B, T = 6, 5
    lengths = torch.tensor([5, 2, 4, 1, 3, 5])
    mask = (torch.arange(T) < lengths.unsqueeze(1)).to(D)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    token_rewards = torch.zeros(B, T, dtype=D)
    token_rewards[torch.arange(B), lengths - 1] = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0], dtype=D)
    adv, _ = compute_advantages("group_mean", token_rewards, mask, groups)
    logp = (torch.randn(B, T, dtype=D, generator=g) - 1).requires_grad_(True)
    kimi, _ = kimi_loss(logp, logp.detach(), adv, mask, kimi_tau=0.3, agg_mode=mode)
    reinforce, _ = reinforce_loss(logp, None, adv, mask, agg_mode=mode)
    (g_kimi,) = torch.autograd.grad(kimi, logp)
    (g_reinforce,) = torch.autograd.grad(reinforce, logp)
    torch.testing.assert_close(g_kimi, g_reinforce)
    assert g_kimi.abs().sum() > 0


def test_is_weights_scale_each_tokens_term_and_a_zero_weight_drops_it_from_loss_and_stats():
    """The train-inference correction's weights (mismatch.correction_weights) multiply each
    token's term, detached; a 0 drops the token from the stats too; the counts stay."""
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]], dtype=D, requires_grad=True)
    old = torch.tensor([[-1.0, -2.0, -1.0], [-1.0, -1.0, -1.0]], dtype=D)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    weights = torch.tensor([[2.0, 0.0, 0.5], [1.0, 0.25, float("nan")]], dtype=D)  # nan on padding
    loss, stats = ppo_clip_loss(logp, old, adv, mask, clip_low=None, clip_high=None, is_weights=weights)
    # ratios [1, 1, e^0.5] / [1, 1]; unclipped terms -r A: [-1, -1, -e^0.5] / [2, 2]; token-mean over 5
    expected = (2.0 * -1 + 0.0 + 0.5 * -math.exp(0.5) + 1.0 * 2 + 0.25 * 2) / 5
    assert loss.item() == pytest.approx(expected)
    loss.backward()
    # d/dlogp of -w r A = -w r A: the weight scales the gradient and gets none itself
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.0, 0.0, -0.5 * math.exp(0.5)],
                                                        [2.0, 0.5, 0.0]], dtype=D) / 5)
    # the stats see the 4 tokens with a weight: ratio mean (1 + e^0.5 + 1 + 1) / 4
    assert stats["ratio_mean"].item() == pytest.approx((3 + math.exp(0.5)) / 4)
    with pytest.raises(ValueError, match="is_weights"):
        ppo_clip_loss(logp, old, adv, mask, is_weights=weights[:, :2])
