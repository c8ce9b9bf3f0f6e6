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
import os
import sys
from pathlib import Path

from posttrain.errors import DataError
from posttrain.eval.report.curves import X_AXES
from posttrain.eval.report.document import write_report
from posttrain.eval.report.runs import ReportError


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
    """--compare: the runs' panel pages (panel_pages.py, which checks the directories), in
    `out_dir` (default: the runs' common folder / compare)."""
    # start-up: the pages' code loads only when pages are asked for
    from posttrain.eval.report.panel_pages import write_panel_pages

    if out_dir is None:
        out_dir = Path(os.path.commonpath([run.resolve() for run in run_dirs])) / "compare"
    return write_panel_pages(list(run_dirs), Path(out_dir), at_batches)
