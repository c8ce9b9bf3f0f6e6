"""`posttrain-report`: a sweep's results as a markdown table and plots, offline.

    posttrain -m algorithm=grpo,dapo seed=0,1,2
    posttrain-report outputs/multiruns/<time>                   # -> <dir>/report/report.md, *.png
    posttrain-report outputs/multiruns/<time> --by algorithm --smooth 10 --out /tmp/report
    posttrain-report outputs/multiruns/<time> --baseline algorithm=dapo --x samples
    posttrain-report --compare <run dir> <run dir> --at 100 200  # side-by-side pages (panel_pages.py)

Reads every job's summary.json (final and start metrics), .hydra/overrides.yaml (the sweep's
axes) and logged history: `metrics.jsonl` (posttrain.run.history, written whatever the logger)
or, for runs without it, `csv/metrics.csv` (logger=csv). W&B's own files are binary and are
not read.

A "choice" is one value of the sweep's axes other than the seed (or of the keys given with
--by); the runs of a choice are its seeds. The table gives mean ± sample std over seeds (n
shown; n = 1: the value alone); the plots draw one line per choice (the mean over seeds) with
a band from the lowest to the highest seed, over rollout batches. Runs that logged held-out
calibration (`eval/ece`, `eval/reliability/*`) add a calibration table (ECE and confidence
before and after) and `reliability.png`, the reliability diagram before and after training.

Verdicts (docs/verdicts.md): each choice ("arm") against a baseline arm (`--baseline`, default
the first): per final metric of VERDICT_METRICS, the arm's mean with its 95% t interval over
seeds, the difference to the baseline with its 95% interval (paired over seeds when both arms
ran the same seeds, else Welch; core/statistics.py), and the verdict: better, worse, or within
noise. The baseline's seed spread (the noise floor) is shown above each table.

Curves are drawn against `--x`: rollout batches (default), sampled completions
(`rollout/samples_seen`), generated response tokens (`rollout/tokens_seen`) or wall seconds
(`perf/elapsed_s`, checkpointed, so a resumed run continues it; in a history from before it
was, the clock restarts at a resume, and the report adds the seconds before each restart).
Against a budget that seeds spend unevenly (tokens, seconds), each seed's curve is
interpolated onto the x values where every seed has one.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import sys
from pathlib import Path

import yaml

from posttrain.core import statistics
from posttrain.errors import DataError
from posttrain.run.history import HISTORY_FILE, read_history

# --- reading a sweep --------------------------------------------------------------------------


def load_runs(root: Path) -> list[dict]:
    """Every summary.json below `root` (the warm-start cache excluded), in job order, with
    the run's command-line overrides (`overrides`: key -> value, `+`/`~` prefixes dropped)
    and its directory (`path`) attached."""
    paths = [p for p in Path(root).rglob("summary.json") if "warm_start" not in p.parts and "cache" not in p.parts]
    runs = []
    for summary_path in sorted(paths, key=_job_order):
        summary = json.loads(summary_path.read_text())
        overrides_path = summary_path.parent / ".hydra" / "overrides.yaml"
        overrides = yaml.safe_load(overrides_path.read_text()) if overrides_path.is_file() else []
        summary["overrides"] = dict(o.lstrip("+~").split("=", 1) for o in overrides or [] if "=" in o)
        summary["path"] = summary_path.parent
        runs.append(summary)
    return runs


def _job_order(summary_path: Path):
    # Hydra names jobs `<n>_<task>`: 2_grpo before 10_grpo, which a plain sort would swap
    match = re.match(r"(\d+)_", summary_path.parent.name)
    return (str(summary_path.parent.parent), int(match.group(1)) if match else -1, summary_path.parent.name)


def varying_keys(runs: list[dict]) -> list[str]:
    """Override keys whose value differs between runs (the sweep's axes)."""
    keys = sorted({k for run in runs for k in run["overrides"]})
    return [k for k in keys if len({run["overrides"].get(k) for run in runs}) > 1]


def choice_value(run: dict, key: str) -> str:
    """A run's value of `key`: its override, else its Hydra group choice, else ''."""
    return str(run["overrides"].get(key, run.get("choices", {}).get(key, "")))


def load_history(run_dir: Path) -> dict[str, dict[int, float]]:
    """{metric: {batch: value}} of one run: metrics.jsonl, else csv/metrics.csv, else {}."""
    if (run_dir / HISTORY_FILE).is_file():
        return read_history(run_dir / HISTORY_FILE)
    if (run_dir / "csv" / "metrics.csv").is_file():
        return read_csv_history(run_dir / "csv" / "metrics.csv")
    return {}


def read_csv_history(path: Path) -> dict[str, dict[int, float]]:
    """Lightning CSVLogger's metrics.csv -> {metric: {batch: value}}.

    Its `step` is Lightning's logged step, batch n at step n - 1, and an evaluation after
    batch n is logged at the same step as batch n's training metrics (the one before
    training at step 0 too). So the rows are read in order: a training row's batch is its
    `rollout/batch` (else step + 1), an eval row's the last training row's (0 before any).
    A later row wins over an earlier one of the same batch (a resumed run's repeats)."""
    series: dict[str, dict[int, float]] = {}
    last_batch = 0
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            values = {k: float(v) for k, v in row.items() if k not in ("step", "epoch") and v not in ("", None)}
            if not values:
                continue
            if any(k.startswith("eval/") for k in values):
                x = last_batch
            else:
                x = int(values["rollout/batch"]) if "rollout/batch" in values else int(float(row["step"])) + 1
                last_batch = x
            for name, value in values.items():
                if math.isfinite(value):
                    series.setdefault(name, {})[x] = value
    return series


# --- the table --------------------------------------------------------------------------------


def group_runs(runs: list[dict], by: list[str]) -> dict[tuple, list[dict]]:
    """Runs with the same values of `by` (one choice, its seeds), in order of first appearance."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault(tuple(choice_value(run, k) for k in by), []).append(run)
    return groups


def mean_std(values: list[float], fmt: str = ".1f") -> str:
    """'mean ± sample std' of the values present (n - 1 in the std); the value alone when there
    is one. `fmt`: the mean's format spec ('+.1f' signs it); the std's drops the sign."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return ""
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.mean(values), fmt)} ± {format(statistics.sample_std(values), fmt.lstrip('+'))}"


