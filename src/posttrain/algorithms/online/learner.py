"""The update stage of online RL: ppo_epochs x minibatches x micro-batches of one rollout batch,
gradient accumulation with global token counts, and the optimiser steps. No Lightning here:
the module hands the learner what it needs to step (`Steppers`).

Step counters: one rollout batch makes ppo_epochs x num_minibatches policy optimiser steps
(`trainer.max_steps` counts them); none while a part holds the policy back (the critic's
warm-up) or when no rank's batch has a group with a reward spread.

Ranks agree: every rank runs the same number of minibatches and micro-batches (a rank with
fewer rows pads with zero-weighted stand-ins), and every count a loss divides by is summed
over ranks, so the gradient is that of one process on the union of the batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from posttrain import core
from posttrain.algorithms.experience import Experience
from posttrain.algorithms.formulas import AGGREGATION_OPTIONS
from posttrain.core.options import Option, boolean, integer, number, optional
from posttrain.algorithms.online.collect import rank_seed
from posttrain.algorithms.online.micro_batches import plan_micro_batches
from posttrain.algorithms.online.terms import MISMATCH_SUMS, MicroBatch
from posttrain.distributed.collectives import all_reduce_max, all_reduce_sum, average_gradients, rank_and_world
from posttrain.errors import RewardError
from posttrain.models.forward import (lm_head_weights, logprobs_from_hidden, sequence_hidden_states, sequence_logits,
                                      sequence_logprobs)

# Rollout batches in a row without a learning signal (every group flat on every rank) after
# which the run stops: the data or the reward gives the policy nothing to learn from.
MAX_BATCHES_WITHOUT_SIGNAL = 50
# The learner's options (algorithm.<name>), declared once: the start-up check, the module and
# --help read them. The policy loss's own options are its declaration's (core/policy_loss.py).
LEARNER_OPTIONS = (
    Option("prompts_per_step", 16, integer(1), "prompts per rollout batch, per process"),
    Option("group_size", 8, integer(1), "samples per prompt"),
    Option("ppo_epochs", 1, integer(1), "passes over each rollout batch"),
    Option("num_minibatches", 1, integer(1), "optimiser steps per pass"),
    Option("micro_batch_size", None, optional(integer(1)), "null: the whole minibatch at once"),
    Option("micro_batch_tokens", None, optional(integer(1)),
           "null: by rows; else rows sorted by length, each micro-batch's rows x (widest prompt + widest "
           "response) at most this (a longer row alone); with micro_batch_size both caps hold"),
    *AGGREGATION_OPTIONS,  # the policy loss's aggregation (formulas.py)
    Option("mask_truncated", False, boolean(), "overlong filtering: truncated responses leave the loss"),
    Option("entropy_coef", 0.0, number(), "weight of the entropy bonus; 0: logged only"),
    Option("max_grad_norm", 1.0, optional(number(0)), "null or 0: no clipping"),
    Option("offpolicy_mask_delta", None, optional(number(0)), "DeepSeek-V3.2 off-policy sequence mask threshold"),
    Option("keep_sampling_mask", False, boolean(), "DeepSeek-V3.2: log-probs over the sampler's top-k/top-p support"),
)
# Term stats aggregated with the global token/sequence counts: they sum over micro-batches.
GLOBAL_STATS = ("policy/loss", "policy/kl", "policy/entropy", "critic/value_loss", "distill/loss")


@dataclass(frozen=True)
class Scoring:
    """How every log-prob of a response is taken: at the sampling temperature, over the
    sampler's kept top-k/top-p support when `keep_sampling_mask` (DeepSeek-V3.2)."""

    temperature: float
    keep_sampling_mask: bool = False

    def options(self, exp: Experience) -> dict:
        return dict(support_size=exp.support_size if self.keep_sampling_mask else None, temperature=self.temperature)

    def logprobs(self, model, exp: Experience) -> torch.Tensor:
        """log-probs of the response tokens under `model` (a scorer's forward), from its hidden
        states chunk by chunk (no [b, T, V] logits)."""
        return exp.policy_tokens_only(sequence_logprobs(model, *exp.model_inputs(), with_entropy=False,
                                                        **self.options(exp))[0])

    def logprobs_from(self, logits, exp: Experience, with_entropy: bool, entropy_grad: bool = True):
        """Per-token log-probs (and entropy) of full logits [b, T, V], in fp32 chunk by chunk."""
        return core.token_logprobs_and_entropy(logits, exp.response_ids, with_entropy=with_entropy,
                                               entropy_grad=entropy_grad, **self.options(exp))


