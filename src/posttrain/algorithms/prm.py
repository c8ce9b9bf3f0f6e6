"""Process reward model (algorithm=prm): a score PRM(x, y<=k) for every step k of a response.

The model is the policy's causal-LM body under a one-label linear head read at every token:
Hugging Face's ``<Arch>ForTokenClassification`` with ``num_labels=1``, built from the starting
policy (the SFT warm start) and trained whole. A row is laid out by `data.process.prm_row` (the
prompt, each step's tokens, EOS when the response ended), and step k's logit is read at its last
token, so ``hf_model/`` scores through `posttrain reward=prm prm=learned prm.path=...` exactly
as it trained. Loss: binary cross-entropy with logits at each step's end against the step's
label (data/process.py: the step verifier's, or Math-Shepherd's Monte-Carlo estimate; soft
labels allowed), averaged over the steps of the global batch.

Held-out evaluation is on the validation responses against the step verifier's labels, not
generation: eval/step_accuracy (sigmoid >= 0.5 agrees with the label, every step),
eval/first_error_accuracy (the first step scored below 0.5 is the first wrong step, or none
of either), eval/outcome_accuracy (the last step), eval/loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AutoModelForTokenClassification

from posttrain.algorithms.base import OfflineModule
from posttrain.algorithms.reward_model import one_label_head_on
from posttrain.data.process import LABEL_SOURCES, collate_step_rows
from posttrain.distributed.collectives import all_reduce_sum, rank_and_world
from posttrain.errors import ConfigError


def token_classifier(causal_lm, tokenizer):
    """``<Arch>ForTokenClassification`` (num_labels=1, pad_token_id set) holding the body of
    ``causal_lm``; its ``score`` head starts as Hugging Face initialises it (small normal)."""
    return one_label_head_on(causal_lm, tokenizer, AutoModelForTokenClassification, "algorithm=prm")


def first_below(scores: torch.Tensor, valid: torch.Tensor, threshold: float) -> torch.Tensor:
    """[B] index of each row's first valid step with score < threshold; K (one past the last
    column) where there is none."""
    below = (scores < threshold) & valid
    index = torch.arange(scores.shape[1], device=scores.device).expand_as(scores)
    return torch.where(below, index, scores.shape[1]).amin(dim=1)


class PRMModule(OfflineModule):
    train_collate = staticmethod(collate_step_rows)
    eval_collate = staticmethod(collate_step_rows)
    eval_on_pairs = True  # the datamodule's held-out batches are the validation step rows, not prompts

    def __init__(self, policy, tokenizer, source, optim, rollout, eval_max_new_tokens, batch_size,
                 max_grad_norm=1.0, labels="verifier", process_data=None):
        # `labels` and `process_data` make the rows (train.py hands them to data/process.py); the
        # module keeps them only to refuse a label source no row was made with
        if labels not in LABEL_SOURCES:
            raise ConfigError(f"algorithm.labels={labels!r} is not one of {list(LABEL_SOURCES)}")
        super().__init__(token_classifier(policy, tokenizer), tokenizer, source, optim, rollout,
                         eval_max_new_tokens, max_grad_norm)
        self.batch_size, self.labels = batch_size, labels

    def step_logits(self, batch: dict) -> torch.Tensor:
        """[B, K] the logit at each step's last token (anything past a row's steps)."""
        logits = self.policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return logits[..., 0].float().gather(1, batch["step_ends"])

    def training_step(self, batch, batch_idx):
        logits, valid, labels = self.step_logits(batch), batch["step_mask"], batch["labels"]
        loss_sum = F.binary_cross_entropy_with_logits(logits[valid], labels[valid], reduction="sum")
        agree = ((logits[valid] >= 0) == (labels[valid] >= 0.5)).sum()
        # The mean over every rank's steps: each rank divides its sum by the global count and
        # scales by the world size, so the ranks' averaged gradients are those of one global mean.
        sums = all_reduce_sum(torch.stack([loss_sum.detach(), agree.float(), valid.sum().float()]))
        steps = sums[2].clamp(min=1.0)
        self.train_batches_seen += 1
        self.log("train/loss", sums[0] / steps, prog_bar=True)
        self.log("train/step_accuracy", sums[1] / steps)
        return loss_sum * rank_and_world()[1] / steps

    # --- held-out evaluation: against the step verifier's labels ------------------------------
    def on_validation_epoch_start(self) -> None:
        # steps, right steps, loss sum, responses, right first errors, right outcomes: summed over ranks
        self._eval_sums = torch.zeros(6, dtype=torch.float64, device=self.device)

    def validation_step(self, batch, batch_idx):
        # the forward runs on every row (a collective under FSDP); the stand-ins that even out the
        # ranks' shares (datamodule.val_dataloader) count for nothing
        logits, steps, truth, counted = self.step_logits(batch), batch["step_mask"], batch["verifier"], batch["counted"]
        valid = steps & counted[:, None]
        scores = torch.sigmoid(logits)
        right = ((scores >= 0.5) == (truth >= 0.5)) & valid
        loss_sum = F.binary_cross_entropy_with_logits(logits[valid], truth[valid], reduction="sum")
        first_error = (first_below(scores, steps, 0.5) == first_below(truth, steps, 0.5)) & counted
        last = steps.sum(dim=1, keepdim=True) - 1
        outcome = ((scores.gather(1, last) >= 0.5) == (truth.gather(1, last) >= 0.5)).squeeze(1) & counted
        counts = [valid.sum(), right.sum(), loss_sum, counted.sum(), first_error.sum(), outcome.sum()]
        self._eval_sums += torch.stack([count.double() for count in counts])

    def on_validation_epoch_end(self):
        steps, right, loss, rows, first_error, outcome = all_reduce_sum(self._eval_sums).tolist()
        if rows == 0:
            return
        self.log_dict({"eval/step_accuracy": right / steps, "eval/loss": loss / steps,
                       "eval/first_error_accuracy": first_error / rows, "eval/outcome_accuracy": outcome / rows})
        self.evaluated_at_step = self.trainer.global_step
