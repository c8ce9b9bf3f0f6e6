"""Seed statistics (core/statistics.py): Student's t, the intervals of a mean and of a
difference (paired, Welch), the verdict; against values computed by hand and by simulation."""

import math
import random

import pytest

from posttrain.core.statistics import (
    BETTER,
    WITHIN_NOISE,
    WORSE,
    arm_difference,
    mean,
    mean_interval,
    paired_difference,
    regularized_incomplete_beta,
    sample_std,
    simultaneous_level,
    student_t_cdf,
    student_t_quantile,
    verdict,
    welch_difference,
)

T_975_DF2 = 4.302652729749752  # t_{0.975, 2} (tables: 4.303)


def test_mean_and_sample_std_by_hand():
    # deviations from 5: -3 -1 -1 -1 0 0 2 4 -> squares sum 32, over n - 1 = 7
    values = [2, 4, 4, 4, 5, 5, 7, 9]
    assert mean(values) == 5.0
    assert sample_std(values) == pytest.approx(math.sqrt(32 / 7))
    assert math.isnan(sample_std([3.0])) and math.isnan(mean([]))


@pytest.mark.parametrize("df, quantile", [(1, 12.706), (2, 4.303), (3, 3.182), (5, 2.571), (10, 2.228),
                                          (30, 2.042)])
def test_t_quantiles_match_the_tables(df, quantile):
    assert student_t_quantile(0.975, df) == pytest.approx(quantile, abs=5e-4)


def test_t_cdf_closed_forms_and_symmetry():
    # df = 1 is the Cauchy distribution, df = 2 has F(t) = 1/2 + t / (2 sqrt(2 + t^2))
    for t in (-3.0, -0.4, 0.0, 0.7, 5.0):
        assert student_t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)
        assert student_t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-12)
        assert student_t_cdf(-t, 3.7) == pytest.approx(1 - student_t_cdf(t, 3.7), abs=1e-12)
    # a large df is the normal: Phi(1.96) = 0.9750021
    assert student_t_cdf(1.96, 1e7) == pytest.approx(0.9750021, abs=1e-6)
    # non-integer df (Welch's): the quantile inverts the CDF
    for df in (2.5, 3.99, 17.3):
        assert student_t_cdf(student_t_quantile(0.975, df), df) == pytest.approx(0.975, abs=1e-10)
    assert student_t_quantile(0.025, 2) == pytest.approx(-T_975_DF2)


