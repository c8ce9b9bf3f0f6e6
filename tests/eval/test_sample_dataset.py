"""`posttrain-sample` (rejection sampling for off-policy distillation) as a user runs it: an embedded
teacher trained on the task, sampled and verified into a data=jsonl dataset that SFT trains on; the
selection rule on scripted samples; bad arguments refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from forked_cli import run_command
from omegaconf import OmegaConf

from posttrain.data.arithmetic import verify_answer
from posttrain.errors import ConfigError
from posttrain.eval.sample_dataset import check_settings, select_responses

# 1-digit addition, and an embedded teacher of the policy's size that learns some of it in 60 steps
TASK = ["data.min_digits=1", "data.max_digits=1"]
RECIPE = ["teacher=tiny_concise", "teacher_recipe.steps=60", "teacher_recipe.until_accuracy=null",
          "teacher_recipe.lr=3e-3", "teacher_recipe.model.hidden_size=128", "teacher_recipe.model.num_layers=3",
          "teacher_recipe.model.intermediate_size=384", "eval.num_prompts=16", "eval.batch_size=16"]


def posttrain_sample(*args: str, log_dir: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "posttrain.eval.sample_dataset", *args, "num_threads=1",
               f"paths.log_dir={log_dir}"]
    return run_command(command, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def sampled(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The dataset of 64 prompts x 8 samples from an embedded teacher (trained here, into the cache)."""
    root = tmp_path_factory.mktemp("sample")
    result = posttrain_sample(*TASK, *RECIPE, "sample.num_prompts=64", "sample.samples_per_prompt=8",
                              "sample.keep_per_prompt=3", "sample.validation_prompts=16",
                              f"sample.output={root / 'data'}", f"paths.cache_dir={root / 'cache'}", log_dir=root)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return root, result


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_dataset_holds_verified_responses_only(sampled):
    root, result = sampled
    rows = read_rows(root / "data" / "train.jsonl")
    summary = json.loads((root / "data" / "summary.json").read_text())
    assert rows and all(set(row) == {"prompt", "response", "answer"} for row in rows)
    assert all(verify_answer(row["prompt"], row["response"]) for row in rows)
    assert all(str(sum(map(int, row["prompt"][:-1].split("+")))) == row["answer"] for row in rows)
    # dedupe: each (prompt, response) once in the dataset (1-digit prompts repeat over the split)
    pairs = [(row["prompt"], row["response"]) for row in rows]
    assert len(set(pairs)) == len(pairs)
    # the summary adds up
    assert summary["prompts"] == 64 and summary["samples"] == 512 and summary["kept"] == len(rows)
    assert summary["kept"] + summary["duplicates_dropped"] + summary["over_keep_per_prompt_dropped"] == \
        summary["verified"] <= summary["samples"] - summary["truncated"]
    assert summary["acceptance_rate"] == pytest.approx(len(rows) / 512)
    assert len({row["prompt"] for row in rows}) == summary["prompts_with_kept"]
    # every sample generated at least its EOS, at most the budget; a kept row's tokens: at least its
    # characters and EOS (the embedded tokenizer: a token a character; special tokens decode to nothing)
    assert 512 <= summary["teacher_generated_tokens"] <= 512 * summary["max_new_tokens"]
    assert summary["kept_response_tokens"] >= sum(len(row["response"]) + 1 for row in rows)
    assert summary["validation_rows"] == 16 and summary["teacher"] == "tiny_concise"
    assert "Teacher tiny_concise: not cached yet" in result.stdout + result.stderr
    assert "teacher tokens:" in result.stdout


def test_the_teacher_is_read_from_the_cache_the_second_time(sampled, tmp_path):
    root, _ = sampled
    result = posttrain_sample(*TASK, *RECIPE, "sample.num_prompts=8", "sample.samples_per_prompt=2",
                              "sample.validation_prompts=0", f"sample.output={tmp_path / 'data'}",
                              f"paths.cache_dir={root / 'cache'}", log_dir=tmp_path)
    output = result.stdout + result.stderr
    if result.returncode != 0:  # 16 samples of a weak teacher may all be wrong: then the one-line error
        assert "posttrain-sample: error: none of the 16 samples" in result.stderr, output
    assert "not cached yet" not in output, output


