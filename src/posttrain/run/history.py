"""A run's logged metrics as plain lines, whatever the logger: `<run dir>/metrics.jsonl`.

One JSON object per log call (rank 0):

    {"step": 12, "batch": 6, "rollout/reward_mean": 0.31, "policy/kl": 0.002, ...}
    {"step": 12, "batch": 6, "eval/accuracy": 0.45, "eval/response_len": 4.6}

`step` is Lightning's global step (optimiser steps), `batch` the training batches seen
(rollout batches for RL: `rollout/batch`; eval lines carry the batch they evaluated at, 0
for the evaluation before training). W&B keeps its history in binary files and
`logger=none` keeps none, so `posttrain-report` reads this file instead.

How it sees every log call: Lightning has no callback hook for "metrics were logged", only
loggers get them. `MetricsHistory` is a callback that adds a small logger of its own next
to the configured ones (or alone, with `logger=none`), so it records exactly what W&B or
the CSV logger receive.

Resume: a resumed run repeats the batches after its checkpoint, which were already logged
before it stopped. At the start of a resumed fit the lines past the checkpoint's batch are
dropped; readers (`read_history`) also let a later line win over an earlier one of the same
batch, so a line logged twice never counts twice.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger

HISTORY_FILE = "metrics.jsonl"


class MetricsHistory(Callback):
    """Append every logged metrics dict to `<run_dir>/metrics.jsonl` (rank 0 only)."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / HISTORY_FILE
        self.trainer = None
        self.module = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        # called by each trainer.validate() and trainer.fit() of the job: add the logger once
        if not trainer.is_global_zero:
            return
        self.trainer, self.module = trainer, pl_module
        if not any(isinstance(logger, _HistoryLogger) for logger in trainer.loggers):
            trainer.loggers = list(trainer.loggers) + [_HistoryLogger(self)]

    def on_train_start(self, trainer, pl_module) -> None:
        # after the checkpoint is restored: drop what the resumed run will log again
        if trainer.is_global_zero and trainer.ckpt_path is not None:
            truncate_history(self.path, batches_seen(trainer, pl_module))

    def write(self, metrics: dict) -> None:
        batch = metrics.get("rollout/batch", batches_seen(self.trainer, self.module))
        record = {"step": int(self.trainer.global_step), "batch": int(batch)}
        # `epoch` is Lightning's own addition to eval logs, not a metric of ours
        record.update({k: float(v) for k, v in metrics.items() if k != "epoch"})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:  # one short line per log call: open, append, close
            f.write(json.dumps(record) + "\n")


def batches_seen(trainer, pl_module) -> int:
    """Training batches done: our modules count them (`train_batches_seen`, rollout batches
    for RL, restored on resume); any other module: Lightning's global step."""
    count = getattr(pl_module, "train_batches_seen", None)
    return int(count) if count is not None else int(trainer.global_step)


def truncate_history(path: Path, batch: int) -> None:
    """Keep the lines logged at or before `batch` (the resumed checkpoint's), rewritten
    atomically: a crash here must not lose the history."""
    if not path.is_file():
        return
    kept = [record for record in _records(path) if _line_key(record) <= batch]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(record) + "\n" for record in kept))
    tmp.replace(path)


def _records(path: Path):
    """The file's JSON objects. A job killed mid-write leaves a cut last line: skipped."""
    for line in Path(path).read_text().splitlines():
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue


def _line_key(record: dict) -> int:
    return int(record["batch"]) if record.get("batch") is not None else int(record["step"])


def read_history(path: Path) -> dict[str, dict[int, float]]:
    """metrics.jsonl -> {metric: {batch: value}} (batch, or step where a line has none). A
    later line wins over an earlier one of the same batch (a resumed run's repeats)."""
    series: dict[str, dict[int, float]] = {}
    for record in _records(path):
        x = _line_key(record)
        for name, value in record.items():
            if name in ("step", "batch") or value is None or not math.isfinite(value):
                continue
            series.setdefault(name, {})[x] = float(value)
    return series


class _HistoryLogger(Logger):
    """The logger half of MetricsHistory: Lightning hands it every metrics dict it logs."""

    def __init__(self, history: MetricsHistory):
        super().__init__()
        self.history = history

    @property
    def name(self) -> str:
        return "history"

    @property
    def version(self) -> str:
        return ""

    @property
    def save_dir(self) -> str:
        return str(self.history.path.parent)

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass  # the resolved config is saved beside the run as config.yaml

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        self.history.write(metrics)
