"""Verdicts: each arm (a choice) against a baseline arm, per judged final metric, over seeds
(docs/verdicts.md). The statistics themselves are core/statistics.py's."""

from __future__ import annotations

import math

from posttrain.core import statistics
from posttrain.eval.report.runs import ReportError, Run
from posttrain.eval.report.suites import suite_verdict_metrics
from posttrain.eval.report.tables import markdown_table

# The final metrics judged, each with its direction, explicit: (title, summary.json key, scale,
# format, higher is better). A shorter response counts as better (the same answer for less
# compute); read it beside the accuracy.
VERDICT_METRICS = (
    ("held-out accuracy %", "eval/accuracy", 100.0, ".1f", True),
    ("held-out response length (tokens)", "eval/response_len", 1.0, ".2f", False),
    ("held-out calibration error (ECE)", "eval/ece", 1.0, ".3f", False),
    ("held-out proxy reward (learned)", "eval/proxy_reward", 1.0, ".3f", True),
)
CONFIDENCE_LEVEL = 0.95


def seed_values(members: list[Run], key: str, scale: float) -> dict[str, float]:
    """{seed: scaled value} of a choice's runs that have a finite `key`. Runs of one choice that
    share a seed (keys left out of --by) are told apart by their job name, so they pair with no
    other arm's."""
    seeds = [run.seed for run in members]
    unique = len(set(seeds)) == len(seeds)
    values = {}
    for seed, run in zip(seeds, members):
        value = run.summary.get(key)
        if value is not None and math.isfinite(float(value)):
            values[seed if unique else run.name] = scale * float(value)
    return values


def pick_baseline(labels: list[str], keys: list[tuple], choice: str | None) -> int:
    """The index of the baseline arm: `choice` is an arm's label as the report prints it
    ('algorithm=grpo'), its values alone ('grpo'), or its index (0: the first); None: the first."""
    if choice is None:
        return 0
    if choice.isdigit() and int(choice) < len(labels):
        return int(choice)
    matches = [i for i, (label, key) in enumerate(zip(labels, keys)) if choice in (label, ", ".join(key))]
    if len(matches) != 1:
        arms = "; ".join(f"{i}: {label}" for i, label in enumerate(labels))
        reason = "matches no arm" if not matches else "matches several arms"
        raise ReportError(f"--baseline {choice} {reason}; the arms are {arms}")
    return matches[0]


def interval_text(interval: statistics.Interval, fmt: str) -> str:
    """'mean [low, high]', signed for a difference; the mean alone, marked, without an interval."""
    estimate = format(interval.estimate, fmt)
    if math.isinf(interval.half_width):
        return f"{estimate} (1 seed: no interval)"
    return f"{estimate} [{format(interval.low, fmt)}, {format(interval.high, fmt)}]"


def method_text(difference: statistics.Interval) -> str:
    if math.isinf(difference.half_width):
        return "needs 2 seeds per arm"
    if difference.method == "paired":
        return f"paired, {difference.n} seeds"
    return "Welch" + (f", df {difference.df:.1f}" if math.isfinite(difference.df) else ", no spread")


def verdict_cell(difference: statistics.Interval, higher_is_better: bool) -> str:
    """The verdict on an interval, in bold where it is one (better / worse)."""
    judged = statistics.verdict(difference, higher_is_better)
    return judged if judged == "within noise" else f"**{judged}**"


def verdict_table(groups: dict[tuple, list[Run]], labels: list[str], baseline: int, key: str, scale: float,
                  fmt: str, higher_is_better: bool, difference_level: float = CONFIDENCE_LEVEL) -> list[list[str]]:
    """One row per arm that has the metric: #, arm, n, mean [CI], difference [CI], interval, verdict.
    `difference_level`: the level of the differences' intervals (simultaneous_level with --simultaneous)."""
    arms = [seed_values(members, key, scale) for members in groups.values()]
    reference = arms[baseline]
    body = []
    for i, (label, values) in enumerate(zip(labels, arms)):
        if not values:
            continue
        arm_mean = statistics.mean_interval(list(values.values()), CONFIDENCE_LEVEL)
        row = [str(i), label, str(len(values)), interval_text(arm_mean, fmt)]
        if i == baseline:
            row += ["(baseline)", "", ""]
        elif not reference:
            row += ["", "", "baseline lacks it"]
        else:
            difference = statistics.arm_difference(values, reference, difference_level)
            row += [interval_text(difference, "+" + fmt), method_text(difference),
                    verdict_cell(difference, higher_is_better)]
        body.append(row)
    return body


def change_table(groups: dict[tuple, list[Run]], labels: list[str], key: str, scale: float, fmt: str,
                 higher_is_better: bool) -> list[list[str]]:
    """One row per arm whose runs logged `key` and its start (`key`_start): #, arm, n, start,
    change [95% CI], lowest change, verdict. The change is each run's own (end - start: its seed,
    its warm start), so runs of one arm need not pair with another's."""
    body = []
    for i, (label, members) in enumerate(zip(labels, groups.values())):
        pairs = [(run.summary.get(f"{key}_start"), run.summary.get(key)) for run in members]
        pairs = [(scale * float(a), scale * float(b)) for a, b in pairs
                 if a is not None and b is not None and math.isfinite(float(a)) and math.isfinite(float(b))]
        if not pairs:
            continue
        changes = [end - start for start, end in pairs]
        change = statistics.mean_interval(changes, CONFIDENCE_LEVEL)
        worst = min(changes) if higher_is_better else max(changes)
        body.append([str(i), label, str(len(changes)), format(statistics.mean([a for a, _ in pairs]), fmt),
                     interval_text(change, "+" + fmt), format(worst, "+" + fmt),
                     verdict_cell(change, higher_is_better)])
    return body


