"""What a run prints: each line once, no third-party banners, a progress bar in optimiser
steps, train.log with what matters, and `posttrain --help`."""

import io
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import torch
from rich.console import Console

from posttrain.run.callbacks import StepProgressBar
from posttrain.run.console import BannerFilter, ConsoleHandler, wandb_settings

from forked_cli import run_command

TINY_RUN = ["trainer.max_steps=4", "trainer.val_check_interval=2", "eval.num_prompts=8", "eval.batch_size=8",
            "algorithm.batch_size=8", "callbacks.checkpoint.every_n_train_steps=4"]

# What libraries print on every run and a run must not show (the console as a user sees it).
BANNERS = ("GPU available", "TPU available", "Tip:", "litlogger", "INFO:", "[INFO]",
           "Tracking run with wandb", "syncing is set to", "wandb leet", "anonymous setting",
           "Run history", "Run summary", "Writing model shards", "Loading weights", "Epoch 0", "v_num")


def posttrain(*args: str, log_dir: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """The CLI in a subprocess whose output is a pipe (as under SLURM or CI), not a terminal."""
    run_env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "WANDB_MODE")}
    run_env.update(env or {})
    command = [sys.executable, "-m", "posttrain.train", *args, f"paths.log_dir={log_dir}"]
    return run_command(command, capture_output=True, text=True, timeout=600, env=run_env)


def repeated_lines(text: str) -> list[str]:
    lines = [line for line in text.splitlines() if line.strip()]
    return sorted({line for line in lines if lines.count(line) > 1})


def only_run_dir(log_dir: Path) -> Path:
    (log,) = [p for p in log_dir.rglob("train.log") if "cache" not in p.parts]
    return log.parent


# --- the CLI -------------------------------------------------------------------------------
def test_help_shows_usage_groups_and_examples(tmp_path):
    result = posttrain("--help", log_dir=tmp_path)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "Usage: posttrain" in text
    groups = dict(re.findall(r"^(\w+): (.+)$", text, flags=re.M))
    assert {"sft", "grpo", "dr_grpo", "dapo"} <= set(groups["algorithm"].split(", "))
    assert {"k1", "k3", "none"} <= set(groups["kl_estimator"].split(", "))
    for group in ("advantage", "reward", "data_curriculum", "model", "data", "rollout", "trainer", "logger",
                  "experiment", "numerics"):
        assert group in groups, group
    for example in ("posttrain experiment=grpo_tiny", "posttrain algorithm=dapo trainer.max_steps=300",
                    "posttrain -m algorithm=grpo,dr_grpo,dapo seed=0,1,2", "--cfg job", "README.md", "conf/"):
        assert example in text, example
    assert "_target_" not in text and "== Config ==" not in text  # not the composed config dump
    assert "Powered by Hydra" not in text


