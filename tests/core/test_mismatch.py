"""The train-inference mismatch math (core/mismatch.py): hand values, Monte-Carlo checks of the
estimators, and the numbers verl's and slime's own rollout-correction code gives on one input."""

import math

import pytest
import torch

from posttrain.core import (
    CORRECTION_LEVELS,
    MISMATCH_MAX_KEYS,
    MISMATCH_SUM_KEYS,
    correction_weights,
    level_log_ratio,
    masked_is_keep,
    mismatch_log_ratio,
    mismatch_metrics,
    mismatch_sums,
    truncated_is_weights,
)

D = torch.float64
L = math.log
NAN = float("nan")

# Hand example: log-ratios [ln 3, 0, -ln 4 | pad] and an empty row [pad x3]; NaN in padding.
LR = torch.tensor([[L(3), 0.0, -L(4), NAN], [NAN, 7.0, float("inf"), NAN]], dtype=D)
MASK = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0]])


def _t(rows):
    return torch.tensor(rows, dtype=D)


# --- mismatch_log_ratio ---------------------------------------------------------------------

def test_log_ratio_hand_values_and_padding():
    old = _t([[L(0.6), L(0.5), L(0.2), NAN]])
    sampler = _t([[L(0.2), L(0.5), L(0.8), float("-inf")]])
    lr = mismatch_log_ratio(old, sampler, torch.tensor([[1, 1, 1, 0]]))
    # log(0.6/0.2) = ln 3, log(0.5/0.5) = 0, log(0.2/0.8) = -ln 4; padding (NaN - -inf) -> 0
    torch.testing.assert_close(lr, _t([[L(3), 0.0, -L(4), 0.0]]))


def test_log_ratio_is_detached():
    old = torch.zeros(1, 2, dtype=D, requires_grad=True)
    assert not mismatch_log_ratio(old, torch.zeros(1, 2, dtype=D), torch.ones(1, 2)).requires_grad


def test_log_ratio_errors_name_the_argument():
    ones = torch.ones(1, 3)
    with pytest.raises(ValueError, match="sampler_logp has shape"):
        mismatch_log_ratio(torch.zeros(1, 3), torch.zeros(1, 2), ones)
    with pytest.raises(ValueError, match="mask has shape"):
        mismatch_log_ratio(torch.zeros(1, 3), torch.zeros(1, 3), torch.ones(1, 2))
    with pytest.raises(ValueError, match="old_logp contains"):
        mismatch_log_ratio(torch.tensor([[0.0, NAN, 0.0]]), torch.zeros(1, 3), ones)
    with pytest.raises(ValueError, match="sampler_logp contains"):
        mismatch_log_ratio(torch.zeros(1, 3), torch.tensor([[0.0, 0.0, float("-inf")]]), ones)


# --- level_log_ratio ------------------------------------------------------------------------

def test_level_log_ratio_each_level():
    # row 0: sum = ln 3 - ln 4 = ln(3/4), mean = ln(3/4) / 3; the empty row stays 0
    s = L(3 / 4)
    torch.testing.assert_close(level_log_ratio(LR, MASK, "token"), _t([[L(3), 0, -L(4), 0], [0, 0, 0, 0]]))
    torch.testing.assert_close(level_log_ratio(LR, MASK, "sequence"), _t([[s, s, s, 0], [0, 0, 0, 0]]))
    torch.testing.assert_close(level_log_ratio(LR, MASK, "geometric"), _t([[s / 3] * 3 + [0], [0, 0, 0, 0]]))


def test_level_log_ratio_errors():
    with pytest.raises(ValueError, match="unknown level 'seq'.*token, sequence, geometric"):
        level_log_ratio(LR, MASK, "seq")
    with pytest.raises(ValueError, match="log_ratio contains"):
        level_log_ratio(_t([[0.0, NAN]]), torch.ones(1, 2), "token")
    with pytest.raises(ValueError, match="mask has shape"):
        level_log_ratio(LR, torch.ones(2, 3), "token")
    assert CORRECTION_LEVELS == ("token", "sequence", "geometric")


# --- truncated_is_weights -------------------------------------------------------------------

