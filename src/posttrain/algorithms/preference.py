"""Direct preference optimisation on fixed pairs: DPO, IPO, hinge (SLiC) and SimPO.

One module for the four; `loss` picks the formula from `posttrain.core.preference`:

    batch of pairs -> sequence log-probs of chosen and rejected under the policy
                   -> (DPO / IPO / hinge) the frozen reference's, looked up in a cache
                   -> preference_loss(loss, ...) -> mean over pairs, implicit rewards logged

The reference is the policy's starting weights (the SFT warm start; with LoRA, the base with
the adapter off) unless `roles.reference` names another model. Its log-probs never change,
so they are computed once per dataset, before the first update, for every training and
validation pair, and stored by pair index (`reference_logps`). The cache travels in the
checkpoint: on resume the policy's starting weights are gone, so recomputing would need a
second copy of them. SimPO is reference-free and builds no cache.
"""

from __future__ import annotations

import contextlib
import json

import torch
import torch.nn.functional as F

from posttrain import core
from posttrain.algorithms.base import OfflineModule
from posttrain.data.preference import collate_pairs
from posttrain.distributed.collectives import all_reduce_sum, rank_and_world, rank_share
from posttrain.errors import CheckpointError, ConfigError, DataError
from posttrain.models.lora import has_adapter, reference_is_the_base, reference_model
from posttrain.models.roles import build_role

# Splits whose pairs get reference log-probs: training, and held-out implicit-reward accuracy.
CACHED_SPLITS = ("train", "validation")
REWARD_STATS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracy")


def pair_key(pair) -> tuple:
    """What a pair's token ids are made of: pairs with equal keys have equal log-probs, so the
    cache finds a batch's pairs by content, whatever order the data stream draws them in."""
    messages = None if pair.messages is None else json.dumps(pair.messages, sort_keys=True)
    return pair.prompt, messages, pair.chosen, pair.rejected