def _change(run: dict) -> float | None:
    start, end = run.get("eval/accuracy_start"), run.get("eval/accuracy")
    return None if start is None or end is None else 100 * (end - start)


def _scaled(run: dict, key: str, scale: float = 1.0) -> float | None:
    value = run.get(key)
    return None if value is None else scale * float(value)


# Final-metric columns: (header, value of a run, format)
COLUMNS = (
    ("acc start %", lambda r: _scaled(r, "eval/accuracy_start", 100), ".1f"),
    ("acc end %", lambda r: _scaled(r, "eval/accuracy", 100), ".1f"),
    ("change pts", _change, "+.1f"),
    ("len start", lambda r: _scaled(r, "eval/response_len_start"), ".2f"),
    ("len end", lambda r: _scaled(r, "eval/response_len"), ".2f"),
    ("steps", lambda r: _scaled(r, "global_step"), ".0f"),
    ("train s", lambda r: _scaled(r, "train_seconds"), ".0f"),
)
HEADER = [name for name, _, _ in COLUMNS]
# summary.json's count of rollout batches over rollout.mismatch_budget: a run with any is invalid
OVER_BUDGET = "rollout/mismatch/over_budget_batches"


def over_budget(run: dict) -> int:
    """Rollout batches of a run whose sampler/trainer mismatch was over its budget (0: valid)."""
    return int(run.get(OVER_BUDGET) or 0)


def validity(members: list[dict]) -> str:
    """'yes', or which of a choice's runs went over their mismatch budget: the choice is invalid."""
    invalid = sum(over_budget(run) > 0 for run in members)
    if not invalid:
        return "yes"
    return f"**invalid** ({invalid} of {len(members)})" if len(members) > 1 else "**invalid**"


