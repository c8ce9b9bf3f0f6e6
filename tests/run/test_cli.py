"""The `posttrain` console script as a user runs it: overrides, --cfg, multirun, errors."""

import json
import subprocess
import sys
from pathlib import Path

from forked_cli import run_command

QUICK = ["logger=none", "callbacks.progress_bar=none", "eval.num_prompts=16", "eval.batch_size=16",
         "trainer.max_steps=2", "trainer.val_check_interval=2", "eval.at_start=false"]


def posttrain(*args: str, log_dir: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "posttrain.train", *args, f"paths.log_dir={log_dir}"]
    return run_command(command, capture_output=True, text=True, timeout=300)


def assert_clean_failure(result, *needles: str):
    assert result.returncode != 0
    message = result.stderr + result.stdout
    for needle in needles:
        assert needle in message, message
    assert "Traceback" not in message, message


def test_cfg_job_prints_resolved_config(tmp_path):
    result = posttrain("--cfg", "job", "algorithm=sft", "model=tiny", "data=arithmetic", log_dir=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "algorithm:" in result.stdout and "_target_: posttrain.algorithms.sft.SFTModule" in result.stdout


def test_unknown_override_key_fails_cleanly(tmp_path):
    assert_clean_failure(posttrain("trainer.max_stepz=3", log_dir=tmp_path), "max_stepz")


def test_unknown_group_option_fails_cleanly(tmp_path):
    assert_clean_failure(posttrain("algorithm=nope", log_dir=tmp_path), "algorithm=nope", "sft")


def test_missing_model_directory_fails_cleanly_without_files(tmp_path):
    result = posttrain(*QUICK, "model.name_or_path=/no/such/model_dir", log_dir=tmp_path)
    assert_clean_failure(result, "model.name_or_path", "/no/such/model_dir")
    assert not list(tmp_path.rglob("*.ckpt")) and not list(tmp_path.rglob("summary.json"))
    assert not list(tmp_path.rglob(".hydra")), "a failed start leaves no run directory"


def test_malformed_data_file_names_file_and_line(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "response": "2"}\n{"prompt": "2+2=", "answer": "4"}\n')
    files = ["data=jsonl", f"data.files.train={data}", f"data.files.validation={data}"]
    assert_clean_failure(posttrain(*QUICK, *files, log_dir=tmp_path / "out"), f"{data}:2", "'response'")
    data.write_text('{"prompt": "1+1=", "response": "2"}\nnot json\n')
    assert_clean_failure(posttrain(*QUICK, *files, log_dir=tmp_path / "out"), f"{data}:2", "not valid JSON")


def test_missing_checkpoint_fails_cleanly(tmp_path):
    assert_clean_failure(posttrain(*QUICK, "ckpt_path=/no/such.ckpt", log_dir=tmp_path), "ckpt_path", "/no/such.ckpt")


def test_multirun_with_experiment_preset(tmp_path):
    result = posttrain("-m", "experiment=sft_tiny", *QUICK, "seed=0,1", log_dir=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = sorted(tmp_path.rglob("summary.json"))
    assert len(summaries) == 2
    seeds = {json.loads(p.read_text())["choices"]["experiment"] for p in summaries}
    assert seeds == {"sft_tiny"}
    assert "sft_tiny" in str(summaries[0])  # the preset names the run directory
