import pytest
import torch

from posttrain.core import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    discounted_returns,
    gae_advantages,
    masked_whiten,
)

D = torch.float64
EPS = 1e-6


def outcome_batch(scores, lengths, T=4):
    """token_rewards with each score at the last valid token, and the response mask."""
    B = len(scores)
    r = torch.zeros(B, T, dtype=D)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        mask[i, :n] = True
        if n:
            r[i, n - 1] = s
    return r, mask


# group 3: scores 1,2,3 (mean 2, unbiased std 1); group 7: 5,5 (zero variance); group 9: size 1
SCORES = [1.0, 5.0, 2.0, 3.0, 5.0, 7.0]
GROUPS = torch.tensor([3, 7, 3, 3, 7, 9])
LENGTHS = [2, 4, 3, 1, 4, 2]


def per_seq(adv, mask):
    """The single advantage value of each row (checks it is constant over valid tokens)."""
    out = []
    for a, m in zip(adv, mask):
        vals = a[m]
        assert torch.allclose(vals, vals[:1].expand_as(vals)) if vals.numel() else True
        out.append(vals[0].item() if vals.numel() else 0.0)
        assert (a[~m] == 0).all()
    return out


def test_group_norm_hand_values():
    r, mask = outcome_batch(SCORES, LENGTHS)
    adv, ret = compute_advantages("group_norm", r, mask, GROUPS)
    expected = [-1 / (1 + EPS), 0.0, 0.0, 1 / (1 + EPS), 0.0, 0.0]
    assert per_seq(adv, mask) == pytest.approx(expected, abs=1e-12)
    torch.testing.assert_close(ret, adv)


def test_group_norm_sums_token_rewards_into_the_score():
    # KL-shaped per-token rewards are part of the sequence score
    r = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 0.0]], dtype=D)
    mask = torch.ones(2, 3, dtype=torch.bool)
    adv, _ = compute_advantages("group_norm", r, mask, torch.tensor([0, 0]))
    # scores [1, 0]: mean 0.5, unbiased std sqrt(0.5)
    assert adv[0, 0].item() == pytest.approx(0.5 / (0.5**0.5 + EPS))
    assert adv[1, 0].item() == pytest.approx(-0.5 / (0.5**0.5 + EPS))


def test_group_mean_is_dr_grpo():
    r, mask = outcome_batch(SCORES, LENGTHS)
    adv, _ = compute_advantages("group_mean", r, mask, GROUPS)
    assert per_seq(adv, mask) == pytest.approx([-1.0, 0.0, 0.0, 1.0, 0.0, 0.0])
    adv2, _ = compute_advantages("group_norm", r, mask, GROUPS, norm_by_std=False)
    torch.testing.assert_close(adv, adv2)


def test_rloo_leave_one_out():
    r, mask = outcome_batch(SCORES, LENGTHS)
    adv, _ = compute_advantages("rloo", r, mask, GROUPS)
    # 1 - (2+3)/2, 2 - (1+3)/2, 3 - (1+2)/2; zero-variance group -> 0; size-1 group -> 0
    assert per_seq(adv, mask) == pytest.approx([-1.5, 0.0, 0.0, 1.5, 0.0, 0.0])


