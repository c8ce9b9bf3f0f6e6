"""report.md: a sweep's table per choice, its invalid runs, the evaluation suites, the verdicts, the calibration, the
curves and the per-run table, written with the plots beside it."""

from __future__ import annotations

from pathlib import Path

from posttrain.eval.report.calibration import calibration_section
from posttrain.eval.report.curves import X_AXES, move_to_budget_axis
from posttrain.eval.report.plots import write_plots
from posttrain.eval.report.runs import ReportError, Run, check_keys, group_runs, load_histories, load_runs, varying_keys
from posttrain.eval.report.suites import suites_section
from posttrain.eval.report.tables import HEADER, choice_rows, markdown_table, over_budget, rows
from posttrain.eval.report.verdicts import change_section, pick_baseline, verdict_section


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
    check_keys(runs, by)
    load_histories(runs)
    if x_axis != "batch":
        move_to_budget_axis(runs, x_axis)

    out_dir = Path(out_dir) if out_dir is not None else root / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    groups = group_runs(runs, by)
    labels = [", ".join(f"{k}={v}" for k, v in zip(by, key)) or "all runs" for key in groups]
    baseline_index = pick_baseline(labels, list(groups), baseline)
    pictures = write_plots(groups, labels, out_dir, smooth, x_axis)

    lines = choices_section(root, runs, groups, by)
    lines += invalid_section(runs)
    lines += suites_section(groups, by)
    lines += change_section(groups, labels)
    lines += verdict_section(groups, labels, baseline_index, simultaneous)
    lines += calibration_section(groups, labels, by, out_dir)
    lines += curves_section(runs, pictures, x_axis, smooth)
    lines += runs_section(runs, by)
    report = out_dir / "report.md"
    report.write_text("\n".join(lines))
    return report


def choices_section(root: Path, runs: list[Run], groups: dict[tuple, list[Run]], by: list[str]) -> list[str]:
    """The title and the table of final metrics per choice."""
    n_seeds = sorted({len(members) for members in groups.values()})
    return [
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


def invalid_section(runs: list[Run]) -> list[str]:
    """The runs over their mismatch budget, named; [] when there are none."""
    invalid = [run for run in runs if over_budget(run)]
    if not invalid:
        return []
    return [
        "**Invalid runs.** The sampler and the trainer disagreed beyond `rollout.mismatch_budget` in "
        + ", ".join(f"{run.name} ({over_budget(run)} rollout batches)" for run in invalid)
        + ": their updates were trained on a distribution other than the one the trainer scores "
        "(rollout/mismatch/*). A choice with an invalid run is marked invalid; do not compare it as it is.",
        "",
    ]


def curves_section(runs: list[Run], pictures: list[str], x_axis: str, smooth: int) -> list[str]:
    """The curves (write_plots' files) and what they show, or why there are none."""
    lines = [
        "## Curves",
        "",
    ]
    without = [run.name for run in runs if not run.history]
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
    return lines


def runs_section(runs: list[Run], by: list[str]) -> list[str]:
    """One row per run (its seed a column when the choices aggregate seeds)."""
    per_run_keys = by + (["seed"] if "seed" not in by and any("seed" in run.overrides for run in runs) else [])
    return [
        "",
        "## Runs",
        "",
        *markdown_table(["job"] + per_run_keys + HEADER + ["valid"],
                        [[run.name] + row for run, row in zip(runs, rows(runs, per_run_keys))]),
        "",
    ]
