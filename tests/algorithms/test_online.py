"""The online-RL pipeline's own behaviour, beyond the presets: stages and scorers, the loss
mask, skipped and guarded optimiser steps, the like-with-like off-policy mask, the critic."""

import math
from dataclasses import replace

import pytest
import torch
from conftest import EASY_TASK, FAST_RUN, module_from_config
from test_grpo import online_module

from posttrain.algorithms.experience import Experience
from posttrain.algorithms.online.terms import MicroBatch, PolicyTerm
from posttrain.errors import ConfigError, RewardError


def test_scorers_compute_only_what_a_later_stage_reads(make_config, sft_start):
    cases = {("algorithm=dapo",): [],                                  # on-policy, no KL, no critic
             ("algorithm=grpo",): ["ref_logp"],                         # k3 as a loss
             ("algorithm=gspo",): ["old_logp"],                         # two minibatches: off-policy
             ("algorithm=grpo", "kl_estimator=k1"): ["old_logp", "ref_logp"],   # KL in the reward
             ("algorithm=ppo",): ["old_logp", "ref_logp", "values"]}
    for overrides, fields in cases.items():
        module = online_module(make_config, sft_start, *overrides)
        assert [f for f, _ in module.scorers] == fields, overrides
        assert (module.reference is not None) == ("ref_logp" in fields)
        assert (module.critic is not None) == ("values" in fields)


def test_a_batch_without_signal_takes_no_step_and_too_many_stop_the_run(make_config, sft_start):
    module = online_module(make_config, sft_start, "algorithm=dapo")
    exp, _, _ = module.collect(step=0)
    module.optimizers = lambda: pytest.fail("no optimiser may be touched without a learning signal")
    assert module.update(exp, has_signal=False) == {"perf/skipped_update": 1.0}
    module.learner.batches_without_signal = 49
    with pytest.raises(RewardError, match="no group with a reward spread"):
        module.update(exp, has_signal=False)


def test_a_non_finite_gradient_skips_the_step_and_is_counted(make_config, sft_start):
    module = online_module(make_config, sft_start, "algorithm=grpo")
    params = list(module.policy.parameters())
    for p in params:
        p.grad = torch.ones_like(p)
    params[0].grad[0, 0] = float("nan")

    class Recorder:
        stepped = zeroed = False

        def step(self):
            self.stepped = True

        def zero_grad(self):
            self.zeroed = True

    optimizer = Recorder()
    module.learner.steppers.optimizers = lambda: [optimizer]
    norm = module.learner.optimiser_step(0, params, max_norm=1.0)
    assert math.isnan(norm) and not optimizer.stepped and optimizer.zeroed
    assert module.learner.nonfinite_steps == 1


def test_offpolicy_mask_compares_sampler_and_trainer_over_the_same_support():
    """V3.2's off-policy mask with keep_sampling_mask: the trainer's log-probs are renormalised
    over the kept support, so the sampler's must be too (support_logprobs), not full-vocabulary."""
    B, T = 2, 3
    mask = torch.ones(B, T)
    trainer_logp = torch.full((B, T), -0.1)
    exp = Experience(prompt_ids=torch.zeros(B, 1, dtype=torch.long), prompt_mask=torch.ones(B, 1),
                     response_ids=torch.zeros(B, T, dtype=torch.long), response_mask=mask,
                     rollout_logprobs=torch.full((B, T), -3.0),    # full vocabulary: far lower
                     support_logprobs=torch.full((B, T), -0.1),    # over the support: the same
                     truncated=torch.zeros(B, dtype=torch.bool), scores=torch.zeros(B), correct=torch.zeros(B),
                     group_index=torch.tensor([0, 0]), advantages=-torch.ones(B, T))
    term = PolicyTerm("ppo_clip", {}, offpolicy_mask_delta=0.5)
    mb = MicroBatch(exp=exp, mask=mask, logp=trainer_logp.requires_grad_(), old_logp=trainer_logp.detach(),
                    entropy=None, values=None, aggregation={"agg_mode": "token-mean"})
    _, stats = term(mb)
    assert float(stats["offpolicy_masked_frac"]) == 0.0  # like with like: nothing is off-policy
    exp.support_logprobs = None                           # without a support: the full-vocabulary ones
    exp.rollout_logprobs = torch.full((B, T), -0.1)
    _, stats = term(mb)
    assert float(stats["offpolicy_masked_frac"]) == 0.0


