"""What a `posttrain` run prints: each message once, plainly, and nothing a library prints on
every run that says nothing about this one.

Hydra configures logging before the job starts (conf/hydra/default.yaml, `job_logging`): the
console gets the bare message (warnings and errors on stderr) through `ConsoleHandler`, the
run's train.log gets it with a time stamp and the logger's name, and `BannerFilter` drops
Lightning's banners from both. `setup_console()`, called once the job starts, undoes what
libraries set up for themselves at import time. `wandb_settings()` is what W&B gets.
"""

from __future__ import annotations

import io
import logging
import re
import sys
from pathlib import Path

import rich
import rich.syntax
import rich.tree
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from posttrain.files import save_config_atomic
from posttrain.run.precision import FP32

# What the user must see goes through this logger: Hydra's logging config sends it to the
# console and to the run's log file.
log = logging.getLogger("posttrain")

# Lightning INFO lines that say nothing about this run: hardware availability (the trainer
# config says what is used), adverts for Lightning's cloud products, the process-group
# banners of a multi-process run, and the end of fit at max_steps (the progress bar shows the
# last step). Its warnings all stay.
BANNERS = (
    r"^(GPU|TPU|HPU|IPU) available: ",
    r"^LOCAL_RANK: \d+ - CUDA_VISIBLE_DEVICES: ",
    r"^💡 Tip: ",
    r"^Initializing distributed: GLOBAL_RANK: ",
    r"^-+\ndistributed_backend=",
    r"^`Trainer\.fit` stopped: `max_steps=\d+` reached\.$",
)
_BANNER_RE = re.compile("|".join(f"(?:{pattern})" for pattern in BANNERS))

# The loggers that Lightning gives a console handler of its own when it is imported; the
# root logger (Hydra's handlers) must be the only one that prints, or every line shows twice.
LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")


class BannerFilter(logging.Filter):
    """Drops the INFO records listed in BANNERS (a handler filter: it sees every logger)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not _BANNER_RE.search(record.getMessage())


class ConsoleHandler(logging.StreamHandler):
    """Information to stdout, warnings and errors to stderr.

    The stream is looked up at every record rather than kept from start-up: a live progress
    bar redirects sys.stdout and sys.stderr to print above itself, and tests capture them."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            sys.stdout.flush()  # both streams often end in one file (SLURM logs): keep the order
            self.stream = sys.stderr
        else:
            self.stream = sys.stdout
        super().emit(record)


def _strip_final_newline(record: logging.LogRecord) -> bool:
    """A captured warning's text (warnings.formatwarning) ends with a newline, and the handler
    adds its own: without this every warning is followed by a blank line."""
    if isinstance(record.msg, str):
        record.msg = record.msg.rstrip("\n")
    return True


def setup_console() -> None:
    """Quiet the libraries a run imports; call it once logging is configured (Hydra's job
    logging), before training. Safe to call again (each job of a local multirun)."""
    # Lightning is imported now so that the handlers it adds on import exist, and here, not at
    # the top, for start-up: torch loads only once Hydra has composed the job
    import lightning  # noqa: F401
    from transformers.utils import logging as transformers_logging

    if logging.getLogger().handlers:  # configured: let the root's handlers print Lightning's records
        for name in LIGHTNING_LOGGERS:
            logger = logging.getLogger(name)
            for handler in list(logger.handlers):
                if type(handler) is logging.StreamHandler:  # Lightning's own, not one a user added
                    logger.removeHandler(handler)
            logger.propagate = True
    # tqdm bars of every save_pretrained ("Writing model shards") and load ("Loading weights")
    transformers_logging.disable_progress_bar()
    # Python warnings through logging: printed as before (stderr), and kept in train.log too
    logging.captureWarnings(True)
    warnings_logger = logging.getLogger("py.warnings")
    if _strip_final_newline not in warnings_logger.filters:
        warnings_logger.addFilter(_strip_final_newline)


def wandb_settings(mode: str) -> dict:
    """Settings for `wandb.init`. W&B prints a banner at start and a history and summary
    block at the end of every run. Online, `quiet` keeps only the run's name and link;
    offline, `silent` prints nothing of the run (posttrain prints the `wandb sync` command
    at the end). W&B's warnings and errors (wandb.termwarn / termerror) still show either
    way: they follow W&B's global setup, not the run's settings."""
    return {"quiet": True, "silent": mode == "offline"}


def render(renderable, width: int = 80) -> str:
    """A rich table (or any renderable) as plain text, for the log: printed to the console by
    the log's handler, and kept in the run's log file."""
    console = Console(file=io.StringIO(), width=width)
    console.print(renderable)
    return console.file.getvalue().rstrip()


PRINT_ORDER = ("algorithm", "kl_estimator", "advantage", "reward", "data_curriculum", "model", "data",
               "rollout", "trainer", "logger", "callbacks", "eval", "paths")


def print_config_tree(cfg: DictConfig) -> None:
    """The resolved config as a rich tree, one branch per config group."""

    tree = rich.tree.Tree("config", style="dim")
    keys = [k for k in PRINT_ORDER if k in cfg] + [k for k in cfg if k not in PRINT_ORDER]
    for key in keys:
        branch = tree.add(str(key), style="bold")
        value = cfg[key]
        text = OmegaConf.to_yaml(value, resolve=True) if isinstance(value, DictConfig) else str(value)
        branch.add(rich.syntax.Syntax(text, "yaml", theme="ansi_dark"))
    rich.print(tree)


ANNOUNCED_GROUPS = ("preset", "experiment", "algorithm", "advantage", "kl_estimator", "reward", "data_curriculum", "model",
                    "data")


def announce_run(cfg: DictConfig, choices: dict[str, str], output_dir: Path, ckpt_path: str | None) -> None:
    """One line on what trains and where, as training starts; the resolved config is saved
    beside it (and printed as a tree with print_config=true)."""
    save_config_atomic(cfg, output_dir / "config.yaml")
    picked = " ".join(f"{group}={choices[group]}" for group in ANNOUNCED_GROUPS if choices.get(group) not in (None, "None"))
    if cfg.trainer.get("precision", FP32) != FP32:  # fp32 goes unsaid; any other is what trains
        picked += f" trainer.precision={cfg.trainer.precision}"
    action = f"resuming from {ckpt_path}" if ckpt_path else f"training for {cfg.trainer.max_steps} steps"
    log.info(f"{picked} seed={cfg.seed}\n{action}; run dir {output_dir}")
    if cfg.print_config:
        print_config_tree(cfg)


def print_before_after(summary: dict) -> None:
    if "eval/accuracy_start" not in summary or "eval/accuracy" not in summary:
        return

    table = Table(title="held-out evaluation (greedy)")
    for column in ("", "start", "end", "change"):
        table.add_column(column, justify="right")
    for name, scale, unit in (("accuracy", 100, " pts"), ("response_len", 1, " tok")):
        before, after = summary[f"eval/{name}_start"], summary[f"eval/{name}"]
        table.add_row(name, f"{before * scale:.1f}", f"{after * scale:.1f}", f"{(after - before) * scale:+.1f}{unit}")
    log.info(render(table))  # through the logger: the table is also in train.log
