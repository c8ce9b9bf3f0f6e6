"""Seed statistics of a sweep: is one arm better than another, or within the noise of seeds?

An arm (one choice of a sweep) is run with n seeds; each seed gives one value of a metric.
Its mean over seeds has the t-based confidence interval

    mean ± t_{1-α/2, n-1} · s / √n          (s: the sample std, n - 1 in its denominator)

and the difference of an arm to a baseline arm is one of two intervals:

- **paired**, when both arms ran the same seeds: a seed fixes the data order and the
  sampler's draws for both arms, so the per-seed differences d_i = a_i - b_i remove that
  shared noise: d̄ ± t_{1-α/2, n-1} · s_d / √n.
- **Welch**, otherwise: ā - b̄ ± t_{1-α/2, ν} · √(s_a²/n_a + s_b²/n_b), with the
  Welch–Satterthwaite degrees of freedom
  ν = (s_a²/n_a + s_b²/n_b)² / ((s_a²/n_a)²/(n_a - 1) + (s_b²/n_b)²/(n_b - 1)).

The verdict reads the difference's interval: "better" when it lies wholly on the good side
of 0, "worse" when wholly on the bad side, else "within noise" (an interval touching 0
included). With fewer than 2 seeds there is no estimate of the noise: the interval is
(-inf, inf) and the verdict is "within noise".

Student's t quantile: the CDF through the regularised incomplete beta function,
P(T ≤ t) = 1 - ½ I_{ν/(ν+t²)}(ν/2, ½) for t ≥ 0, evaluated by its continued fraction, and
inverted by bisection (df need not be an integer: Welch's is not).

Plain floats, no tensors: a sweep has a handful of seeds.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

BETTER, WORSE, WITHIN_NOISE = "better", "worse", "within noise"


def mean(values: list[float]) -> float:
    """The arithmetic mean (NaN for no values)."""
    return math.fsum(values) / len(values) if values else math.nan


def sample_std(values: list[float]) -> float:
    """The sample standard deviation, n - 1 in the denominator (NaN below 2 values)."""
    if len(values) < 2:
        return math.nan
    centre = mean(values)
    return math.sqrt(math.fsum((v - centre) ** 2 for v in values) / (len(values) - 1))


# --- Student's t ------------------------------------------------------------------------------


def _beta_continued_fraction(x: float, a: float, b: float) -> float:
    """The continued fraction of I_x(a, b) (modified Lentz), converging for x < (a+1)/(a+b+2)."""
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    fraction = d
    for m in range(1, 1000):
        # even step, then odd step, of the fraction's terms
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            fraction *= c * d
        if abs(c * d - 1.0) < eps:
            break
    return fraction


def regularized_incomplete_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b) = B(x; a, b) / B(a, b) for 0 ≤ x ≤ 1, a, b > 0."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_continued_fraction(x, a, b) / a
    # the symmetry I_x(a, b) = 1 - I_{1-x}(b, a) keeps the fraction where it converges fast
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(1.0 - x, b, a) / b


def student_t_cdf(t: float, df: float) -> float:
    """P(T ≤ t) for Student's t with `df` > 0 degrees of freedom."""
    if df <= 0:
        raise ValueError(f"student_t_cdf: df must be > 0, got {df}")
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * regularized_incomplete_beta(df / (df + t * t), df / 2.0, 0.5)
    return 1.0 - tail if t >= 0 else tail


@functools.lru_cache(maxsize=1024)  # a report asks for the same few df over and over
def student_t_quantile(p: float, df: float) -> float:
    """The t with P(T ≤ t) = p (0 < p < 1), by bisection on the CDF."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"student_t_quantile: p must be in (0, 1), got {p}")
    if p < 0.5:
        return -student_t_quantile(1.0 - p, df)
    low, high = 0.0, 1.0
    while student_t_cdf(high, df) < p:  # the quantile is finite: widen until it is inside
        low, high = high, 2.0 * high
    for _ in range(200):
        middle = 0.5 * (low + high)
        if student_t_cdf(middle, df) < p:
            low = middle
        else:
            high = middle
        if high - low <= 1e-12 * max(1.0, high):
            break
    return 0.5 * (low + high)


# --- intervals --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Interval:
    """An estimate and its confidence interval [low, high] at `level`, from `n` seeds with `df`
    degrees of freedom (NaN: none, fewer than 2 seeds or no spread). `method`: 'mean',
    'paired' or 'welch'."""

    estimate: float
    low: float
    high: float
    n: int
    df: float
    level: float
    method: str

    @property
    def half_width(self) -> float:
        return 0.5 * (self.high - self.low)


def t_interval(estimate: float, standard_error: float, df: float, level: float, n: int, method: str) -> Interval:
    """estimate ± t_{(1+level)/2, df} · standard_error; infinite without degrees of freedom,
    a point when the standard error is 0 (every seed agreed)."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"confidence level must be in (0, 1), got {level}")
    if math.isnan(standard_error) or math.isnan(df) or df <= 0:
        return Interval(estimate, -math.inf, math.inf, n, math.nan, level, method)
    half = 0.0 if standard_error == 0.0 else student_t_quantile(0.5 + level / 2.0, df) * standard_error
    return Interval(estimate, estimate - half, estimate + half, n, df, level, method)


