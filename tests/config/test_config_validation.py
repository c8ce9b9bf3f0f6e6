"""Every config value is validated before anything is built: each key of conf/ has a spec,
every option of every group passes as composed, and a bad value or combination is one
ConfigError naming the key, the value and what is allowed (from the CLI: no traceback, no
run directory)."""

import copy
import functools
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf, open_dict

from posttrain.config import check, spec
from posttrain.config.algorithm import ONLINE_ONLY_GROUPS
from posttrain.config.check import check_config, keys_without_spec
from posttrain.errors import ConfigError
from posttrain.conf import CONFIG_DIR

from forked_cli import run_command
from conftest import compose_config

GROUPS = ["algorithm", "kl_estimator", "advantage", "reward", "data_curriculum", "model", "data", "rollout",
          "trainer", "logger", "callbacks", "paths", "numerics", "experiment"]

# What an option needs beside it to make a valid run: online components an online
# algorithm, gae a critic, and the values the user must supply (`???`).
CONTEXT = {
    ("advantage", "none"): (),
    ("advantage", "gae"): ("algorithm=ppo",),
    ("kl_estimator", "none"): (),
    ("data_curriculum", "none"): (),
    ("model", "hf"): ("model.name_or_path=Qwen/Qwen2.5-0.5B-Instruct",),
    ("data", "jsonl"): ("data.files.train=train.jsonl", "data.files.validation=validation.jsonl"),
    ("data", "prompt_answer"): ("data.path=prompts.jsonl",),
    ("data", "verifiers"): ("algorithm=grpo", "env=verifiers", "env.load=my_env", "reward=environment"),
    ("algorithm", "opd"): ("roles.teacher.init_from=policy",),   # a teacher: here a copy of the policy
    ("algorithm", "kdrl"): ("roles.teacher.init_from=policy",),
}
ONLINE_CONTEXT = ("algorithm=grpo",)
# Options no algorithm can run yet, with the reason their refusal gives.
REFUSED = {("advantage", "prm_step"): "process reward model",
           ("reward", "reward_model"): "needs exactly one of path"}  # which reward model: the user's
# Options that need hardware or packages this machine may lack, with what their refusal names.
GPU_ONLY = {("rollout", "vllm"): "rollout=vllm needs vLLM"}
if importlib.util.find_spec("vllm") is None:
    REFUSED.update(GPU_ONLY)
elif torch.cuda.is_available():  # vLLM's GPU build with a GPU trainer (its CPU build: the default trainer=cpu)
    CONTEXT[("rollout", "vllm")] = ("trainer=default",)


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (Path(CONFIG_DIR) / group).glob("*.yaml"))


def group_options() -> list[tuple[str, str]]:
    return [(group, option) for group in GROUPS for option in options(group)]


def context(group: str, option: str) -> tuple[str, ...]:
    if (group, option) in CONTEXT:
        return CONTEXT[(group, option)]
    return ONLINE_CONTEXT if group in (*ONLINE_ONLY_GROUPS, "reward", "numerics") else ()


def compose(*overrides: str):
    """The config `posttrain <overrides>` hands to check_config: composed and resolved (a copy:
    the spec and validation tests of each option compose it once between them)."""
    return copy.deepcopy(composed(overrides))


@functools.lru_cache(maxsize=None)
def composed(overrides: tuple[str, ...]):
    cfg = compose_config(list(overrides))
    OmegaConf.resolve(cfg)
    return cfg


def refusal(*overrides: str) -> str:
    """The message check_config refuses `posttrain <overrides>` with."""
    with pytest.raises(ConfigError) as caught:
        check_config(compose(*overrides), {})
    return str(caught.value)


# --- completeness: every key has a spec, every option passes --------------------------------

@pytest.mark.parametrize("group,option", group_options())
def test_every_key_of_every_option_has_a_spec(group, option):
    cfg = compose(*context(group, option), f"{group}={option}")
    assert keys_without_spec(cfg) == [], "add these keys to the SPECS of their group's file in posttrain/config/"


@pytest.mark.parametrize("group,option", [pair for pair in group_options() if pair not in REFUSED])
def test_every_option_passes_validation(group, option):
    check_config(compose(*context(group, option), f"{group}={option}"), {group: option})


@pytest.mark.parametrize("group,option", list(REFUSED))
def test_an_option_no_algorithm_can_run_is_refused(group, option):
    assert REFUSED[(group, option)] in refusal(*ONLINE_CONTEXT, f"{group}={option}")


