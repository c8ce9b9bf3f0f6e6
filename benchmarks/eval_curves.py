"""Held-out accuracy curves of finished runs, side by side: a table (step x run, with the mean)
and optionally a plot.

    python benchmarks/eval_curves.py outputs/grpo_smollm2/runs/<time> [<run dir> ...] [--markdown]
        [--plot curve.png] [--metric eval/accuracy]

Each run directory's metrics.jsonl (written by every run, whatever the logger) gives the metric
at each held-out evaluation; summary.json gives the training seconds and the run's seed comes
from config.yaml. Runs that evaluated at different steps are aligned on the steps they share.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml


def read_curve(run_dir: Path, metric: str) -> dict[int, float]:
    """{step: value} of `metric` at each evaluation of the run."""
    curve = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if metric in record:
            curve[int(record["step"])] = float(record[metric])
    if not curve:
        raise SystemExit(f"{run_dir}/metrics.jsonl has no {metric!r}")
    return curve


def run_label(run_dir: Path) -> str:
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    return f"seed {config.get('seed')}"


def table(curves: dict[str, dict[int, float]], seconds: dict[str, float | None], markdown: bool) -> str:
    steps = sorted(set.intersection(*(set(c) for c in curves.values())))
    labels = list(curves)
    rows = [["step", *labels, "mean"]]
    for step in steps:
        values = [curves[label][step] for label in labels]
        rows.append([str(step), *(f"{100 * v:.1f}" for v in values), f"{100 * sum(values) / len(values):.1f}"])
    rows.append(["train s", *(f"{seconds[label]:.0f}" if seconds[label] else "-" for label in labels), ""])
    if markdown:
        lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---:|" * len(rows[0])]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows[1:]])
    return "\n".join("  ".join(f"{cell:>8}" for cell in row) for row in rows)


def plot(curves: dict[str, dict[int, float]], metric: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(5, 3.2))
    for label, curve in curves.items():
        steps = sorted(curve)
        axes.plot(steps, [100 * curve[s] for s in steps], marker="o", label=label)
    axes.set_xlabel("training step")
    axes.set_ylabel(f"{metric} (%)")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run directories")
    parser.add_argument("--metric", default="eval/accuracy")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--plot", type=Path, default=None, help="write the curves as a PNG here")
    args = parser.parse_args(argv)
    curves, seconds = {}, {}
    for run_dir in args.runs:
        label = run_label(run_dir)
        curves[label] = read_curve(run_dir, args.metric)
        summary = run_dir / "summary.json"
        seconds[label] = json.loads(summary.read_text()).get("train_seconds") if summary.exists() else None
    print(table(curves, seconds, args.markdown))
    if args.plot:
        plot(curves, args.metric, args.plot)


if __name__ == "__main__":
    main()
