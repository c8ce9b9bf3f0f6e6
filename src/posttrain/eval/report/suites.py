"""The evaluation suites (`eval.suites`, algorithms/eval_suites.py) and the held-out accuracy per
source (`eval/<source>/accuracy`) in posttrain-report: which of a run's summary.json keys they
are, the report's table of them per choice, the metrics the verdicts judge, and the value cell
the panel pages show."""

from __future__ import annotations

import re

from posttrain.algorithms.eval_suites import EVAL_NAMESPACES
from posttrain.eval.report.runs import Run
from posttrain.eval.report.tables import column_cells, markdown_table, scaled

# eval/<suite or source>/<metric>: the metrics a suite logs (a source logs its accuracy)
SUITE_KEY = re.compile(r"eval/(?P<name>[^/]+)/(?P<metric>accuracy|response_len|(?:pass|maj|mean)@\d+)")


def suite_keys(runs: list[Run]) -> list[str]:
    """The suites' and sources' final metrics some run's summary.json holds, in first-seen order."""
    return suite_keys_in([run.summary for run in runs])


def suite_keys_in(metric_tables: list[dict]) -> list[str]:
    """The suites' and sources' metrics among the keys of `metric_tables` (summaries or
    histories), in first-seen order."""
    keys = []
    for table in metric_tables:
        for key in table:
            match = SUITE_KEY.fullmatch(key)
            if match and match["name"] not in EVAL_NAMESPACES and not match["name"].startswith("thinking@"):
                keys.append(key)
    return list(dict.fromkeys(keys))


def metric_format(key: str) -> tuple[float, str, bool]:
    """(scale, format, higher is better) of a suite's metric: a share in %, a length in tokens
    (shorter counts as better: the same answer for less compute)."""
    if key.endswith("/response_len"):
        return 1.0, ".2f", False
    return 100.0, ".1f", True


def metric_title(key: str) -> str:
    match = SUITE_KEY.fullmatch(key)
    unit = " (tokens)" if match["metric"] == "response_len" else " %"
    return f"suite or source `{match['name']}`: {match['metric']}{unit}"


def suite_verdict_metrics(runs: list[Run]) -> list[tuple[str, str, float, str, bool]]:
    """The verdicts' (title, key, scale, format, higher is better) of every suite's and source's
    metric (verdicts.VERDICT_METRICS' shape)."""
    return [(metric_title(key), key, *metric_format(key)) for key in suite_keys(runs)]


def suites_section(groups: dict[tuple, list[Run]], by: list[str]) -> list[str]:
    """Per choice, mean ± sample std over its seeds of each suite's and source's final metric
    (start → end for accuracies evaluated before training too); [] when no run has any."""
    runs = [run for members in groups.values() for run in members]
    keys = suite_keys(runs)
    if not keys:
        return []
    columns = []
    for key in keys:
        scale, fmt, _ = metric_format(key)
        name = key.removeprefix("eval/")
        if any(f"{key}_start" in run.summary for run in runs):
            columns.append((f"{name} start", lambda s, key=key, scale=scale: scaled(s, f"{key}_start", scale), fmt))
        columns.append((name, lambda s, key=key, scale=scale: scaled(s, key, scale), fmt))
    body = [list(choice) + [str(len(members))] + column_cells(members, tuple(columns))
            for choice, members in groups.items()]
    return [
        "## Evaluation suites and sources",
        "",
        "Each suite of `eval.suites` (its own held-out set and decoding: docs/running.md, \"Evaluation "
        "suites\") and each source of the held-out examples (`eval/<source>/accuracy`): the final value, "
        "and before training where it was evaluated. Shares in %, lengths in tokens; mean ± sample "
        "standard deviation over the choice's seeds.",
        "",
        *markdown_table(by + ["n"] + [header for header, _, _ in columns], body),
        "",
    ]


def value_cell(key: str, value: float | None) -> str:
    """A suite metric as a table shows it: a share in %, a length in tokens; '' when absent."""
    if value is None:
        return ""
    scale, fmt, _ = metric_format(key)
    return format(scale * value, fmt)