def test_run_prints_each_line_once_without_banners(tmp_path):
    """SFT logged to W&B offline: the announce line, a plain line per evaluation, the result
    table and the sync hint; nothing twice, none of the libraries' banners."""
    result = posttrain("algorithm=sft", *TINY_RUN, "logger=wandb", "logger.mode=offline", log_dir=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    console = result.stdout + result.stderr
    assert repeated_lines(console) == [], console
    for banner in BANNERS:
        assert banner not in console, (banner, console)
    assert "Traceback" not in console

    steps = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == ["2/4", "4/4"], steps  # out of max_steps, once per eval
    assert all(" loss " in line and " eval_acc " in line for line in steps), steps
    assert "held-out evaluation" in result.stdout and "wandb sync" in result.stdout

    train_log = (only_run_dir(tmp_path) / "train.log").read_text()
    assert "held-out evaluation" in train_log and "[posttrain][INFO]" in train_log  # time-stamped lines
    assert "GPU available" not in train_log and "Tip:" not in train_log


def test_progress_bar_none_prints_no_bar(tmp_path):
    result = posttrain("algorithm=sft", *TINY_RUN, "logger=csv", "callbacks.progress_bar=none", log_dir=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    console = result.stdout + result.stderr
    assert not re.search(r"^step \d+/", console, flags=re.M), console
    assert "it/s" not in console and "Epoch" not in console, console  # nor Lightning's default bar


def test_failed_run_reports_its_warm_start_warnings_and_error_in_train_log(tmp_path):
    """An RL run with a short SFT warm start, whose reward function warns, then returns NaN,
    stops at its first step: the warm-start lines, the warning and the error are printed once
    and are in the run's train.log, which the run keeps (it had started). The function scores
    the start-up check's stand-in samples (its first call) and fails from its second on."""
    (tmp_path / "nan_reward.py").write_text("import warnings\n\ncalls = []\n\n"
                                            "def nan_scores(samples, source):\n"
                                            "    calls.append(len(samples))\n"
                                            "    if len(calls) == 1:\n"
                                            "        return [0.0] * len(samples)\n"
                                            "    warnings.warn('nan_scores cannot score')\n"
                                            "    return [float('nan')] * len(samples)\n")
    result = posttrain("algorithm=grpo", "algorithm.warm_start.steps=2", "algorithm.warm_start.batch_size=8",
                       "eval.at_start=false", "trainer.max_steps=2", "eval.num_prompts=8", "eval.batch_size=8",
                       "algorithm.prompts_per_step=2", "algorithm.group_size=2", "logger=csv",
                       "+reward.components.nan={weight:1.0,_target_:nan_reward.nan_scores}",
                       log_dir=tmp_path / "out", env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode != 0
    assert "'nan'" in result.stderr and "NaN" in result.stderr, result.stderr
    assert "UserWarning: nan_scores cannot score" in result.stderr
    assert repeated_lines(result.stdout + result.stderr) == []
    # in a file or a pipe the warm start says where it starts and stops, without a line per eval
    assert not re.search(r"^step \d+/2  loss ", result.stdout, flags=re.M), result.stdout
    train_log = (only_run_dir(tmp_path / "out") / "train.log").read_text()
    assert "Warm start: SFT" in train_log and "Warm start: stopped at step 2" in train_log, train_log
    assert "[WARNING] - " in train_log and "nan_scores cannot score" in train_log, train_log
    assert "[ERROR] - " in train_log and "'nan'" in train_log, train_log


# --- the progress bar ----------------------------------------------------------------------
class TwoStepsPerBatch(L.LightningModule):
    """Like an RL module with two minibatches: each batch makes two optimiser steps."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        for _ in range(2):
            loss = self.layer(batch[0]).pow(2).mean()
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
        self.log("train/loss", loss, prog_bar=True)
        self.log("rollout/reward_mean", 0.5)
        self.log("rollout/accuracy", float(batch_idx % 2))  # 0, 1, 0, 1, ...: a mean of 50%

    def validation_step(self, batch, batch_idx):
        self.log("eval/accuracy", 0.25, prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit_with(bar: StepProgressBar) -> L.Trainer:
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 2)), batch_size=2)
    trainer = L.Trainer(max_steps=8, val_check_interval=2, limit_val_batches=1, callbacks=[bar], logger=False,
                        enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0,
                        accelerator="cpu", devices=1)
    trainer.fit(TwoStepsPerBatch(), train_dataloaders=data, val_dataloaders=data)
    return trainer


def terminal_screen(raw: str) -> list[str]:
    """The lines a terminal shows after the output of a rich live display (its cursor moves)."""
    raw = re.sub(r"\x1b\[\?25[lh]|\x1b\[[0-9;]*m", "", raw)
    screen, row, col = [""], 0, 0
    for token in re.split(r"(\x1b\[2K|\x1b\[\d*A|\n|\r)", raw):
        if token == "\n":
            row, col = row + 1, 0
            screen += [""] * (row + 1 - len(screen))
        elif token == "\r":
            col = 0
        elif token == "\x1b[2K":
            screen[row] = ""
        elif token.startswith("\x1b["):
            row = max(0, row - int(token[2:-1] or 1))
        elif token:
            line = screen[row].ljust(col)
            screen[row] = line[:col] + token + line[col + len(token):]
            col += len(token)
    return [line for line in screen if line.strip()]


def test_bar_follows_optimiser_steps_on_a_terminal():
    out = io.StringIO()
    trainer = fit_with(StepProgressBar(Console(file=out, force_terminal=True, width=80)))
    assert trainer.global_step == 8
    screen = terminal_screen(out.getvalue())
    assert len(screen) == 2, screen  # the last frame only: a bar line and a metrics line
    bar, metrics = screen
    assert bar.startswith("step 8/8 ") and "100%" in bar, bar  # 4 batches, 8 optimiser steps
    assert re.fullmatch(r"loss \d+\.\d{3}  reward 0\.500  acc 50\.0%  eval_acc 25\.0%", metrics), metrics
    assert all(len(line) <= 80 for line in screen), screen


def test_bar_prints_plain_lines_when_not_on_a_terminal(capsys):
    fit_with(StepProgressBar(Console(file=io.StringIO(), force_terminal=False, width=80)))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["4/8", "8/8"], lines  # at each evaluation (every 2 batches)
    assert all("eval_acc 25.0%" in line and "\x1b" not in line for line in lines), lines
    # each line's training accuracy is the mean of the batches since the last line (0, 1), not the last (1)
    assert all(" acc 50.0% " in line for line in lines), lines


def test_bar_metric_names_are_short():
    bar = StepProgressBar()
    trainer = SimpleNamespace(
        global_step=20, max_steps=600,
        callback_metrics={"train/loss": torch.tensor(1.9346), "eval/accuracy": torch.tensor(0.25),
                          "eval/response_len": torch.tensor(3.5), "rollout/accuracy": torch.tensor(0.125),
                          "policy/kl": torch.tensor(0.00123), "perf/update_s": torch.tensor(0.1)},
        progress_bar_metrics={"train/loss": 1.9346, "v_num": 3, "rewards/margins": 0.5})
    assert bar.description(trainer) == "step 20/600"
    assert bar.get_metrics(trainer) == {"loss": "1.935", "acc": "12.5%", "kl": "0.0012", "eval_acc": "25.0%",
                                        "eval_len": "3.5", "margins": "0.5"}


# --- logging pieces ------------------------------------------------------------------------
def record(message: str, level: int = logging.INFO) -> logging.LogRecord:
    return logging.LogRecord("lightning.pytorch.utilities.rank_zero", level, __file__, 1, message, None, None)


def test_banner_filter_drops_banners_and_keeps_the_rest():
    keep = BannerFilter().filter
    for banner in ("GPU available: False, used: False", "TPU available: False, using: 0 TPU cores",
                   "💡 Tip: For seamless cloud logging, try installing [litlogger](https://pypi.org/project/litlogger/)",
                   "LOCAL_RANK: 0 - CUDA_VISIBLE_DEVICES: [0]", "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2",
                   f"{'-' * 100}\ndistributed_backend=gloo\nAll distributed processes registered. Starting with 2 "
                   f"processes\n{'-' * 100}\n", "`Trainer.fit` stopped: `max_steps=20` reached."):
        assert not keep(record(banner)), banner
    assert keep(record("Restoring states from the checkpoint path at /x/last.ckpt"))
    assert keep(record("GPU available: True (cuda), used: False", logging.WARNING))  # a warning always shows


def test_console_handler_sends_warnings_to_stderr(capsys):
    handler = ConsoleHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.handle(record("an info line"))
    handler.handle(record("a warning line", logging.WARNING))
    out, err = capsys.readouterr()
    assert out == "an info line\n" and err == "a warning line\n"


def test_wandb_prints_nothing_of_an_offline_run():
    assert wandb_settings("offline") == {"quiet": True, "silent": True}
    assert wandb_settings("online") == {"quiet": True, "silent": False}  # keeps the run's link
