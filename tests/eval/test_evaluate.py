"""`posttrain-eval` as a user runs it: on a trained run's checkpoint, run dir and hf_model/,
on a bare model directory, and with bad arguments."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from forked_cli import run_command

# 1-digit addition: 60 SFT steps reach a non-zero greedy accuracy, so the comparisons mean something
TASK = ["data.min_digits=1", "data.max_digits=1"]
SMALL_EVAL = ["eval.num_prompts=16", "eval.batch_size=16"]


def posttrain_eval(*args: str, log_dir: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "posttrain.eval.evaluate", *args, "num_threads=1", f"paths.log_dir={log_dir}"]
    return run_command(command, capture_output=True, text=True, timeout=300)


def eval_results(result: subprocess.CompletedProcess, log_dir: Path) -> dict:
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = log_dir.glob("eval/runs/*/eval.json")
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A short SFT run with a small held-out eval: its run dir."""
    log_dir = tmp_path_factory.mktemp("train")
    command = [sys.executable, "-m", "posttrain.train", "algorithm=sft", "trainer.max_steps=60",
               "trainer.val_check_interval=60", *SMALL_EVAL, *TASK, "eval.at_start=false", "logger=none",
               "callbacks.progress_bar=none", "num_threads=1", f"paths.log_dir={log_dir}"]
    result = run_command(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = log_dir.glob("sft/runs/*")
    return run_dir


@pytest.fixture(scope="module")
def checkpoint_results(trained_run, tmp_path_factory) -> dict:
    log_dir = tmp_path_factory.mktemp("eval_ckpt")
    result = posttrain_eval(f"checkpoint={trained_run / 'checkpoints' / 'last.ckpt'}", "pass_k=[1,2,4,8]",
                            "num_samples=8", log_dir=log_dir)
    assert "accuracy (greedy)" in result.stdout and "pass@8" in result.stdout  # the table
    return eval_results(result, log_dir)


def test_checkpoint_reproduces_the_runs_final_eval(trained_run, checkpoint_results):
    summary = json.loads((trained_run / "summary.json").read_text())
    assert summary["eval/accuracy"] > 0  # the run learned something: equality is not 0 == 0
    assert checkpoint_results["eval/accuracy"] == summary["eval/accuracy"]
    assert checkpoint_results["eval/response_len"] == summary["eval/response_len"]
    for name in ("eval/ece", "eval/confidence", "eval/reliability/bin09/share"):  # calibration, as training's
        assert checkpoint_results[name] == pytest.approx(summary[name], abs=1e-9)
    assert checkpoint_results["run_dir"] == str(trained_run)
    assert checkpoint_results["num_prompts"] == 16 and checkpoint_results["settings"]["data"]["max_digits"] == 1


def test_pass_at_k_is_non_decreasing_in_k(checkpoint_results):
    values = [checkpoint_results[f"eval/pass@{k}"] for k in (1, 2, 4, 8)]
    assert all(0.0 <= v <= 1.0 for v in values)
    assert values == sorted(values)
    assert values[-1] > values[0]  # sampled responses differ, so more attempts solve more prompts


def test_run_dir_and_hf_model_give_the_checkpoints_numbers(trained_run, checkpoint_results, tmp_path):
    # a run dir evaluates its hf_model/ export: same weights, same prompts, same sampling seed
    results = eval_results(posttrain_eval(f"checkpoint={trained_run}", "pass_k=[1,2,4,8]", "num_samples=8",
                                          log_dir=tmp_path), tmp_path)
    assert results["weights"] == str(trained_run / "hf_model")
    for key in ("eval/accuracy", "eval/response_len", "eval/pass@1", "eval/pass@2", "eval/pass@4", "eval/pass@8"):
        assert results[key] == checkpoint_results[key], key


def test_command_line_overrides_win_over_the_runs_settings(trained_run, tmp_path):
    results = eval_results(posttrain_eval(f"checkpoint={trained_run / 'hf_model'}", "eval.num_prompts=8",
                                          "pass_k=[]", log_dir=tmp_path), tmp_path)
    assert results["num_prompts"] == 8  # overridden
    assert results["settings"]["data"]["max_digits"] == 1  # still the run's task
    assert not any(key.startswith("eval/pass@") for key in results)


def test_bare_model_dir_and_near_greedy_pass_at_1(trained_run, checkpoint_results, tmp_path):
    # an HF directory outside any run: the composed defaults, here set to the run's task
    model_dir = tmp_path / "exported"
    shutil.copytree(trained_run / "hf_model", model_dir)
    results = eval_results(posttrain_eval(f"checkpoint={model_dir}", *TASK, *SMALL_EVAL, "pass_k=[1]",
                                          "num_samples=2", "temperature=1e-4", log_dir=tmp_path / "out"),
                           tmp_path / "out")
    assert results["run_dir"] is None
    assert results["eval/accuracy"] == checkpoint_results["eval/accuracy"]
    assert results["eval/response_len"] == checkpoint_results["eval/response_len"]
    assert results["eval/pass@1"] == pytest.approx(results["eval/accuracy"])  # sampling at T -> 0 is greedy


def assert_clean_failure(result: subprocess.CompletedProcess, log_dir: Path, *needles: str) -> None:
    assert result.returncode != 0
    message = result.stderr + result.stdout
    assert "posttrain-eval: error:" in result.stderr, message
    for needle in needles:
        assert needle in message, message
    assert "Traceback" not in message, message
    assert not list(log_dir.rglob(".hydra")), "a failed evaluation leaves no output directory"


def test_missing_checkpoint_fails_cleanly(tmp_path):
    assert_clean_failure(posttrain_eval("checkpoint=/no/such/run_dir", log_dir=tmp_path), tmp_path,
                         "checkpoint=", "/no/such/run_dir")


def test_directory_that_is_neither_run_nor_model_fails_cleanly(tmp_path):
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "notes.txt").write_text("not a model")
    assert_clean_failure(posttrain_eval(f"checkpoint={stray}", log_dir=tmp_path / "out"), tmp_path / "out",
                         str(stray), "config.yaml", "config.json")


def test_k_above_num_samples_fails_cleanly(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")  # refused before anything loads
    assert_clean_failure(posttrain_eval(f"checkpoint={model_dir}", "pass_k=[1,16]", "num_samples=8",
                                        log_dir=tmp_path / "out"), tmp_path / "out", "pass_k", "pass@16", "num_samples=8")
