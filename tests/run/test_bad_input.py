"""Bad input ends cleanly (issue 26, item 14): an unknown config group option is one line
naming the nearest ones; `ckpt_path=last` after a kill -9 between the periodic checkpoint and
last.ckpt resumes the newest intact one and removes what the cut save left; a user reward
function that fails is caught before any warm start trains; a distillation weight that is no
number is a ConfigError naming its key."""

import os
import shutil
import sys
from pathlib import Path

import pytest
from forked_cli import run_command
from conftest import FAST_RUN
from test_input_checks import assert_clean_failure, posttrain

from posttrain.algorithms import rules
from posttrain.conf import CONFIG_DIR
from posttrain.config.check import check_config
from posttrain.errors import ConfigError, RewardError
from posttrain.run.cli import check_group_options
from posttrain.train import run

QUICK_SFT = (*FAST_RUN, "eval.num_prompts=8", "eval.batch_size=8", "eval.at_start=false", "trainer.val_check_interval=2")


# --- an unknown config group option ------------------------------------------------------------
@pytest.mark.parametrize("arguments, named, nearest", [
    (("algorithm=grpoo",), "algorithm=grpoo: config group algorithm", ["grpo"]),
    (("advantage=gae2",), "advantage=gae2: config group advantage", ["gae"]),
    (("trainer=fsdpp",), "trainer=fsdpp: config group trainer", ["fsdp"]),
    (("-m", "algorithm=grpo,grpoo"), "algorithm=grpoo: config group algorithm", ["grpo"]),  # one value of a sweep
    # nothing close: every option is listed
    (("experiment=zzz",), "experiment=zzz: config group experiment",
     sorted(p.stem for p in (Path(CONFIG_DIR) / "experiment").glob("*.yaml"))),
])
def test_an_unknown_group_option_is_one_line_naming_the_nearest_options(arguments, named, nearest, tmp_path):
    message = assert_clean_failure(posttrain(*arguments, log_dir=tmp_path), tmp_path, f"posttrain: error: {named}",
                                   *nearest)
    assert len(message.strip().splitlines()) == 1, message  # not Hydra's listing of every option
    assert not tmp_path.exists() or not any(tmp_path.iterdir()), "no run directory"


def test_posttrain_eval_names_an_unknown_option_in_one_line(tmp_path):
    command = [sys.executable, "-m", "posttrain.eval.evaluate", "checkpoint=nowhere", "data=arithmetik",
               f"paths.log_dir={tmp_path}"]
    result = run_command(command, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    message = assert_clean_failure(result, tmp_path, "posttrain-eval: error: data=arithmetik: config group data",
                                   "arithmetic")
    assert len(message.strip().splitlines()) == 1, message


# --- ckpt_path=last after a kill -9 between the periodic checkpoint and last.ckpt ------------------
def test_last_after_a_kill_mid_save_resumes_the_newest_intact_checkpoint_and_removes_the_leftovers(
        make_config, tmp_path, caplog):
    caplog.set_level("INFO", logger="posttrain")
    run(make_config(*QUICK_SFT, "trainer.max_steps=2", "callbacks.checkpoint.every_n_train_steps=1"), announce=False)
    checkpoints = tmp_path / "checkpoints"
    # the kill landed after step000002.ckpt, while last.ckpt was being written: last.ckpt still
    # holds step 1, and the write's temporary is left (a sharded save's staging directory too)
    shutil.copy(checkpoints / "step000001.ckpt", checkpoints / "last.ckpt")
    whole = (checkpoints / "step000002.ckpt").read_bytes()
    leftovers = [checkpoints / ".last.ckpt.4242.tmp", checkpoints / ".step000003.ckpt.partial"]
    leftovers[0].write_bytes(whole[: len(whole) // 2])
    leftovers[1].mkdir()
    (leftovers[1] / "__0_0.distcp").write_bytes(b"shard")
    not_ours = [checkpoints / "notes.tmp", checkpoints / ".last.ckpt.backup"]
    for path in not_ours:
        path.write_text("the user's")

    summary = run(make_config(*QUICK_SFT, "trainer.max_steps=3", "callbacks.checkpoint.every_n_train_steps=1",
                              "ckpt_path=last"))
    assert f"resuming from {checkpoints / 'step000002.ckpt'}" in caplog.text
    assert summary["global_step"] == 3
    assert not [path for path in leftovers if path.exists()], "the interrupted save's temporaries are removed"
    assert all(path.exists() for path in not_ours), "only our temporaries, by their names"


# --- a user reward function, called once before the warm start -----------------------------------
def raising_reward(samples, source):
    raise ZeroDivisionError("a bug in my reward")


def nan_reward(samples, source):
    return [float("nan")] * len(samples)


def worded_reward(samples, source):
    return ["good"] * len(samples)


@pytest.mark.parametrize("function, says", [
    ("raising_reward", "raised on sample 0"),
    ("nan_reward", "returned nan"),
    ("worded_reward", "must return [B] scores"),
])
def test_a_failing_user_reward_stops_the_run_before_the_warm_start_trains(function, says, make_config, tmp_path):
    cache = tmp_path / "cache"
    cfg = make_config(*QUICK_SFT, "algorithm=grpo", "algorithm.prompts_per_step=2", "algorithm.group_size=2",
                      "trainer.max_steps=1", "algorithm.warm_start.steps=2", "algorithm.warm_start.until_accuracy=null",
                      f"+reward.components.mine._target_={__name__}.{function}", f"paths.cache_dir={cache}",
                      output_dir=tmp_path / "run")
    with pytest.raises(RewardError, match="before training") as caught:
        run(cfg)
    assert "'mine'" in str(caught.value) and says in str(caught.value)
    assert not cache.exists() or not any(cache.rglob("*.safetensors")), "no warm start was trained"


# --- a distillation weight that is no number ------------------------------------------------------
def test_a_distill_coef_that_is_no_number_is_a_config_error_naming_it(make_config):
    with pytest.raises(ConfigError, match=r"algorithm\.distill\.coef='abc' is not valid"):
        check_config(make_config("algorithm=kdrl", "algorithm.distill.coef=abc"))
    with pytest.raises(ConfigError, match=r"algorithm\.distill\.coef='abc'"):
        rules.distills({"coef": "abc"})  # a module built without the start-up check
    with pytest.raises(ConfigError, match=r"algorithm\.distill\.coef_schedule\.end='x'"):
        rules.distills({"coef": 0.0, "coef_schedule": {"name": "linear", "end": "x"}})


def test_options_of_another_config_dir_are_left_to_hydra():
    # a user's own config dir may hold algorithm/mine.yaml: only Hydra sees it
    check_group_options(["--config-dir", "/my/configs", "algorithm=mine"])
    check_group_options(["hydra.searchpath=[file:///my/configs]", "algorithm=mine"])
    with pytest.raises(ConfigError, match="algorithm=mine: config group algorithm has no option 'mine'"):
        check_group_options(["algorithm=mine"])