def choice_rows(groups: dict[tuple, list[dict]]) -> list[list[str]]:
    """One row per choice: its values, n, the seeds, then mean ± std of each column."""
    table = []
    for key, members in groups.items():
        seeds = ",".join(choice_value(run, "seed") for run in members if choice_value(run, "seed"))
        table.append(list(key) + [str(len(members)), seeds] +
                     [mean_std([value(run) for run in members], fmt) for _, value, fmt in COLUMNS]
                     + [validity(members)])
    return table


def rows(runs: list[dict], by: list[str]) -> list[list[str]]:
    """One row per run: the values of `by`, then each column (the sweep_table layout)."""
    return [[choice_value(run, k) for k in by] + [mean_std([value(run)], fmt) for _, value, fmt in COLUMNS]
            + [validity([run])] for run in runs]


def markdown_table(header: list[str], body: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in body]


# --- the plots --------------------------------------------------------------------------------

# (file stem, title, metrics in order of preference: the first one any run logged, scale)
PANELS = (
    ("reward", "reward (rollout mean)", ("rollout/reward_mean",), 1.0),
    ("eval_accuracy", "held-out accuracy % (greedy)", ("eval/accuracy",), 100.0),
    # beside the accuracy: a learned reward's score of the same responses (over-optimisation shows as a parting)
    ("proxy_reward", "held-out proxy reward (learned, greedy)", ("eval/proxy_reward",), 1.0),
    # calibration of the greedy responses: expected calibration error (0: confidence = accuracy)
    ("ece", "held-out calibration error (ECE, greedy)", ("eval/ece",), 1.0),
    ("response_length", "response length (tokens)", ("rollout/response_len_mean", "eval/response_len"), 1.0),
    ("kl", "KL to the reference", ("policy/kl",), 1.0),
    ("entropy", "entropy (nats / token)", ("policy/entropy",), 1.0),
    ("clip_fraction", "clip fraction", ("policy/clip_frac",), 1.0),
    ("mismatch_kl", "sampler-trainer mismatch KL", ("rollout/mismatch/kl",), 1.0),
)


def smoothed(series: dict[int, float], window: int) -> dict[int, float]:
    """Trailing mean over `window` logged points (1: unchanged)."""
    xs = sorted(series)
    if window <= 1:
        return {x: series[x] for x in xs}
    out = {}
    for i, x in enumerate(xs):
        recent = [series[xs[j]] for j in range(max(0, i - window + 1), i + 1)]
        out[x] = sum(recent) / len(recent)
    return out


def seed_band(series: list[dict[int, float]], interpolate: bool = False) -> tuple[list, list[float], list[float],
                                                                                  list[float]]:
    """x, mean, min, max over the seeds that logged each x. `interpolate` (a budget the seeds
    spend unevenly: tokens, seconds): each seed's curve linearly interpolated onto every x
    logged by some seed inside the range all seeds cover."""
    if interpolate and len(series) > 1:
        low_x, high_x = max(min(s) for s in series), min(max(s) for s in series)
        if low_x <= high_x:
            xs = sorted({x for s in series for x in s if low_x <= x <= high_x})
            series = [{x: interpolated(s, x) for x in xs} for s in series]
    xs = sorted({x for s in series for x in s})
    mean, low, high = [], [], []
    for x in xs:
        values = [s[x] for s in series if x in s]
        mean.append(sum(values) / len(values))
        low.append(min(values))
        high.append(max(values))
    return xs, mean, low, high


def interpolated(series: dict[float, float], x: float) -> float:
    """The series' value at x (inside its range), linear between its two nearest points."""
    xs = sorted(series)
    right = next(i for i, value in enumerate(xs) if value >= x)
    if xs[right] == x or right == 0:
        return series[xs[right]]
    x0, x1 = xs[right - 1], xs[right]
    return series[x0] + (series[x1] - series[x0]) * (x - x0) / (x1 - x0)