def test_gae_and_a_critic_go_together(make_config, sft_start):
    with pytest.raises(ConfigError, match="critic"):
        online_module(make_config, sft_start, "algorithm=grpo", "advantage=gae")
    with pytest.raises(ConfigError, match="critic"):
        online_module(make_config, sft_start, "algorithm=ppo", "advantage=group_norm")


def test_ppo_critic_has_its_own_optimiser_and_trains_in_warm_up(make_config, sft_start):
    module = online_module(make_config, sft_start, "algorithm=ppo", "algorithm.critic.warmup_batches=1")
    assert module.critic.lm is not module.policy  # its own backbone by default
    critic_params = {id(p) for p in module.critic.trainable_parameters()}
    assert not critic_params & {id(p) for p in module.policy.parameters()}
    exp, _, _ = module.collect(step=0)
    exp, metrics = module.compute_advantages(module.annotate(exp.without_trailing_padding()))
    assert "critic/explained_var" in metrics and exp.returns is not None
    # returns of 1 on every response token: a briefly trained start may answer every prompt wrong,
    # and zero returns against the zero-initialised value head would leave nothing to learn
    exp = replace(exp, returns=exp.response_mask.float())
    module.policy.zero_grad()
    stats = module.learner.accumulate_gradients(exp, train_policy=False)  # warm-up: the value loss only
    assert "critic/value_loss" in stats and "policy/loss" not in stats
    assert all(p.grad is None or not p.grad.any() for p in module.policy.parameters())
    assert any(p.grad is not None and p.grad.any() for p in module.critic.trainable_parameters())
    shared = online_module(make_config, sft_start, "algorithm=ppo", "roles.critic.shared_backbone=true")
    assert shared.critic.lm is shared.policy and shared.scorers[-1][0] == "values"


def test_a_role_is_built_by_one_loader_and_its_errors_name_the_role(make_config, sft_start):
    from posttrain.errors import CheckpointError

    module = online_module(make_config, sft_start, "algorithm=grpo")
    assert not any(p.requires_grad for p in module.reference.parameters())  # frozen
    for mine, ref in zip(module.policy.parameters(), module.reference.parameters()):
        assert torch.equal(mine, ref)  # init_from=policy: the policy's starting weights
    with pytest.raises(CheckpointError, match="roles.reference.init_from"):
        online_module(make_config, sft_start, "algorithm=grpo", "roles.reference.init_from=/no/such/dir")
    module = online_module(make_config, sft_start, "algorithm=grpo", f"roles.reference.init_from={sft_start}")
    assert module.reference is not None


def random_online_module(make_config, *overrides):
    """A GRPO module on a small random policy (no warm start): for the update's own mechanics."""
    return module_from_config(make_config(*FAST_RUN, *EASY_TASK, "model.hidden_size=32", "model.num_layers=2",
                                          "model.num_heads=2", "model.num_kv_heads=2", "model.intermediate_size=64",
                                          "algorithm=grpo", "algorithm.warm_start.steps=0",
                                          "algorithm.prompts_per_step=5", "algorithm.group_size=2", *overrides))


def scored_batch(module) -> Experience:
    exp, _, _ = module.collect(step=0)
    exp, _ = module.compute_advantages(module.annotate(exp.without_trailing_padding()))
    # advantages of both signs: a random policy's rewards may all agree, which would leave no gradient
    exp.advantages = torch.randn(len(exp), 1, generator=torch.Generator().manual_seed(0)) * exp.response_mask
    return exp


