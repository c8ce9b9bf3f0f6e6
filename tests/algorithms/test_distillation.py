"""Distillation as configurations of the online-RL module: on-policy distillation (opd),
KDRL and Long2Short. The distillation term against hand-computed values, OPD's reward mode
against the gradient of the sampled reverse KL, a teacher equal to the student, the Kimi
length reward's warm-up, and a short run of each preset."""

import math
import shutil

import pytest
import torch

from posttrain import core
from posttrain.algorithms.experience import Experience
from posttrain.algorithms.online.parts.distillation import DistillTerm
from posttrain.algorithms.online.terms import MicroBatch
from posttrain.errors import ConfigError
from posttrain.rewards import ScoredSample, build_reward
from posttrain.train import run

from conftest import module_from_config
from conftest import rl_config


def two_samples(student_logp, teacher_logp, mask, scores):
    B, T = mask.shape
    return Experience(prompt_ids=torch.zeros(B, 1, dtype=torch.long), prompt_mask=torch.ones(B, 1),
                      response_ids=torch.zeros(B, T, dtype=torch.long), response_mask=mask,
                      rollout_logprobs=student_logp.detach().clone(), truncated=torch.zeros(B, dtype=torch.bool),
                      scores=scores, correct=scores, group_index=torch.tensor([0, 0]), teacher_logp=teacher_logp)


def micro_batch(exp, logp, **extra):
    mask = exp.response_mask
    aggregation = dict(agg_mode="token-mean", norm_constant=None, count_empty_rows=False, dp_size=1,
                       num_tokens=mask.sum(), num_seqs=torch.tensor(2.0))
    return MicroBatch(exp=exp, mask=mask, logp=logp, old_logp=logp.detach(), entropy=None, values=None,
                      aggregation=aggregation, **extra)


