"""posttrain-report (mean ± std over seeds per choice, curve plots) and the metrics history
every run writes (posttrain.run.history)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from posttrain.run.history import MetricsHistory, read_history
from posttrain.eval.report.command import main
from posttrain.eval.report.curves import seed_band
from posttrain.eval.report.document import write_report
from posttrain.eval.report.runs import load_history, read_csv_history

from forked_cli import run_command

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def fake_job(sweep: Path, number: int, algorithm: str, seed: int, summary: dict, history: list[dict]) -> Path:
    """A job directory as a sweep writes it: summary.json, .hydra/overrides.yaml, metrics.jsonl."""
    job = sweep / f"{number}_{algorithm}"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(
        yaml.safe_dump([f"algorithm={algorithm}", f"seed={seed}", "trainer.max_steps=4"]))
    (job / "summary.json").write_text(json.dumps({**summary, "choices": {"algorithm": algorithm, "model": "tiny"}}))
    (job / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in history))
    return job


def history(rewards: list[float], evals: dict[int, float], kl: float | None = 0.01) -> list[dict]:
    """Training lines at batches 1..n (step = batch) and eval lines at the given batches."""
    lines = []
    for batch, reward in enumerate(rewards, start=1):
        line = {"step": batch, "batch": batch, "rollout/batch": float(batch), "rollout/reward_mean": reward,
                "rollout/response_len_mean": 5.0, "policy/entropy": 1.0}
        if kl is not None:
            line["policy/kl"] = kl * batch
        lines.append(line)
        if batch in evals:
            lines.append({"step": batch, "batch": batch, "eval/accuracy": evals[batch], "eval/response_len": 4.0})
    return lines


def summary(start: float, end: float, len_start: float, len_end: float, steps: int, seconds: float) -> dict:
    return {"eval/accuracy_start": start, "eval/accuracy": end, "eval/response_len_start": len_start,
            "eval/response_len": len_end, "global_step": steps, "train_seconds": seconds}


@pytest.fixture
def sweep(tmp_path) -> Path:
    """2 choices x 2 seeds, plus a third choice with one seed; the jobs numbered as Hydra does
    (10_... after 2_...)."""
    root = tmp_path / "multiruns" / "2026-11-24_00-00-00"
    fake_job(root, 0, "grpo", 0, summary(0.25, 0.60, 4.0, 4.5, 4, 100.0),
             history([0.1, 0.2, 0.3, 0.4], {2: 0.40, 4: 0.60}))
    fake_job(root, 1, "grpo", 1, summary(0.25, 0.70, 5.0, 4.5, 4, 120.0),
             history([0.3, 0.4, 0.5, 0.6], {2: 0.50, 4: 0.70}))
    fake_job(root, 2, "dapo", 0, summary(0.25, 0.50, 4.0, 4.0, 4, 90.0),
             history([0.2, 0.2, 0.2, 0.2], {2: 0.45, 4: 0.50}, kl=None))
    fake_job(root, 10, "dapo", 1, summary(0.25, 0.56, 4.0, 4.0, 4, 90.0),
             history([0.2, 0.4, 0.2, 0.4], {2: 0.45, 4: 0.56}, kl=None))
    fake_job(root, 11, "gspo", 0, summary(0.25, 0.66, 4.0, 4.25, 8, 200.0),
             history([0.5, 0.5, 0.5, 0.5], {4: 0.66}, kl=None))
    return root


def test_the_table_is_mean_and_sample_std_over_seeds_per_choice(sweep):
    report = write_report(sweep)
    assert report == sweep / "report" / "report.md"
    text = report.read_text()
    # by hand: grpo end 60, 70 -> mean 65.0, sample std sqrt(((5)^2 + (5)^2) / 1) = 7.07;
    # change 35, 45 -> +40.0 ± 7.1; len start 4, 5 -> 4.50 ± 0.71; seconds 100, 120 -> 110 ± 14
    assert "| grpo | 2 | 0,1 | 25.0 ± 0.0 | 65.0 ± 7.1 | +40.0 ± 7.1 | 4.50 ± 0.71 | 4.50 ± 0.00 | 4 ± 0 | 110 ± 14 |" in text
    # dapo end 50, 56 -> 53.0 ± sqrt(2 * 3^2) = 4.24; change 25, 31 -> +28.0 ± 4.2
    assert "| dapo | 2 | 0,1 | 25.0 ± 0.0 | 53.0 ± 4.2 | +28.0 ± 4.2 | 4.00 ± 0.00 | 4.00 ± 0.00 | 4 ± 0 | 90 ± 0 |" in text
    # one seed: its values alone, no ±
    assert "| gspo | 1 | 0 | 25.0 | 66.0 | +41.0 | 4.00 | 4.25 | 8 | 200 |" in text
    assert "| algorithm | n | seeds | acc start % |" in text  # seed is aggregated, not a column of choices
    # the per-run table, in Hydra's job order (10_dapo after 2_dapo)
    jobs = [line.split(" | ")[0] for line in text.splitlines() if line.startswith("| ") and "_" in line.split(" | ")[0]]
    assert jobs == ["| 0_grpo", "| 1_grpo", "| 2_dapo", "| 10_dapo", "| 11_gspo"]
    assert "| 10_dapo | dapo | 1 | 25.0 | 56.0 | +31.0 |" in text


def test_plots_are_written_one_per_logged_panel(sweep):
    report = write_report(sweep)
    out = report.parent
    for name in ("curves", "reward", "eval_accuracy", "response_length", "kl", "entropy"):
        png = out / f"{name}.png"
        assert png.is_file() and png.stat().st_size > 1000, name
        assert png.read_bytes()[:8] == PNG_MAGIC
        assert f"({name}.png)" in report.read_text()
    assert not (out / "clip_fraction.png").exists()  # no run logged policy/clip_frac: no panel


def test_the_band_is_the_seeds_min_to_max_around_their_mean(sweep):
    grpo = [load_history(sweep / "0_grpo"), load_history(sweep / "1_grpo")]
    xs, mean, low, high = seed_band([h["rollout/reward_mean"] for h in grpo])
    assert xs == [1, 2, 3, 4]
    assert mean == pytest.approx([0.2, 0.3, 0.4, 0.5])
    assert low == pytest.approx([0.1, 0.2, 0.3, 0.4]) and high == pytest.approx([0.3, 0.4, 0.5, 0.6])
    xs, mean, _, _ = seed_band([h["eval/accuracy"] for h in grpo])
    assert xs == [2, 4] and mean == pytest.approx([0.45, 0.65])


def test_by_and_out_options(sweep, tmp_path, capsys):
    main([str(sweep), "--by", "algorithm", "seed", "--out", str(tmp_path / "elsewhere"), "--smooth", "2"])
    text = (tmp_path / "elsewhere" / "report.md").read_text()
    assert "| grpo | 1 | 1 | 1 | 25.0 | 70.0 | +45.0 |" in text  # grouped by seed too: one run each
    assert "smoothed by a trailing mean over 2 batches" in text
    assert not (sweep / "report").exists()
    assert "wrote" in capsys.readouterr().out


def test_a_directory_without_summaries_is_one_error(tmp_path, capsys):
    (tmp_path / "empty" / "0_grpo").mkdir(parents=True)
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "empty")])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("posttrain-report: error: no summary.json below") and err.count("\n") == 1


def test_an_unknown_by_key_is_named(sweep, capsys):
    with pytest.raises(SystemExit):
        main([str(sweep), "--by", "algorithmm"])
    err = capsys.readouterr().err
    assert "--by algorithmm" in err and "algorithm" in err


def test_csv_history_puts_eval_rows_at_the_batch_they_follow(tmp_path):
    """Lightning's CSVLogger: batch n at step n - 1, an eval after batch n at the same step,
    the eval before training at step 0; LearningRateMonitor rows in between."""
    path = tmp_path / "metrics.csv"
    rows = [
        {"step": 0, "epoch": 0, "eval/accuracy": 0.25},
        {"step": 0, "lr-AdamW": 1e-5},
        {"step": 0, "epoch": 0, "rollout/batch": 1.0, "rollout/reward_mean": 0.1},
        {"step": 1, "lr-AdamW": 2e-5},
        {"step": 1, "epoch": 0, "rollout/batch": 2.0, "rollout/reward_mean": 0.2},
        {"step": 1, "epoch": 0, "eval/accuracy": 0.5},
    ]
    columns = ["epoch", "eval/accuracy", "lr-AdamW", "rollout/batch", "rollout/reward_mean", "step"]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    series = read_csv_history(path)
    assert series["eval/accuracy"] == {0: 0.25, 2: 0.5}
    assert series["rollout/reward_mean"] == {1: 0.1, 2: 0.2}


# --- the history callback ---------------------------------------------------------------------


def toy_module(run_id: float):
    """A LightningModule that logs like ours: per batch `rollout/batch` and a metric, an eval
    metric per validation, `train_batches_seen` kept in its checkpoints. `run` tells which
    fit logged a line."""
    import lightning as L

    class Toy(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)
            self.train_batches_seen = 0

        def training_step(self, batch, batch_idx):
            self.train_batches_seen += 1
            self.log_dict({"rollout/batch": float(self.train_batches_seen), "run": run_id})
            return self.layer(batch).pow(2).mean()

        def validation_step(self, batch, batch_idx):
            pass

        def on_validation_epoch_end(self):
            self.log("eval/accuracy", run_id)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def on_save_checkpoint(self, checkpoint):
            checkpoint["train_batches_seen"] = self.train_batches_seen

        def on_load_checkpoint(self, checkpoint):
            self.train_batches_seen = checkpoint["train_batches_seen"]

    return Toy()


def fit_toy(run_dir: Path, run_id: float, max_steps: int, ckpt_path: str | None = None, validate_first: bool = False):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    loader = torch.utils.data.DataLoader(torch.randn(64, 2), batch_size=4)
    trainer = L.Trainer(
        max_steps=max_steps, val_check_interval=2, check_val_every_n_epoch=None, log_every_n_steps=1,
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[MetricsHistory(run_dir), ModelCheckpoint(dirpath=run_dir / "checkpoints", filename="step{step}",
                                                            auto_insert_metric_name=False, every_n_train_steps=2,
                                                            save_top_k=-1)],
    )
    module = toy_module(run_id)
    if validate_first:
        trainer.validate(module, dataloaders=loader, verbose=False)
    trainer.fit(module, train_dataloaders=loader, val_dataloaders=loader, ckpt_path=ckpt_path)


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_history_records_every_log_call_without_a_logger(tmp_path):
    fit_toy(tmp_path, run_id=1.0, max_steps=4, validate_first=True)
    records = lines(tmp_path / "metrics.jsonl")
    train = [r for r in records if "run" in r]
    evals = [r for r in records if "eval/accuracy" in r]
    assert [(r["step"], r["batch"]) for r in train] == [(1, 1), (2, 2), (3, 3), (4, 4)]
    assert [(r["step"], r["batch"]) for r in evals] == [(0, 0), (2, 2), (4, 4)]  # before training, then every 2
    assert all("epoch" not in r for r in records)


def test_a_resumed_run_does_not_log_a_batch_twice(tmp_path):
    fit_toy(tmp_path, run_id=1.0, max_steps=6)  # as if stopped after batch 6, checkpoints at 2, 4, 6
    fit_toy(tmp_path, run_id=2.0, max_steps=6, ckpt_path=str(tmp_path / "checkpoints" / "step4.ckpt"))
    records = lines(tmp_path / "metrics.jsonl")
    train = [(r["batch"], r["run"]) for r in records if "run" in r]
    assert train == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 1.0), (5, 2.0), (6, 2.0)]
    evals = [(r["batch"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r]
    assert [batch for batch, _ in evals] == sorted({batch for batch, _ in evals})  # each batch once
    assert evals[-1] == (6, 2.0)
    series = read_history(tmp_path / "metrics.jsonl")
    assert series["run"] == {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 2.0, 6: 2.0}


def test_the_reader_lets_a_later_line_of_a_batch_win_and_skips_a_cut_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "batch": 1, "m": 1.0}\n{"step": 2, "batch": 2, "m": 2.0}\n'
                    '{"step": 2, "batch": 2, "m": 3.0}\n\n{"step": 3, "m": NaN}\n{"step": 4, "batch": 4, "m"')
    assert read_history(path) == {"m": {1: 1.0, 2: 3.0}}


# --- a real sweep -----------------------------------------------------------------------------


@pytest.mark.slow  # 15 s; the report's reading is tested on written runs above, a real sweep runs in the README's commands
def test_a_real_two_job_sweep_reports(tmp_path):
    """The embedded GRPO-family sweep, tiny. With logger=csv the history comes from
    csv/metrics.csv, or from metrics.jsonl once train.py adds MetricsHistory; then both must
    agree on every RL curve."""
    # not dapo: its correctness filter finds no signal after a 4-step warm start
    command = [sys.executable, "-m", "posttrain.train", "-m", "algorithm=grpo,dr_grpo", "seed=0",
               "algorithm.warm_start.steps=4", "algorithm.prompts_per_step=2", "algorithm.group_size=4",
               "trainer.max_steps=3", "trainer.val_check_interval=3", "eval.num_prompts=8", "eval.batch_size=8",
               "logger=csv", "callbacks.progress_bar=none", f"paths.log_dir={tmp_path}"]
    result = run_command(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (sweep,) = list((tmp_path / "multiruns").iterdir())
    report = subprocess.run(["posttrain-report", str(sweep)], capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    text = (sweep / "report" / "report.md").read_text()
    assert "| algorithm | n | seeds |" in text and "| grpo | 1 | 0 |" in text and "| dr_grpo | 1 | 0 |" in text
    for name in ("curves", "reward", "eval_accuracy", "response_length", "entropy", "clip_fraction"):
        assert (sweep / "report" / f"{name}.png").stat().st_size > 1000, name
    for job in ("0_grpo", "1_dr_grpo"):
        series = read_csv_history(sweep / job / "csv" / "metrics.csv")
        assert sorted(series["rollout/reward_mean"]) == [1, 2, 3]
        assert sorted(series["eval/accuracy"]) == [0, 3]  # before training, and at the end
        if (sweep / job / "metrics.jsonl").is_file():
            jsonl = read_history(sweep / job / "metrics.jsonl")
            for name in series:
                if name.startswith(("rollout/", "policy/", "eval/")):
                    assert jsonl[name] == pytest.approx(series[name]), name


def test_each_arm_is_judged_against_its_own_start(tmp_path):
    """Change from the start: each run's end - start, the arm's mean with its t interval, its
    worst run and the verdict; by hand (t_{0.975, 2} = 4.303)."""
    root = tmp_path / "sweep"
    # grpo: +10, +12, +14 points -> mean 12, s = 2, 12 +- 4.303 * 2 / sqrt(3) = [+7.0, +17.0]
    # dapo: -5, -6, -7 points -> mean -6, s = 1, -6 +- 2.48 = [-8.5, -3.5]; length 5 -> 4 in each (lower: better)
    for seed, (grpo_end, dapo_end) in enumerate([(0.40, 0.25), (0.42, 0.24), (0.44, 0.23)]):
        fake_job(root, seed, "grpo", seed, summary(0.30, grpo_end, 4.0, 4.0, 4, 10.0), history([0.1], {}))
        fake_job(root, 3 + seed, "dapo", seed, summary(0.30, dapo_end, 5.0, 4.0, 4, 10.0), history([0.1], {}))
    text = write_report(root).read_text()
    section = text[text.index("## Change from the start"):text.index("## Verdicts")]
    assert "| 0 | algorithm=grpo | 3 | 30.0 | +12.0 [+7.0, +17.0] | +10.0 | **better** |" in section
    assert "| 1 | algorithm=dapo | 3 | 30.0 | -6.0 [-8.5, -3.5] | -7.0 | **worse** |" in section
    # every dapo run shortened by exactly 1 token: no spread, a point interval below 0
    assert "| 1 | algorithm=dapo | 3 | 5.00 | -1.00 [-1.00, -1.00] | -1.00 | **better** |" in section