def mean_interval(values: list[float], level: float = 0.95) -> Interval:
    """The mean over seeds and its t interval: mean ± t_{n-1} · s/√n."""
    n = len(values)
    if n == 0:
        raise ValueError("mean_interval: no values")
    standard_error = sample_std(values) / math.sqrt(n)
    return t_interval(mean(values), standard_error, n - 1, level, n, "mean")


def paired_difference(arm: list[float], baseline: list[float], level: float = 0.95) -> Interval:
    """Mean of the per-seed differences arm_i - baseline_i (the lists in seed order) and its t
    interval with n - 1 degrees of freedom."""
    if len(arm) != len(baseline) or not arm:
        raise ValueError(f"paired_difference: needs one value of each arm per seed, got {len(arm)} and "
                         f"{len(baseline)}")
    differences = [a - b for a, b in zip(arm, baseline)]
    n = len(differences)
    interval = t_interval(mean(differences), sample_std(differences) / math.sqrt(n), n - 1, level, n, "paired")
    return interval


def welch_difference(arm: list[float], baseline: list[float], level: float = 0.95) -> Interval:
    """mean(arm) - mean(baseline) and its Welch interval, Welch–Satterthwaite degrees of
    freedom; n is the smaller arm's number of seeds."""
    if not arm or not baseline:
        raise ValueError(f"welch_difference: each arm needs a value, got {len(arm)} and {len(baseline)}")
    n = min(len(arm), len(baseline))
    estimate = mean(arm) - mean(baseline)
    if n < 2:
        return Interval(estimate, -math.inf, math.inf, n, math.nan, level, "welch")
    var_arm, var_base = sample_std(arm) ** 2 / len(arm), sample_std(baseline) ** 2 / len(baseline)
    variance = var_arm + var_base
    if variance == 0.0:  # every seed of both arms agreed: a point, no degrees of freedom to speak of
        return Interval(estimate, estimate, estimate, n, math.nan, level, "welch")
    df = variance ** 2 / (var_arm ** 2 / (len(arm) - 1) + var_base ** 2 / (len(baseline) - 1))
    return t_interval(estimate, math.sqrt(variance), df, level, n, "welch")


def arm_difference(arm: dict, baseline: dict, level: float = 0.95) -> Interval:
    """The difference arm - baseline of two arms given as {seed: value}: paired over seeds when
    both ran the same seeds, else Welch."""
    if arm.keys() == baseline.keys():
        seeds = sorted(arm, key=str)
        return paired_difference([arm[s] for s in seeds], [baseline[s] for s in seeds], level)
    return welch_difference(list(arm.values()), list(baseline.values()), level)


def simultaneous_level(level: float, comparisons: int) -> float:
    """The level each of `comparisons` intervals needs so that all of them hold together with
    probability at least `level` (Bonferroni: 1 - (1 - level) / m). With m arms judged against one
    baseline at 95% each, about m x 5% of the arms that do not differ would still get a verdict."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"confidence level must be in (0, 1), got {level}")
    if comparisons < 1:
        raise ValueError(f"simultaneous_level: needs at least one comparison, got {comparisons}")
    return 1.0 - (1.0 - level) / comparisons


def verdict(difference: Interval, higher_is_better: bool = True) -> str:
    """'better' or 'worse' when the difference's interval excludes 0 (strictly), on the good or
    the bad side by the metric's direction; else 'within noise'."""
    if difference.low > 0.0:
        return BETTER if higher_is_better else WORSE
    if difference.high < 0.0:
        return WORSE if higher_is_better else BETTER
    return WITHIN_NOISE