@dataclass
class Steppers:
    """What the learner steps with, from the module: `backward(loss)` (the precision plugin's),
    `optimizers()` and `schedulers()` (Lightning's: one, or a list with the policy's first, then each role's), `clip(optimizer,
    parameters, max_norm, norm)`, and `policy_stepped()` after each policy step."""

    backward: Callable
    optimizers: Callable[[], list]
    schedulers: Callable[[], list]
    clip: Callable
    policy_stepped: Callable[[], None]


class Learner:
    """Owns the update: `update(exp, has_signal, batch_index)` -> metrics. `terms` are the policy's
    loss terms (the learner's own and the parts'); a part with a role of its own (the critic)
    adds `role_terms` stepped by that role's optimiser."""

    def __init__(self, policy, parts: list, terms: list, steppers: Steppers, scoring: Scoring, *,
                 settings: dict, aggregation: dict, seed: int):
        self.policy, self.parts, self.terms, self.steppers, self.scoring = policy, parts, terms, steppers, scoring
        self.ppo_epochs, self.num_minibatches = settings["ppo_epochs"], settings["num_minibatches"]
        self.micro_batch_size, self.max_grad_norm = settings["micro_batch_size"], settings["max_grad_norm"]
        self.micro_batch_tokens = settings["micro_batch_tokens"]
        self.mask_truncated, self.entropy_coef = settings["mask_truncated"], settings["entropy_coef"]
        self.aggregation, self.seed = aggregation, seed
        self.roles = [part for part in parts if part.role_terms()]  # parts stepping a role of their own
        self.critic = next((part for part in parts if getattr(part, "value_model", None) is not None), None)
        self.full_logits = any(getattr(part, "needs_logits", False) for part in parts)
        self.nonfinite_steps = 0  # optimiser steps skipped for a non-finite gradient norm (checkpointed)
        self.batches_without_signal = 0

    # --- the training forward ------------------------------------------------------------------
    def training_forward(self, exp: Experience, with_values: bool):
        """(log pi_theta (with gradient), entropy (with gradient only when weighted), the critic's
        V(s_t) or None — one backbone pass when the critic shares the policy's — and the logits
        [b, T, V] or None). The log-probs come from hidden states with the LM head applied chunk
        by chunk (models.forward.sequence_logprobs): no [b, T, V] logits exist unless a part
        reads them (distill.mode=full)."""
        options = dict(with_entropy=True, entropy_grad=bool(self.entropy_coef), **self.scoring.options(exp))
        batch = exp.model_inputs()  # the environment's tokens are read, and scored by none
        logits = None
        if with_values and self.critic.shared_backbone:
            hidden = sequence_hidden_states(self.policy, *batch)
            values = self.critic.value_model.values(hidden)
            weight, bias = lm_head_weights(self.policy)
            if self.full_logits:
                logits = torch.nn.functional.linear(hidden, weight, bias)
                logp, entropy = self.scoring.logprobs_from(logits, exp, True, options["entropy_grad"])
            else:
                logp, entropy = logprobs_from_hidden(hidden, weight, bias, exp.response_ids, exp.response_mask,
                                                     **options)
            return exp.policy_tokens_only(logp), exp.policy_tokens_only(entropy), values, logits
        if self.full_logits:
            logits = sequence_logits(self.policy, *batch)
            logp, entropy = self.scoring.logprobs_from(logits, exp, True, options["entropy_grad"])
        else:
            logp, entropy = sequence_logprobs(self.policy, *batch, **options)
        values = self.critic.value_model(*batch) if with_values else None
        return exp.policy_tokens_only(logp), exp.policy_tokens_only(entropy), values, logits

    # --- the update ----------------------------------------------------------------------------
    def loss_mask(self, exp: Experience) -> torch.Tensor:
        """The tokens the loss terms see: every generated token, less the truncated responses
        when `mask_truncated` is set (overlong filtering). Counts follow this mask."""
        if not self.mask_truncated:
            return exp.response_mask
        return core.drop_truncated(exp.response_mask, exp.truncated)

    def update(self, exp: Experience, has_signal: bool, batch_index: int) -> dict[str, float]:
        """ppo_epochs x num_minibatches optimiser steps on one rollout batch."""
        self.batches_without_signal = 0 if has_signal else self.batches_without_signal + 1
        if self.batches_without_signal >= MAX_BATCHES_WITHOUT_SIGNAL:
            raise RewardError(f"{self.batches_without_signal} rollout batches in a row had no group with a reward "
                              f"spread, so no step was taken: check the reward (reward=...) and the prompts' "
                              f"difficulty (data.*, data_curriculum=...)")
        train_policy = has_signal and all(part.policy_may_train(batch_index) for part in self.parts)
        if not train_policy and not self.roles:
            return {"perf/skipped_update": 1.0}
        generator = torch.Generator().manual_seed(rank_seed(self.seed * 7919 + batch_index, *rank_and_world()))
        # what a rank computes, weighted 0, in the micro-batches it runs beyond its own rows (see
        # accumulate_gradients), also in a minibatch it has no rows of (more minibatches than rows)
        stand_in = first_row(exp)
        totals: dict[str, float] = {}
        updates: dict[str, int] = {}
        mismatch: dict[str, float] = {}
        for _ in range(self.ppo_epochs):
            order = torch.randperm(len(exp), generator=generator).to(exp.response_mask.device)
            # exactly num_minibatches minibatches of near-equal sizes, whatever the rank's row
            # count (dynamic sampling's differ): each is an optimiser step every rank takes
            for rows in order.tensor_split(self.num_minibatches):
                # a random set of rows, kept in batch order: the loss is a sum over rows, and a
                # group's rows stay together, so the forward computes their prompt once
                stats = self.minibatch_step(exp.select(rows.sort().values), train_policy, stand_in)
                for k, v in stats.items():
                    if MISMATCH_SUMS in k:
                        core.accumulate_mismatch_sum(mismatch, k.rsplit("/", 1)[1], v)
                        continue
                    totals[k] = totals.get(k, 0.0) + v
                    updates[k] = updates.get(k, 0) + 1
        metrics = {k: v / updates[k] for k, v in totals.items()}
        if train_policy:  # the policy term ran on every rank (a rank without rows adds zeros)
            metrics.update(mismatch_metrics(mismatch, exp.response_mask.device))
        metrics["perf/nonfinite_grad_steps"] = float(self.nonfinite_steps)
        if not train_policy:
            metrics["perf/skipped_update"] = 1.0
        return metrics

    def minibatch_step(self, exp: Experience, train_policy: bool, stand_in: Experience | None = None) -> dict[str, float]:
        """One optimiser step per trainable role over a minibatch (`stand_in`: see accumulate_gradients)."""
        optimizers = as_list(self.steppers.optimizers())
        for optimizer in optimizers:
            optimizer.zero_grad()
        sums = self.accumulate_gradients(exp, train_policy, stand_in)
        if train_policy:
            sums["policy/grad_norm"] = self.optimiser_step(0, self.policy_parameters(), self.max_grad_norm)
        for index, part in enumerate(self.roles, start=1):  # also in a warm-up, when the policy does not step
            sums[f"{part.prefix}/grad_norm"] = self.optimiser_step(index, part.role_parameters(),
                                                                  part.role_max_grad_norm)
        for optimizer in optimizers:  # set to None: a policy-sized buffer would otherwise sit through the rollout
            optimizer.zero_grad(set_to_none=True)
        return sums

    def accumulate_gradients(self, exp: Experience, train_policy: bool = True,
                             stand_in: Experience | None = None) -> dict[str, float]:
        """Backward of the summed loss terms over the minibatch's micro-batches, with token and
        sequence counts summed over micro-batches and ranks (so the gradient is the full
        batch's, however it is split). Returns the terms' stats.

        The micro-batches are `plan_micro_batches`' (by rows, by tokens, or both), each trimmed
        to the columns its own rows need (`Experience.without_padding`).

        Every rank runs as many micro-batches as the rank with the most (under FSDP each forward
        and backward is a collective): a rank with fewer rows pads with micro-batches of
        `stand_in` (a one-row Experience; default: exp's first row) whose loss is weighted 0, so
        they add exactly nothing to the gradient or the stats."""
        device = exp.response_mask.device
        mask = self.loss_mask(exp)
        num_tokens, num_seqs = core.count_tokens_and_seqs(mask, count_empty_rows=self.aggregation["count_empty_rows"])
        counts = dict(num_tokens=all_reduce_sum(num_tokens), num_seqs=all_reduce_sum(num_seqs),
                      dp_size=rank_and_world()[1])
        aggregation = {**self.aggregation, **counts}
        train_roles = bool(self.roles)
        plan = plan_micro_batches(*(lengths.tolist() for lengths in exp.row_widths()),
                                  max_rows=self.micro_batch_size, max_tokens=self.micro_batch_tokens)
        num_micro = int(all_reduce_max(torch.tensor(len(plan), device=device)))
        stand_in = stand_in if stand_in is not None else first_row(exp)
        terms = (self.terms if train_policy else []) + [term for part in self.roles for term in part.role_terms()]
        sums: dict[str, float] = {}
        for index in range(num_micro):
            padding = index >= len(plan)
            part = stand_in if padding else exp.select(torch.tensor(plan[index], device=device)).without_padding()
            part_mask = self.loss_mask(part)  # a row's mask is its own (truncation is a row's flag): `mask`'s rows
            logp, entropy, values, logits = self.training_forward(part, with_values=train_roles)
            extras = {}
            for p in self.parts:
                extras.update(p.micro_batch(part, train_policy))
            mb = MicroBatch(exp=part, mask=part_mask, logp=logp, entropy=entropy, values=values,
                            old_logp=logp.detach() if part.old_logp is None else part.old_logp,
                            aggregation=aggregation, logits=logits if extras else None, **extras)
            losses, stats = [], {}
            for term in terms:
                loss, term_stats = term(mb)
                losses.append(loss)
                stats.update({f"{term.prefix}/{k}": float(v) for k, v in term_stats.items()})
            if losses:
                # a stand-in's backward still runs (FSDP's reduce-scatter), with a zero gradient
                self.steppers.backward(torch.stack(losses).sum() * (0.0 if padding else 1.0))
            if padding:
                continue
            # values aggregated with the global counts add up over micro-batches; the other
            # stats are micro-batch means, weighted by their token share
            share = float(part_mask.sum() / num_tokens.clamp(min=1))
            for k, v in stats.items():
                if MISMATCH_SUMS in k:
                    core.accumulate_mismatch_sum(sums, k, v)
                else:
                    sums[k] = sums.get(k, 0.0) + v * (1.0 if k in GLOBAL_STATS else share)
        for p in self.parts:
            sums.update(p.after_micro_batches(train_policy))
        return sums

    # --- optimiser steps -----------------------------------------------------------------------
    def policy_parameters(self):
        return [p for p in self.policy.parameters() if p.requires_grad]

    def optimiser_step(self, index: int, parameters, max_norm) -> float:
        """Average gradients over ranks, skip (and count) a step whose gradient norm is not
        finite, clip, step, advance the schedule. Optimiser 0 is the policy's: its steps are
        Lightning's global step; a role's (index > 0) are not."""
        optimizer = as_list(self.steppers.optimizers())[index]
        parameters = list(parameters)
        average_gradients(parameters)
        grads = [p.grad for p in parameters if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        norm = float(total)
        if not math.isfinite(norm):
            optimizer.zero_grad()
            self.nonfinite_steps += 1
            return norm
        if max_norm:
            self.steppers.clip(optimizer, parameters, max_norm, total)
        schedule = as_list(self.steppers.schedulers())[index]
        if index == 0:
            optimizer.step()
            schedule.step()
            self.steppers.policy_stepped()
        else:
            optimizer.optimizer.step()  # the raw optimiser: not one of Lightning's global steps
            schedule.step()
        return norm


def first_row(exp: Experience) -> Experience:
    """A one-row Experience of `exp`'s first row, trimmed: the stand-in a rank computes, weighted 0,
    in the micro-batches it runs beyond its own rows (see Learner.accumulate_gradients)."""
    return exp.select(torch.zeros(1, dtype=torch.long, device=exp.response_mask.device)).without_padding()


def as_list(items) -> list:
    """Lightning's optimizers() / lr_schedulers(): one object, or a list when there are several."""
    return items if isinstance(items, list) else [items]


def mismatch_metrics(sums: dict[str, float], device) -> dict[str, float]:
    """`rollout/mismatch/*` of the whole batch, every rank's tokens together, from the policy
    term's sums (core.mismatch_metrics): the same values on every rank."""
    added = all_reduce_sum(torch.tensor([sums.get(k, 0.0) for k in core.MISMATCH_SUM_KEYS],
                                        dtype=torch.float64, device=device))
    maxima = all_reduce_max(torch.tensor([sums.get(k, 0.0) for k in core.MISMATCH_MAX_KEYS],
                                         dtype=torch.float64, device=device))
    reduced = {**dict(zip(core.MISMATCH_SUM_KEYS, added)), **dict(zip(core.MISMATCH_MAX_KEYS, maxima))}
    return {f"rollout/mismatch/{k}": float(v) for k, v in core.mismatch_metrics(reduced).items()}
