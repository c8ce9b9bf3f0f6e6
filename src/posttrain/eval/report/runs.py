"""Reading a sweep: every finished job below a folder as a `Run` (its directory, its sweep axes,
its summary.json and its logged history)."""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from posttrain.run.history import HISTORY_FILE, read_history

# held-out metrics a run also evaluates before training: summary.json's `<name>_start` is the
# history's point at batch 0
START_EVALUATED = ("eval/accuracy", "eval/response_len", "eval/proxy_reward", "eval/ece")


class ReportError(Exception):
    """Bad input to posttrain-report: printed as one line, exit 1."""


@dataclass
class Run:
    """One finished job of a sweep."""

    path: Path                      # the job's directory (its name: the job's, `2_grpo`)
    overrides: dict[str, str]       # its command-line overrides, key -> value (`+`/`~` prefixes dropped)
    choices: dict[str, str]         # its Hydra group choices (summary.json's `choices`)
    summary: dict[str, Any]         # its summary.json: final metrics, `<metric>_start` before training
    history: dict[str, dict[float, float]] = field(default_factory=dict)  # {metric: {x: value}}, load_histories

    def value(self, key: str) -> str:
        """Its value of `key`: its override, else its Hydra group choice, else ''."""
        return str(self.overrides.get(key, self.choices.get(key, "")))

    @property
    def seed(self) -> str:
        return self.value("seed")

    @property
    def name(self) -> str:
        return self.path.name


def load_runs(root: Path) -> list[Run]:
    """Every summary.json below `root` (the warm-start cache excluded), in job order; histories
    are read apart (load_histories)."""
    paths = [p for p in Path(root).rglob("summary.json") if "warm_start" not in p.parts and "cache" not in p.parts]
    runs = []
    for path in sorted(paths, key=_job_order):
        summary = json.loads(path.read_text())
        runs.append(Run(path.parent, read_overrides(path.parent), summary.get("choices", {}), summary))
    return runs


def read_overrides(run_dir: Path) -> dict[str, str]:
    """A run's command-line overrides (Hydra's .hydra/overrides.yaml), key -> value, `+`/`~` dropped."""
    path = run_dir / ".hydra" / "overrides.yaml"
    overrides = yaml.safe_load(path.read_text()) if path.is_file() else []
    return dict(o.lstrip("+~").split("=", 1) for o in overrides or [] if "=" in o)


def _job_order(summary_path: Path):
    # Hydra names jobs `<n>_<task>`: 2_grpo before 10_grpo, which a plain sort would swap
    match = re.match(r"(\d+)_", summary_path.parent.name)
    return (str(summary_path.parent.parent), int(match.group(1)) if match else -1, summary_path.parent.name)


def varying_keys(runs: list[Run]) -> list[str]:
    """Override keys whose value differs between runs (the sweep's axes)."""
    keys = sorted({k for run in runs for k in run.overrides})
    return [k for k in keys if len({run.overrides.get(k) for run in runs}) > 1]


def check_keys(runs: list[Run], by: list[str]) -> None:
    """A ReportError naming the keys of `by` that no run has among its overrides and choices."""
    known = {k for run in runs for k in run.overrides} | {k for run in runs for k in run.choices}
    unknown = [k for k in by if k not in known]
    if unknown:
        raise ReportError(f"--by {' '.join(unknown)}: no run has {'this key' if len(unknown) == 1 else 'these keys'}; "
                          f"the runs' overrides and choices are: {', '.join(sorted(known))}")


def group_runs(runs: list[Run], by: list[str]) -> dict[tuple, list[Run]]:
    """Runs with the same values of `by` (one choice, its seeds), in order of first appearance."""
    groups: dict[tuple, list[Run]] = {}
    for run in runs:
        groups.setdefault(tuple(run.value(k) for k in by), []).append(run)
    return groups


def load_histories(runs: list[Run]) -> None:
    """Each run's logged history, with the evaluation before training (summary.json) at batch 0."""
    for run in runs:
        run.history = load_history(run.path)
        for name in START_EVALUATED:
            if name in run.history and f"{name}_start" in run.summary:
                run.history[name].setdefault(0, run.summary[f"{name}_start"])


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
