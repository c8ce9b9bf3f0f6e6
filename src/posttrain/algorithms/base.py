"""What every posttrain LightningModule shares: the policy, the optimiser and schedule,
held-out evaluation by greedy generation, and the resumable count of training batches."""

from __future__ import annotations

import math

import lightning as L
import torch

from posttrain.distributed import all_reduce_sum
from posttrain.rollout import SamplingParams, build_rollout


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warm-up to 1, then cosine decay to ``min_lr_ratio`` at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def decode_responses(tokenizer, response_ids: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
    """Response texts without padding and special tokens (EOS)."""
    rows = [ids[mask.bool()].tolist() for ids, mask in zip(response_ids, response_mask)]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)


def generate_and_score(module: "PosttrainModule", batch: dict, params: SamplingParams,
                       generator: torch.Generator | None = None) -> tuple[list[float], list[float]]:
    """One response per prompt row of `batch` (from `collate_prompts`), judged by the task's
    verifier: (1.0 / 0.0 per row, response length in tokens per row). Held-out evaluation and
    `posttrain-eval`'s pass@k both score through here, so their numbers mean the same thing."""
    rollout = module.generate(batch["prompt_ids"], batch["prompt_mask"], params, generator=generator)
    texts = decode_responses(module.tokenizer, rollout.response_ids, rollout.response_mask)
    correct = [float(module.source.is_correct(e, t)) for e, t in zip(batch["examples"], texts)]
    return correct, rollout.response_lengths().float().tolist()


class PosttrainModule(L.LightningModule):
    """Base of all algorithms. Subclasses write `training_step` and call `self.evaluate`."""

    def __init__(self, policy, tokenizer, source, optim, rollout, eval_max_new_tokens: int,
                 max_grad_norm: float | None = 1.0):
        super().__init__()
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm = float("nan")
        self.policy = policy
        self.tokenizer = tokenizer
        self.source = source
        self.optim = optim
        self.rollout_cfg = rollout
        self.engine = build_rollout(rollout.engine)
        self.eval_max_new_tokens = eval_max_new_tokens
        self.train_batches_seen = 0  # restored on resume: the data stream restarts here
        self.evaluated_at_step = -1  # global step of the last held-out evaluation
        self._eval_correct: list[float] = []
        self._eval_lengths: list[float] = []

    def configure_model(self) -> None:
        """Where a parallel strategy shards the model (FSDP2); plain data parallelism needs nothing."""

    # --- optimisation -------------------------------------------------------------------
    def configure_optimizers(self):
        return self.make_optimizer([p for p in self.policy.parameters() if p.requires_grad], self.optim)

    def make_optimizer(self, parameters, optim) -> dict:
        """AdamW with linear warm-up and cosine decay over `trainer.max_steps`, from an `optim`
        node (lr, weight_decay, betas, warmup_steps, min_lr_ratio); one per trainable role."""
        optimizer = torch.optim.AdamW(parameters, lr=optim.lr, weight_decay=optim.weight_decay, betas=tuple(optim.betas))
        total = self.trainer.max_steps if self.trainer.max_steps > 0 else 1
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, optim.warmup_steps, total, optim.min_lr_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Automatic optimisation (SFT): record the gradient norm, then clip at `max_grad_norm`
        through Lightning (precision- and strategy-aware). Online RL steps by hand and clips in
        `OnlineRLModule.optimiser_step`, where a non-finite norm also skips the step."""
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        self.last_grad_norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        if self.max_grad_norm:
            self.clip_gradients(optimizer, gradient_clip_val=self.max_grad_norm, gradient_clip_algorithm="norm")

    # --- resumable data position ------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["train_batches_seen"] = self.train_batches_seen

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.train_batches_seen = checkpoint["train_batches_seen"]

    # --- generation and held-out evaluation ---------------------------------------------------
    def generate(self, prompt_ids, prompt_mask, params: SamplingParams, generator=None):
        return self.engine.generate(
            self.policy, prompt_ids, prompt_mask, params,
            eos_token_id=self.tokenizer.eos_token_id, pad_token_id=self.tokenizer.pad_token_id,
            generator=generator,
        )

    def validation_step(self, batch, batch_idx):
        params = SamplingParams(max_new_tokens=self.eval_max_new_tokens, greedy=True, temperature=0.0)
        correct, lengths = generate_and_score(self, batch, params)
        self._eval_correct += correct
        self._eval_lengths += lengths

    def on_validation_epoch_end(self):
        # each rank scored its own shard of the held-out prompts: reduce sums and counts
        totals = all_reduce_sum(torch.tensor([sum(self._eval_correct), sum(self._eval_lengths),
                                              float(len(self._eval_correct))], dtype=torch.float64, device=self.device))
        if totals[2] == 0:
            return
        accuracy, length = float(totals[0] / totals[2]), float(totals[1] / totals[2])
        self.log_dict({"eval/accuracy": accuracy, "eval/response_len": length}, prog_bar=True)
        self.evaluated_at_step = self.trainer.global_step
        self._eval_correct, self._eval_lengths = [], []