def draw_panel(ax, metric: str, title: str, scale: float, groups: dict[tuple, list[dict]], labels: list[str],
               smooth: int, x_label: str, interpolate: bool = False) -> None:
    # start-up: plotting loads only when a report draws
    from matplotlib.ticker import MaxNLocator

    # held-out metrics are a few points each (every val_check_interval): markers, no smoothing
    evaluated = metric.startswith("eval/")
    for i, members in enumerate(groups.values()):
        series = [smoothed({x: scale * v for x, v in run["history"][metric].items()}, 1 if evaluated else smooth)
                  for run in members if metric in run["history"]]
        if not series:
            continue
        xs, mean, low, high = seed_band(series, interpolate)
        color = f"C{i % 10}"
        ax.plot(xs, mean, color=color, label=labels[i], marker="o" if evaluated else None, markersize=3,
                linewidth=1.2)
        if len(series) > 1:
            ax.fill_between(xs, low, high, color=color, alpha=0.2, linewidth=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # batches, samples and tokens are whole numbers
    ax.set_title(f"{title}\n{metric}", fontsize=9)
    ax.set_xlabel(x_label, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)


def write_plots(groups: dict[tuple, list[dict]], labels: list[str], out_dir: Path, smooth: int,
                x_axis: str = "batch") -> list[str]:
    """One PNG per panel some run logged, and curves.png with all of them; returns the files."""
    # start-up: plotting loads only when a report draws
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on a cluster node
    # start-up: plotting loads only when a report draws
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    runs = [run for members in groups.values() for run in members]
    logged = {name for run in runs for name in run["history"]}
    panels = []
    for stem, title, candidates, scale in PANELS:
        metric = next((m for m in candidates if m in logged), None)
        if metric is not None:
            panels.append((stem, title, metric, scale))
    if not panels:
        return []
    x_label = X_AXES[x_axis][1] if x_axis != "batch" or "rollout/batch" in logged else "training batch"

    files = []
    for stem, title, metric, scale in panels:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        draw_panel(ax, metric, title, scale, groups, labels, smooth, x_label, interpolate=x_axis != "batch")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / f"{stem}.png", dpi=120)
        plt.close(fig)
        files.append(f"{stem}.png")

    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.2 * nrows + 0.4), squeeze=False)
    for ax, (stem, title, metric, scale) in zip(axes.flat, panels):
        draw_panel(ax, metric, title, scale, groups, labels, smooth, x_label, interpolate=x_axis != "batch")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    # one legend for the figure, every choice in it (a panel may lack some: no KL for dapo)
    handles = [Line2D([], [], color=f"C{i % 10}", label=label) for i, label in enumerate(labels)]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 4), fontsize=8, frameon=False)
    legend_height = 0.25 * math.ceil(len(handles) / 4) + 0.1  # inches: a row per 4 choices
    fig.tight_layout(rect=(0, legend_height / fig.get_figheight(), 1, 1))
    fig.savefig(out_dir / "curves.png", dpi=120)
    plt.close(fig)
    return ["curves.png"] + files


# --- budget axes: what the curves are drawn against ----------------------------------------------

# --x: (the history's cumulative metric, None for the batch itself; the axis label)
X_AXES = {
    "batch": (None, "rollout batch"),
    "samples": ("rollout/samples_seen", "sampled completions (all ranks)"),
    "tokens": ("rollout/tokens_seen", "generated response tokens (all ranks)"),
    "seconds": ("perf/elapsed_s", "training wall seconds"),
}


def summed_over_resumes(elapsed: dict[int, float]) -> dict[int, float]:
    """perf/elapsed_s with each restart (a value below the one before) continued from where the
    batch before it ended: runs logged before the clock was checkpointed restart it at 0 when
    they resume (a resumed run now continues it itself, and nothing changes here)."""
    total, offset, previous = {}, 0.0, None
    for batch in sorted(elapsed):
        if previous is not None and elapsed[batch] < previous:
            offset = total[max(total)]
        total[batch] = offset + elapsed[batch]
        previous = elapsed[batch]
    return total


def budget_axis(history: dict[str, dict[int, float]], x_axis: str) -> dict[int, float] | None:
    """{batch: x} of one run on the axis `x_axis` (batch 0, before training, at x = 0); None
    when the run did not log the axis' metric."""
    metric = X_AXES[x_axis][0]
    if metric not in history:
        return None
    values = summed_over_resumes(history[metric]) if x_axis == "seconds" else dict(history[metric])
    return {0: 0.0, **values}


