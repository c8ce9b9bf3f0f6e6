"""PPO's critic warm-up with a value head on the policy's own backbone
(roles.critic.shared_backbone=true): the warm-up batches train the head, and only the head."""

import copy

import lightning as L
import torch
from torch.utils.data import DataLoader

from posttrain.data.datamodule import StepTickets

from conftest import EASY_TASK, FAST_RUN, module_from_config

# the tiny model as initialised (no SFT start: what it answers does not matter here)
SHARED_CRITIC_WARMUP = ("algorithm=ppo", "roles.critic.shared_backbone=true", "algorithm.critic.warmup_batches=1",
                        "algorithm.prompts_per_step=4", "algorithm.group_size=2", "rollout.max_new_tokens=8")


def test_a_shared_value_head_trains_in_warm_up_and_the_policy_does_not(make_config):
    module = module_from_config(make_config(*FAST_RUN, *EASY_TASK, *SHARED_CRITIC_WARMUP))
    assert module.critic.lm is module.policy
    # values away from any return (the zero-initialised head would predict returns of 0 exactly
    # when every sample is wrong, and leave the value loss nothing to learn)
    with torch.no_grad():
        module.critic.head.bias.fill_(5.0)
    head = copy.deepcopy(module.critic.head.state_dict())
    policy = copy.deepcopy(module.policy.state_dict())
    trainer = L.Trainer(max_epochs=1, limit_train_batches=1, limit_val_batches=0, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        accelerator="cpu")
    trainer.fit(module, train_dataloaders=DataLoader(StepTickets(), batch_size=None))  # one rollout batch: warm-up

    assert module.train_batches_seen == 1 and trainer.global_step == 0  # no policy optimiser step
    assert all(torch.equal(module.policy.state_dict()[k], v) for k, v in policy.items())
    assert not torch.equal(module.critic.head.bias, head["bias"])  # the value head learned
    # the head is stepped by the critic's optimiser (critic.optim, critic.max_grad_norm), not the policy's
    policy_optimiser, critic_optimiser = trainer.optimizers
    head_params = {id(p) for p in module.critic.head.parameters()}
    assert not head_params & {id(p) for group in policy_optimiser.param_groups for p in group["params"]}
    assert head_params == {id(p) for group in critic_optimiser.param_groups for p in group["params"]}