def test_every_rule_of_a_group_file_runs_once():
    """check.RULES lists the rules by hand, in the order their problems are numbered: a rule
    written with @rule in a group file but left out of it would never run."""
    assert len(set(check.RULES)) == len(check.RULES)
    assert {f.__qualname__ for f in spec.DEFINED_RULES} - {f.__qualname__ for f in check.RULES} == set()
    assert set(check.RULES) == set(spec.DEFINED_RULES)


def test_the_warm_starts_own_config_passes():
    """train.warm_start runs SFT with the online groups replaced by bare {name: none} nodes."""
    cfg = compose("experiment=grpo_tiny")
    with open_dict(cfg):
        cfg.algorithm = OmegaConf.load(Path(CONFIG_DIR) / "algorithm" / "sft.yaml")
        for group in ONLINE_ONLY_GROUPS:
            cfg[group] = {"name": "none"}
        cfg.logger = {"backend": "none"}
        cfg.callbacks.stop_at_accuracy = 0.25
    check_config(cfg, {"algorithm": "grpo"})


def test_extra_lightning_trainer_keys_pass():
    check_config(compose("+trainer.max_time=00:00:01:59", "+trainer.enable_checkpointing=true"), {})


# --- one bad value: the message names the key, the value and what is allowed -----------------

def test_a_non_numeric_step_count_is_refused_with_one_plain_sentence():
    assert refusal("trainer.max_steps=abc") == ("trainer.max_steps='abc' is not valid: expected a positive integer "
                                                "(optimiser steps).")


def test_a_negative_learning_rate_is_refused():
    assert refusal("algorithm.optim.lr=-0.001") == ("algorithm.optim.lr=-0.001 is not valid: expected a number > 0 "
                                                    "(learning rate).")


def test_a_bool_is_not_an_int_and_an_int_is_not_a_bool():
    assert "trainer.max_steps=True is not valid: expected a positive integer" in refusal("trainer.max_steps=true")
    assert "eval.at_start=1 is not valid: expected true or false" in refusal("eval.at_start=1")


def test_a_value_outside_its_choices_lists_them():
    assert refusal("rollout.engine=sglang") == (
        "rollout.engine='sglang' is not valid: expected one of 'fast', 'hf', 'vllm', 'vllm_server'.")


def test_a_required_value_left_unset_is_named():
    assert refusal("data=jsonl", "data.files.validation=validation.jsonl") == (
        "data.files.train has no value (???): expected a non-empty string (a JSON-lines file).")


def test_model_hf_without_a_model_is_refused():
    # Hydra's merge keeps tiny's name_or_path: null under hf's `???`, so the choice says it
    with pytest.raises(ConfigError, match=r"model=hf needs model\.name_or_path"):
        check_config(compose("model=hf"), {"model": "hf"})


@pytest.mark.parametrize("overrides,named", [
    (("rollout.top_p=0",), "rollout.top_p=0 is not valid: expected a number in (0, 1]"),
    (("rollout.top_p=1.5",), "rollout.top_p=1.5"),
    (("rollout.temperature=nan",), "rollout.temperature=nan"),
    (("rollout.max_new_tokens=0",), "rollout.max_new_tokens=0"),
    (("algorithm=grpo", "algorithm.warm_start.until_accuracy=0"), "algorithm.warm_start.until_accuracy=0"),
    (("algorithm=grpo", "algorithm.warm_start.until_accuracy=5"), "algorithm.warm_start.until_accuracy=5"),
    (("algorithm=grpo", "algorithm.clip_low=1.2"), "algorithm.clip_low=1.2"),
    (("algorithm=grpo", "algorithm.policy_loss=ppo"), "algorithm.policy_loss='ppo'"),
    (("eval.num_prompts=0",), "eval.num_prompts=0"),
    (("trainer.val_check_interval=0",), "trainer.val_check_interval=0"),
    (("trainer.val_check_interval=0.5",), "trainer.val_check_interval=0.5"),
    (("callbacks.checkpoint.every_n_train_steps=0",), "callbacks.checkpoint.every_n_train_steps=0"),
    (("seed=-1",), "seed=-1"),
    (("num_threads=0",), "num_threads=0"),
    (("algorithm.optim.betas=[0.9]",), "algorithm.optim.betas=[0.9]"),
    (("trainer.precision=31",), "trainer.precision=31"),
    (("model.gradient_checkpointing=partial",),
     "model.gradient_checkpointing='partial' is not valid: expected true, false or 'selective'"),
    (("trainer.gradient_clip_val=1.0",), "algorithm.max_grad_norm"),
    (("algorithm=grpo", "kl_estimator.coef=-1"), "kl_estimator.coef=-1"),
    (("algorithm=grpo", "reward.components.accuracy.weight=heavy"), "reward.components.accuracy.weight='heavy'"),
    (("algorithm=grpo", "rollout.dtype=int8"), "rollout.dtype='int8'"),
    (("algorithm=grpo", "rollout.correction.tis=row"), "rollout.correction.tis='row'"),
    (("algorithm=grpo", "rollout.correction.mis_low=1.5"), "rollout.correction.mis_low=1.5"),
    (("algorithm=grpo", "rollout.correction.mis_high=0.5"), "rollout.correction.mis_high=0.5"),
    (("algorithm=grpo", "rollout.mismatch_budget.action=abort"), "rollout.mismatch_budget.action='abort'"),
    (("algorithm=grpo", "~reward.components.accuracy"), "reward.components={} is not valid: expected a non-empty"),
])
def test_a_bad_value_is_named(overrides, named):
    assert named in refusal(*overrides)