def test_tis_hand_values():
    # token: min([3, 1, 1/4], 2) = [2, 1, 0.25]; sequence: 3/4 (under the cap); geometric: (3/4)^(1/3)
    torch.testing.assert_close(truncated_is_weights(LR, MASK), _t([[2, 1, 0.25, 0], [0, 0, 0, 0]]))
    torch.testing.assert_close(truncated_is_weights(LR, MASK, "sequence"), _t([[0.75] * 3 + [0], [0] * 4]))
    g = 0.75 ** (1 / 3)
    torch.testing.assert_close(truncated_is_weights(LR, MASK, "geometric"), _t([[g] * 3 + [0], [0] * 4]))
    # a cap of 0.5 binds everywhere but on the 1/4 token; sequence 3/4 -> 0.5
    torch.testing.assert_close(truncated_is_weights(LR, MASK, cap=0.5), _t([[0.5, 0.5, 0.25, 0], [0] * 4]))
    torch.testing.assert_close(truncated_is_weights(LR, MASK, "sequence", cap=0.5), _t([[0.5] * 3 + [0], [0] * 4]))


def test_tis_is_detached_float():
    lr = torch.zeros(1, 3, dtype=torch.bfloat16, requires_grad=True)
    w = truncated_is_weights(lr, torch.ones(1, 3))
    assert not w.requires_grad and w.dtype == torch.float32
    torch.testing.assert_close(w, torch.ones(1, 3))


def test_tis_long_sequence_caps_in_log_space():
    # 4096 tokens with log-ratio +1: the product e^4096 overflows even fp64; its log does not
    T = 4096
    lr = torch.cat([torch.ones(1, T), -torch.ones(1, T)])
    mask = torch.ones(2, T)
    w = truncated_is_weights(lr, mask, "sequence", cap=2.0)
    assert torch.isfinite(w).all()
    torch.testing.assert_close(w[0], torch.full((T,), 2.0))
    assert (w[1] == 0).all()  # e^-4096 underflows to 0, never NaN
    torch.testing.assert_close(truncated_is_weights(lr, mask, "geometric", cap=2.0)[1], torch.full((T,), math.exp(-1)))
    # the metrics do not overflow either
    sums = mismatch_sums(lr, mask, tis="sequence", mis="sequence")
    assert all(math.isfinite(float(v)) for v in sums.values())
    assert float(sums["capped"]) == T and float(sums["masked"]) == 2 * T


def test_tis_cap_must_be_positive():
    for bad in (0.0, -1.0, NAN):
        with pytest.raises(ValueError, match="cap must be > 0"):
            truncated_is_weights(LR, MASK, cap=bad)
    with pytest.raises(ValueError, match="unknown level"):
        truncated_is_weights(LR, MASK, "tok")


# --- masked_is_keep -------------------------------------------------------------------------

def test_mis_bounds_inclusive_in_log_space():
    # ratios [2, 1/2, 2 e^1e-12, 1/2 e^-1e-12]: the bounds themselves are kept, just beyond them not
    lr = _t([[L(2), -L(2), L(2) + 1e-12, -L(2) - 1e-12, NAN]])
    keep = masked_is_keep(lr, torch.tensor([[1, 1, 1, 1, 0]]))
    assert keep.dtype == torch.bool
    assert keep.tolist() == [[True, True, False, False, False]]
    # low = high = 1 keeps exactly the agreeing tokens
    assert masked_is_keep(_t([[0.0, 1e-9]]), torch.ones(1, 2), low=1.0, high=1.0).tolist() == [[True, False]]


def test_mis_each_level():
    # token: [3, 1, 1/4] in [1/2, 2] -> [F, T, F]; sequence 3/4 -> kept; geometric (3/4)^(1/3) -> kept
    assert masked_is_keep(LR, MASK).tolist() == [[False, True, False, False], [False] * 4]
    assert masked_is_keep(LR, MASK, "sequence").tolist() == [[True, True, True, False], [False] * 4]
    assert masked_is_keep(LR, MASK, "geometric").tolist() == [[True, True, True, False], [False] * 4]
    # with [0.8, 1.25]: sequence 3/4 dropped, geometric 0.9086 kept
    assert masked_is_keep(LR, MASK, "sequence", low=0.8, high=1.25)[0].tolist() == [False] * 4
    assert masked_is_keep(LR, MASK, "geometric", low=0.8, high=1.25)[0].tolist() == [True] * 3 + [False]


def test_mis_bound_errors_name_the_bound():
    for low in (0.0, -0.5, 1.5, NAN):
        with pytest.raises(ValueError, match="low must satisfy 0 < low <= 1"):
            masked_is_keep(LR, MASK, low=low)
    for high in (0.99, NAN):
        with pytest.raises(ValueError, match="high must satisfy high >= 1"):
            masked_is_keep(LR, MASK, high=high)