def change_section(groups: dict[tuple, list[Run]], labels: list[str]) -> list[str]:
    """Each arm against its own start: per judged metric with a start value (accuracy, response
    length), the mean change over the arm's runs with its 95% interval and the verdict."""
    runs = [run for members in groups.values() for run in members]
    lines = []
    for title, key, scale, fmt, higher_is_better in VERDICT_METRICS:
        if not any(f"{key}_start" in run.summary for run in runs):
            continue
        direction = "higher is better" if higher_is_better else "lower is better"
        lines += [f"### {title}: `{key}` against its start, {direction}", "",
                  *markdown_table(["#", "arm", "n", "start", "change [95% CI]", "worst run", "verdict"],
                                  change_table(groups, labels, key, scale, fmt, higher_is_better)), ""]
    if not lines:
        return []
    return ["## Change from the start", "",
            ("Per arm, each run's change from its own start (the held-out evaluation before its first step), "
             "the mean over the arm's runs with its 95% interval (Student's t) and the run that moved least "
             "(or most, where lower is better). **better** / **worse**: the interval excludes 0 on the "
             "metric's good / bad side."), "", *lines]


def noise_floor_text(values: dict[str, float], fmt: str) -> str:
    """The baseline's seed spread: its sample std and its mean's interval half-width."""
    if len(values) < 2:
        return f"Noise floor: the baseline has {len(values)} seed: no spread to measure, no verdict but noise."
    spread = statistics.sample_std(list(values.values()))
    half = statistics.mean_interval(list(values.values()), CONFIDENCE_LEVEL).half_width
    return (f"Noise floor: the baseline's seeds spread with a sample std of {format(spread, fmt)} over "
            f"{len(values)} seeds; its mean is known to ± {format(half, fmt)} (95%).")


def verdict_section(groups: dict[tuple, list[Run]], labels: list[str], baseline: int,
                    simultaneous: bool = False) -> list[str]:
    """The report's verdicts: per judged metric some run has, the noise floor and a table of
    every arm against the baseline; [] with a single arm. `simultaneous`: the differences'
    intervals hold for all the arms together (Bonferroni over the len(groups) - 1 comparisons)."""
    if len(groups) < 2:
        return []
    runs = [run for members in groups.values() for run in members]
    comparisons = len(groups) - 1
    level = statistics.simultaneous_level(CONFIDENCE_LEVEL, comparisons) if simultaneous else CONFIDENCE_LEVEL
    difference_header = f"difference to baseline [{100 * level:.3g}% CI]"
    if simultaneous:
        family = (f"With --simultaneous each difference's interval is at {100 * level:.3g}% (Bonferroni over the "
                  f"{comparisons} arms), so that all {comparisons} hold together at 95%.")
    elif comparisons > 1:
        family = (f"Each difference's interval is at 95% on its own: among {comparisons} arms that do not differ "
                  f"from the baseline, about {comparisons} x 5% would still get a verdict; `--simultaneous` "
                  f"makes the {comparisons} intervals hold together (Bonferroni).")
    else:
        family = ""
    lines = [
        f"## Verdicts against arm {baseline}: {labels[baseline]}",
        "",
        ("Per arm, the mean over its seeds with its 95% confidence interval (Student's t, n - 1 degrees of "
         "freedom); per arm against the baseline, the difference of the means with its 95% interval: "
         "paired over seeds when both arms ran the same seeds (the per-seed differences; a seed shares the "
         "data order and the sampler's draws between arms), else Welch's. **better** / **worse**: the "
         "difference's interval excludes 0 on the metric's good / bad side; within noise: it contains 0. "
         "Another baseline: `--baseline <arm label or #>`. How to read it: docs/verdicts.md."),
        "",
        *([family, ""] if family else []),
    ]
    # then each evaluation suite's and source's metrics (eval/<suite>/accuracy, pass@k, ...)
    for title, key, scale, fmt, higher_is_better in (*VERDICT_METRICS, *suite_verdict_metrics(runs)):
        if not any(key in run.summary for run in runs):
            continue
        direction = "higher is better" if higher_is_better else "lower is better"
        baseline_values = seed_values(list(groups.values())[baseline], key, scale)
        lines += [
            f"### {title}: `{key}`, {direction}",
            "",
            noise_floor_text(baseline_values, fmt.lstrip("+")),
            "",
            *markdown_table(["#", "arm", "n", "mean [95% CI]", difference_header, "interval", "verdict"],
                            verdict_table(groups, labels, baseline, key, scale, fmt, higher_is_better, level)),
            "",
        ]
    return lines
