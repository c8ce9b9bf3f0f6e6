"""`posttrain-report`: a sweep's results as a markdown table, verdicts and plots, offline; with
--compare, runs' prompt panels side by side.

    runs.py         the finished jobs of a sweep (`Run`: directory, overrides, choices, summary, history)
    tables.py       final metrics per choice (mean ± std over seeds) and per run; markdown tables
    verdicts.py     each arm against a baseline arm (the statistics: core/statistics.py)
    curves.py       the budget axes (--x), the seed band, smoothing
    plots.py        the curves' PNGs
    calibration.py  ECE per choice and the reliability diagram
    document.py     report.md (write_report)
    panel_pages.py  --compare's pages
    command.py      the command line (main)
"""

from posttrain.eval.report.command import main

__all__ = ["main"]
