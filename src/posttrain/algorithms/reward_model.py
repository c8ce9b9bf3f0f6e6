"""Bradley–Terry reward model: a scalar score per (prompt, response), trained on preference pairs.

The model is the policy's causal-LM body under a linear head named ``score`` that reads the
hidden state of the last non-padding token: Hugging Face's ``<Arch>ForSequenceClassification``
with ``num_labels=1``, built from the starting policy (the SFT warm start) and trained whole.
Training and held-out scoring go through that class's own forward, so ``hf_model/`` (its
``save_pretrained``) loads with ``AutoModelForSequenceClassification`` and scores exactly as
the module did. Loss: ``core.preference.bradley_terry_loss`` (margin, reward centering).
Held-out evaluation is pair accuracy on the validation pairs (``eval/pair_accuracy``), not
generation.

Several heads (``algorithm.heads: [correct, concise]``, one objective each): the classifier has
one label per head (``num_labels`` = the number of heads), all read at the same last token of
the shared body; its config names them (``reward_heads``, and ``id2label`` for Hugging Face),
so the scorer (rewards/reward_model.py) knows them. Each pair names the head it trains
(``PreferencePair.head``) and its Bradley–Terry loss is taken on that head's scores alone; the
loss is the mean over the batch's pairs, as with one head. The default, one head named
``reward``, is the reward model of before heads had names (checkpoints and exports unchanged).
"""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForSequenceClassification

from posttrain.algorithms.base import OfflineModule
from posttrain.algorithms.preference import pair_sums
from posttrain.core.preference import bradley_terry_loss
from posttrain.data.preference import DEFAULT_HEADS, collate_pairs
from posttrain.distributed.collectives import all_reduce_sum
from posttrain.errors import ConfigError, DataError
from posttrain.models.loading import disable_dropout
from posttrain.models.lora import has_adapter


def sequence_classifier(causal_lm, tokenizer, heads=DEFAULT_HEADS):
    """``<Arch>ForSequenceClassification`` (a label per head, pad_token_id set) holding the body of
    ``causal_lm``; its ``score`` head starts as Hugging Face initialises it (small normal). Its
    config names the heads: ``reward_heads`` (what the scorer reads) and ``id2label``."""
    return one_label_head_on(causal_lm, tokenizer, AutoModelForSequenceClassification, "algorithm=reward_model",
                             labels=list(heads))