@pytest.mark.parametrize("rows", [10, 3])
def test_a_rollout_batch_takes_ppo_epochs_times_num_minibatches_steps_whatever_its_size(rows, make_config):
    """Dynamic sampling leaves a rank any number of rows; every rank must take the configured
    optimiser steps (each all-reduces under ddp), in minibatches of near-equal sizes."""
    module = random_online_module(make_config, "algorithm.ppo_epochs=2", "algorithm.num_minibatches=4")
    exp = scored_batch(module).select(torch.arange(rows))
    sizes = []
    module.learner.minibatch_step = lambda minibatch, train_policy, stand_in=None: sizes.append(len(minibatch)) or {}
    module.update(exp)
    assert len(sizes) == 2 * 4
    for epoch in (sizes[:4], sizes[4:]):
        assert sum(epoch) == rows and max(epoch) - min(epoch) <= 1


def test_stand_in_micro_batches_add_nothing_to_the_gradient(make_config, monkeypatch):
    """A rank with fewer micro-batches than another runs stand-ins to match its collectives (every
    forward and backward under FSDP): weighted 0, they leave its gradient and stats exactly as
    they were; in a minibatch it has no rows of, their backward still reaches every parameter."""
    import posttrain.algorithms.online.learner as online

    module = random_online_module(make_config, "algorithm.micro_batch_size=3")
    exp = scored_batch(module)
    params = [p for p in module.policy.parameters() if p.requires_grad]

    def gradients(minibatch, **kwargs):
        module.policy.zero_grad(set_to_none=True)
        stats = module.learner.accumulate_gradients(minibatch, **kwargs)
        return stats, [p.grad for p in params]

    stats, alone = gradients(exp)
    assert any(g.any() for g in alone)
    monkeypatch.setattr(online, "all_reduce_max", lambda count: count + 2)  # another rank: 2 micro-batches more
    padded_stats, padded = gradients(exp)
    assert padded_stats == stats
    for g, h in zip(alone, padded):
        torch.testing.assert_close(h, g, rtol=0, atol=0)
    _, empty = gradients(exp.select(torch.zeros(0, dtype=torch.long)), stand_in=exp.select(torch.tensor([0])))
    assert all(g is not None and not g.any() for g in empty)


def test_under_bf16_mixed_an_online_step_clips_with_the_fused_adamw(make_config, sft_start, monkeypatch):
    """Lightning's own clip refuses a fused AdamW under any mixed precision: the GPU preset
    (trainer=default, bf16-mixed) stopped at its first step. bf16 has no loss scaler, so the
    step clips the true gradients itself, by the norm it logs."""
    from conftest import rl_config

    from posttrain.train import run

    # an entropy bonus: a gradient also where every group's rewards are equal
    cfg = rl_config(make_config, sft_start, "algorithm=grpo", "trainer.precision=bf16-mixed",
                    "algorithm.max_grad_norm=1e-4", "algorithm.entropy_coef=0.01")
    clip, norms = torch.nn.utils.clip_grads_with_norm_, []

    def recording(parameters, max_norm, total_norm, *args, **kwargs):
        parameters = list(parameters)
        clip(parameters, max_norm, total_norm, *args, **kwargs)
        norms.append((float(total_norm), float(torch.nn.utils.get_total_norm([p.grad for p in parameters]))))

    monkeypatch.setattr(torch.nn.utils, "clip_grads_with_norm_", recording)
    summary = run(cfg)
    assert summary["global_step"] == 2 and len(norms) == 2
    for before, after in norms:
        assert before > 1e-4 and after == pytest.approx(1e-4, rel=1e-3)


def test_no_gradient_is_held_through_a_rollout(make_config, sft_start, monkeypatch):
    """Gradients live only within a minibatch step: kept until the next one, a policy-sized
    buffer (4 bytes a parameter in fp32) would sit through every rollout and raise its peak."""
    from conftest import rl_config

    from posttrain.algorithms.online import OnlineRLModule
    from posttrain.train import run

    generate, held = OnlineRLModule.generate, []

    def recording(self, *args, **kwargs):
        held.append(sum(p.grad is not None for p in self.policy.parameters()))
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(OnlineRLModule, "generate", recording)
    summary = run(rl_config(make_config, sft_start, "algorithm=grpo", "trainer.max_steps=3",
                            "algorithm.entropy_coef=0.01"))  # a gradient even where every group agrees
    assert summary["global_step"] == 3
    assert len(held) >= 3 and held == [0] * len(held)