def test_sft_trains_on_the_dataset_as_it_is(sampled):
    root, _ = sampled
    summary = json.loads((root / "data" / "summary.json").read_text())
    files = summary["files"]
    command = [sys.executable, "-m", "posttrain.train", "algorithm=sft", "data=jsonl",
               f"data.files.train={files['train']}", f"data.files.validation={files['validation']}",
               "data.max_response_tokens=4", f"model.name_or_path={summary['teacher_dir']}", "trainer.max_steps=4",
               "trainer.val_check_interval=4", "algorithm.batch_size=8", "eval.at_start=false", "logger=none",
               "callbacks.progress_bar=none", "num_threads=1", f"paths.log_dir={root / 'sft'}"]
    result = run_command(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_summary,) = (root / "sft").glob("sft/runs/*/summary.json")
    trained = json.loads(run_summary.read_text())
    assert trained["global_step"] == 4 and 0.0 <= trained["eval/accuracy"] <= 1.0


def test_selection_keeps_ended_verified_distinct_responses_up_to_k():
    texts = ["5", "4", "5", "5", "55", "5"]
    ended = [True, True, True, False, True, True]
    verdicts = [True, False, True, True, False, True]
    kept_before: set[str] = set()
    kept, counts = select_responses(texts, ended, verdicts, keep_per_prompt=None, kept_before=kept_before)
    assert kept == [0] and counts == {"verified": 3, "truncated": 1, "duplicates": 2, "over_keep_per_prompt": 0}
    assert kept_before == {"5"}
    # the same prompt again (another index of the split): its "5" is a duplicate of the first's
    kept, counts = select_responses(["5", "5"], [True, True], [True, True], None, kept_before)
    assert kept == [] and counts["duplicates"] == 2
    kept, counts = select_responses(texts, ended, verdicts, keep_per_prompt=2, kept_before=None)
    assert kept == [0, 2] and counts["over_keep_per_prompt"] == 1 and counts["duplicates"] == 0


@pytest.mark.parametrize("key, value, needle", [
    ("samples_per_prompt", 0, "sample.samples_per_prompt=0"),
    ("temperature", 0.0, "sample.temperature=0.0"),
    ("keep_per_prompt", 1.5, "sample.keep_per_prompt=1.5"),
    ("split", "dev", "sample.split='dev'"),
    ("split", "validation", "also eval.split"),
])
def test_bad_settings_are_refused_naming_the_key(key, value, needle):
    settings = OmegaConf.load(Path(__file__).parents[2] / "src/posttrain/conf/sample.yaml").sample
    settings[key] = value
    with pytest.raises(ConfigError) as raised:
        check_settings(settings, "validation")
    assert needle in str(raised.value)


def assert_clean_failure(result: subprocess.CompletedProcess, log_dir: Path, *needles: str) -> None:
    message = result.stdout + result.stderr
    assert result.returncode != 0, message
    assert "posttrain-sample: error:" in result.stderr, message
    assert all(needle in message for needle in needles), message
    assert "Traceback" not in message, message
    assert not list(log_dir.rglob("*.jsonl")), "a failed command writes no dataset"


def test_a_missing_model_fails_cleanly(tmp_path):
    result = posttrain_sample("teacher=/no/such/model_dir", *TASK, f"sample.output={tmp_path / 'data'}",
                              log_dir=tmp_path)
    assert_clean_failure(result, tmp_path, "teacher='/no/such/model_dir'", "no such file or directory")


def test_no_model_fails_cleanly(tmp_path):
    assert_clean_failure(posttrain_sample(*TASK, log_dir=tmp_path), tmp_path, "teacher= names the model to sample")


def test_unknown_data_fails_cleanly(tmp_path):
    result = posttrain_sample("teacher=tiny_concise", "data=arithmetik", log_dir=tmp_path)
    assert_clean_failure(result, tmp_path, "data", "arithmetic")
