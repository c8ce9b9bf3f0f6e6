"""A run's life as a user sees it: the shared warm start of the online presets, resuming a
run from its directory alone, and checkpoints that do not belong to the run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from omegaconf import OmegaConf

from posttrain.run.cli import resume_arguments
from posttrain.prepare.warm_start import warm_start_plan

from forked_cli import run_command

ONLINE_PRESETS = ["grpo", "dr_grpo", "dapo", "gspo", "cispo", "sapo", "ppo"]
QUICK = ["logger=none", "callbacks.progress_bar=none", "eval.num_prompts=16", "eval.batch_size=16"]


def posttrain(*args: str, log_dir: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "posttrain.train", *args, f"paths.log_dir={log_dir}"]
    return run_command(command, capture_output=True, text=True, timeout=300)


def assert_clean_failure(result, *needles: str):
    message = result.stderr + result.stdout
    assert result.returncode != 0, message
    for needle in needles:
        assert needle in message, message
    assert "Traceback" not in message, message


def test_every_online_preset_shares_one_accuracy_targeted_warm_start(make_config):
    """`algorithm=<preset>` commands learn out of the box: each starts from the same cached SFT
    warm start, stopped at 25% held-out accuracy, as the headline experiment does."""
    def plan(*overrides):
        cfg = make_config(*overrides)
        OmegaConf.resolve(cfg)  # as run() does
        return warm_start_plan(cfg)

    plans = {name: plan(f"algorithm={name}") for name in ONLINE_PRESETS}
    plans["grpo_tiny"] = plan("experiment=grpo_tiny")
    plans["ppo_tiny"] = plan("experiment=ppo_tiny")
    plans["grpo_tiny on 2 processes"] = plan("experiment=grpo_tiny", "trainer=ddp")  # one process trains it
    targets = {name: plan[1] for name, plan in plans.items()}
    assert len(set(targets.values())) == 1, targets
    sft_cfg = plans["dapo"][0]
    assert sft_cfg.callbacks.stop_at_accuracy == 0.25 and sft_cfg.algorithm.name == "sft"
    # what the warm start reads does change the key
    assert plan("algorithm=dapo", "data.max_digits=4")[1] != targets["dapo"]
    assert plan("algorithm=sft") is None


def test_resume_arguments_replay_the_saved_overrides(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text(
        "- algorithm=grpo\n- trainer.max_steps=500\n- callbacks.stop_at_step=10\n- ckpt_path=old.ckpt\n")
    (run_dir / "checkpoints").mkdir()
    torch.save({"global_step": 3}, run_dir / "checkpoints" / "last.ckpt")
    assert resume_arguments(["seed=1"]) == ["seed=1"]  # no resume: untouched
    assert resume_arguments([f"resume={run_dir}", "trainer.max_steps=800"]) == [
        "algorithm=grpo", "trainer.max_steps=800", f"hydra.run.dir={run_dir.resolve()}",
        f"ckpt_path={run_dir.resolve() / 'checkpoints' / 'last.ckpt'}"]


def test_resume_from_the_run_directory_alone(tmp_path):
    """A preempted run continues from its directory: same dir, its overrides replayed, the
    steps it had left, and the same before/after table at the end."""
    first = posttrain(*QUICK, "algorithm=sft", "model.hidden_size=32", "trainer.max_steps=8",
                      "trainer.val_check_interval=4", "callbacks.checkpoint.every_n_train_steps=4",
                      "callbacks.stop_at_step=4", log_dir=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    (run_dir,) = list((tmp_path / "sft" / "runs").iterdir())
    preempted = json.loads((run_dir / "summary.json").read_text())
    assert preempted["global_step"] == 4

    resumed = run_command([sys.executable, "-m", "posttrain.train", f"resume={run_dir}"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert list((tmp_path / "sft" / "runs").iterdir()) == [run_dir]  # no second run directory
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["global_step"] == 8  # the overrides (max_steps, hidden_size) came back
    assert summary["eval/accuracy_start"] == preempted["eval/accuracy_start"]
    assert summary["eval/response_len_start"] == preempted["eval/response_len_start"]
    assert "held-out evaluation" in resumed.stdout + resumed.stderr
    assert "resuming from" in (run_dir / "train.log").read_text()


def test_resume_errors_name_the_run_directory(tmp_path):
    assert_clean_failure(posttrain(f"resume={tmp_path / 'nowhere'}", log_dir=tmp_path), "nowhere", "run directory")
    run_dir = tmp_path / "fresh"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text("[]\n")
    assert_clean_failure(posttrain(f"resume={run_dir}", log_dir=tmp_path), "checkpoints", "no checkpoint")


@pytest.fixture(scope="module")
def sft_checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sft_checkpoint")
    result = posttrain(*QUICK, "algorithm=sft", "trainer.max_steps=2", "trainer.val_check_interval=2",
                       "callbacks.checkpoint.every_n_train_steps=2", "eval.at_start=false", log_dir=out)
    assert result.returncode == 0, result.stderr[-3000:]
    return next(out.rglob("last.ckpt"))


def test_a_checkpoint_of_another_algorithm_is_refused_naming_both(tmp_path, sft_checkpoint):
    result = posttrain(*QUICK, "algorithm=grpo", "algorithm.warm_start.steps=0", f"ckpt_path={sft_checkpoint}",
                       log_dir=tmp_path)
    assert_clean_failure(result, "algorithm=sft", "algorithm=grpo", str(sft_checkpoint))
    assert not any(tmp_path.iterdir()), "a refused resume leaves no run directory"


def test_a_checkpoint_of_another_shape_is_refused_naming_the_tensor(tmp_path, sft_checkpoint):
    result = posttrain(*QUICK, "algorithm=sft", "model.hidden_size=32", f"ckpt_path={sft_checkpoint}", log_dir=tmp_path)
    assert_clean_failure(result, str(sft_checkpoint), "does not fit", "shape", "resume=")
    assert not any(tmp_path.iterdir())


def test_a_sweep_over_algorithms_writes_one_directory_that_sweep_table_reads(tmp_path):
    """All jobs of `-m algorithm=...` land in one sweep directory (none elsewhere), and a key
    only the swept algorithms have (group_size) is accepted although the default (sft) lacks it."""
    # not dapo: its correctness filter finds no signal after a 4-step warm start
    result = posttrain("-m", "algorithm=grpo,dr_grpo", "algorithm.group_size=2", "algorithm.prompts_per_step=2",
                       "algorithm.warm_start.steps=4", "trainer.max_steps=1", "trainer.val_check_interval=1",
                       *QUICK, "eval.at_start=false", log_dir=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "multiruns"]
    (sweep,) = list((tmp_path / "multiruns").iterdir())
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0_grpo", "1_dr_grpo"]
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from sweep_table import load_runs

    runs = load_runs(sweep)
    assert sorted(run.choices["algorithm"] for run in runs) == ["dr_grpo", "grpo"]
    assert all(run.overrides["algorithm.group_size"] == "2" for run in runs)


def test_a_resumed_run_keeps_its_wandb_run(tmp_path):
    from posttrain.run.tracking import wandb_run_id

    first = wandb_run_id(tmp_path)
    assert first.isalnum() and wandb_run_id(tmp_path) == first  # the same run dir: the same W&B run
    assert wandb_run_id(tmp_path / "other") != first
