import pytest
import torch

from posttrain.core import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    discounted_returns,
    gae_advantages,
    masked_whiten,
)
from posttrain.core.advantages import dr_grpo_advantages, grpo_advantages
from posttrain.core.groups import group_ids, group_max, group_mean, group_min, group_std, group_sum

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
    adv2, _ = compute_advantages("group_norm", r, mask, GROUPS, scale="none")
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
    vals = tok[mask]  # whitening statistics: every valid token of the batch (16 tokens)
    expected = ((tok - vals.mean()) / torch.sqrt(vals.var() + 1e-8)).masked_fill(~mask, 0.0)
    # the token-weighted mean of the centred values is (-1 * 2 + 1 * 1) / 16 != 0 (lengths 2 and 1)...
    assert vals.mean().item() == pytest.approx(-1 / 16)
    # ...so plain whitening would push the zero-variance group (rows 1, 4) and the group of one
    # (row 5) by -mean/std; they carry no relative signal and are explicitly 0
    degenerate = torch.tensor([False, True, False, False, True, True])
    expected[degenerate] = 0.0
    torch.testing.assert_close(adv, expected)
    assert (adv[degenerate] == 0).all() and (adv[~degenerate][mask[~degenerate]] != 0).all()
    plain = masked_whiten(torch.where(mask, tok, 0.0), mask)
    torch.testing.assert_close(adv[~degenerate], plain[~degenerate])
    assert (plain[degenerate][mask[degenerate]] != 0).all()  # what the explicit zeroing prevents


def test_reinforce_pp_whitens_over_the_whole_batch_ignoring_groups():
    g = torch.Generator().manual_seed(4)
    r = torch.randn(5, 6, dtype=D, generator=g)
    mask = torch.arange(6) < torch.tensor([6, 3, 1, 0, 4]).unsqueeze(1)
    a1, _ = compute_advantages("reinforce_pp", r, mask, torch.tensor([0, 0, 1, 1, 2]), gamma=0.9)
    a2, _ = compute_advantages("reinforce_pp", r, mask, torch.tensor([0, 1, 2, 3, 4]), gamma=0.9)
    torch.testing.assert_close(a1, a2)
    vals = a1[mask]
    assert vals.mean().item() == pytest.approx(0.0, abs=1e-12)
    assert vals.std().item() == pytest.approx(1.0, rel=1e-6)  # unbiased std over all 14 valid tokens


@pytest.mark.parametrize("name", ["group_norm", "group_mean", "rloo", "reinforce_pp_baseline", "prm_step"])
def test_zero_variance_group_is_exactly_zero_with_inexact_floats(name):
    """Scores 0.1 x 3: their float mean (and RLOO's leave-one-out mean) is not exactly 0.1."""
    assert (0.1 + 0.1 + 0.1 - 0.1) / 2 != 0.1
    r, mask = outcome_batch([0.1, 0.1, 0.1, 0.0, 1.0], [2, 3, 4, 2, 3])
    groups = torch.tensor([0, 0, 0, 1, 1])
    adv, _ = compute_advantages(name, r, mask, groups, **({"step_mask": r != 0} if name == "prm_step" else {}))
    assert (adv[:3] == 0).all()
    if name != "prm_step":  # group 1 has a single step (the 0.0 score is no step): 0 as well
        assert (adv[3:][mask[3:]] != 0).all()


def _prm_reference(r, mask, step_mask, groups, eps=EPS):
    """Loop version: normalise all step rewards of a group together, then sum those ending at or after t."""
    adv = torch.zeros_like(r)
    for gid in groups.unique():
        rows = (groups == gid).nonzero().flatten().tolist()
        steps = [(i, t) for i in rows for t in range(r.shape[1]) if mask[i, t] and step_mask[i, t]]
        vals = torch.tensor([r[i, t].item() for i, t in steps], dtype=D)
        if len(steps) < 2 or vals.max() == vals.min():
            continue
        normed = (vals - vals.mean()) / (vals.std() + eps)  # torch std is unbiased
        for (i, s), v in zip(steps, normed):
            for t in range(s + 1):
                if mask[i, t]:
                    adv[i, t] += v
    return adv


