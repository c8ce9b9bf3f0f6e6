"""Tabulate a sweep: one row per run directory holding a summary.json.

    posttrain -m algorithm=grpo,dr_grpo,dapo,gspo,cispo hydra.sweep.dir=outputs/presets
    python benchmarks/sweep_table.py outputs/presets [--by algorithm seed] [--markdown]

Columns: the Hydra choices and overrides that differ between runs (or those named with
--by), held-out greedy accuracy and response length at start and end, the change, the
optimiser steps and the training seconds. `--markdown` prints a table to paste in a README.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import yaml


def load_runs(root: Path) -> list[dict]:
    """Every summary.json below `root`, with the run's command-line overrides attached."""
    runs = []
    for summary_path in sorted(root.rglob("summary.json")):
        if "warm_start" in summary_path.parts or "cache" in summary_path.parts:
            continue
        summary = json.loads(summary_path.read_text())
        overrides_path = summary_path.parent / ".hydra" / "overrides.yaml"
        overrides = yaml.safe_load(overrides_path.read_text()) if overrides_path.is_file() else []
        summary["overrides"] = dict(o.lstrip("+~").split("=", 1) for o in overrides if "=" in o)
        runs.append(summary)
    return runs


def varying_keys(runs: list[dict]) -> list[str]:
    """Override keys whose value differs between runs (the sweep's axes)."""
    keys = sorted({k for run in runs for k in run["overrides"]})
    return [k for k in keys if len({run["overrides"].get(k) for run in runs}) > 1]


def rows(runs: list[dict], by: list[str]) -> list[list[str]]:
    table = []
    for run in runs:
        start, end = run.get("eval/accuracy_start"), run.get("eval/accuracy")
        change = "" if start is None or end is None else f"{100 * (end - start):+.1f}"
        table.append([str(run["overrides"].get(k, run.get("choices", {}).get(k, ""))) for k in by] + [
            "" if start is None else f"{100 * start:.1f}",
            "" if end is None else f"{100 * end:.1f}",
            change,
            f"{run.get('eval/response_len_start', float('nan')):.2f}",
            f"{run.get('eval/response_len', float('nan')):.2f}",
            str(run.get("global_step", "")),
            f"{run.get('train_seconds', float('nan')):.0f}",
        ])
    return table


HEADER = ["acc start %", "acc end %", "change pts", "len start", "len end", "steps", "train s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", type=Path, help="a multirun directory (or any folder of run dirs)")
    parser.add_argument("--by", nargs="*", help="override keys to show (default: those that vary)")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = parser.parse_args()
    runs = load_runs(args.root)
    if not runs:
        raise SystemExit(f"sweep_table: no summary.json below {args.root}")
    by = args.by or varying_keys(runs)
    header, body = by + HEADER, rows(runs, by)
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for row in body:
            print("| " + " | ".join(row) + " |")
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=str(args.root))
        for column in header:
            table.add_column(column, justify="right")
        for row in body:
            table.add_row(*row)
        Console().print(table)
    changes = [float(r[len(by) + 2]) for r in body if r[len(by) + 2]]
    if len(changes) > 1:
        print(f"change over {len(changes)} runs: mean {statistics.mean(changes):+.1f} pts, "
              f"min {min(changes):+.1f}, max {max(changes):+.1f}")


if __name__ == "__main__":
    main()