# --- correction_weights ---------------------------------------------------------------------

def test_correction_weights_combinations():
    assert correction_weights(LR, MASK) is None
    torch.testing.assert_close(correction_weights(LR, MASK, tis="token"), truncated_is_weights(LR, MASK))
    # MIS alone: keep as 0/1 floats
    torch.testing.assert_close(correction_weights(LR, MASK, mis="token"), _t([[0, 1, 0, 0], [0] * 4]))
    # token TIS x sequence MIS (3/4 kept): [2, 1, 0.25]
    torch.testing.assert_close(correction_weights(LR, MASK, tis="token", mis="sequence"),
                               _t([[2, 1, 0.25, 0], [0] * 4]))
    # sequence TIS (3/4) x token MIS [F, T, F]
    torch.testing.assert_close(correction_weights(LR, MASK, tis="sequence", mis="token"),
                               _t([[0, 0.75, 0, 0], [0] * 4]))
    # cap 4 and band [1/8, 4]: [3, 1, 1/4] all kept, none capped
    torch.testing.assert_close(correction_weights(LR, MASK, tis="token", tis_cap=4.0, mis="token", mis_low=0.125,
                                                  mis_high=4.0), _t([[3, 1, 0.25, 0], [0] * 4]))
    w = correction_weights(LR.float().requires_grad_(), MASK, tis="token", mis="token")
    assert w.dtype == torch.float32 and not w.requires_grad


def test_correction_weights_errors_name_the_option():
    with pytest.raises(ValueError, match="unknown tis 'x'"):
        correction_weights(LR, MASK, tis="x")
    with pytest.raises(ValueError, match="unknown mis 'x'"):
        correction_weights(LR, MASK, mis="x")
    with pytest.raises(ValueError, match="tis_cap must be > 0"):
        correction_weights(LR, MASK, tis="token", tis_cap=0.0)
    with pytest.raises(ValueError, match="mis_low must satisfy"):
        correction_weights(LR, MASK, mis="token", mis_low=2.0)
    with pytest.raises(ValueError, match="mis_high must satisfy"):
        correction_weights(LR, MASK, mis="token", mis_high=0.5)


# --- mismatch_sums / mismatch_metrics -------------------------------------------------------

