"""Lightning callbacks of our own, and the list a run trains with (`build_callbacks`)."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint, ProgressBar
from omegaconf import DictConfig
from rich import get_console
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Column
from rich.text import Text

from posttrain.errors import ConfigError
from posttrain.run.history import MetricsHistory
from posttrain.run.user_components import build_user_components


class StopAtStep(Callback):
    """Stop as if preempted once `step` optimiser steps are done. The LR schedule still
    spans trainer.max_steps, so resuming from the last checkpoint continues the same run."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


class StopAtAccuracy(Callback):
    """Stop once a held-out evaluation reaches `threshold` greedy accuracy: the SFT warm
    start ends at a chosen point of its learning curve, whatever the seed's pace."""

    def __init__(self, threshold: float):
        self.threshold = threshold

    def on_validation_end(self, trainer, pl_module) -> None:
        accuracy = trainer.callback_metrics.get("eval/accuracy")
        if not trainer.sanity_checking and accuracy is not None and float(accuracy) >= self.threshold:
            trainer.should_stop = True


class RunRecord(Callback):
    """What a checkpoint must tell about its run beyond the weights: the algorithm that wrote
    it (a resume under another one is refused before anything loads) and the held-out metrics
    measured before training, so a resumed run ends with the same before/after table."""

    def __init__(self, algorithm: str):
        self.algorithm = algorithm
        self.start_metrics: dict[str, float] = {}

    def state_dict(self) -> dict:
        return {"algorithm": self.algorithm, "start_metrics": dict(self.start_metrics)}

    def load_state_dict(self, state: dict) -> None:
        self.start_metrics = dict(state.get("start_metrics", {}))


# What the progress bar shows, in this order, under short names: (logged name, short name,
# format). Any other metric a module logs with prog_bar=True follows under the last part of
# its name; Lightning's `v_num` is not shown.
PROGRESS_METRICS = (
    ("train/loss", "loss", "{:.3f}"),
    ("rollout/reward_mean", "reward", "{:.3f}"),
    ("rollout/accuracy", "acc", "{:.1%}"),
    ("policy/kl", "kl", "{:.4f}"),
    ("eval/accuracy", "eval_acc", "{:.1%}"),
    ("eval/response_len", "eval_len", "{:.1f}"),
)
# Training metrics shown as their mean over the batches since the last printed line (on a
# terminal: over the last LIVE_WINDOW batches), not the last batch's value: one rollout batch of
# 8 prompts swings its accuracy by +-15 points, which read as a collapse in a printout where
# the 100-batch mean rose steadily (docs/algorithms.md, "What moves the main job's gain").
AVERAGED_METRICS = ("train/loss", "rollout/reward_mean", "rollout/accuracy", "policy/kl")
LIVE_WINDOW = 20