def test_prm_step_matches_loop_reference_and_uses_group_not_sample_statistics():
    g = torch.Generator().manual_seed(5)
    B, T = 7, 8
    r = torch.randn(B, T, dtype=D, generator=g)
    mask = torch.arange(T) < torch.tensor([8, 6, 7, 0, 5, 8, 3]).unsqueeze(1)
    mask[0, 2:4] = False  # a masked hole (tool output): a step ending there is ignored
    step_mask = torch.rand(B, T, generator=g) < 0.4
    step_mask[0, 3] = True
    groups = torch.tensor([2, 2, 2, 2, 9, 9, 4])
    adv, ret = compute_advantages("prm_step", r, mask, groups, step_mask=step_mask)
    torch.testing.assert_close(adv, _prm_reference(r, mask, step_mask, groups))
    torch.testing.assert_close(ret, adv)
    assert adv[mask].abs().sum() > 0
    # per-sample normalisation (one group per row) would give a different answer
    per_sample, _ = compute_advantages("prm_step", r, mask, torch.arange(B), step_mask=step_mask)
    assert not torch.allclose(per_sample, adv)


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
    assert adv_w.std().item() == pytest.approx(1.0, rel=1e-5)  # unbiased, over the 3 valid tokens (eps 1e-8 in var)
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


# --- peer conventions: singletons, batch scaling, kept degenerate groups ---------------------

# group 0: scores 1, 2, 6 (mean 3, unbiased std sqrt(7)); group 5: a single sample with score 4
S_SCORES, S_LENGTHS, S_GROUPS = [1.0, 2.0, 6.0, 4.0], [2, 3, 1, 2], torch.tensor([0, 0, 0, 5])
SQ7 = 7**0.5


@pytest.mark.parametrize(
    "name, singleton, expected",
    [
        ("group_norm", "zero", [-2 / (SQ7 + EPS), -1 / (SQ7 + EPS), 3 / (SQ7 + EPS), 0.0]),
        ("group_norm", "raw", [-2 / (SQ7 + EPS), -1 / (SQ7 + EPS), 3 / (SQ7 + EPS), 4.0]),
        ("group_norm", "unit_std", [-2 / (SQ7 + EPS), -1 / (SQ7 + EPS), 3 / (SQ7 + EPS), 4 / (1 + EPS)]),
        ("group_mean", "zero", [-2.0, -1.0, 3.0, 0.0]),
        ("group_mean", "raw", [-2.0, -1.0, 3.0, 4.0]),
        ("group_mean", "unit_std", [-2.0, -1.0, 3.0, 4.0]),
        # 1 - (2+6)/2, 2 - (1+6)/2, 6 - (1+2)/2
        ("rloo", "zero", [-3.0, -1.5, 4.5, 0.0]),
        ("rloo", "raw", [-3.0, -1.5, 4.5, 4.0]),
        ("rloo", "unit_std", [-3.0, -1.5, 4.5, 4.0]),
    ],
)
def test_singleton_modes_hand_values(name, singleton, expected):
    r, mask = outcome_batch(S_SCORES, S_LENGTHS)
    adv, ret = compute_advantages(name, r, mask, S_GROUPS, singleton=singleton)
    assert per_seq(adv, mask) == pytest.approx(expected, abs=1e-12)
    torch.testing.assert_close(ret, adv)


def _whiten_tokens(seq_values, mask):
    """Hand whitening of per-sequence values broadcast to tokens: mean and unbiased std over
    all valid tokens, rsqrt(var + 1e-8) (verl's masked_whiten)."""
    tok = torch.tensor(seq_values, dtype=D).unsqueeze(-1).expand(mask.shape)
    vals = tok[mask]
    return ((tok - vals.mean()) / torch.sqrt(vals.var() + 1e-8)).masked_fill(~mask, 0.0)


