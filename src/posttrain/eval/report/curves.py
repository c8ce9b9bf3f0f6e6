"""What the curves are drawn against and how seeds are pooled: the budget axes (--x), the seed
band (mean, lowest, highest), the trailing mean."""

from __future__ import annotations

from posttrain.eval.report.runs import ReportError, Run

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


def move_to_budget_axis(runs: list[Run], x_axis: str) -> None:
    """Each run's history re-keyed from batches to `x_axis`; a run that did not log the axis'
    metric keeps no history (listed in the report as without one). No run with it: an error."""
    metric = X_AXES[x_axis][0]
    axes = [budget_axis(run.history, x_axis) for run in runs]
    if all(axis is None for axis in axes):
        raise ReportError(f"--x {x_axis}: no run logged {metric} (online RL runs log it each rollout batch); "
                          "draw against --x batch")
    for run, axis in zip(runs, axes):
        run.history = on_budget_axis(run.history, axis) if axis is not None else {}


# --- pooling the seeds' curves --------------------------------------------------------------------


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