# --- rules across keys -----------------------------------------------------------------------

def test_groups_of_one_sample_are_refused_with_a_group_advantage():
    message = refusal("algorithm=grpo", "algorithm.group_size=1")
    assert "algorithm.group_size=1 with advantage=group_norm" in message and "nothing would be trained" in message
    assert "algorithm.group_size=1" in refusal("algorithm=dr_grpo", "algorithm.group_size=1")
    # verl's convention scores a group of one (mean 0, std 1): that run has a signal
    check_config(compose("algorithm=grpo", "algorithm.group_size=1", "numerics=verl"), {})
    check_config(compose("algorithm=grpo", "algorithm.group_size=1", "advantage=reinforce_pp"), {})


def test_minibatches_must_split_the_rollout_batch():
    message = refusal("algorithm=grpo", "algorithm.num_minibatches=3")
    assert "algorithm.num_minibatches=3" in message and "16 x 8 = 128 samples" in message


@pytest.mark.parametrize("overrides,named", [
    (("data.min_digits=4",), "data.min_digits=4 is larger than data.max_digits=3"),
    (("trainer.devices=2",), "trainer=ddp"),
    (("trainer=ddp", "trainer.strategy.data_parallel_size=4"), "trainer.strategy.data_parallel_size=4"),
    (("algorithm=grpo", "algorithm.keep_sampling_mask=true"), "rollout.top_k > 0 or rollout.top_p < 1"),
    (("algorithm=grpo", "algorithm.delta=1.1"), "algorithm.delta=1.1"),
    (("algorithm=grpo", "kl_estimator.controller=adaptive"), "kl_estimator.target"),
    (("algorithm=grpo", "kl_estimator.placement=none"), "kl_estimator.placement='none'"),
    (("algorithm=grpo", "advantage=gae"), "advantage=gae needs a critic"),
    (("algorithm=ppo", "advantage=group_norm"), "algorithm.critic=set"),
    (("algorithm=grpo", "advantage=none"), "needs an advantage estimator"),
    (("algorithm=sft", "kl_estimator=k1"), "kl_estimator=k1 has no effect"),
    (("algorithm=dapo", "algorithm.group_size=1", "numerics=verl"), "data_curriculum=dynamic_sampling"),
    (("algorithm=grpo", "data_curriculum=pass_rate_filter", "data_curriculum.low=0.9", "data_curriculum.high=0.1"),
     "data_curriculum.low=0.9 is larger than data_curriculum.high=0.1"),
    (("algorithm=grpo", "data_curriculum=difficulty_schedule", "data_curriculum.accuracy_threshold=null"),
     "data_curriculum.milestones or data_curriculum.accuracy_threshold"),
    (("algorithm=grpo", "data_curriculum=pass_rate_filter", "reward=format", "~reward.components.accuracy"),
     "add reward.components.accuracy"),
    (("data=jsonl", "data.files.train=train.jsonl"), "eval.split=validation needs data.files.validation"),
    (("roles.reference.name_or_path=Qwen/Qwen2.5-0.5B",), "roles.reference.init_from=policy"),
    (("model.num_kv_heads=3",), "model.num_heads=4 is not a multiple of model.num_kv_heads=3"),
    (("model.hidden_size=120", "model.num_heads=8", "model.num_kv_heads=8"), "even head size"),
    (("algorithm=grpo", "+trainer.accumulate_grad_batches=2"), "algorithm.micro_batch_size"),
    (("algorithm=opd",), "algorithm=opd distils from a teacher, but none is configured"),
    (("algorithm=grpo", "teacher=tiny_concise"), "teacher=tiny_concise is set, but algorithm=grpo does not read"),
    (("algorithm=long2short", "teacher=tiny_verbose"), "algorithm.distill.coef=0"),
    (("algorithm=opd", "teacher=tiny_concise", "algorithm.critic={}", "advantage=gae"),
     "algorithm.distill.mode=reward adds each token's distillation reward"),
    (("algorithm=kdrl", "teacher=tiny_concise", "algorithm.distill.coef_schedule.steps=0"),
     "algorithm.distill.coef_schedule.steps=0"),
    (("algorithm=grpo", "rollout=hf", "rollout.dtype=bfloat16"), "rollout=hf samples with the policy's own weights"),
    (("algorithm=sft", "rollout.correction.tis=token"), "algorithm=sft has none"),
    (("algorithm=dpo", "rollout.mismatch_budget.kl=0.01"), "rollout.mismatch_budget.kl"),
    (("algorithm=grpo", "rollout.mismatch_budget.masked_frac=0.1"), "rollout.correction.mis is null"),
])
def test_a_bad_combination_is_named(overrides, named):
    assert named in refusal(*overrides)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_accelerator_without_cuda_is_refused():
    assert "no CUDA device is visible" in refusal("trainer.accelerator=cuda")