@pytest.mark.parametrize("singleton", ["zero", "raw", "unit_std"])
@pytest.mark.parametrize("keep_degenerate", [False, True])
def test_reinforce_pp_baseline_singleton_and_keep_degenerate(singleton, keep_degenerate):
    # group 0: 1, 2, 6 (mean 3); group 5: the single score 4; group 8: flat 2, 2
    r, mask = outcome_batch(S_SCORES + [2.0, 2.0], S_LENGTHS + [3, 4])
    groups = torch.tensor([0, 0, 0, 5, 8, 8])
    adv, ret = compute_advantages(
        "reinforce_pp_baseline", r, mask, groups, singleton=singleton, keep_degenerate=keep_degenerate
    )
    single = 0.0 if singleton == "zero" else 4.0  # "raw" and "unit_std": baseline 0 -> R
    expected = _whiten_tokens([-2.0, -1.0, 3.0, single, 0.0, 0.0], mask)
    if not keep_degenerate:
        expected[4:] = 0.0  # the flat group is reset
        if singleton == "zero":
            expected[3] = 0.0  # so is the group of one, unless it has a baseline-0 signal
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, adv)
    if keep_degenerate:  # verl: whitening moves the flat group away from 0, and that is kept
        assert (adv[4][mask[4]] != 0).all()


def test_group_norm_unit_std_singletons_are_verl_grpo():
    """verl's GRPO gives a group of one mean 0 and std 1: (R - 0) / (1 + eps)."""
    r, mask = outcome_batch([3.0, -2.0, 0.5], [1, 2, 4])
    adv, _ = grpo_advantages(r, mask, torch.tensor([0, 1, 2]), singleton="unit_std")
    assert per_seq(adv, mask) == pytest.approx([3.0 / (1 + 1e-6), -2.0 / (1 + 1e-6), 0.5 / (1 + 1e-6)], abs=1e-15)
    adv, _ = grpo_advantages(r, mask, torch.tensor([0, 1, 2]), singleton="unit_std", eps=1e-4)
    assert per_seq(adv, mask) == pytest.approx([3.0 / (1 + 1e-4), -2.0 / (1 + 1e-4), 0.5 / (1 + 1e-4)], abs=1e-15)
    # a zero score stays 0; "raw" divides by nothing
    adv, _ = grpo_advantages(r, mask, torch.tensor([0, 1, 2]), singleton="raw")
    assert per_seq(adv, mask) == pytest.approx([3.0, -2.0, 0.5], abs=0)


def test_singleton_options_leave_all_padding_rows_alone():
    # row 2 is all padding in group 0: group 0 keeps two members; row 3 is an empty group of its own
    r, mask = outcome_batch([1.0, 3.0, 0.0, 0.0, 5.0], [2, 1, 0, 0, 3])
    groups = torch.tensor([0, 0, 0, 4, 7])
    for name in ("group_norm", "group_mean", "rloo", "reinforce_pp_baseline"):
        for singleton in ("raw", "unit_std"):
            adv, _ = compute_advantages(name, r, mask, groups, singleton=singleton)
            assert (adv[2:4] == 0).all(), (name, singleton)
            assert (adv[4][mask[4]] != 0).all()  # the real singleton gets its signal
            ref, _ = compute_advantages(name, r[[0, 1, 4]], mask[[0, 1, 4]], groups[[0, 1, 4]], singleton=singleton)
            torch.testing.assert_close(adv[[0, 1, 4]], ref)
    # TRL batch std: computed over the 3 non-empty rows only
    adv, _ = grpo_advantages(r, mask, groups, scale="batch", singleton="unit_std")
    std = torch.tensor([1.0, 3.0, 5.0], dtype=D).std().item()
    assert per_seq(adv, mask) == pytest.approx([-1 / (std + EPS), 1 / (std + EPS), 0.0, 0.0, 5 / (std + EPS)], abs=1e-12)


@pytest.mark.parametrize("name", ["group_norm", "group_mean", "rloo", "reinforce_pp_baseline"])
def test_unknown_singleton_mode_lists_valid_ones(name):
    r, mask = outcome_batch([1.0, 2.0], [1, 1])
    with pytest.raises(ValueError, match=r"singleton must be one of 'zero', 'raw', 'unit_std'; got 'one'"):
        compute_advantages(name, r, mask, torch.tensor([0, 0]), singleton="one")


