"""The train-inference mismatch in the online update (issue 28): the sampler's precision
(`rollout.dtype`), the `rollout/mismatch/*` metrics of every batch, the corrections
(`rollout.correction`) applied to the policy loss, and the budget that marks a run invalid or
stops it. The formulas themselves are tested in tests/core/test_mismatch.py."""

import json
import sys

import pytest
import torch
from conftest import EASY_TASK, FAST_RUN
from forked_cli import run_command
from test_grpo import online_module

from posttrain import core
from posttrain.algorithms.online.learner import mismatch_metrics
from posttrain.errors import MismatchError
from posttrain.eval.report.document import write_report


def one_update(module, step: int = 0):
    """collect -> annotate -> advantages -> the update's gradient of one rollout batch, outside a
    Trainer; returns the batch and its `rollout/mismatch/*` metrics."""
    exp, _, _ = module.collect(step=step)
    exp = module.annotate(exp.without_trailing_padding())
    exp, _ = module.compute_advantages(exp)
    stats = module.learner.accumulate_gradients(exp)
    sums = {key.rsplit("/", 1)[1]: value for key, value in stats.items() if "/mismatch_sum/" in key}
    return exp, mismatch_metrics(sums, exp.response_mask.device)


def test_an_fp32_sampler_agrees_with_the_trainer_and_a_bf16_one_does_not(make_config, sft_start):
    same = online_module(make_config, sft_start, "algorithm=dapo")
    _, fp32 = one_update(same)
    # the fused KV-cache decoder and the training forward compute in other orders: rounding only
    assert fp32["rollout/mismatch/abs_log_ratio_mean"] < 1e-5
    assert fp32["rollout/mismatch/abs_log_ratio_max"] < 1e-4
    assert fp32["rollout/mismatch/kl"] < 1e-9
    assert fp32["rollout/mismatch/ess"] > 1 - 1e-9
    assert fp32["rollout/mismatch/capped_frac"] == fp32["rollout/mismatch/masked_frac"] == 0.0

    bf16 = online_module(make_config, sft_start, "algorithm=dapo", "rollout.dtype=bfloat16")
    _, rounded = one_update(bf16)
    assert rounded["rollout/mismatch/abs_log_ratio_mean"] > 100 * fp32["rollout/mismatch/abs_log_ratio_mean"]
    assert rounded["rollout/mismatch/abs_log_ratio_max"] > 1e-3
    assert 0 < rounded["rollout/mismatch/kl"] < 0.1  # bf16 rounding: a small but real gap
    assert rounded["rollout/mismatch/ess"] < 1.0


def test_the_corrected_update_reads_the_trainers_pi_old_on_policy_as_an_explicit_old_forward(make_config,
                                                                                               sft_start):
    """On-policy, pi_old is the training forward's own log-probs (detached): the same weights
    and forward as a separate old-log-prob pass, so TIS and MIS weigh pi_old / mu alike."""
    module = online_module(make_config, sft_start, "algorithm=dapo", "rollout.dtype=bfloat16",
                           "rollout.correction.tis=token", "rollout.correction.mis=token")
    assert [field for field, _ in module.scorers] == []  # no extra forward on-policy
    exp, _, _ = module.collect(step=0)
    exp = module.annotate(exp.without_trailing_padding())
    exp, _ = module.compute_advantages(exp)
    with torch.no_grad():
        explicit_old = module.scoring.logprobs(module.policy, exp)
    # bounds at this batch's median |log pi_old - log mu|: about half the tokens capped or masked
    gap = core.mismatch_log_ratio(explicit_old, exp.rollout_logprobs, exp.response_mask)
    bound = float(gap[exp.response_mask.bool()].abs().median().exp())
    module.policy_term.correction.update(tis_cap=bound, mis_low=1 / (bound * 1.0001), mis_high=bound * 1.0001)
    grads, stats = [], []
    for old in (None, explicit_old):
        exp.old_logp = old
        module.policy.zero_grad()
        stats.append(module.learner.accumulate_gradients(exp))
        grads.append([p.grad.clone() for p in module.policy.parameters() if p.grad is not None])
    for shortcut, explicit in zip(*grads):
        torch.testing.assert_close(shortcut, explicit, rtol=1e-5, atol=1e-7)
    # the corrections acted: with bounds this tight a bf16 sampler gets tokens capped and rows masked
    masked = stats[0]["policy/mismatch_sum/masked"] / stats[0]["policy/mismatch_sum/tokens"]
    capped = stats[0]["policy/mismatch_sum/capped"] / stats[0]["policy/mismatch_sum/tokens"]
    assert 0 < masked < 1 and 0 < capped < 1
    assert stats[0]["policy/mismatch_sum/masked"] == stats[1]["policy/mismatch_sum/masked"]