def on_budget_axis(history: dict[str, dict[int, float]], axis: dict[int, float]) -> dict[str, dict[float, float]]:
    """Each metric's points moved from their batch to the batch's x on the axis (points at a
    batch the axis lacks are dropped)."""
    return {name: {axis[batch]: value for batch, value in series.items() if batch in axis}
            for name, series in history.items()}


# --- verdicts: each arm against the baseline arm -------------------------------------------------

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


def seed_values(members: list[dict], key: str, scale: float) -> dict[str, float]:
    """{seed: scaled value} of a choice's runs that have a finite `key`. Runs of one choice that
    share a seed (keys left out of --by) are told apart by their job name, so they pair with no
    other arm's."""
    seeds = [choice_value(run, "seed") for run in members]
    unique = len(set(seeds)) == len(seeds)
    values = {}
    for seed, run in zip(seeds, members):
        value = run.get(key)
        if value is not None and math.isfinite(float(value)):
            values[seed if unique else run["path"].name] = scale * float(value)
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


def verdict_table(groups: dict[tuple, list[dict]], labels: list[str], baseline: int, key: str, scale: float,
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
            judged = statistics.verdict(difference, higher_is_better)
            row += [interval_text(difference, "+" + fmt), method_text(difference),
                    judged if judged == "within noise" else f"**{judged}**"]
        body.append(row)
    return body


def noise_floor_text(values: dict[str, float], fmt: str) -> str:
    """The baseline's seed spread: its sample std and its mean's interval half-width."""
    if len(values) < 2:
        return f"Noise floor: the baseline has {len(values)} seed: no spread to measure, no verdict but noise."
    spread = statistics.sample_std(list(values.values()))
    half = statistics.mean_interval(list(values.values()), CONFIDENCE_LEVEL).half_width
    return (f"Noise floor: the baseline's seeds spread with a sample std of {format(spread, fmt)} over "
            f"{len(values)} seeds; its mean is known to ± {format(half, fmt)} (95%).")


def verdict_section(groups: dict[tuple, list[dict]], labels: list[str], baseline: int,
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
    for title, key, scale, fmt, higher_is_better in VERDICT_METRICS:
        if not any(key in run for run in runs):
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


# --- calibration: ECE and the reliability diagram ------------------------------------------------

CALIBRATION_COLUMNS = (
    ("ECE start", lambda r: _scaled(r, "eval/ece_start"), ".3f"),
    ("ECE end", lambda r: _scaled(r, "eval/ece"), ".3f"),
    ("confidence start %", lambda r: _scaled(r, "eval/confidence_start", 100), ".1f"),
    ("confidence end %", lambda r: _scaled(r, "eval/confidence", 100), ".1f"),
    ("acc start %", lambda r: _scaled(r, "eval/accuracy_start", 100), ".1f"),
    ("acc end %", lambda r: _scaled(r, "eval/accuracy", 100), ".1f"),
)


def reliability_points(members: list[dict], suffix: str = "") -> tuple[list[float], list[float], list[float]]:
    """(mean confidence, accuracy, share) of each non-empty confidence bin, pooled over the
    runs of a choice: each run's bin weighted by its share of that run's responses. Read from
    summary.json's `eval/reliability/bin<b>/{share,confidence,accuracy}<suffix>` (suffix
    '_start': before training)."""
    pattern = re.compile(rf"eval/reliability/bin(\d+)/share{suffix}$")
    bins = sorted({int(m.group(1)) for run in members for key in run if (m := pattern.match(key))})
    confidence, accuracy, share = [], [], []
    for b in bins:
        prefix = f"eval/reliability/bin{b:02d}/"
        rows = [(run[f"{prefix}share{suffix}"], run[f"{prefix}confidence{suffix}"], run[f"{prefix}accuracy{suffix}"])
                for run in members if f"{prefix}share{suffix}" in run]
        weight = sum(w for w, _, _ in rows)
        if weight <= 0:  # an empty bin in every run
            continue
        confidence.append(sum(w * c for w, c, _ in rows) / weight)
        accuracy.append(sum(w * a for w, _, a in rows) / weight)
        share.append(weight / len(rows))
    return confidence, accuracy, share


def write_reliability_plot(groups: dict[tuple, list[dict]], labels: list[str], out_dir: Path) -> str | None:
    """reliability.png: accuracy against confidence per bin, before and after training, one
    line per choice (its seeds pooled), marker area by the bin's share; the diagonal is a
    calibrated model. None when no run has reliability bins."""
    panels = [(suffix, title) for suffix, title in (("_start", "before training"), ("", "after training"))
              if any(reliability_points(members, suffix)[0] for members in groups.values())]
    if not panels:
        return None
    # start-up: plotting loads only when a report draws
    import matplotlib

    matplotlib.use("Agg")
    # start-up: plotting loads only when a report draws
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.0), squeeze=False)
    for ax, (suffix, title) in zip(axes[0], panels):
        ax.plot([0, 1], [0, 1], color="black", linestyle="--", linewidth=0.8)
        for i, members in enumerate(groups.values()):
            confidence, accuracy, share = reliability_points(members, suffix)
            if confidence:
                ax.plot(confidence, accuracy, color=f"C{i % 10}", linewidth=1.0)
                ax.scatter(confidence, accuracy, s=[20 + 200 * w for w in share], color=f"C{i % 10}", alpha=0.7)
        ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="confidence (probability of the greedy response)",
               ylabel="accuracy")
        ax.set_title(f"reliability, {title}", fontsize=9)
        ax.xaxis.label.set_fontsize(8)
        ax.yaxis.label.set_fontsize(8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    # one legend below the panels, a row per choice (labels can be long)
    handles = [Line2D([], [], color="black", linestyle="--", label="calibrated (accuracy = confidence)")]
    handles += [Line2D([], [], color=f"C{i % 10}", marker="o", label=label) for i, label in enumerate(labels)]
    fig.legend(handles=handles, loc="lower center", ncol=1, fontsize=7, frameon=False)
    legend_height = 0.17 * len(handles) + 0.1  # inches
    fig.set_figheight(fig.get_figheight() + legend_height)
    fig.tight_layout(rect=(0, legend_height / fig.get_figheight(), 1, 1))
    fig.savefig(out_dir / "reliability.png", dpi=120)
    plt.close(fig)
    return "reliability.png"


def calibration_section(groups: dict[tuple, list[dict]], labels: list[str], by: list[str], out_dir: Path) -> list[str]:
    """The report's calibration section (runs that logged eval/ece): a table of ECE, confidence
    and accuracy per choice, and the reliability diagram; [] when no run has it."""
    if not any("eval/ece" in run for members in groups.values() for run in members):
        return []
    body = [list(key) + [str(len(members))] + [mean_std([value(run) for run in members], fmt)
                                               for _, value, fmt in CALIBRATION_COLUMNS]
            for key, members in groups.items()]
    picture = write_reliability_plot(groups, labels, out_dir)
    lines = [
        "## Calibration",
        "",
        "Held-out greedy responses: confidence is the policy's probability of its whole response "
        "(exp of the sum of its token log-probs), ECE the expected calibration error over equal-width "
        "confidence bins (0: confidence equals accuracy in every bin; confidence above accuracy: "
        "over-confident).",
        "",
        *markdown_table(by + ["n"] + [name for name, _, _ in CALIBRATION_COLUMNS], body),
        "",
    ]
    if picture:
        lines += [f"![reliability]({picture})", ""]
    return lines


# --- the report -------------------------------------------------------------------------------


def write_report(root: Path, by: list[str] | None = None, out_dir: Path | None = None, smooth: int = 1,
                 baseline: str | None = None, x_axis: str = "batch", simultaneous: bool = False) -> Path:
    """Write <out_dir>/report.md and the PNGs (out_dir: <root>/report); returns report.md.
    `baseline`: the arm the others are judged against (pick_baseline); `x_axis`: a key of X_AXES."""
    root = Path(root)
    runs = load_runs(root)
    if not runs:
        raise ReportError(f"no summary.json below {root}: not a sweep directory, or no job has finished "
                          "(each job writes <job dir>/summary.json when it ends)")
    if by is None:
        by = [k for k in varying_keys(runs) if k != "seed"]
    known = {k for run in runs for k in run["overrides"]} | {k for run in runs for k in run.get("choices", {})}
    unknown = [k for k in by if k not in known]
    if unknown:
        raise ReportError(f"--by {' '.join(unknown)}: no run has {'this key' if len(unknown) == 1 else 'these keys'}; "
                          f"the runs' overrides and choices are: {', '.join(sorted(known))}")
    for run in runs:
        run["history"] = load_history(run["path"])
        for name in ("eval/accuracy", "eval/response_len", "eval/proxy_reward", "eval/ece"):  # from the start eval
            if name in run["history"] and f"{name}_start" in run:
                run["history"][name].setdefault(0, run[f"{name}_start"])
    if x_axis != "batch":
        move_to_budget_axis(runs, x_axis)

    out_dir = Path(out_dir) if out_dir is not None else root / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    groups = group_runs(runs, by)
    labels = [", ".join(f"{k}={v}" for k, v in zip(by, key)) or "all runs" for key in groups]
    baseline_index = pick_baseline(labels, list(groups), baseline)
    pictures = write_plots(groups, labels, out_dir, smooth, x_axis)

    n_seeds = sorted({len(members) for members in groups.values()})
    lines = [
        f"# Sweep report: {root}",
        "",
        f"{len(runs)} runs (jobs with a summary.json), {len(groups)} choices"
        + (f" of {', '.join(f'`{k}`' for k in by)}" if by else "")
        + f", {n_seeds[0] if len(n_seeds) == 1 else f'{n_seeds[0]} to {n_seeds[-1]}'} "
        + f"{'seed' if n_seeds == [1] else 'seeds'} each. Held-out greedy accuracy and response length "
        "before and after training (summary.json). Each cell: mean ± sample standard deviation "
        "over the choice's seeds (n runs); a single run shows its value alone.",
        "",
        *markdown_table(by + ["n", "seeds"] + HEADER + ["valid"], choice_rows(groups)),
        "",
    ]
    invalid = [run for run in runs if over_budget(run)]
    if invalid:
        lines += [
            "**Invalid runs.** The sampler and the trainer disagreed beyond `rollout.mismatch_budget` in "
            + ", ".join(f"{run['path'].name} ({over_budget(run)} rollout batches)" for run in invalid)
            + ": their updates were trained on a distribution other than the one the trainer scores "
            "(rollout/mismatch/*). A choice with an invalid run is marked invalid; do not compare it as it is.",
            "",
        ]
    lines += verdict_section(groups, labels, baseline_index, simultaneous)
    lines += calibration_section(groups, labels, by, out_dir)
    lines += [
        "## Curves",
        "",
    ]
    without = [run["path"].name for run in runs if not run["history"]]
    if pictures:
        lines += [
            "One line per choice: the mean over its seeds; the shaded band spans the lowest to the "
            f"highest seed. x: {X_AXES[x_axis][1]}"
            + ("" if x_axis == "batch" else f" (`{X_AXES[x_axis][0]}`, each seed interpolated onto common x)")
            + "; held-out metrics where they were evaluated (0: before training)"
            + (f"; training curves smoothed by a trailing mean over {smooth} batches." if smooth > 1 else "."),
            "",
            f"![curves]({pictures[0]})",
            "",
            "Panels: " + ", ".join(f"[{name[:-4]}]({name})" for name in pictures[1:]),
        ]
    else:
        lines.append("No run has a logged history (metrics.jsonl or csv/metrics.csv): no curves.")
    if without and pictures:
        lines += ["", f"Without a logged history (not in the curves): {', '.join(without)}."]
    per_run_keys = by + (["seed"] if "seed" not in by and any("seed" in run["overrides"] for run in runs) else [])
    lines += [
        "",
        "## Runs",
        "",
        *markdown_table(["job"] + per_run_keys + HEADER + ["valid"],
                        [[run["path"].name] + row for run, row in zip(runs, rows(runs, per_run_keys))]),
        "",
    ]
    report = out_dir / "report.md"
    report.write_text("\n".join(lines))
    return report


def move_to_budget_axis(runs: list[dict], x_axis: str) -> None:
    """Each run's history re-keyed from batches to `x_axis`; a run that did not log the axis'
    metric keeps no history (listed in the report as without one). No run with it: an error."""
    metric = X_AXES[x_axis][0]
    axes = [budget_axis(run["history"], x_axis) for run in runs]
    if all(axis is None for axis in axes):
        raise ReportError(f"--x {x_axis}: no run logged {metric} (online RL runs log it each rollout batch); "
                          "draw against --x batch")
    for run, axis in zip(runs, axes):
        run["history"] = on_budget_axis(run["history"], axis) if axis is not None else {}


class ReportError(Exception):
    """Bad input to posttrain-report: printed as one line, exit 1."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="posttrain-report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", type=Path, nargs="?",
                        help="a multirun directory (or any folder of run directories); optional with --compare")
    parser.add_argument("--by", nargs="+", metavar="KEY",
                        help="the keys that make a choice; runs that share them are aggregated as seeds "
                             "(default: every override that varies, except seed; `--by algorithm seed`: one row per run)")
    parser.add_argument("--out", type=Path, help="output directory (default: <root>/report)")
    parser.add_argument("--smooth", type=int, default=1, metavar="N",
                        help="trailing mean over N batches of the training curves (default 1: none)")
    parser.add_argument("--baseline", metavar="ARM",
                        help="the arm the others are judged against: its label as the report prints it "
                             "(algorithm=grpo), its values (grpo) or its # (default: 0, the first)")
    parser.add_argument("--simultaneous", action="store_true",
                        help="widen the differences' intervals so that all arms' hold together at 95%% "
                             "(Bonferroni over the arms judged against the baseline)")
    parser.add_argument("--x", dest="x_axis", choices=list(X_AXES), default="batch",
                        help="the curves' x axis: rollout batches, sampled completions, generated tokens or "
                             "training wall seconds (default: batch)")
    parser.add_argument("--compare", nargs="+", type=Path, metavar="RUN",
                        help="run (or sweep) directories to set side by side in panel pages, written to --out "
                             "when no root is given, else to <their common folder>/compare")
    parser.add_argument("--at", nargs="+", type=int, metavar="BATCH",
                        help="with --compare: the rollout batches whose samples the pages show")
    args = parser.parse_args(argv)
    try:
        if args.at and not args.compare:
            raise ReportError("--at picks the batches of --compare's pages: give --compare RUN [RUN ...] too")
        if args.root is None and not args.compare:
            raise ReportError("give a sweep directory (root) or --compare RUN [RUN ...]")
        if args.root is not None:
            if not args.root.is_dir():
                raise ReportError(f"{args.root} is not a directory")
            report = write_report(args.root, args.by, args.out, max(1, args.smooth), args.baseline, args.x_axis,
                                  args.simultaneous)
            print(f"wrote {report} and its plots in {report.parent}")
        if args.compare:
            print(f"wrote {compare_runs(args.compare, args.out if args.root is None else None, args.at)}")
    except (ReportError, DataError) as err:  # DataError: a run directory --compare cannot read
        print(f"posttrain-report: error: {err}", file=sys.stderr)
        sys.exit(1)


def compare_runs(run_dirs: list[Path], out_dir: Path | None, at_batches: list[int] | None) -> Path:
    """--compare: the runs' panel pages (posttrain.eval.panel_pages, which checks the
    directories), in `out_dir` (default: the runs' common folder / compare)."""
    # start-up: the pages' code loads only when pages are asked for
    from posttrain.eval.panel_pages import write_panel_pages

    if out_dir is None:
        out_dir = Path(os.path.commonpath([run.resolve() for run in run_dirs])) / "compare"
    return write_panel_pages(list(run_dirs), Path(out_dir), at_batches)


if __name__ == "__main__":
    main()