def test_batch_scale_hand_values():
    # TRL scale_rewards="batch": (R - mean_G) / (std over all scores + eps), unbiased std
    scores = [1.0, 0.0, 0.0, 1.0, 3.0, 3.0]
    r, mask = outcome_batch(scores, [1, 2, 3, 4, 2, 1])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])  # group 2 is flat
    adv, ret = grpo_advantages(r, mask, groups, scale="batch")
    mean = sum(scores) / 6
    std = (sum((s - mean) ** 2 for s in scores) / 5) ** 0.5
    assert std == pytest.approx(torch.tensor(scores, dtype=D).std().item(), abs=1e-15)
    a = 0.5 / (std + EPS)
    assert per_seq(adv, mask) == pytest.approx([a, -a, -a, a, 0.0, 0.0], abs=1e-12)
    torch.testing.assert_close(ret, adv)
    # the group scale would give +-0.5 / (sqrt(0.5) + eps)
    grp, _ = grpo_advantages(r, mask, groups)
    assert per_seq(grp, mask)[0] == pytest.approx(0.5 / (0.5**0.5 + EPS))
    # "none" is Dr. GRPO
    none, _ = grpo_advantages(r, mask, groups, scale="none")
    torch.testing.assert_close(none, dr_grpo_advantages(r, mask, groups)[0])
    with pytest.raises(ValueError, match=r"scale must be one of 'group', 'batch', 'none'"):
        grpo_advantages(r, mask, groups, scale="global")


def test_batch_scale_zero_std_gives_zero_not_nan():
    r, mask = outcome_batch([2.0, 2.0, 2.0], [1, 2, 3])
    for singleton in ("zero", "unit_std"):
        adv, _ = grpo_advantages(r, mask, torch.tensor([0, 0, 1]), scale="batch", eps=0.0, singleton=singleton)
        assert (adv == 0).all()
    # a batch of one singleton: std of one score is 0 -> 0 ("raw" does not divide: R)
    r1, m1 = outcome_batch([2.0], [2])
    adv, _ = grpo_advantages(r1, m1, torch.tensor([0]), scale="batch", singleton="unit_std")
    assert (adv == 0).all()
    adv, _ = grpo_advantages(r1, m1, torch.tensor([0]), scale="batch", singleton="raw")
    assert (adv[m1] == 2.0).all()


def _today(name, r, mask, groups):
    """The pre-option formulas, written out with the same primitives (bit-for-bit reference)."""
    valid = mask.bool()
    scores = torch.where(valid, r, torch.zeros_like(r)).sum(-1)
    has = valid.any(-1)
    g = group_ids(groups, len(groups))
    g = group_ids(torch.where(has, g.inverse, g.num_groups + torch.arange(len(groups))), len(groups))
    n = g.counts[g.inverse]
    sums = group_sum(scores, g)[g.inverse]
    flat = group_max(scores, g) == group_min(scores, g)
    degenerate = flat | (n < 2)
    centred = scores - group_mean(scores, g)
    if name == "group_norm":
        seq = centred / (group_std(scores, g) + EPS)
    elif name == "rloo":
        seq = scores - (sums - scores) / (n.to(D) - 1).clamp_min(1)
    else:
        seq = centred
    seq = torch.where(degenerate, torch.zeros_like(seq), seq)
    adv = torch.where(valid, seq.unsqueeze(-1).expand(valid.shape), torch.zeros_like(r))
    if name == "reinforce_pp_baseline":
        adv = masked_whiten(adv, valid)
        adv = torch.where(degenerate.unsqueeze(-1), torch.zeros_like(adv), adv)
    return adv


@pytest.mark.parametrize("name", ["group_norm", "group_mean", "rloo", "reinforce_pp_baseline"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_defaults_reproduce_previous_outputs_exactly(name, seed):
    gen = torch.Generator().manual_seed(seed)
    B, T = 13, 6
    r = torch.randn(B, T, dtype=D, generator=gen)
    mask = torch.arange(T) < torch.randint(0, T + 1, (B,), generator=gen).unsqueeze(1)
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 4, 4, 5])  # 2 and 5: groups of one
    r[10:12] = 0.25  # group 4: flat if both rows are non-empty
    adv, _ = compute_advantages(name, r, mask, groups)
    assert torch.equal(adv, _today(name, r, mask, groups))
    explicit = {"group_norm": {"scale": "group", "eps": EPS}, "reinforce_pp_baseline": {"keep_degenerate": False}}
    adv2, _ = compute_advantages(name, r, mask, groups, singleton="zero", **explicit.get(name, {}))
    assert torch.equal(adv, adv2)
