"""Tabulate a sweep on the console: one row per run directory holding a summary.json.

    posttrain -m algorithm=grpo,dr_grpo,dapo,gspo,cispo hydra.sweep.dir=outputs/presets
    python benchmarks/sweep_table.py outputs/presets [--by algorithm seed] [--markdown]

Columns: the Hydra choices and overrides that differ between runs (or those named with
--by), held-out greedy accuracy and response length at start and end, the change, the
optimiser steps and the training seconds. `--markdown` prints a table to paste in a README.

The reading and the columns are posttrain.eval.report's (`posttrain-report <dir>` writes the
same per-run table, plus mean ± std over seeds per choice and plots of the curves).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from posttrain.eval.report.runs import load_runs, varying_keys
from posttrain.eval.report.tables import HEADER, markdown_table, rows

__all__ = ["load_runs", "varying_keys", "rows", "HEADER"]


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
        print("\n".join(markdown_table(header, body)))
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
