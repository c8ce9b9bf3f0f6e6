"""A role the run reads is configured (config/roles.py `a_role_in_use_is_configured`): a KL term
with `roles.reference=null`, a critic with `roles.critic=null`, a distillation weight with
`roles.teacher=null` are refused by the start-up check, naming the role's key and what reads it,
before any warm start trains; a setup where nothing reads the role, or where null is meaningful
(DPO's reference: the policy's starting weights), is not."""

from __future__ import annotations

import os
import sys

import pytest
from forked_cli import run_command

from conftest import compose_config
from posttrain.config.check import check_config
from posttrain.errors import ConfigError


def problems(*overrides: str) -> str | None:
    """The start-up check's message for `posttrain <overrides>`, or None when it passes."""
    try:
        check_config(compose_config(list(overrides)))
    except ConfigError as err:
        return str(err)
    return None


@pytest.mark.parametrize("overrides, named", [
    # a KL term (grpo_tiny: kl_estimator=k3, coef 0.01) reads the frozen reference
    (("experiment=grpo_tiny", "roles.reference=null"), ("roles.reference=null", "kl_estimator=k3")),
    (("algorithm=grpo", "kl_estimator=k1", "roles.reference=null"), ("roles.reference=null", "kl_estimator=k1")),
    # a LoRA policy's reference is its own base, but only through roles.reference's init_from=policy
    (("experiment=grpo_tiny", "model.lora.r=4", "roles.reference=null"), ("roles.reference=null", "kl_estimator=k3")),
    (("experiment=grpo_tiny", "roles.reference=policy"), ("roles.reference='policy'", "kl_estimator=k3")),
    (("experiment=ppo_tiny", "roles.critic=null"), ("roles.critic=null", "algorithm.critic")),
    (("algorithm=opd", "teacher=tiny_concise", "roles.teacher=null"), ("roles.teacher=null", "algorithm.distill")),
])
def test_a_role_the_run_reads_is_refused_when_null(overrides, named):
    message = problems(*overrides)
    assert message is not None, f"{overrides} passed the start-up check"
    for needle in named:
        assert needle in message, message


def test_a_null_teacher_role_is_reported_beside_the_missing_teacher():
    """Two problems, two keys: the teacher rule (config/models.py) names `teacher`, this one `roles.teacher`."""
    message = problems("algorithm=opd", "roles.teacher=null")
    assert "2 problems" in message and "set teacher=" in message and "roles.teacher=null" in message, message


@pytest.mark.parametrize("overrides", [
    ("experiment=grpo_tiny",),
    # a LoRA policy: the reference is its own base, through the default roles.reference
    ("experiment=grpo_tiny", "model.lora.r=4", "model.lora.export_merged=true"),
    ("experiment=grpo_tiny", "kl_estimator=none", "roles.reference=null"),  # no KL term: nothing reads it
    ("experiment=grpo_tiny", "kl_estimator.coef=0", "roles.reference=null"),
    ("experiment=grpo_tiny", "roles.critic=null", "roles.teacher=null"),  # grpo has neither
    ("algorithm=dpo", "roles.reference=null"),  # DPO's null reference: the policy's starting weights
    ("algorithm=dpo", "model.lora.r=4", "model.lora.export_merged=true", "roles.reference=null"),  # or its base
    ("algorithm=sft", "roles.reference=null", "roles.critic=null", "roles.teacher=null"),
    ("experiment=ppo_tiny",),
    ("algorithm=opd", "teacher=tiny_concise"),
])
def test_a_role_nothing_reads_or_a_meaningful_null_is_not_refused(overrides):
    assert problems(*overrides) is None


def test_posttrain_with_a_kl_term_and_no_reference_stops_before_the_warm_start_trains(tmp_path):
    cache, logs = tmp_path / "cache", tmp_path / "logs"
    command = [sys.executable, "-m", "posttrain.train", "experiment=grpo_tiny", "roles.reference=null",
               "logger=none", f"paths.cache_dir={cache}", f"paths.log_dir={logs}"]
    result = run_command(command, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    message = result.stderr + result.stdout
    assert result.returncode != 0, message
    assert "roles.reference=null" in message and "kl_estimator=k3" in message, message
    assert "Traceback" not in message, message
    assert not cache.exists(), "no warm start was trained (nothing written under paths.cache_dir)"
    assert not list(logs.rglob("*.ckpt")) and not list(logs.rglob("summary.json"))