def test_the_correction_changes_the_gradient_as_its_weights_say(make_config, sft_start):
    """TIS with a cap below every ratio (1e-6) weighs every token by the cap: the gradient is
    the uncorrected one times 1e-6; MIS with bounds no ratio meets masks everything: no gradient."""
    grads = {}
    for name, overrides in {"none": (), "tis": ("rollout.correction.tis=token", "rollout.correction.tis_cap=1e-6"),
                            "mis": ("rollout.correction.mis=token", "rollout.correction.mis_low=0.999999",
                                    "rollout.correction.mis_high=1.000001")}.items():
        module = online_module(make_config, sft_start, "algorithm=dapo", "rollout.dtype=bfloat16", *overrides)
        exp, _, _ = module.collect(step=0)
        exp, _ = module.compute_advantages(module.annotate(exp.without_trailing_padding()))
        if name == "mis":  # every token's ratio outside the bounds (bf16 rounding moves each one)
            ratio = core.mismatch_log_ratio(module.scoring.logprobs(module.policy, exp).detach(),
                                            exp.rollout_logprobs, exp.response_mask)
            inside = (ratio.abs() <= 1e-6) & exp.response_mask.bool()
            exp.response_mask = exp.response_mask * ~inside  # the few tokens bf16 left exact: out of the batch
        module.policy.zero_grad()
        module.learner.accumulate_gradients(exp)
        grads[name] = torch.cat([p.grad.flatten() for p in module.policy.parameters() if p.grad is not None])
    torch.testing.assert_close(grads["tis"], grads["none"] * 1e-6, rtol=1e-3, atol=1e-12)
    assert grads["mis"].abs().max() == 0


def test_over_budget_batches_are_counted_and_checkpointed_and_stop_when_asked(make_config, sft_start):
    module = online_module(make_config, sft_start, "algorithm=dapo", "rollout.dtype=bfloat16",
                           "rollout.mismatch_budget.kl=1e-12")
    metrics = {"rollout/mismatch/kl": 1e-6}
    budget = module.part("mismatch_budget")
    budget.after_update(None, metrics, step=0)
    budget.after_update(None, {"rollout/mismatch/kl": 0.0}, step=1)  # within: not counted
    assert module.part("mismatch_budget").over_budget == 1 and metrics["rollout/mismatch/over_budget_batches"] == 1.0
    checkpoint = {"state_dict": {}}
    module.on_save_checkpoint(checkpoint)
    assert checkpoint["mismatch_over_budget"] == 1
    budget.budget["action"] = "stop"
    with pytest.raises(MismatchError, match=r"rollout/mismatch/kl = 1e-06 > 1e-12.*action=stop"):
        budget.after_update(None, {"rollout/mismatch/kl": 1e-6}, step=2)


def posttrain(tmp_path, name, *overrides):
    out = tmp_path / name
    result = run_command([sys.executable, "-m", "posttrain.train", *FAST_RUN, *EASY_TASK, "algorithm=dapo",
                          "algorithm.prompts_per_step=4", "algorithm.group_size=4", "trainer.max_steps=2",
                          "trainer.val_check_interval=2", "eval.num_prompts=16", "eval.batch_size=16",
                          "eval.at_start=false", "rollout.dtype=bfloat16", "num_threads=1",
                          f"paths.cache_dir={tmp_path}/cache", f"hydra.run.dir={out}", *overrides], timeout=300)
    return out, result


@pytest.mark.slow  # 3 CLI runs (68 s); the budget's counting, checkpoint and stop are tested on the module
def test_a_deliberately_mismatched_run_is_marked_invalid_and_a_stopped_one_writes_no_summary(tmp_path):
    """End to end, as a user runs it: a bf16 sampler against a budget no bf16 sampler meets.
    With action=warn the run finishes, its summary counts the batches over budget and
    posttrain-report marks it invalid; with action=stop it exits non-zero naming the budget,
    before any summary.json is written."""
    valid, result = posttrain(tmp_path, "valid")
    assert result.returncode == 0, result.stderr[-3000:]
    invalid, result = posttrain(tmp_path, "invalid", "rollout.mismatch_budget.kl=1e-12")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "disagree beyond rollout.mismatch_budget" in result.stdout + result.stderr
    summary = json.loads((invalid / "summary.json").read_text())
    assert summary["rollout/mismatch/over_budget_batches"] == 2.0
    assert summary["rollout/mismatch/kl"] > 0
    assert "rollout/mismatch/over_budget_batches" not in json.loads((valid / "summary.json").read_text())
    text = write_report(tmp_path, by=["rollout.mismatch_budget.kl"]).read_text()
    assert "**invalid**" in text and f"{invalid.name} (2 rollout batches)" in text
    assert text.count("| yes |") == 2  # the valid run: its choice row and its run row

    stopped, result = posttrain(tmp_path, "stopped", "rollout.mismatch_budget.kl=1e-12",
                                "rollout.mismatch_budget.action=stop")
    assert result.returncode != 0
    assert "rollout.mismatch_budget" in result.stderr and "Traceback" not in result.stderr
    assert not (stopped / "summary.json").exists()