def one_label_head_on(causal_lm, tokenizer, auto_class, algorithm: str, labels: list[str] | None = None):
    """A model of `auto_class` (a Hugging Face AutoModelFor...Classification) with one label (or,
    given `labels`, one per name: a reward model's heads), the pad token id set (the rows are
    right-padded; a sequence classifier finds each row's last token by it) and the body of
    ``causal_lm``, without dropout; `algorithm` trains it whole."""
    if has_adapter(causal_lm):
        raise ConfigError(f"{algorithm} trains every weight of its backbone and a new head; set model.lora.r=null")
    config = copy.deepcopy(causal_lm.config)
    config.num_labels = 1
    if labels is not None:
        config.num_labels = len(labels)
        config.id2label, config.label2id = dict(enumerate(labels)), {name: i for i, name in enumerate(labels)}
        config.reward_heads = list(labels)
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
                 max_grad_norm=1.0, margin=0.0, center_coef=0.0, heads=DEFAULT_HEADS, roles=None):
        # `roles` (train.py hands every preference module the role settings, for DPO's
        # reference): a reward model has no other role
        heads = list(heads)
        if not heads or len(set(heads)) != len(heads):
            raise ConfigError(f"algorithm.heads={heads} must name at least one head, each once")
        super().__init__(sequence_classifier(policy, tokenizer, heads), tokenizer, source, optim, rollout,
                         eval_max_new_tokens, max_grad_norm)
        self.batch_size, self.margin, self.center_coef = batch_size, margin, center_coef
        self.heads = heads

    def pair_heads(self, pairs) -> torch.Tensor:
        """[B] the index of the head each pair trains: its named head, or the only one."""
        if len(self.heads) == 1:
            return torch.zeros(len(pairs), dtype=torch.long)
        try:
            return torch.tensor([self.heads.index(pair.head) for pair in pairs], dtype=torch.long)
        except ValueError:
            named = sorted({str(pair.head) for pair in pairs if pair.head not in self.heads})
            raise DataError(f"preference pairs name heads {named}, not among algorithm.heads={self.heads}") from None

    def pair_scores(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen scores [B], rejected scores [B]) from one forward over both sides, each pair's
        read off the head it trains."""
        input_ids, attention_mask = pair_rows(batch, self.tokenizer.pad_token_id)
        logits = self.policy(input_ids=input_ids, attention_mask=attention_mask).logits.float()  # [2B, heads]
        heads = self.pair_heads(batch["pairs"]).to(logits.device).repeat(2)
        return logits.gather(1, heads[:, None]).squeeze(1).chunk(2)

    def head_sums(self, chosen, rejected, heads) -> torch.Tensor:
        """[heads, 4] per head: pairs, pairs ranked right, chosen sum, rejected sum (summed over ranks later)."""
        one_hot = torch.nn.functional.one_hot(heads.to(chosen.device), len(self.heads)).double()  # [B, heads]
        per_pair = torch.stack([torch.ones_like(chosen), (chosen > rejected).to(chosen), chosen, rejected], 1).double()
        return one_hot.T @ per_pair

    def training_step(self, batch, batch_idx):
        chosen, rejected = self.pair_scores(batch)
        out = bradley_terry_loss(chosen, rejected, margin=self.margin or None, center_coef=self.center_coef)
        self.train_batches_seen += 1
        # the global batch's means (every rank's pairs), as one process would log them
        sums = all_reduce_sum(pair_sums(out, len(chosen)))
        loss, *stats = (sums[:-1] / sums[-1].clamp(min=1.0)).unbind()
        self.log("train/loss", loss, prog_bar=True)
        self.log_dict({f"rewards/{name}": value for name, value in zip(("chosen", "rejected", "margin", "accuracy"), stats)})
        if len(self.heads) > 1:  # every rank has the same heads: the same collective
            heads = self.pair_heads(batch["pairs"])
            per_head = all_reduce_sum(self.head_sums(chosen.detach(), rejected.detach(), heads)).tolist()
            self.log_dict({f"rewards/heads/{head}/accuracy": right / pairs
                           for head, (pairs, right, _, _) in zip(self.heads, per_head) if pairs})
        return out.loss

    # --- held-out evaluation: pair accuracy on the validation pairs ------------------------------
    def on_validation_epoch_start(self) -> None:
        self._eval_sums = torch.zeros(len(self.heads), 4, dtype=torch.float64, device=self.device)

    def validation_step(self, batch, batch_idx):
        chosen, rejected = self.pair_scores(batch)  # every pair: the forward is a collective under FSDP
        # the stand-ins that even out the ranks' shares (datamodule.val_dataloader) count for nothing
        counted = batch["counted"]
        heads = self.pair_heads(batch["pairs"])[counted.cpu()]
        self._eval_sums += self.head_sums(chosen[counted], rejected[counted], heads)

    def on_validation_epoch_end(self):
        per_head = all_reduce_sum(self._eval_sums)
        pairs, right, chosen, rejected = per_head.sum(0).tolist()
        if pairs == 0:
            return
        self.log("eval/pair_accuracy", right / pairs, prog_bar=True)
        self.log_dict({"eval/rewards/chosen": chosen / pairs, "eval/rewards/rejected": rejected / pairs,
                       "eval/rewards/margin": (chosen - rejected) / pairs})
        if len(self.heads) > 1:  # each objective's own held-out accuracy
            self.log_dict({f"eval/heads/{head}/pair_accuracy": right / count
                           for head, (count, right, _, _) in zip(self.heads, per_head.tolist()) if count})
        self.evaluated_at_step = self.trainer.global_step