def test_sums_hand_values():
    # valid log-ratios [ln 3, 0, -ln 4 | ln 2], ratios [3, 1, 1/4 | 2]
    lr = _t([[L(3), 0.0, -L(4), NAN], [L(2), NAN, NAN, NAN]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    sums = mismatch_sums(lr, mask, tis="token", mis="token")
    assert set(sums) == {"tokens", "abs_log_ratio", "abs_log_ratio_max", "kl", "capped", "masked", "ratio",
                         "ratio_sq"}
    assert set(MISMATCH_MAX_KEYS) <= set(sums)
    assert set(sums) == set(MISMATCH_SUM_KEYS) | set(MISMATCH_MAX_KEYS)  # the update packs them in this order
    assert all(v.dtype == D and v.dim() == 0 for v in sums.values())
    k3 = (3 - 1 - L(3)) + 0 + (0.25 - 1 + L(4)) + (2 - 1 - L(2))  # r - 1 - log r per token
    expected = {"tokens": 4, "abs_log_ratio": L(3) + L(4) + L(2), "abs_log_ratio_max": L(4), "kl": k3,
                "capped": 1,   # only 3 > 2 (2 itself is not capped)
                "masked": 2,   # 3 and 1/4 are outside [1/2, 2] (2 is kept)
                "ratio": 3 + 1 + 0.25 + 2, "ratio_sq": 9 + 1 + 0.0625 + 4}
    for key, value in expected.items():
        assert float(sums[key]) == pytest.approx(value, rel=1e-12), key
    metrics = mismatch_metrics(sums)
    assert metrics == pytest.approx({"abs_log_ratio_mean": (L(3) + L(4) + L(2)) / 4, "abs_log_ratio_max": L(4),
                                     "kl": k3 / 4, "capped_frac": 0.25, "masked_frac": 0.5,
                                     "ess": 6.25 ** 2 / (4 * 14.0625)})  # 39.0625 / 56.25 = 0.6944


def test_sums_without_corrections_and_sequence_levels():
    sums = mismatch_sums(LR, MASK)
    assert float(sums["capped"]) == 0 and float(sums["masked"]) == 0
    # sequence level, every token of the row counts: its ratio 3/4 is over a cap of 1/2 (3 tokens
    # capped) and outside [0.8, 1.25] (3 tokens masked)
    sums = mismatch_sums(LR, MASK, tis="sequence", tis_cap=0.5, mis="sequence", mis_low=0.8, mis_high=1.25)
    assert float(sums["capped"]) == 3 and float(sums["masked"]) == 3


def test_sums_clamp_the_ratio_at_20():
    # lr = 30 -> r = e^20, k3 = e^20 - 1 - 20; lr = -30 -> r = e^-20, k3 = e^-20 - 1 + 20
    sums = mismatch_sums(_t([[30.0, -30.0]]), torch.ones(1, 2))
    k3 = (math.exp(20) - 21) + (math.exp(-20) + 19)
    assert float(sums["kl"]) == pytest.approx(k3, rel=1e-12)
    assert float(sums["ratio_sq"]) == pytest.approx(math.exp(40) + math.exp(-40), rel=1e-12)
    assert float(sums["abs_log_ratio_max"]) == 30.0  # the raw |lr|, not clamped


def test_empty_batch():
    sums = mismatch_sums(LR[1:], MASK[1:], tis="token", mis="token")
    assert all(float(v) == 0 for v in sums.values())
    assert mismatch_metrics(sums) == {"abs_log_ratio_mean": 0.0, "abs_log_ratio_max": 0.0, "kl": 0.0,
                                      "capped_frac": 0.0, "masked_frac": 0.0, "ess": 1.0}
    assert mismatch_metrics(mismatch_sums(torch.zeros(0, 3), torch.zeros(0, 3)))["ess"] == 1.0


def test_sums_add_over_micro_batches():
    g = torch.Generator().manual_seed(0)
    lr = torch.randn(6, 7, generator=g, dtype=D) * 0.7
    mask = torch.rand(6, 7, generator=g) > 0.3
    opts = dict(tis="geometric", tis_cap=1.3, mis="token", mis_low=0.6, mis_high=1.8)
    whole = mismatch_sums(lr, mask, **opts)
    parts = [mismatch_sums(lr[i:i + 2], mask[i:i + 2], **opts) for i in range(0, 6, 2)]
    reduced = {k: (max if k in MISMATCH_MAX_KEYS else sum)(float(p[k]) for p in parts) for k in whole}
    assert mismatch_metrics(reduced) == pytest.approx(mismatch_metrics(whole), rel=1e-12)


def test_float32_input_gives_float64_sums():
    sums = mismatch_sums(LR.float(), MASK)
    assert all(v.dtype == D for v in sums.values())


# --- Monte-Carlo: the estimators estimate what the docstring says ----------------------------

def _mc_setup(n=200_000, vocab=5):
    g = torch.Generator().manual_seed(1234)
    mu = torch.softmax(torch.randn(vocab, generator=g, dtype=D) * 0.6, -1)
    old = torch.softmax(torch.randn(vocab, generator=g, dtype=D) * 0.6, -1)
    y = torch.multinomial(mu, n, replacement=True, generator=g).view(400, n // 400)
    lr = mismatch_log_ratio(old.log()[y], mu.log()[y], torch.ones_like(y))
    return mu, old, y, lr


def test_monte_carlo_kl_tis_and_ess():
    mu, old, y, lr = _mc_setup()
    n, mask = y.numel(), torch.ones_like(y)
    ratio = old / mu
    metrics = mismatch_metrics(mismatch_sums(lr, mask))

    # mean k3 over y ~ mu -> KL(mu || pi_old), exactly computed; within 5 standard errors
    k3 = lr.exp() - 1 - lr
    exact_kl = float((mu * (mu.log() - old.log())).sum())
    assert metrics["kl"] == pytest.approx(float(k3.mean()), rel=1e-10)
    assert abs(metrics["kl"] - exact_kl) < 5 * float(k3.std()) / math.sqrt(n)

    # a cap no ratio reaches: the TIS-weighted mean of f(y) -> E_{pi_old}[f]
    f = torch.tensor([1.0, -2.0, 0.5, 3.0, 1.5], dtype=D)
    assert float(ratio.max()) < 1e6
    w = truncated_is_weights(lr, mask, cap=1e6)
    wf = w * f[y]
    assert abs(float(wf.mean()) - float((old * f).sum())) < 5 * float(wf.std()) / math.sqrt(n)
    # a binding cap: the mean tends to E_mu[min(r, C) f], which is not E_{pi_old}[f] (truncation
    # trades that bias for a bounded variance)
    cap = 1.0  # every token pi_old favours is capped
    truncated = float((mu * ratio.clamp(max=cap) * f).sum())
    wf = truncated_is_weights(lr, mask, cap=cap) * f[y]
    assert abs(float(wf.mean()) - truncated) < 5 * float(wf.std()) / math.sqrt(n)
    assert abs(truncated - float((old * f).sum())) > 20 * float(wf.std()) / math.sqrt(n)

    # ESS: Kish's (sum w)^2 / sum w^2 over n, the same as 1 / mean((w / mean w)^2) (verl's form);
    # for y ~ mu it tends to 1 / E_mu[r^2] = 1 / sum pi_old^2 / mu
    r = lr.exp().flatten()
    kish = float(r.sum() ** 2 / (r * r).sum()) / n
    assert metrics["ess"] == pytest.approx(kish, rel=1e-10)
    assert metrics["ess"] == pytest.approx(1 / float(((r / r.mean()) ** 2).mean()), rel=1e-10)
    assert metrics["ess"] == pytest.approx(1 / float((old**2 / mu).sum()), rel=0.01)
    assert 0 < metrics["ess"] <= 1


# --- peers: verl's and slime's numbers for the same input -------------------------------------
# How the numbers below were obtained: a throwaway script under /tmp ran the peers' own functions
# (pulled out of their files with `ast`; verl's `verl_F.masked_sum`/`masked_mean` taken from
# verl/utils/torch_functional.py the same way; nothing else replaced) on this float64 input:
#   verl  b178a3cd (2026-01-29) verl/trainer/ppo/rollout_corr_helper.py:
#         compute_rollout_correction_weights(rollout_is=token|sequence, rollout_is_threshold=2.0),
#         compute_rollout_rejection_mask(rollout_rs=token_k1|seq_sum_k1|seq_mean_k1, "0.5_2.0" / "0.8_1.5"),
#         compute_offpolicy_metrics (k3_kl), compute_is_metrics (rollout_is_eff_sample_size)
#   verl  7eb030e9 (2025-12-15), same file: compute_rollout_rejection_mask(rollout_rs=token|sequence|geometric,
#         rollout_rs_threshold=2.0, rollout_rs_threshold_lower=0.5 / 1.5 and 0.8)
#   slime 624b824a slime/backends/megatron_utils/loss.py: vanilla_tis_function, icepop_function
#         (tis_clip=2, tis_clip_low=0 (default) and 0.5), fed the valid tokens row by row;
#         examples/train_infer_mismatch_helper/mis.py: compute_mis_weights (tis_mode=truncate,
#         use_rs, tis/rs_level = token|sequence|geometric, bounds [0.5, 2], no veto, no batch norm)
# Padding holds finite garbage here: verl multiplies by the mask (NaN padding would give NaN
# weights there); ours is checked with NaN padding above.

PEER_OLD = _t([[L(.6), L(.5), L(.2), L(.3)], [L(.5), L(.25), L(.5), -3.0],
               [L(.1), L(.3), L(.45), -3.0], [L(.9), L(.6), L(.6), -3.0]])
PEER_MU = _t([[L(.2), L(.5), L(.8), L(.2)], [L(.25), L(.5), L(.4), -7.0],
              [L(.5), L(.5), L(.5), -7.0], [L(.5), L(.4), L(.5), -7.0]])
PEER_MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 0]])
# ratios pi_old/mu: [3, 1, 1/4, 1.5] (prod 1.125) | [2, 1/2, 1.25] (prod 1.25; 2 and 1/2 exactly: the
# bounds) | [0.2, 0.6, 0.9] (prod 0.108, geo 0.476) | [1.8, 1.5, 1.2] (prod 3.24, geo 1.480)