def test_incomplete_beta_by_hand():
    # I_x(1, 1) = x; I_x(2, 1) = x^2; I_x(1, 2) = 1 - (1 - x)^2
    for x in (0.1, 0.5, 0.93):
        assert regularized_incomplete_beta(x, 1, 1) == pytest.approx(x)
        assert regularized_incomplete_beta(x, 2, 1) == pytest.approx(x * x)
        assert regularized_incomplete_beta(x, 1, 2) == pytest.approx(1 - (1 - x) ** 2)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="df"):
        student_t_cdf(1.0, 0)
    with pytest.raises(ValueError, match="p must"):
        student_t_quantile(1.0, 3)
    with pytest.raises(ValueError, match="one value of each arm per seed"):
        paired_difference([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="level"):
        mean_interval([1.0, 2.0], level=1.0)


def test_mean_interval_by_hand():
    # mean 2, s = 1, n = 3: 2 ± 4.303 / sqrt(3) = 2 ± 2.4841
    interval = mean_interval([1.0, 2.0, 3.0])
    assert interval.estimate == 2.0 and interval.n == 3 and interval.df == 2
    assert interval.half_width == pytest.approx(T_975_DF2 / math.sqrt(3))
    assert (interval.low, interval.high) == pytest.approx((2 - 2.48414, 2 + 2.48414), abs=1e-5)
    # one seed: no spread to estimate, the interval is the whole line
    single = mean_interval([0.7])
    assert single.estimate == 0.7 and single.low == -math.inf and single.high == math.inf


ARM = [3.1, 4.2, 5.0]
BASE = [1.0, 2.0, 3.0]


def test_pairing_removes_the_seeds_shared_noise():
    # per-seed differences 2.1, 2.2, 2.0: mean 2.1, s = 0.1 -> 2.1 ± 4.303 * 0.1 / sqrt(3) = 2.1 ± 0.2484
    paired = paired_difference(ARM, BASE)
    assert paired.method == "paired" and paired.df == 2
    assert (paired.low, paired.high) == pytest.approx((2.1 - 0.24842, 2.1 + 0.24842), abs=1e-5)
    assert verdict(paired) == BETTER
    # unpaired, the seeds' spread stays in: s_a^2 = 0.91, s_b^2 = 1, se^2 = 0.91/3 + 1/3 = 0.63667,
    # df = 0.405344 / ((0.092011 + 0.111111) / 2) = 3.9911, t = 2.7777 -> 2.1 ± 2.2164
    welch = welch_difference(ARM, BASE)
    assert welch.method == "welch" and welch.df == pytest.approx(3.9911, abs=1e-4)
    assert welch.half_width == pytest.approx(student_t_quantile(0.975, welch.df) * math.sqrt(0.63667), rel=1e-4)
    assert welch.half_width == pytest.approx(2.2164, abs=1e-3)
    assert verdict(welch) == WITHIN_NOISE


def test_arm_difference_pairs_only_the_same_seeds():
    base = dict(zip((0, 1, 2), BASE))
    assert arm_difference(dict(zip((0, 1, 2), ARM)), base).method == "paired"
    # seeds listed in another order pair by seed, not by position
    shuffled = {2: ARM[2], 0: ARM[0], 1: ARM[1]}
    assert arm_difference(shuffled, base) == paired_difference(ARM, BASE)
    assert arm_difference(dict(zip((3, 4, 5), ARM)), base).method == "welch"


def test_identical_arms_are_within_noise_and_direction_flips_the_verdict():
    same = paired_difference(BASE, BASE)
    assert (same.estimate, same.low, same.high) == (0.0, 0.0, 0.0)
    assert verdict(same) == WITHIN_NOISE
    worse = paired_difference(BASE, ARM)  # the mirror of the BETTER case
    assert verdict(worse) == WORSE and verdict(worse, higher_is_better=False) == BETTER
    # every seed moved by the same amount: a point interval away from 0
    shifted = paired_difference([v + 0.5 for v in BASE], BASE)
    assert shifted.low == shifted.high == pytest.approx(0.5) and verdict(shifted) == BETTER
    # one seed each: no verdict but noise
    assert verdict(paired_difference([9.0], [1.0])) == WITHIN_NOISE
    assert verdict(welch_difference([9.0], [1.0, 2.0])) == WITHIN_NOISE


def coverage(draw_interval, truth: float, trials: int, seed: int) -> float:
    rng = random.Random(seed)
    hits = 0
    for _ in range(trials):
        interval = draw_interval(rng)
        hits += interval.low <= truth <= interval.high
    return hits / trials


# 3000 trials: the share's standard error at 95% is 0.004, so 0.93-0.97 is 5 of them
TRIALS = 3000


def test_the_mean_interval_covers_the_true_mean_95_percent_of_the_time():
    share = coverage(lambda rng: mean_interval([rng.gauss(1.5, 2.0) for _ in range(3)]), 1.5, TRIALS, seed=0)
    assert 0.93 <= share <= 0.97


def test_welch_covers_the_true_difference_with_unequal_spreads():
    def draw(rng):
        return welch_difference([rng.gauss(1.0, 3.0) for _ in range(5)], [rng.gauss(0.0, 1.0) for _ in range(3)])

    assert 0.93 <= coverage(draw, 1.0, TRIALS, seed=1) <= 0.97


def test_paired_covers_the_true_difference_and_is_narrower_under_shared_noise():
    # each seed adds the same large offset to both arms (data order, warm start)
    def draw(rng):
        offsets = [rng.gauss(0.0, 5.0) for _ in range(4)]
        arm = [0.3 + o + rng.gauss(0.0, 0.5) for o in offsets]
        base = [o + rng.gauss(0.0, 0.5) for o in offsets]
        return paired_difference(arm, base), welch_difference(arm, base)

    rng = random.Random(2)
    pairs = [draw(rng) for _ in range(TRIALS)]
    share = sum(p.low <= 0.3 <= p.high for p, _ in pairs) / TRIALS
    assert 0.93 <= share <= 0.97
    narrower = sum(p.half_width < w.half_width for p, w in pairs) / TRIALS
    assert narrower > 0.9


def test_simultaneous_level_is_bonferroni():
    assert simultaneous_level(0.95, 1) == pytest.approx(0.95)
    assert simultaneous_level(0.95, 4) == pytest.approx(0.9875)
    with pytest.raises(ValueError, match="at least one comparison"):
        simultaneous_level(0.95, 0)


def test_simultaneous_intervals_hold_for_every_arm_together():
    """Four arms that do not differ from the baseline, 3 seeds each (paired): judged at 95% one by
    one, some arm gets a verdict far more often than 5% of the time; at the Bonferroni level, at
    most about 5%."""
    rng = random.Random(7)
    trials, arms, seeds = 2000, 4, (0, 1, 2)
    spurious = {"one by one": 0, "together": 0}
    for _ in range(trials):
        baseline = {s: rng.gauss(0, 1) for s in seeds}
        others = [{s: rng.gauss(0, 1) for s in seeds} for _ in range(arms)]
        for name, level in (("one by one", 0.95), ("together", simultaneous_level(0.95, arms))):
            verdicts = [verdict(arm_difference(arm, baseline, level)) for arm in others]
            spurious[name] += any(v != WITHIN_NOISE for v in verdicts)
    assert spurious["one by one"] / trials > 0.12
    assert spurious["together"] / trials < 0.065