def sequence_logps(model, input_ids, attention_mask, labels) -> torch.Tensor:
    """log pi(y | x) [B]: the sum of the response tokens' log-probs (labels -100 elsewhere)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    # position t predicts token t+1; ignored labels give log-prob 0
    return core.logprobs_from_logits(logits, labels[:, 1:]).sum(-1)


def pad_to(x: torch.Tensor, width: int, value: int) -> torch.Tensor:
    return F.pad(x, (0, width - x.shape[1]), value=value)


def pair_sums(out, pairs: int) -> torch.Tensor:
    """Sums over a batch of `pairs` pairs of (loss, chosen reward, rejected reward, margin,
    chosen > rejected, 1): summed over ranks and batches, then divided by the last."""
    c, r = out.chosen_rewards.float(), out.rejected_rewards.float()
    return torch.stack([out.loss.detach().float() * pairs, c.sum(), r.sum(), (c - r).sum(),
                        (c > r).float().sum(), torch.tensor(float(pairs), device=c.device)])


class PreferenceModule(OfflineModule):
    """`loss`: dpo | ipo | hinge | simpo. `beta`: the loss's inverse temperature (IPO's tau);
    `gamma`: SimPO's target margin; `label_smoothing`: cDPO's label noise (dpo, simpo);
    `length_normalize`: DPO (Tulu 3's length-normalised DPO) or IPO on per-token log-ratios,
    each side's divided by its response length (`batch["chosen_len"]`, EOS included). `roles`: the run's role configs, of
    which `roles.reference` says what the reference is."""

    train_collate = staticmethod(collate_pairs)

    def __init__(self, policy, tokenizer, source, optim, rollout, eval_max_new_tokens, batch_size, loss, beta,
                 gamma=0.0, label_smoothing=0.0, length_normalize=False, max_grad_norm=1.0, roles=None):
        super().__init__(policy, tokenizer, source, optim, rollout, eval_max_new_tokens, max_grad_norm)
        self.batch_size = batch_size
        self.loss_name = loss
        self.loss_options = dict(beta=beta, gamma=gamma, label_smoothing=label_smoothing,
                                 length_normalize=length_normalize)
        self.needs_lengths = loss == "simpo" or length_normalize
        self.uses_reference = loss != "simpo"
        self.reference_cfg = roles.reference if roles is not None else None
        self.reference_logps: dict[str, torch.Tensor] = {}  # split -> [N, 2]: (chosen, rejected) by pair index
        self.reference_forwards = 0  # forwards of the reference (tests: the cache is filled once)
        self._pair_index: dict[str, dict[tuple, int]] = {}
        self.check_loss_options()

    def check_loss_options(self) -> None:
        """The core's own checks on a dummy pair, at start-up: an option the loss does not use
        (gamma outside SimPO, label smoothing for IPO / hinge, ...) fails before any forward."""
        one = torch.zeros(1)
        reference = (one, one) if self.uses_reference else (None, None)
        try:
            self.preference_output(one, one, *reference, torch.ones(1), torch.ones(1))
        except ValueError as err:
            raise ConfigError(f"algorithm.loss={self.loss_name!r} with algorithm.beta, gamma, label_smoothing, "
                              f"length_normalize={self.loss_options}: {err}") from None

    def preference_output(self, chosen_logp, rejected_logp, ref_chosen, ref_rejected, chosen_len, rejected_len):
        lengths = dict(chosen_len=chosen_len, rejected_len=rejected_len) if self.needs_lengths else {}
        return core.preference_loss(self.loss_name, chosen_logp, rejected_logp, ref_chosen, ref_rejected,
                                    **self.loss_options, **lengths)

    # --- sequence log-probs ---------------------------------------------------------------------
    def pair_logps(self, model, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(log pi(chosen | x), log pi(rejected | x)) [B] each, from one forward over both sides."""
        width = max(batch["chosen_input_ids"].shape[1], batch["rejected_input_ids"].shape[1])
        both = {name: torch.cat([pad_to(batch[f"chosen_{name}"], width, fill),
                                 pad_to(batch[f"rejected_{name}"], width, fill)])
                for name, fill in (("input_ids", self.tokenizer.pad_token_id), ("attention_mask", 0),
                                   ("labels", -100))}
        logps = sequence_logps(model, both["input_ids"], both["attention_mask"], both["labels"])
        return logps.chunk(2)

    def on_device(self, batch: dict) -> dict:
        return {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}

    # --- the reference cache --------------------------------------------------------------------
    @contextlib.contextmanager
    def reference(self):
        """The model whose forward gives log pi_ref: a LoRA policy's base (adapter off), the
        policy itself before its first update, or the role `roles.reference` describes."""
        cfg = self.reference_cfg
        starts_as_policy = cfg is None or (cfg.get("init_from") == "policy" and not cfg.get("name_or_path")
                                           and not cfg.get("dtype"))
        if has_adapter(self.policy) and (cfg is None or reference_is_the_base(self.policy, cfg)):
            with reference_model(self.policy, None) as model:
                yield model
        elif starts_as_policy:
            # past the first update the policy's starting weights have been trained away
            if self._trainer is not None and self.trainer.global_step > 0:
                raise CheckpointError("the reference log-probs are missing after training began (a checkpoint "
                                      "written without 'reference_logps'?), and the reference is the policy's "
                                      "starting weights, which only the start of a run has; start a new run")
            yield self.policy
        else:
            yield build_role("reference", cfg, self.policy).to(self.device)

    def ensure_reference_logps(self) -> None:
        """Fill the cache, once: every training and validation pair, by pair index. Each rank
        scores its share of the pairs and the shares are summed, so every rank holds all."""
        if not self.uses_reference or self.reference_logps:
            return
        # under the training forwards' precision (bf16 autocast with bf16-mixed): at step 0,
        # where the policy is the reference, the implicit rewards are then 0, not a rounding offset
        with torch.no_grad(), self.training_precision(), self.reference() as model:
            for split in CACHED_SPLITS:
                pairs = self.source.pairs(split)
                logps = torch.zeros(len(pairs), 2, device=self.device)
                for rows, counted, batch in self.rank_batches(pairs):
                    both = torch.stack(self.pair_logps(model, batch), dim=1).float()
                    logps[rows[counted]] = both[counted]  # none of the stand-ins
                    self.reference_forwards += 1
                self.reference_logps[split] = all_reduce_sum(logps)

    def rank_batches(self, pairs):
        """(pair indices [b], counted flags [b], collated batch) of this rank's share of `pairs`
        (collectives.rank_share: pairs r, r+W, r+2W, ...), in batches of `batch_size`. A sharded
        (FSDP2) model's forward gathers its weights with every rank, so every rank runs the same
        number of forwards: a shorter share ends with a stand-in pair, which counts for nothing."""
        indices, counted = rank_share(len(pairs))
        for start in range(0, len(indices), self.batch_size):
            rows = indices[start:start + self.batch_size]
            yield (torch.tensor(rows, device=self.device),
                   torch.tensor(counted[start:start + self.batch_size], device=self.device),
                   self.on_device(collate_pairs([pairs[i] for i in rows], self.tokenizer)))

    def cached_reference(self, split: str, pairs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(log pi_ref(chosen), log pi_ref(rejected)) [B] of `pairs` from the cache; (None, None) for SimPO."""
        if not self.uses_reference:
            return None, None
        if split not in self._pair_index:
            self._pair_index[split] = {pair_key(p): i for i, p in enumerate(self.source.pairs(split))}
        index = self._pair_index[split]
        missing = [p.prompt for p in pairs if pair_key(p) not in index]
        if missing:
            raise DataError(f"a batch holds pairs that are not among the {split} pairs the reference log-probs were "
                            f"computed for (prompt {missing[0]!r})")
        rows = self.reference_logps[split][[index[pair_key(p)] for p in pairs]]
        return rows[:, 0], rows[:, 1]

    def on_train_start(self) -> None:
        # not on_fit_start: under trainer=ddp and fsdp Lightning restores a checkpoint after
        # on_fit_start, and a resumed run takes its cache from the checkpoint
        self.ensure_reference_logps()

    # --- training ---------------------------------------------------------------------------------
    def pair_output(self, model, batch, split: str, counted: torch.Tensor | None = None):
        """The preference loss's output on the batch's pairs, or on those `counted` ([B] bool) of
        them: the forward runs on every pair (under FSDP it is a collective), stand-ins too."""
        chosen, rejected = self.pair_logps(model, batch)
        pairs, chosen_len, rejected_len = batch["pairs"], batch["chosen_len"], batch["rejected_len"]
        if counted is not None:
            chosen, rejected, chosen_len, rejected_len = (x[counted] for x in (chosen, rejected, chosen_len, rejected_len))
            pairs = [pair for pair, keep in zip(pairs, counted.tolist()) if keep]
        ref_chosen, ref_rejected = self.cached_reference(split, pairs)
        return self.preference_output(chosen, rejected, ref_chosen, ref_rejected, chosen_len, rejected_len)

    def training_step(self, batch, batch_idx):
        out = self.pair_output(self.policy, batch, "train")
        pairs = len(batch["pairs"])
        # The mean over the pairs of every rank's batch: each rank weights its mean by its share
        # of the global count and scales by the world size, so the ranks' averaged gradients
        # (on_before_optimizer_step; FSDP2's reduce-scatter) are those of one global pair mean.
        sums = all_reduce_sum(pair_sums(out, pairs))
        global_pairs = sums[-1].clamp(min=1.0)
        self.train_batches_seen += 1
        self.log_means(sums, "train/loss", "")
        return out.loss * pairs * rank_and_world()[1] / global_pairs

    def log_means(self, sums: torch.Tensor, loss_name: str, prefix: str) -> None:
        means = sums[:-1] / sums[-1].clamp(min=1.0)
        self.log(loss_name, means[0], prog_bar=True)
        self.log_dict({f"{prefix}{name}": means[1 + i] for i, name in enumerate(REWARD_STATS)})

    # --- held-out pairs ------------------------------------------------------------------------------
    def on_validation_epoch_start(self) -> None:
        super().on_validation_epoch_start()
        self.ensure_reference_logps()  # eval.at_start runs before fit: the policy is still the reference

    def on_validation_epoch_end(self) -> None:
        self.log_held_out_pairs()
        super().on_validation_epoch_end()

    @torch.no_grad()
    def log_held_out_pairs(self) -> None:
        """The loss and implicit rewards on the validation pairs (this rank's share of them):
        `eval/loss`, `eval/rewards/{chosen,rejected,margins,accuracy}`."""
        pairs = self.source.pairs("validation")
        if not pairs:
            return
        sums = torch.zeros(6, device=self.device)
        for _, counted, batch in self.rank_batches(pairs):
            if not counted.any():  # stand-ins only: the forward (a collective under FSDP), nothing counted
                self.pair_logps(self.policy, batch)
                continue
            sums += pair_sums(self.pair_output(self.policy, batch, "validation", counted), int(counted.sum()))
        self.log_means(all_reduce_sum(sums), "eval/loss", "eval/")  # every rank's pairs

    # --- checkpoints ----------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["reference_logps"] = {split: logps.cpu() for split, logps in self.reference_logps.items()}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        stored = checkpoint.get("reference_logps", {})
        for split, logps in stored.items():
            if logps.shape[0] != len(self.source.pairs(split)):
                raise CheckpointError(f"the checkpoint's reference log-probs cover {logps.shape[0]} {split} pairs, "
                                      f"but this run has {len(self.source.pairs(split))}: the pairs changed "
                                      f"(preference.* settings); resume with the settings the run started with")
        self.reference_logps = {split: logps.to(self.device) for split, logps in stored.items()}