# sample 0: two tokens (the third is padding), sample 1: three tokens
STUDENT = torch.tensor([[-1.0, -2.0, -5.0], [-1.0, -1.0, -1.0]])
TEACHER = torch.tensor([[-2.0, -2.0, -9.0], [-1.5, -0.5, -1.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])


def test_distill_term_loss_mode_on_two_samples_by_hand():
    logp = STUDENT.clone().requires_grad_()
    exp = two_samples(logp, TEACHER, MASK, scores=torch.tensor([1.0, 0.0]))
    term = DistillTerm("loss", lambda: 0.5, estimator="k2")
    loss, stats = term(micro_batch(exp, logp))
    # k2 = (log p_S - log p_T)^2 / 2 per real token: 0.5, 0, | 0.125, 0.125, 0; token-mean over 5
    assert float(stats["loss"]) == pytest.approx(0.75 / 5)
    assert loss.item() == pytest.approx(0.5 * 0.75 / 5)
    assert float(stats["coef"]) == 0.5
    # sampled reverse KL, log p_S - log p_T over the 5 real tokens: 1, 0, 0.5, -0.5, 0
    assert float(stats["reverse_kl"]) == pytest.approx(1.0 / 5)
    # reward-guided masking: sample 0 (reward 1 > threshold 0.5) is not distilled; counts stay 5
    masked = DistillTerm("loss", lambda: 1.0, mask="low_reward", reward_threshold=0.5)
    loss, stats = masked(micro_batch(exp, logp))
    assert loss.item() == pytest.approx(0.25 / 5)
    assert float(stats["masked_frac"]) == 0.5
    loss.backward()
    assert (logp.grad[0] == 0).all()
    torch.testing.assert_close(logp.grad[1], (STUDENT[1] - TEACHER[1]) / 5)
    # k3 = exp(d) - d - 1, d = log p_T - log p_S
    d = TEACHER - STUDENT
    k3 = ((d.exp() - d - 1) * MASK).sum() / 5
    loss, _ = DistillTerm("loss", lambda: 1.0, estimator="k3")(micro_batch(exp, STUDENT.clone().requires_grad_()))
    assert loss.item() == pytest.approx(float(k3))


def test_distill_term_full_mode_is_the_full_vocabulary_divergence():
    # two-token vocabulary: p_S = (1/2, 1/2) everywhere, p_T = (1/4, 3/4) everywhere
    student_logits = torch.zeros(2, 3, 2, requires_grad=True)
    teacher_logits = torch.log(torch.tensor([0.25, 0.75])).expand(2, 3, 2)
    exp = two_samples(STUDENT, TEACHER, MASK, scores=torch.zeros(2))
    mb = micro_batch(exp, STUDENT.clone().requires_grad_(), logits=student_logits, teacher_logits=teacher_logits)
    loss, stats = DistillTerm("full", lambda: 2.0, divergence="reverse_kl")(mb)
    reverse = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert float(stats["loss"]) == pytest.approx(reverse)  # the same at every token: its token-mean
    assert loss.item() == pytest.approx(2.0 * reverse)
    forward = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    _, stats = DistillTerm("full", lambda: 1.0, divergence="forward_kl")(mb)
    assert float(stats["loss"]) == pytest.approx(forward)
    # reward mode: the reward is in the advantages already, the term only logs
    loss, stats = DistillTerm("reward", lambda: 1.0)(mb)
    assert float(loss) == 0.0 and float(stats["reverse_kl"]) == pytest.approx(1.0 / 5)


def test_kimi_length_reward_switches_on_after_its_warm_up():
    class Source:
        def is_correct(self, example, response):
            return True

    reward = build_reward({"components": {"accuracy": {"weight": 1.0},
                                          "length_penalty": {"weight": 1.0, "warmup": 2}}}, Source(), 8)
    samples = [ScoredSample(None, "x" * n, n, False, 0) for n in (2, 4, 6)]
    for step in (0, 1):
        reward.set_step(step)
        assert reward(samples, Source()).components["length_penalty"].tolist() == [0.0, 0.0, 0.0]
    reward.set_step(2)
    # lambda = 0.5 - (len - 2) / (6 - 2), all correct
    assert reward(samples, Source()).components["length_penalty"].tolist() == [0.5, 0.0, -0.5]
    with pytest.raises(ConfigError, match="warmup"):
        build_reward({"components": {"length_penalty": {"warmup": -1}}}, Source(), 8)


@pytest.fixture(scope="module")
def other_teacher(sft_start, tmp_path_factory):
    """An HF directory of the policy's architecture and tokenizer with perturbed weights."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("teacher") / "hf_model"
    shutil.copytree(sft_start, out)
    model = AutoModelForCausalLM.from_pretrained(out)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    model.save_pretrained(out)
    return out


def one_batch(module):
    exp, _, _ = module.collect(step=0)
    exp, _ = module.compute_advantages(module.annotate(exp.without_trailing_padding()))
    return exp


def policy_grads(module, exp):
    module.policy.zero_grad()
    stats = module.learner.accumulate_gradients(exp)
    return [p.grad.clone() for p in module.policy.parameters()], stats


def test_opd_reward_mode_gradient_is_the_sampled_reverse_kl_gradient(make_config, sft_start, other_teacher):
    """Per-token reward log p_T - log p_S through the policy-gradient path = the gradient of the
    surrogate sg(log p_S - log p_T) * log p_S, whose expectation is grad KL(p_S || p_T)."""
    module = module_from_config(rl_config(make_config, sft_start, "algorithm=opd",
                                          f"roles.teacher.name_or_path={other_teacher}"))
    assert [field for field, _ in module.scorers] == ["old_logp", "teacher_logp"]
    assert module.frozen_roles() == ["teacher"] and not any(p.requires_grad for p in module.teacher.parameters())
    exp = one_batch(module)
    grads, stats = policy_grads(module, exp)
    assert stats["distill/reverse_kl"] > 0.01  # a different teacher
    module.policy.zero_grad()
    logp = module.learner.training_forward(exp, with_values=False)[0]
    surrogate = core.aggregate_loss((logp.detach() - exp.teacher_logp) * logp, exp.response_mask,
                                    "seq-mean-token-mean")  # opd's aggregation (grpo's)
    surrogate.backward()
    for got, expected in zip(grads, (p.grad for p in module.policy.parameters())):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("mode", ["reward", "full"])
def test_a_teacher_equal_to_the_student_gives_zero_reverse_kl_and_gradient(mode, make_config, sft_start):
    module = module_from_config(rl_config(make_config, sft_start, "algorithm=opd", f"algorithm.distill.mode={mode}",
                                          f"roles.teacher.name_or_path={sft_start}"))
    grads, stats = policy_grads(module, one_batch(module))
    assert abs(stats["distill/reverse_kl"]) < 1e-6
    assert max(float(g.abs().max()) for g in grads) < 1e-6


def test_full_mode_reads_the_teacher_in_the_update_only(make_config, sft_start, other_teacher):
    module = module_from_config(rl_config(make_config, sft_start, "algorithm=opd", "algorithm.distill.mode=full",
                                          "algorithm.distill.divergence=generalized_jsd",
                                          f"roles.teacher.name_or_path={other_teacher}"))
    assert module.scorers == []  # no stored teacher log-probs: its logits come per micro-batch
    grads, stats = policy_grads(module, one_batch(module))
    assert stats["distill/loss"] > 0 and stats["distill/reverse_kl"] > 0
    assert any(g.abs().max() > 0 for g in grads)


def test_kdrl_anneals_its_coefficient_over_rollout_batches(make_config, sft_start, other_teacher):
    module = module_from_config(rl_config(make_config, sft_start, "algorithm=kdrl",
                                          "algorithm.distill.coef_schedule.name=cosine",
                                          "algorithm.distill.coef_schedule.steps=10",
                                          f"roles.teacher.name_or_path={other_teacher}"))
    start, end = module.part("distillation").distill["coef"], module.part("distillation").distill["coef_schedule"]["end"]
    for batch, expected in ((0, start), (5, (start + end) / 2), (10, end), (50, end)):
        module.train_batches_seen = batch
        assert module.part("distillation").coef() == pytest.approx(expected)


def test_the_teacher_is_frozen_and_left_out_of_checkpoints(make_config, sft_start, other_teacher):
    """A frozen role is rebuilt from its config on resume, not stored in every checkpoint."""
    cfg = rl_config(make_config, sft_start, "algorithm=kdrl", f"roles.teacher.name_or_path={other_teacher}")
    module = module_from_config(cfg)
    checkpoint = {"state_dict": module.state_dict()}
    assert any(k.startswith("teacher.") for k in checkpoint["state_dict"])
    module.train_batches_seen = 7
    module.on_save_checkpoint(checkpoint)
    assert not any(k.startswith("teacher.") for k in checkpoint["state_dict"])
    resumed = module_from_config(cfg)
    resumed.on_load_checkpoint(checkpoint)
    teacher = dict(module.teacher.named_parameters())
    for name, p in resumed.teacher.named_parameters():
        assert torch.equal(p, teacher[name]) and not p.requires_grad
    assert resumed.part("distillation").coef() == module.part("distillation").coef()  # the schedule continues from batch 7


def test_a_distilling_algorithm_without_a_teacher_is_refused(make_config, sft_start):
    with pytest.raises(ConfigError, match="teacher"):
        module_from_config(rl_config(make_config, sft_start, "algorithm=kdrl"))
    with pytest.raises(ConfigError, match="advantage=gae"):
        module_from_config(rl_config(make_config, sft_start, "algorithm=ppo", "+algorithm.distill.mode=reward",
                                     "+algorithm.distill.coef=1.0", f"roles.teacher.name_or_path={sft_start}"))


@pytest.mark.parametrize("preset,overrides", [
    ("opd", ()),
    ("kdrl", ("algorithm.distill.mask=low_reward",)),
    ("long2short", ("algorithm.distill.coef=0.01", "reward.components.length_penalty.warmup=1",
                    "data.max_response_tokens=24")),
])
def test_each_distillation_preset_trains_and_logs_distill_metrics(preset, overrides, make_config, sft_start,
                                                                   other_teacher):
    summary = run(rl_config(make_config, sft_start, f"algorithm={preset}", *overrides, "eval.num_prompts=16",
                            "eval.batch_size=16", f"roles.teacher.name_or_path={other_teacher}"))
    expected = ["distill/coef", "distill/reverse_kl", "eval/accuracy", "eval/response_len", "policy/loss"]
    if preset == "opd":
        expected.append("distill/reward_mean")
    else:
        expected += ["distill/loss", "distill/kl", "distill/masked_frac"]
    if preset == "long2short":
        expected.append("rewards/length_penalty/mean")
    missing = [k for k in expected if k not in summary]
    assert not missing, missing
    assert summary["global_step"] == 2
