"""Bradley–Terry reward model: a scalar score per (prompt, response), trained on preference pairs.

The model is the policy's causal-LM body under a linear head named ``score`` that reads the
hidden state of the last non-padding token: Hugging Face's ``<Arch>ForSequenceClassification``
with ``num_labels=1``, built from the starting policy (the SFT warm start) and trained whole.
Training and held-out scoring go through that class's own forward, so ``hf_model/`` (its
``save_pretrained``) loads with ``AutoModelForSequenceClassification`` and scores exactly as
the module did. Loss: ``core.preference.bradley_terry_loss`` (margin, reward centering).
Held-out evaluation is pair accuracy on the validation pairs (``eval/pair_accuracy``), not
generation.
"""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForSequenceClassification

from posttrain.algorithms.base import OfflineModule
from posttrain.algorithms.preference import pair_sums
from posttrain.core.preference import bradley_terry_loss
from posttrain.data.preference import collate_pairs
from posttrain.distributed.collectives import all_reduce_sum
from posttrain.errors import ConfigError
from posttrain.models.loading import disable_dropout
from posttrain.models.lora import has_adapter


def sequence_classifier(causal_lm, tokenizer):
    """``<Arch>ForSequenceClassification`` (num_labels=1, pad_token_id set) holding the body of
    ``causal_lm``; its ``score`` head starts as Hugging Face initialises it (small normal)."""
    return one_label_head_on(causal_lm, tokenizer, AutoModelForSequenceClassification, "algorithm=reward_model")


def one_label_head_on(causal_lm, tokenizer, auto_class, algorithm: str):
    """A model of `auto_class` (a Hugging Face AutoModelFor...Classification) with one label,
    the pad token id set (the rows are right-padded; a sequence classifier finds each row's last
    token by it) and the body of ``causal_lm``, without dropout; `algorithm` trains it whole."""
    if has_adapter(causal_lm):
        raise ConfigError(f"{algorithm} trains every weight of its backbone and a new head; set model.lora.r=null")
    config = copy.deepcopy(causal_lm.config)
    config.num_labels = 1
    config.pad_token_id = tokenizer.pad_token_id
    dtype = next(causal_lm.parameters()).dtype
    model = auto_class.from_config(config, dtype=dtype)
    model.base_model.load_state_dict(causal_lm.base_model.state_dict())
    return disable_dropout(model)


def pair_rows(batch: dict, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The chosen rows then the rejected rows of a `collate_pairs` batch, right-padded to one
    width: (input_ids [2B, T], attention_mask [2B, T])."""
    width = max(batch["chosen_input_ids"].shape[1], batch["rejected_input_ids"].shape[1])

    def widen(tensor, fill):
        return torch.nn.functional.pad(tensor, (0, width - tensor.shape[1]), value=fill)

    ids = [widen(batch[f"{side}_input_ids"], pad_token_id) for side in ("chosen", "rejected")]
    masks = [widen(batch[f"{side}_attention_mask"], 0) for side in ("chosen", "rejected")]
    return torch.cat(ids), torch.cat(masks)


class RewardModelModule(OfflineModule):
    train_collate = staticmethod(collate_pairs)
    eval_collate = staticmethod(collate_pairs)
    eval_on_pairs = True  # the datamodule's held-out batches are validation pairs, not prompts

    def __init__(self, policy, tokenizer, source, optim, rollout, eval_max_new_tokens, batch_size,
                 max_grad_norm=1.0, margin=0.0, center_coef=0.0, roles=None):
        # `roles` (train.py hands every preference module the role settings, for DPO's
        # reference): a reward model has no other role
        super().__init__(sequence_classifier(policy, tokenizer), tokenizer, source, optim, rollout,
                         eval_max_new_tokens, max_grad_norm)
        self.batch_size, self.margin, self.center_coef = batch_size, margin, center_coef

    def pair_scores(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen scores [B], rejected scores [B]) from one forward over both sides."""
        input_ids, attention_mask = pair_rows(batch, self.tokenizer.pad_token_id)
        scores = self.policy(input_ids=input_ids, attention_mask=attention_mask).logits.squeeze(-1).float()
        return scores.chunk(2)

    def training_step(self, batch, batch_idx):
        chosen, rejected = self.pair_scores(batch)
        out = bradley_terry_loss(chosen, rejected, margin=self.margin or None, center_coef=self.center_coef)
        self.train_batches_seen += 1
        # the global batch's means (every rank's pairs), as one process would log them
        sums = all_reduce_sum(pair_sums(out, len(chosen)))
        loss, *stats = (sums[:-1] / sums[-1].clamp(min=1.0)).unbind()
        self.log("train/loss", loss, prog_bar=True)
        self.log_dict({f"rewards/{name}": value for name, value in zip(("chosen", "rejected", "margin", "accuracy"), stats)})
        return out.loss

    # --- held-out evaluation: pair accuracy on the validation pairs ------------------------------
    def on_validation_epoch_start(self) -> None:
        self._eval_sums = torch.zeros(4, dtype=torch.float64, device=self.device)

    def validation_step(self, batch, batch_idx):
        chosen, rejected = self.pair_scores(batch)  # every pair: the forward is a collective under FSDP
        # the stand-ins that even out the ranks' shares (datamodule.val_dataloader) count for nothing
        chosen, rejected = chosen[batch["counted"]], rejected[batch["counted"]]
        # pairs, ranked right, chosen sum, rejected sum: summed over ranks at the end
        self._eval_sums += torch.stack([torch.ones_like(chosen).sum(), (chosen > rejected).sum(), chosen.sum(),
                                        rejected.sum()]).double()

    def on_validation_epoch_end(self):
        pairs, right, chosen, rejected = all_reduce_sum(self._eval_sums).tolist()
        if pairs == 0:
            return
        self.log("eval/pair_accuracy", right / pairs, prog_bar=True)
        self.log_dict({"eval/rewards/chosen": chosen / pairs, "eval/rewards/rejected": rejected / pairs,
                       "eval/rewards/margin": (chosen - rejected) / pairs})
        self.evaluated_at_step = self.trainer.global_step
