"""The report's tables: final metrics per choice (mean ± sample std over its seeds) and per run,
whether a choice is valid, and markdown tables."""

from __future__ import annotations

import math

from posttrain.core import statistics
from posttrain.eval.report.runs import Run


def mean_std(values: list[float], fmt: str = ".1f") -> str:
    """'mean ± sample std' of the values present (n - 1 in the std); the value alone when there
    is one. `fmt`: the mean's format spec ('+.1f' signs it); the std's drops the sign."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return ""
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.mean(values), fmt)} ± {format(statistics.sample_std(values), fmt.lstrip('+'))}"


def scaled(summary: dict, key: str, scale: float = 1.0) -> float | None:
    """A summary's `key` times `scale`; None when it lacks it."""
    value = summary.get(key)
    return None if value is None else scale * float(value)


def _change(summary: dict) -> float | None:
    start, end = summary.get("eval/accuracy_start"), summary.get("eval/accuracy")
    return None if start is None or end is None else 100 * (end - start)


# Final-metric columns: (header, value of a run's summary, format)
COLUMNS = (
    ("acc start %", lambda s: scaled(s, "eval/accuracy_start", 100), ".1f"),
    ("acc end %", lambda s: scaled(s, "eval/accuracy", 100), ".1f"),
    ("change pts", _change, "+.1f"),
    ("len start", lambda s: scaled(s, "eval/response_len_start"), ".2f"),
    ("len end", lambda s: scaled(s, "eval/response_len"), ".2f"),
    ("steps", lambda s: scaled(s, "global_step"), ".0f"),
    ("train s", lambda s: scaled(s, "train_seconds"), ".0f"),
)
HEADER = [name for name, _, _ in COLUMNS]
# summary.json's count of rollout batches over rollout.mismatch_budget: a run with any is invalid
OVER_BUDGET = "rollout/mismatch/over_budget_batches"


def over_budget(run: Run) -> int:
    """Rollout batches of a run whose sampler/trainer mismatch was over its budget (0: valid)."""
    return int(run.summary.get(OVER_BUDGET) or 0)


def validity(members: list[Run]) -> str:
    """'yes', or which of a choice's runs went over their mismatch budget: the choice is invalid."""
    invalid = sum(over_budget(run) > 0 for run in members)
    if not invalid:
        return "yes"
    return f"**invalid** ({invalid} of {len(members)})" if len(members) > 1 else "**invalid**"


def column_cells(members: list[Run], columns: tuple) -> list[str]:
    """Mean ± std over `members` of each of `columns` ((header, value of a summary, format))."""
    return [mean_std([value(run.summary) for run in members], fmt) for _, value, fmt in columns]


def choice_rows(groups: dict[tuple, list[Run]]) -> list[list[str]]:
    """One row per choice: its values, n, the seeds, then mean ± std of each column."""
    table = []
    for key, members in groups.items():
        seeds = ",".join(run.seed for run in members if run.seed)
        table.append(list(key) + [str(len(members)), seeds] + column_cells(members, COLUMNS) + [validity(members)])
    return table


def rows(runs: list[Run], by: list[str]) -> list[list[str]]:
    """One row per run: the values of `by`, then each column (the sweep_table layout)."""
    return [[run.value(k) for k in by] + column_cells([run], COLUMNS) + [validity([run])] for run in runs]


def markdown_table(header: list[str], body: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in body]