def test_reinforce_pp_discounted_return_and_global_whitening():
    r = torch.tensor([[0.0, 1.0, 0.0, 2.0], [1.0, 0.0, 0.0, 0.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    g = 0.5
    ret = discounted_returns(r, mask, g)
    expected = torch.tensor([[0.5 * 1.5, 1 + 0.5 * 1.0, 0.5 * 2.0, 2.0], [1.0, 0.0, 0.0, 0.0]], dtype=D)
    torch.testing.assert_close(ret, expected)
    adv, ret2 = compute_advantages("reinforce_pp", r, mask, torch.tensor([0, 0]), gamma=g)
    torch.testing.assert_close(ret2, expected)
    vals = expected[mask]
    whitened = (vals - vals.mean()) / torch.sqrt(vals.var() + 1e-8)
    torch.testing.assert_close(adv[mask], whitened)
    assert (adv[~mask] == 0).all()


def test_reinforce_pp_baseline():
    r, mask = outcome_batch(SCORES, LENGTHS)
    adv, _ = compute_advantages("reinforce_pp_baseline", r, mask, GROUPS)
    centred = torch.tensor([-1.0, 0.0, 0.0, 1.0, 0.0, 0.0], dtype=D)
    tok = centred.unsqueeze(-1).expand(mask.shape)
    vals = tok[mask]
    expected = (vals - vals.mean()) / torch.sqrt(vals.var() + 1e-8)
    torch.testing.assert_close(adv[mask], expected)
    torch.testing.assert_close(adv, masked_whiten(torch.where(mask, tok, 0.0), mask))


def test_gae_lambda1_gamma1_equals_monte_carlo_returns_minus_values():
    torch.manual_seed(0)
    r = torch.randn(4, 6, dtype=D)
    v = torch.randn(4, 6, dtype=D)
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] + [0] * 5, [0] * 6], dtype=torch.bool)
    adv, ret = gae_advantages(r, mask, None, v, gamma=1.0, lam=1.0, whiten=False)
    mc = torch.zeros_like(r)
    for i in range(4):
        n = int(mask[i].sum())
        for t in range(n):
            mc[i, t] = r[i, t:n].sum() - v[i, t]
    torch.testing.assert_close(adv, mc)
    torch.testing.assert_close(ret[mask], (adv + v)[mask])
    assert (ret[~mask] == 0).all()


def test_gae_hand_recursion_and_whitening():
    r = torch.tensor([[0.0, 0.0, 1.0]], dtype=D)
    v = torch.tensor([[0.5, 0.6, 0.7]], dtype=D)
    mask = torch.ones(1, 3, dtype=torch.bool)
    g, lam = 0.9, 0.8
    d2 = 1.0 - 0.7
    d1 = 0.0 + g * 0.7 - 0.6
    d0 = 0.0 + g * 0.6 - 0.5
    a2, a1 = d2, d1 + g * lam * d2
    a0 = d0 + g * lam * a1
    adv, ret = gae_advantages(r, mask, None, v, gamma=g, lam=lam, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[a0, a1, a2]], dtype=D))
    torch.testing.assert_close(ret, torch.tensor([[a0 + 0.5, a1 + 0.6, a2 + 0.7]], dtype=D))
    adv_w, ret_w = compute_advantages("gae", r, mask, None, v, gamma=g, lam=lam)  # whiten default on
    torch.testing.assert_close(ret_w, ret)
    assert adv_w.mean().item() == pytest.approx(0.0, abs=1e-9)
    # lambda = 0: one-step TD errors
    adv0, _ = gae_advantages(r, mask, None, v, gamma=g, lam=0.0, whiten=False)
    torch.testing.assert_close(adv0, torch.tensor([[d0, d1, d2]], dtype=D))


def test_gae_skips_masked_holes():
    """A masked span inside a response (tool output) is skipped: same result as the compacted row."""
    r = torch.tensor([[0.1, 9.0, 0.2, 1.0]], dtype=D)
    v = torch.tensor([[0.3, 9.0, 0.4, 0.5]], dtype=D)
    mask = torch.tensor([[1, 0, 1, 1]], dtype=torch.bool)
    adv, _ = gae_advantages(r, mask, None, v, gamma=0.9, lam=0.7, whiten=False)
    adv_c, _ = gae_advantages(r[:, [0, 2, 3]], torch.ones(1, 3, dtype=torch.bool), None, v[:, [0, 2, 3]], gamma=0.9, lam=0.7, whiten=False)
    torch.testing.assert_close(adv[:, [0, 2, 3]], adv_c)
    assert adv[0, 1] == 0