VERL_IS = {  # compute_rollout_correction_weights, threshold 2.0
    "token": [[2.0, 1.0, 0.25, 1.4999999999999998], [2.0, 0.5, 1.25, 0.0],
              [0.20000000000000007, 0.5999999999999999, 0.8999999999999999, 0.0], [1.8, 1.4999999999999998, 1.2, 0.0]],
    "sequence": [[1.1249999999999996] * 4, [1.25, 1.25, 1.25, 0.0], [0.108, 0.108, 0.108, 0.0], [2.0, 2.0, 2.0, 0.0]],
}
SLIME_MIS_TRUNCATE_GEOMETRIC = [[1.0298835719535588] * 4, [1.077217345015942] * 3 + [0.0],  # mis.py, padding
                                [0.47622031559045985] * 3 + [0.0], [1.479727244598282] * 3 + [0.0]]  # appended
VERL_RS = {  # 7eb030e9 rollout_rs=token|sequence|geometric [0.5, 2]; b178a3cd token_k1|seq_sum_k1|seq_mean_k1 "0.5_2.0"
    "token": [[0, 1, 0, 1], [1, 1, 1, 0], [0, 1, 1, 0], [1, 1, 1, 0]],
    "sequence": [[1, 1, 1, 1], [1, 1, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]],
    "geometric": [[1, 1, 1, 1], [1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 0]],
}
VERL_OLD_RS_TOKEN_08_15 = [[0, 1, 0, 1], [0, 0, 1, 0], [0, 0, 1, 0], [0, 1, 1, 0]]  # 7eb030e9, [0.8, 1.5]
VERL_NEW_RS_TOKEN_K1_08_15 = [[0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 0], [0, 0, 1, 0]]  # b178a3cd, "0.8_1.5"
SLIME_VANILLA_TIS = [2.0, 1.0, 0.25, 1.4999999999999998, 2.0, 0.5, 1.25, 0.20000000000000007,
                     0.5999999999999999, 0.8999999999999999, 1.8, 1.4999999999999998, 1.2]  # tis_clip_low 0