# --- the builders' own checks, run before the SFT warm start ----------------------------------

@pytest.mark.parametrize("overrides,named", [
    (("algorithm=gspo", "algorithm.dual_clip=3.0"), "does not use dual_clip"),
    (("algorithm=grpo", "+algorithm.clip_ratio=0.2"), "algorithm: unknown key(s) ['clip_ratio']"),
    (("algorithm=sft", "+algorithm.group_size=4"), "algorithm: unknown key(s) ['group_size']"),
    (("algorithm=dapo", "reward.components.overlong.cache_len=20"), "reward.components.overlong"),
    (("algorithm=grpo", "+reward.components.mine._target_=no_such_package.fn"), "cannot be imported"),
    (("algorithm=grpo", "algorithm._target_=no_such_package.Module"),
     "algorithm._target_='no_such_package.Module' cannot be imported"),
    (("algorithm=grpo", "data_curriculum=dynamic_sampling", "+data_curriculum.pool_size=3"), "['pool_size']"),
    (("algorithm=grpo", "kl_estimator=k1", "+kl_estimator.log_ratio_clamp=5"), "log_ratio_clamp"),
])
def test_what_a_builder_would_refuse_after_the_warm_start_is_refused_first(overrides, named):
    assert named in refusal(*overrides)


# --- several problems: one error lists them all ---------------------------------------------

def test_several_bad_values_are_reported_together():
    message = refusal("trainer.max_steps=abc", "algorithm.optim.lr=-1", "eval.num_prompts=0")
    assert message.startswith("the config has 3 problems: (1) ")
    for named in ("trainer.max_steps='abc'", "algorithm.optim.lr=-1", "eval.num_prompts=0"):
        assert named in message
    assert "\n" not in message  # one paragraph


def test_a_rule_does_not_reason_about_a_value_already_refused():
    message = refusal("algorithm=grpo", "algorithm.group_size=abc")
    assert message == ("algorithm.group_size='abc' is not valid: expected a positive integer (samples per prompt).")


# --- the real entry point ---------------------------------------------------------------------

def posttrain(*args: str, log_dir: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "posttrain.train", *args, "logger=none", f"paths.log_dir={log_dir}"]
    return run_command(command, capture_output=True, text=True, timeout=300)


def assert_refused_before_anything_is_written(result, log_dir: Path, *needles: str):
    message = result.stderr + result.stdout
    assert result.returncode != 0, message
    for needle in needles:
        assert needle in result.stderr, message
    assert "Traceback" not in message, message
    assert not [p for p in log_dir.rglob("*") if p.is_file()], "a refused start leaves no files"


def test_cli_refuses_a_non_numeric_step_count(tmp_path):
    result = posttrain("trainer.max_steps=abc", log_dir=tmp_path)
    assert_refused_before_anything_is_written(result, tmp_path, "posttrain: error: trainer.max_steps='abc'",
                                              "positive integer")


def test_cli_refuses_groups_of_one_before_the_warm_start(tmp_path):
    result = posttrain("algorithm=grpo", "algorithm.group_size=1", log_dir=tmp_path)
    assert_refused_before_anything_is_written(result, tmp_path, "algorithm.group_size=1", "advantage=group_norm")
    assert "Warm start" not in result.stdout + result.stderr


def test_cli_lists_every_bad_key(tmp_path):
    result = posttrain("algorithm.optim.lr=-0.1", "eval.num_prompts=0", log_dir=tmp_path)
    assert_refused_before_anything_is_written(result, tmp_path, "2 problems", "algorithm.optim.lr=-0.1",
                                              "eval.num_prompts=0")