class StepProgressBar(ProgressBar):
    """Training progress in optimiser steps, `step 20/600` out of trainer.max_steps, with a few
    metrics under short names (PROGRESS_METRICS) on the line below; the training ones
    (AVERAGED_METRICS) are means over the batches since the last line.

    It follows trainer.global_step, not the batch index: one rollout batch of an RL run can
    make several optimiser steps. On a terminal it is a live rich bar whose last frame stays.
    When the output is a file or a pipe (SLURM logs, CI, tests), a live bar would leave
    nothing until the end, or a line per refresh: it prints one plain line at each held-out
    evaluation during training and one at the end instead. Evaluations get no bar of their
    own (the train bar says `evaluating`); neither do trainer.validate() calls outside fit.
    """

    def __init__(self, console: Console | None = None):
        super().__init__()
        self._console = console  # None: rich's console of the process (stdout)
        self._enabled = True
        self._plain: bool | None = None  # decided at train start: lines (True) or a live bar (False)
        self._progress: _BarAndMetrics | None = None
        self._task = None
        self._evaluating = False
        self._printed_step: int | None = None
        self._recent: dict[str, list[float]] = {}  # AVERAGED_METRICS' values since the last line

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    # --- what it shows -----------------------------------------------------------------------
    def description(self, trainer) -> str:
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else "?"
        return f"step {trainer.global_step}/{total}"

    def get_metrics(self, trainer, pl_module=None) -> dict[str, str]:
        """Short name -> formatted value of the metrics shown: the latest logged values, the
        AVERAGED_METRICS' mean over the batches since the last line."""
        logged = trainer.callback_metrics
        shown = {short: fmt.format(self._shown_value(name, logged))
                 for name, short, fmt in PROGRESS_METRICS if name in logged}
        known = {name for name, _, _ in PROGRESS_METRICS}
        for name, value in trainer.progress_bar_metrics.items():
            if name in known or name == "v_num":
                continue
            try:
                shown.setdefault(name.rsplit("/", 1)[-1], f"{float(value):.3g}")
            except (TypeError, ValueError):  # not a single number
                continue
        return shown

    def _shown_value(self, name: str, logged) -> float:
        recent = self._recent.get(name)
        return sum(recent) / len(recent) if recent else float(logged[name])

    def metrics_line(self, trainer) -> str:
        text = "  ".join(f"{name} {value}" for name, value in self.get_metrics(trainer).items())
        return f"{text}  evaluating..." if self._evaluating else text

    # --- Lightning hooks ---------------------------------------------------------------------
    def on_train_start(self, trainer, pl_module) -> None:
        if not self._enabled:
            return
        console = self._console or get_console()
        self._plain = not console.is_terminal or console.is_dumb_terminal
        self._printed_step = None
        self._evaluating = False
        if not self._plain:
            self._progress = _BarAndMetrics(console)
            total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
            self._task = self._progress.add_task(self.description(trainer), total=total,
                                                 completed=trainer.global_step)  # resumed: not from 0
            self._progress.start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        logged = trainer.callback_metrics
        for name in AVERAGED_METRICS:
            if name in logged:
                recent = self._recent.setdefault(name, [])
                recent.append(float(logged[name]))
                if not self._plain:
                    del recent[:-LIVE_WINDOW]
        self._refresh(trainer)

    def on_validation_start(self, trainer, pl_module) -> None:
        if self._during_fit(trainer):
            self._evaluating = True
            self._refresh(trainer)

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._during_fit(trainer):
            self._evaluating = False
            self._refresh(trainer)
            self._print_line(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self._print_line(trainer)
        self._stop()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._stop()

    def teardown(self, trainer, pl_module, stage) -> None:
        self._stop()

    # --- helpers -----------------------------------------------------------------------------
    @staticmethod
    def _during_fit(trainer) -> bool:
        return trainer.state.fn == "fit" and not trainer.sanity_checking

    def _refresh(self, trainer) -> None:
        if self._progress is not None:  # the refresh thread draws it; this only sets the values
            self._progress.metrics = self.metrics_line(trainer)
            self._progress.update(self._task, completed=trainer.global_step, description=self.description(trainer))

    def _print_line(self, trainer) -> None:
        if self._enabled and self._plain and trainer.global_step != self._printed_step:
            print(f"{self.description(trainer)}  {self.metrics_line(trainer)}".rstrip(), flush=True)
            self._printed_step = trainer.global_step
            self._recent.clear()

    def _stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()  # leaves its last frame on the terminal
            self._progress = None


class _BarAndMetrics(Progress):
    """A rich Progress of one task with a line of metrics under the bar. Both lines are
    truncated, never wrapped, on a narrow terminal (80 columns fit the bar line)."""

    def __init__(self, console: Console):
        self.metrics = ""  # set first: rich draws the first frame inside Progress.__init__
        super().__init__(
            TextColumn("{task.description}", table_column=Column(no_wrap=True)),
            BarColumn(bar_width=30),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            TextColumn("eta", table_column=Column(no_wrap=True)),
            TimeRemainingColumn(),
            console=console, refresh_per_second=4,  # 2 CPU cores: drawing must cost nothing
        )

    def get_renderables(self):
        yield self.make_tasks_table(self.tasks)
        yield Text(self.metrics, style="dim", no_wrap=True, overflow="ellipsis")


def build_callbacks(cfg: DictConfig, output_dir: Path) -> list:
    """The callbacks `callbacks.*` configures, then the user's own (`callbacks.extra`), in order."""
    callbacks = [
        ModelCheckpoint(
            dirpath=str(output_dir / "checkpoints"), filename="step{step:06d}", auto_insert_metric_name=False,
            every_n_train_steps=cfg.callbacks.checkpoint.every_n_train_steps,
            save_top_k=cfg.callbacks.checkpoint.save_top_k, save_last=True,
        ),
    ]
    if cfg.callbacks.get("stop_at_step"):
        callbacks.append(StopAtStep(cfg.callbacks.stop_at_step))
    if cfg.callbacks.get("stop_at_accuracy") is not None:
        callbacks.append(StopAtAccuracy(cfg.callbacks.stop_at_accuracy))
    if cfg.callbacks.progress_bar not in ("rich", "none"):
        raise ConfigError(f"callbacks.progress_bar={cfg.callbacks.progress_bar!r} is not one of ['rich', 'none']")
    if cfg.callbacks.progress_bar == "rich":
        callbacks.append(StepProgressBar())
    if cfg.logger.backend != "none" or cfg.logger.get("extra"):  # it refuses a trainer without a logger
        callbacks.append(LearningRateMonitor(logging_interval="step"))
    callbacks.append(MetricsHistory(output_dir))  # <run dir>/metrics.jsonl, whatever the logger (posttrain-report)
    return callbacks + build_user_components(cfg, "callbacks.extra")