SLIME_VANILLA_TIS_LOW_05 = [2.0, 1.0, 0.5, 1.4999999999999998, 2.0, 0.5, 1.25, 0.5,
                            0.5999999999999999, 0.8999999999999999, 1.8, 1.4999999999999998, 1.2]
SLIME_ICEPOP_LOW_05 = [0.0, 1.0, 0.0, 1.4999999999999998, 2.0, 0.5, 1.25, 0.0,
                       0.5999999999999999, 0.8999999999999999, 1.8, 1.4999999999999998, 1.2]
VERL_K3_KL = 0.26224031788159086       # compute_offpolicy_metrics "k3_kl" (its 1e-8 in the denominator)
VERL_ESS_CAP_1E6 = 0.7219025139990108  # compute_is_metrics ESS with threshold 1e6 (no weight truncated)
VERL_ESS_CAP_2 = 0.8258245063202297    # the same with threshold 2: ESS of weights clamped to [1/2, 2]
VERL_TOKEN_FRACTION_HIGH = 1 / 13      # rollout_is_ratio_fraction_high, token level, threshold 2
VERL_SEQ_FRACTION_HIGH = 0.25          # the same at sequence level: 1 of 4 *sequences*
VERL_RS_MASKED_FRACTION = {"token": 3 / 13, "sequence": 6 / 13, "geometric": 3 / 13}


def _peer_lr():
    return mismatch_log_ratio(PEER_OLD, PEER_MU, PEER_MASK)


def _valid_tokens(x):
    return x[PEER_MASK.bool()]  # row by row, as slime concatenates its sequences


def test_peer_tis_weights_match():
    lr = _peer_lr()
    # verl: exp(clamp(L, +-20)), then clamp(max=C), times the mask. Same rule for |L| <= 20; a
    # sequence far below 1 (L < -20) gets e^-20 there and exp(L) here (both ~0).
    for level in ("token", "sequence"):
        torch.testing.assert_close(truncated_is_weights(lr, PEER_MASK, level, cap=2.0), _t(VERL_IS[level]))
    # slime vanilla_tis_function: clamp(r, tis_clip_low, tis_clip), default tis_clip_low = 0: the same
    # weights. A tis_clip_low > 0 is a lower clip (CIS) that we do not offer:
    torch.testing.assert_close(_valid_tokens(truncated_is_weights(lr, PEER_MASK)), _t(SLIME_VANILLA_TIS))
    lower_clipped = _valid_tokens(truncated_is_weights(lr, PEER_MASK)).clamp(min=0.5)
    torch.testing.assert_close(lower_clipped, _t(SLIME_VANILLA_TIS_LOW_05))
    # slime mis.py truncate mode, every level (verl has no geometric IS weight): same numbers
    torch.testing.assert_close(truncated_is_weights(lr, PEER_MASK, "geometric"), _t(SLIME_MIS_TRUNCATE_GEOMETRIC))