def test_prm_step_advantages_hand_example():
    # response 0: steps end at t=1 (reward 0.5) and t=3 (1.0); response 1: one step at t=2 (0.0)
    r = torch.tensor([[0.0, 0.5, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]], dtype=D)
    step = torch.tensor([[0, 1, 0, 1, 0], [0, 0, 1, 0, 0]], dtype=torch.bool)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)
    adv, ret = compute_advantages("prm_step", r, mask, torch.tensor([0, 0]), step_mask=step)
    # group steps [0.5, 1.0, 0.0]: mean 0.5, unbiased std 0.5 -> normalised [0, 1, -1] (up to eps)
    k = 0.5 / (0.5 + EPS)
    expected = torch.tensor([[k, k, k, k, 0.0], [-k, -k, -k, 0.0, 0.0]], dtype=D)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, adv)
    with pytest.raises(ValueError, match="step_mask"):
        compute_advantages("prm_step", r, mask, torch.tensor([0, 0]))


def test_prm_step_degenerate_groups_are_zero():
    r = torch.tensor([[0.0, 1.0], [0.0, 1.0], [0.0, 3.0]], dtype=D)
    step = torch.tensor([[0, 1], [0, 1], [0, 1]], dtype=torch.bool)
    mask = torch.ones(3, 2, dtype=torch.bool)
    adv, _ = compute_advantages("prm_step", r, mask, torch.tensor([0, 0, 1]), step_mask=step)
    assert (adv == 0).all()  # group 0: equal step rewards; group 1: a single step


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_edges_every_estimator(name):
    """Zero-variance group, group of size 1, all-padding row, empty batch mask: finite, 0 where undefined."""
    r, mask = outcome_batch([1.0, 1.0, 4.0, 0.0], [3, 2, 2, 0])
    groups = torch.tensor([0, 0, 1, 2])
    opts = {}
    values = None
    if name == "gae":
        values = torch.zeros_like(r)
        opts = {"whiten": False}
    if name == "prm_step":
        opts = {"step_mask": r != 0}
    adv, ret = compute_advantages(name, r, mask, groups, values, **opts)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()
    if name in ("group_norm", "group_mean", "rloo", "reinforce_pp_baseline", "prm_step"):
        assert (adv == 0).all()  # every group here is degenerate
    empty = torch.zeros_like(mask)
    adv, ret = compute_advantages(name, r, empty, groups, values, **opts)
    assert (adv == 0).all() and (ret == 0).all()


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_non_finite_rewards_raise_but_padding_garbage_is_ignored(name):
    r, mask = outcome_batch([1.0, 2.0], [2, 1])
    values = torch.zeros_like(r) if name == "gae" else None
    opts = {"step_mask": mask} if name == "prm_step" else {}
    bad = r.clone()
    bad[1, 3] = float("nan")  # padding
    adv, _ = compute_advantages(name, bad, mask, torch.tensor([0, 0]), values, **opts)
    assert torch.isfinite(adv).all()
    bad[0, 0] = float("inf")
    with pytest.raises(ValueError, match="token_rewards"):
        compute_advantages(name, bad, mask, torch.tensor([0, 0]), values, **opts)


def test_registry_errors():
    r, mask = outcome_batch([1.0], [1])
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'grpo'.*group_mean, group_norm"):
        compute_advantages("grpo", r, mask, torch.tensor([0]))
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", r, mask, None)
    bad_v = torch.full_like(r, float("nan"))
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", r, mask, None, bad_v)


def test_advantages_carry_no_gradient():
    r = torch.tensor([[1.0, 0.0], [0.0, 0.0]], dtype=D, requires_grad=True)
    adv, _ = compute_advantages("group_norm", r, torch.ones(2, 2), torch.tensor([0, 0]))
    assert not adv.requires_grad


@pytest.mark.parametrize("name", ["group_norm", "group_mean", "rloo", "reinforce_pp_baseline"])
def test_all_padding_rows_do_not_shift_group_statistics(name):
    r, mask = outcome_batch([1.0, 2.0, 4.0], [2, 3, 1])
    groups = torch.tensor([0, 0, 0])
    ref, _ = compute_advantages(name, r, mask, groups)
    r2 = torch.cat([r, torch.zeros(1, 4, dtype=D)])
    mask2 = torch.cat([mask, torch.zeros(1, 4, dtype=torch.bool)])
    adv, _ = compute_advantages(name, r2, mask2, torch.tensor([0, 0, 0, 0]))
    torch.testing.assert_close(adv[:3], ref)
    assert (adv[3] == 0).all()
