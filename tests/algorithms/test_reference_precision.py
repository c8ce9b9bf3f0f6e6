"""DPO's reference log-probs are cached before training, outside a training step: they must be
scored under the precision the policy trains in (bf16 autocast under trainer.precision=bf16-mixed,
the GPU preset), or at step 0, where the policy is the reference, the implicit rewards are a
rounding offset instead of 0. On CPU, Lightning's bf16-mixed is torch.autocast("cpu", bfloat16).
And a resume takes the cache from the checkpoint also where the checkpoint is restored after
on_fit_start (trainer=ddp, fsdp)."""

import pytest
import torch

from conftest import restores_after_fit_start
from test_preference_algorithms import fit, make_module

PAIRS = 6


def step_zero_rewards(precision: str, loss: str):
    """(chosen, rejected) implicit rewards [PAIRS] of the first training step: one batch of all
    the pairs, in the order and padding the reference pass scored them in."""
    module = make_module(f"algorithm={loss}", f"algorithm.batch_size={PAIRS}", train_pairs=PAIRS)
    outputs, pair_output = [], module.pair_output

    def recording(model, batch, split, *args, **kwargs):
        out = pair_output(model, batch, split, *args, **kwargs)
        if split == "train":
            outputs.append(out)
        return out

    module.pair_output = recording
    fit(module, steps=1, precision=precision, enable_checkpointing=False)
    return outputs[0].chosen_rewards.float(), outputs[0].rejected_rewards.float()


def test_at_step_zero_under_bf16_mixed_the_policy_is_the_reference_so_the_implicit_rewards_are_zero():
    chosen, rejected = step_zero_rewards("bf16-mixed", "dpo")
    assert chosen.abs().max() == 0 and rejected.abs().max() == 0, (chosen, rejected)


def test_a_resume_restored_after_fit_start_takes_the_reference_from_the_checkpoint(tmp_path):
    first = make_module("algorithm=dpo", "algorithm.batch_size=2")
    fit(first, steps=1, enable_checkpointing=False).save_checkpoint(tmp_path / "step1.ckpt")
    resumed = make_module("algorithm=dpo", "algorithm.batch_size=2")
    fit(resumed, steps=2, ckpt_path=tmp_path / "step1.ckpt", enable_checkpointing=False,
        strategy=restores_after_fit_start())
    assert resumed.reference_forwards == 0  # no pass over the pairs: the checkpoint's cache
    torch.testing.assert_close(resumed.reference_logps["train"], first.reference_logps["train"])


def test_under_bf16_mixed_a_fused_adamw_step_clips_the_gradient_to_max_grad_norm():
    """Lightning's own clip refuses a fused AdamW under any mixed precision; bf16 has no loss
    scaler, so the offline modules clip the true gradients themselves."""
    module = make_module("algorithm=dpo", "algorithm.batch_size=2", "algorithm.max_grad_norm=1e-4")
    clip, norms = module.configure_gradient_clipping, []

    def recording(optimizer, *args, **kwargs):
        clip(optimizer, *args, **kwargs)
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norms.append((module.last_grad_norm, float(torch.nn.utils.get_total_norm(grads))))
        assert all(group.get("fused") for group in optimizer.param_groups)

    module.configure_gradient_clipping = recording
    fit(module, steps=2, precision="bf16-mixed", enable_checkpointing=False)
    assert len(norms) == 2
    for before, after in norms:
        assert before > 1e-4 and after == pytest.approx(1e-4, rel=1e-3)