def test_peer_rejection_masks_match():
    lr = _peer_lr()
    # verl 7eb030e9 and slime mis.py's `mask`: keep iff lower <= exp(clamp(L, +-20)) <= upper, in ratio
    # space, bounds inclusive. Ours compares in log space: the same masks (here even at the bounds 2
    # and 1/2; in general the two can differ when a ratio rounds onto a bound).
    for level in CORRECTION_LEVELS:
        keep = masked_is_keep(lr, PEER_MASK, level, low=0.5, high=2.0)
        assert keep.int().tolist() == VERL_RS[level], level
        metrics = mismatch_metrics(mismatch_sums(lr, PEER_MASK, mis=level))
        assert metrics["masked_frac"] == pytest.approx(VERL_RS_MASKED_FRACTION[level], rel=1e-6)
    assert masked_is_keep(lr, PEER_MASK, low=0.8, high=1.5).int().tolist() == VERL_OLD_RS_TOKEN_08_15
    # verl b178a3cd *_k1: the bounds "lower_upper" apply to -L, i.e. to mu/pi_old, the inverse ratio.
    # Symmetric bounds (0.5_2.0) give the masks above; "a_b" is ours with low = 1/b, high = 1/a:
    assert masked_is_keep(lr, PEER_MASK, low=1 / 1.5, high=1 / 0.8).int().tolist() == VERL_NEW_RS_TOKEN_K1_08_15
    assert VERL_NEW_RS_TOKEN_K1_08_15 != VERL_OLD_RS_TOKEN_08_15


def test_peer_icepop_is_tis_times_mis():
    # slime icepop_function: weight r where tis_clip_low <= r <= tis_clip, else 0 (the ratio itself is
    # kept, not 1): our TIS at cap = high times MIS on [low, high]. Its default tis_clip_low = 0 has no
    # counterpart (our low must be > 0).
    lr = _peer_lr()
    w = correction_weights(lr, PEER_MASK, tis="token", tis_cap=2.0, mis="token", mis_low=0.5, mis_high=2.0)
    torch.testing.assert_close(_valid_tokens(w), _t(SLIME_ICEPOP_LOW_05))


def test_peer_metrics_match():
    lr = _peer_lr()
    metrics = mismatch_metrics(mismatch_sums(lr, PEER_MASK, tis="token"))
    assert metrics["kl"] == pytest.approx(VERL_K3_KL, rel=1e-6)
    assert metrics["capped_frac"] == pytest.approx(VERL_TOKEN_FRACTION_HIGH)
    # verl's ESS is of the truncated weights clamped to [1/C, C]; ours of the raw ratios. With a
    # cap no ratio reaches they agree: (sum r)^2 / (n sum r^2) = 15.7^2 / (13 * 26.265) = 0.72190
    assert metrics["ess"] == pytest.approx(VERL_ESS_CAP_1E6, rel=1e-6)
    assert metrics["ess"] == pytest.approx(15.7**2 / (13 * 26.265), rel=1e-9)
    assert metrics["ess"] != pytest.approx(VERL_ESS_CAP_2, rel=1e-3)
    # verl counts sequence-level capping per sequence (1 of 4 rows); ours per token (3 of 13 tokens)
    seq = mismatch_metrics(mismatch_sums(lr, PEER_MASK, tis="sequence"))
    assert seq["capped_frac"] == pytest.approx(3 / 13) and VERL_SEQ_FRACTION_HIGH == 0.25


def test_accumulate_mismatch_sum_adds_sums_and_keeps_the_largest_max():
    from posttrain.core import accumulate_mismatch_sum

    total: dict[str, float] = {}
    for part in ({"tokens": 3.0, "kl": 0.5, "abs_log_ratio_max": 0.2},
                 {"tokens": 2.0, "kl": 0.25, "abs_log_ratio_max": 0.7},
                 {"tokens": 1.0, "kl": 0.0, "abs_log_ratio_max": 0.1}):
        for key, value in part.items():
            accumulate_mismatch_sum(total, f"policy/mismatch_sum/{key}", value)  # a prefix is allowed
    assert total == {"policy/mismatch_sum/tokens": 6.0, "policy/mismatch_sum/kl": 0.75,
                     "policy/mismatch_sum/abs_log_ratio_max": 0.7}
