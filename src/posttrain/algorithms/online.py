"""One online-RL LightningModule for every online algorithm: the GRPO family (GRPO, Dr. GRPO,
DAPO, GSPO, CISPO, SAPO, the DeepSeek-V3.2 fixes), PPO, on-policy distillation (OPD), KDRL
and Long2Short are configurations of it. A preset in conf/algorithm/ is a choice of policy
loss, clip range, aggregation, advantage, KL estimator, reward, curriculum and, for PPO, a
critic and a pretraining (ptx) term; for the distillation algorithms, a frozen teacher and
`algorithm.distill` (see `DistillTerm` in terms.py):

  opd          the teacher scores every sampled token: the per-token reward
               coef * (log p_T(y_t) - log p_S(y_t)) is added to each token's advantage
               (distill.mode=reward; no baseline, no discount), or the full-vocabulary
               divergence is a loss term (distill.mode=full)
  kdrl         GRPO's loss + beta * k2 (or k3) of KL(student || teacher) on the student's
               samples (distill.mode=loss), beta annealed by `distill.coef_schedule`,
               optionally only on low-reward samples (distill.mask=low_reward)
  long2short   accuracy + the Kimi k1.5 length reward after a warm-up (reward config),
               optionally with distillation from a long-reasoning teacher
  PRM-RL       reward=prm: a process reward model scores every step of a response (split
               in collect by the task's rule, data/steps.py); advantage=prm_step puts each
               step's reward at its last token (experiment=prm_rl); rollout.prm_stop_below
               cuts a response after a low-scored step

One `training_step` is one rollout batch, four named and timed stages over an `Experience`
(`perf/<stage>_s`), as in the papers' algorithm boxes:

  1. collect     prompts from the curriculum -> `group_size` samples each -> (their steps,
                 for a process reward) -> rewards (dynamic sampling's extra rounds, partial
                 rollouts: collect.py), by this process or by a producer process sampling up
                 to rollout.max_staleness policy versions ahead (producer.py); with
                 reward.constraint the trainer then subtracts lambda x the cost over its
                 limit, and steps lambda (apply_constraint)
  2. annotate    each configured scorer adds its tensors: old log-probs (only off-policy, for
                 a KL in the reward or a distillation reward), reference log-probs (only with
                 a KL term), critic values (only with a critic), teacher log-probs (only with
                 a sampled distillation mode: reward or loss)
  3. advantages  score at the last token, or step rewards at each step's last token
                 (prm_step), (- beta * KL when placed in the reward) ->
                 `core.compute_advantages` (GAE with the critic's values); + the per-token
                 distillation reward (opd)
  4. update      ppo_epochs x minibatches x micro-batches; the loss is a sum of terms
                 (terms.py: policy, KL, entropy, value, distill; plus ptx), global token
                 counts; distill.mode=full runs the teacher's forward here, per micro-batch
                 (vocabulary-sized logits are never stored in the Experience)

Step counters: `trainer.max_steps` counts policy optimiser steps (Lightning's global step);
one rollout batch makes ppo_epochs x num_minibatches of them (none while the critic warms
up or when a batch has no signal). `train_batches_seen` counts rollout batches; evaluation,
logging and curricula follow it. The budgets spent (posttrain-report's x axes), checkpointed
so that a resumed run continues them: `rollout/samples_seen` and `rollout/tokens_seen`, the
completions and response tokens sampled (dynamic sampling's dropped rounds included), summed
over ranks, and
`perf/elapsed_s`, the wall-clock seconds of training.

Data parallelism lives here, not in an algorithm: each rank draws its own prompts (disjoint
streams), seeds its sampler with its rank, sums token and sequence counts over ranks before
aggregating, and averages gradients by hand before each optimiser step. What a decision reads
(the adaptive KL controller, the constraint's lambda, a curriculum's accuracy, the "no signal"
skip, whitening) is reduced over the ranks: every rank holds one state, that of one process on
the union of their batches.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
import time
from dataclasses import replace

import torch
from omegaconf import OmegaConf

from posttrain import core
from posttrain.algorithms import rules
from posttrain.algorithms.base import PosttrainModule
from posttrain.algorithms.collect import Collector, rank_seed
from posttrain.algorithms.experience import Experience
from posttrain.algorithms.producer import InlineProducer, ModelGenerator, ProcessProducer
from posttrain.models.forward import (lm_head_weights, logprobs_from_hidden, sequence_hidden_states, sequence_logits,
                                      sequence_logprobs)
from posttrain.algorithms.terms import (MISMATCH_SUMS, DistillTerm, EntropyTerm, KLTerm, MicroBatch, PolicyTerm,
                                        ValueTerm)
from posttrain.data.curriculum import build_curriculum
from posttrain.data.datamodule import ExampleCursor, collate_sft, tokenizer_context
from posttrain.data.pretraining import PretrainingChunks, read_documents
from posttrain.data.steps import source_step_rule
from posttrain.distributed.collectives import (all_reduce_max, all_reduce_sum, average_gradients, rank_and_world,
                                               is_dtensor, this_ranks, with_every_rank)
from posttrain.errors import ConfigError, MismatchError, RewardError
from posttrain.models.loading import DTYPES, stop_token_ids
from posttrain.models.lora import reference_is_the_base, reference_model
from posttrain.models.roles import ValueModel, build_role
from posttrain.rewards import build_reward
from posttrain.rollout import SamplingParams, build_rollout, engine_options
from posttrain.rollout.repetition import repetition_rule
from posttrain.distributed.sharding import full_weights

log = logging.getLogger(__name__)

# Keys of the kl_estimator group that place and weigh the KL; every other key is an estimator option.
KL_PLACEMENT_KEYS = ("name", "coef", "placement", "controller", "target", "horizon")
# Rollout batches in a row without a learning signal (every group flat on every rank) after
# which the run stops: the data or the reward gives the policy nothing to learn from.
MAX_BATCHES_WITHOUT_SIGNAL = 50
# Term stats aggregated with the global token/sequence counts: they sum over micro-batches.
GLOBAL_STATS = ("policy/loss", "policy/kl", "policy/entropy", "critic/value_loss", "distill/loss")
# algorithm.distill: how the teacher's scores enter the update (see DistillTerm) ...
DISTILL_MODES = ("reward", "full", "loss")
# ... and which samples a loss-mode distillation keeps: all, or those with reward <= reward_threshold (KDRL).
DISTILL_MASKS = ("none", "low_reward")


class OnlineRLModule(PosttrainModule):
    """Online RL as collect -> annotate -> advantages -> update (see the module docstring)."""

    train_collate = None  # the module draws its own prompts through the curriculum

    def __init__(self, policy, tokenizer, source, optim, rollout, eval_max_new_tokens, *,
                 kl_estimator, advantage, reward, data_curriculum, roles, cache_dir=None, seed: int = 0,
                 prompts_per_step: int = 16, group_size: int = 8, ppo_epochs: int = 1, num_minibatches: int = 1,
                 micro_batch_size: int | None = None, policy_loss: str = "ppo_clip", clip_low: float | None = 0.2,
                 clip_high: float | None = 0.2, dual_clip: float | None = None, delta: float | None = None,
                 log_ratio_clamp: float | None = 20.0, seq_log_ratio_clamp: float | None = None,
                 ratio_level: str = "token", tau_pos: float = 1.0, tau_neg: float = 1.05, kimi_tau: float = 1.0,
                 loss_agg_mode: str = "seq-mean-token-mean", norm_constant: float | None = None,
                 count_empty_rows: bool = False, mask_truncated: bool = False,
                 entropy_coef: float = 0.0, max_grad_norm: float | None = 1.0,
                 offpolicy_mask_delta: float | None = None, keep_sampling_mask: bool = False,
                 critic=None, ptx_coef: float = 0.0, ptx_batch_size: int = 16, ptx_data: str | None = None,
                 ptx_seq_len: int = 128, distill=None):
        super().__init__(policy, tokenizer, source, optim, rollout, eval_max_new_tokens, max_grad_norm)
        if policy_loss not in core.POLICY_LOSSES:
            raise ConfigError(f"algorithm.policy_loss={policy_loss!r} is not one of {sorted(core.POLICY_LOSSES)}")
        if loss_agg_mode not in core.AGGREGATION_MODES:
            raise ConfigError(f"algorithm.loss_agg_mode={loss_agg_mode!r} is not one of {core.AGGREGATION_MODES}")
        if advantage.name not in core.ADVANTAGE_ESTIMATORS:
            raise ConfigError(f"advantage={advantage.name!r} is not one of {sorted(core.ADVANTAGE_ESTIMATORS)}")
        rules.refuse(rules.gae_critic_problem(advantage.name, critic is not None),
                     rules.sampling_mask_problem(keep_sampling_mask, rollout.top_k, rollout.top_p))
        for key, value in (("prompts_per_step", prompts_per_step), ("group_size", group_size),
                           ("ppo_epochs", ppo_epochs), ("num_minibatches", num_minibatches)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"algorithm.{key}={value!r} must be a positive integer")
        self.automatic_optimization = False
        self.batch_size = prompts_per_step
        self.prompts_per_step, self.group_size = prompts_per_step, group_size
        self.ppo_epochs, self.num_minibatches, self.micro_batch_size = ppo_epochs, num_minibatches, micro_batch_size
        self.seed, self.cache_dir, self.curriculum_cfg = seed, cache_dir, data_curriculum
        self.keep_sampling_mask, self.mask_truncated = keep_sampling_mask, mask_truncated
        self.entropy_coef = entropy_coef

        # Aggregation settings shared by every loss term, then the policy loss's own options.
        self.aggregation = dict(agg_mode=loss_agg_mode, count_empty_rows=count_empty_rows,
                                norm_constant=norm_constant or rollout.max_new_tokens)  # Dr. GRPO: the budget
        self.loss_options = dict(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, delta=delta,
                                 log_ratio_clamp=log_ratio_clamp, seq_log_ratio_clamp=seq_log_ratio_clamp,
                                 ratio_level=ratio_level, tau_pos=tau_pos, tau_neg=tau_neg, kimi_tau=kimi_tau)
        self.policy_loss = policy_loss
        self.advantage_name = advantage.name
        self.advantage_options = {k: v for k, v in advantage.items() if k != "name"}

        # --- KL: estimator, placement, coefficient; the frozen reference only when needed ---
        self.kl_name, self.kl_placement = kl_estimator.name, kl_estimator.placement
        self.kl_options = {k: v for k, v in kl_estimator.items() if k not in KL_PLACEMENT_KEYS}
        uses_kl = rules.uses_kl(self.kl_name, kl_estimator.coef)
        rules.refuse(rules.kl_placement_problem(self.kl_name, kl_estimator.coef, self.kl_placement))
        controller = kl_estimator.get("controller", "fixed")
        self.kl_controller = core.build_kl_controller(
            controller, **({"beta": kl_estimator.coef} if controller == "fixed" else
                           {"init_beta": kl_estimator.coef, "target_kl": kl_estimator.target,
                            "horizon": kl_estimator.horizon})) if uses_kl else None
        self.kl_in_reward = uses_kl and self.kl_placement == "in_reward"
        # a LoRA policy's reference is its own base (the adapter switched off), not a copy
        self.uses_reference = uses_kl
        self.reference = (build_role("reference", roles.reference, policy)
                          if uses_kl and not reference_is_the_base(policy, roles.reference) else None)

        # --- critic (PPO): its own backbone by default, or a value head on the policy's ---
        self.critic_cfg = critic
        self.critic = None
        if critic is not None:
            shared = bool(roles.critic.get("shared_backbone", False))
            self.critic = ValueModel(policy if shared else build_role("critic", roles.critic, policy))
            self.shared_critic = shared
        self.critic_warmup_batches = critic.warmup_batches if critic is not None else 0

        # --- the train-inference mismatch: corrections of pi_old / mu, and the budget on its size ---
        correction = rollout.get("correction") or {}
        self.correction = {key: correction[key] for key in ("tis", "tis_cap", "mis", "mis_low", "mis_high")
                           if key in correction}
        self.mismatch_budget = dict(rollout.get("mismatch_budget") or {})
        self.mismatch_over_budget = 0  # rollout batches over the budget so far (checkpointed)

        # --- who collects (producer.py): this process, or a producer process up to k versions ahead ---
        self.max_staleness = int(rollout.get("max_staleness") or 0)
        self.producer_kind = rollout.get("producer") or ("process" if self.max_staleness else "inline")
        self.producer_threads = rollout.get("producer_threads")
        self.partial_budget = rollout.get("partial_budget")  # partial rollouts: tokens per generate call
        rules.refuse(rules.producer_problem(self.producer_kind, self.max_staleness))
        self.collector = self.producer = None  # built in setup(), with the curriculum
        self.collector_state: dict = {}  # the collector's state after the last batch trained on
        self.train_started = time.perf_counter()  # reset when training starts (perf/elapsed_s)

        # --- the loss terms of the update stage ---
        self.policy_term = PolicyTerm(policy_loss, self.loss_options, offpolicy_mask_delta, self.correction)
        self.terms = [self.policy_term, EntropyTerm(entropy_coef)]
        if self.uses_reference:
            self.terms.append(KLTerm(self.kl_name, self.kl_options, self.kl_controller,
                                     as_loss=self.kl_placement == "as_loss"))
        self.value_term = ValueTerm(critic.value_clip, critic.vf_coef) if critic is not None else None
        self.ptx_coef, self.ptx_batch_size = ptx_coef, ptx_batch_size
        # PPO-ptx's data: null, the task's supervised data; else pretraining text (data/pretraining.py)
        self.ptx_data, self.ptx_seq_len = ptx_data, ptx_seq_len

        # --- distillation (opd, kdrl, long2short): a frozen teacher scores the student's samples ---
        distill = OmegaConf.to_container(distill, resolve=True) if OmegaConf.is_config(distill) else distill
        self.distill = dict(distill) if rules.distills(distill) else None
        self.teacher = None
        if self.distill is not None:
            check_distill(self.distill, advantage.name, roles.teacher)
            self.teacher = build_role("teacher", roles.teacher, policy)
            if self.teacher.config.vocab_size != policy.config.vocab_size:
                raise ConfigError(f"teacher: its vocabulary ({self.teacher.config.vocab_size} tokens) is not the "
                                  f"policy's ({policy.config.vocab_size}); distillation needs a teacher with the "
                                  f"policy's tokenizer")
            self.terms.append(DistillTerm(self.distill["mode"], self.distill_coef, **{
                key: self.distill[key] for key in ("divergence", "beta", "temperature", "estimator", "mask",
                                                   "reward_threshold") if key in self.distill}))
        self.distill_mode = self.distill["mode"] if self.distill is not None else None

        # --- annotate: each scorer fills one Experience field; only those a stage reads ---
        # With one update per batch pi_old is the current policy: the training forward's own
        # log-probs, detached, stand in for it (ratio exactly 1) and the extra forward is skipped.
        self.on_policy = ppo_epochs == 1 and num_minibatches == 1
        self.scorers = []
        if not self.on_policy or self.kl_in_reward or self.distill_mode == "reward":
            self.scorers.append(("old_logp", lambda exp: self.token_logprobs(self.policy, exp)[0]))
        if self.uses_reference:
            self.scorers.append(("ref_logp", self.reference_logprobs))
        if self.critic is not None:
            self.scorers.append(("values", lambda exp: self.critic(exp.prompt_ids, exp.prompt_mask,
                                                                 exp.response_ids, exp.response_mask)))
        if self.distill_mode in ("reward", "loss"):  # mode full reads the teacher's logits in the update
            self.scorers.append(("teacher_logp", lambda exp: self.token_logprobs(self.teacher, exp)[0]))
        check_core_options(self)
        self.reward_cfg = reward
        self.reward_fn = build_reward(reward, source, rollout.max_new_tokens, policy=policy, tokenizer=tokenizer)
        # --- reward.constraint: E[cost] <= limit through a Lagrange multiplier. lambda lives here, in
        # the trainer, and is applied to each batch as it is consumed: the reward stage may run in a
        # producer process (rollout.max_staleness > 0), which holds no lambda, so it only stores the cost ---
        constraint, components = reward.get("constraint"), reward.get("components")
        if OmegaConf.is_config(constraint):
            constraint = OmegaConf.to_container(constraint, resolve=True)
        if OmegaConf.is_config(components):
            components = OmegaConf.to_container(components, resolve=True)
        rules.refuse(rules.constraint_problem(constraint, components))
        self.constraint = dict(constraint) if constraint is not None else None
        self.multiplier = core.Multiplier.start(float(self.constraint.get("init", 0.0)) if self.constraint else 0.0)

        # --- process rewards: responses split into steps (data/steps.py) for a PRM to score ---
        self.process_reward = process_reward_of(self.reward_fn)
        self.prm_stop_below = rollout.get("prm_stop_below")
        check_process_options(self, advantage.name)
        self.step_rule = source_step_rule(source) if self.process_reward is not None else None
        self.curriculum = None    # built in setup(), when this process's rank is known
        self.ptx_cursor = None
        self.nonfinite_steps = 0  # optimiser steps skipped for a non-finite gradient norm
        # budget counters over every rank (checkpointed): completions and response tokens of the
        # rollout batches trained on (rollout/samples_seen, rollout/tokens_seen)
        self.samples_seen = 0
        self.tokens_seen = 0
        self.elapsed_before = 0.0  # training seconds of the fits before a resume (perf/elapsed_s continues them)
        self.batches_without_signal = 0
        self._restored_state: dict = {}

    # --- set-up, checkpoints ------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        if self.curriculum is not None:
            return
        rank, world = rank_and_world()
        cursor = ExampleCursor(self.source, "train", self.seed, rank=rank, world_size=world)
        self.curriculum = build_curriculum(self.curriculum_cfg, cursor, self.cache_dir)
        if self.ptx_coef:
            # PPO-ptx's own stream (distinct seed): the task's supervised data, or chunks of
            # pretraining text, each rank its own share
            ptx_source = self.source
            if self.ptx_data is not None:
                ptx_source = PretrainingChunks(read_documents(self.ptx_data), self.tokenizer, self.ptx_seq_len,
                                               context=tokenizer_context(self.tokenizer))
            self.ptx_cursor = ExampleCursor(ptx_source, "train", self.seed + 1, rank=rank, world_size=world)
        self.collector = Collector(
            lambda *args, **kwargs: self.generate(*args, **kwargs), self.tokenizer, self.source, self.curriculum,
            self.reward_fn, sampling=self.sampling_params(), group_size=self.group_size,
            prompts_per_step=self.prompts_per_step, seed=self.seed, rank=rank, world=world, device=self.device,
            eos_ids=stop_token_ids(self.tokenizer, self.policy), step_rule=self.step_rule,
            process_reward=self.process_reward, prm_stop_below=self.prm_stop_below,
            partial_budget=self.partial_budget, rounds_agree=self.any_rank_needs,
            cost_component=self.constraint["cost"] if self.constraint is not None else None)
        if self.producer_kind == "inline":
            self.producer = InlineProducer(self.collector)
        else:
            # the same collector, sampling with this process's engine settings on a copy of the
            # policy, taken here, before a sharding strategy splits the policy
            collector = copy.copy(self.collector)
            collector.generate = ModelGenerator(build_rollout(self.rollout_cfg.engine, **engine_options(self.rollout_cfg)),
                                                copy.deepcopy(self.policy).cpu(), collector.eos_ids.tolist(),
                                                self.tokenizer.pad_token_id)
            self.producer = ProcessProducer(collector, self.max_staleness,
                                            threads=self.producer_threads or torch.get_num_threads())
            self.producer.launch()  # now: its imports (seconds) overlap the trainer's own start-up

    def configure_optimizers(self):
        policy = self.make_optimizer(self.policy_parameters(), self.optim)
        if self.critic is None:
            return policy
        return [policy, self.make_optimizer(self.critic_parameters(), self.critic_cfg.optim)]

    def frozen_roles(self) -> list[str]:
        return [role for role in ("reference", "teacher") if getattr(self, role) is not None]

    def on_save_checkpoint(self, checkpoint):
        super().on_save_checkpoint(checkpoint)
        # frozen roles are rebuilt from their config on resume, not stored in every checkpoint
        prefixes = tuple(f"{role}." for role in self.frozen_roles())
        if prefixes:
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith(prefixes)}
        with_every_rank(checkpoint, "curriculum", self.curriculum.state_dict())  # the ranks' positions differ
        checkpoint["ptx_position"] = self.ptx_cursor.position if self.ptx_cursor is not None else 0
        checkpoint["nonfinite_steps"] = self.nonfinite_steps
        checkpoint["mismatch_over_budget"] = self.mismatch_over_budget
        checkpoint["samples_seen"], checkpoint["tokens_seen"] = self.samples_seen, self.tokens_seen
        checkpoint["elapsed_s"] = self.elapsed_s()
        if self.partial_budget:  # the responses under way, and the ended groups waiting for a batch
            with_every_rank(checkpoint, "partial_rollouts", {k: v for k, v in self.collector_state.items()
                                                             if k != "curriculum"})
        if self.kl_controller is not None:
            checkpoint["kl_controller"] = self.kl_controller.state_dict()
        if self.constraint is not None:  # one lambda, the same on every rank (apply_constraint)
            checkpoint["constraint_lambda"] = self.multiplier.value
            checkpoint["constraint_integral"] = self.multiplier.integral
            checkpoint["constraint_last_cost"] = self.multiplier.last_cost

    def on_load_checkpoint(self, checkpoint):
        super().on_load_checkpoint(checkpoint)
        for role in self.frozen_roles():
            checkpoint["state_dict"].update({f"{role}.{k}": v for k, v in getattr(self, role).state_dict().items()})
        self.curriculum.load_state_dict(this_ranks(checkpoint, "curriculum"))
        if self.ptx_cursor is not None:
            self.ptx_cursor.position = checkpoint.get("ptx_position", 0)
        self.nonfinite_steps = checkpoint.get("nonfinite_steps", 0)
        self.mismatch_over_budget = checkpoint.get("mismatch_over_budget", 0)
        self.samples_seen = checkpoint.get("samples_seen", 0)
        self.tokens_seen = checkpoint.get("tokens_seen", 0)
        self.elapsed_before = checkpoint.get("elapsed_s", 0.0)
        if self.partial_budget and "partial_rollouts" in checkpoint:
            self.collector_state = this_ranks(checkpoint, "partial_rollouts")
        if "kl_controller" in checkpoint and self.kl_controller is not None:
            self.kl_controller.load_state_dict(checkpoint["kl_controller"])
        if "constraint_lambda" in checkpoint and self.constraint is not None:
            value = float(checkpoint["constraint_lambda"])  # a checkpoint of plain dual ascent: the integral is lambda
            self.multiplier = core.Multiplier(value, float(checkpoint.get("constraint_integral", value)),
                                              checkpoint.get("constraint_last_cost"))

    def on_train_start(self):
        # not on_fit_start: under trainer=ddp and fsdp Lightning restores a checkpoint after
        # on_fit_start, and here a restored curriculum is already in place (it rebuilds from
        # its state and estimates nothing); pass rates are estimated under the training precision
        self.train_started = time.perf_counter()
        settings = {"samples_per_prompt": 8, "rollout": str(self.rollout_cfg), "reward": str(self.reward_cfg),
                    "seed": self.seed}
        with self.training_precision():
            self.curriculum.setup(self.estimate_pass_rates, self.weights_fingerprint, settings)
        if isinstance(self.producer, ProcessProducer):  # it samples in the training precision, as this process would
            self.producer.autocast_dtype = autocast_dtype(self.trainer.precision)
        with full_weights(self.policy):
            self.producer.start(self.train_batches_seen, self.train_batches_seen, self.policy, self.collector_state)

    def on_train_end(self):
        self.producer.close()

    def elapsed_s(self) -> float:
        """Wall-clock seconds since training began, those of the fits before a resume included."""
        return self.elapsed_before + time.perf_counter() - self.train_started

    def teardown(self, stage: str) -> None:
        if self.producer is not None:
            self.producer.close()

    def weights_fingerprint(self) -> str:
        """A short hash of the policy's current weights (what the pass rates were measured on).
        Under FSDP every rank takes part: each sharded tensor is gathered in turn, hashed and
        dropped, so no device ever holds the whole model."""
        digest = hashlib.sha256()
        for name, tensor in self.policy.state_dict().items():
            whole = tensor.full_tensor() if is_dtensor(tensor) else tensor
            digest.update(name.encode())
            digest.update(whole.detach().float().cpu().numpy().tobytes())
        return digest.hexdigest()[:16]

    # --- the training step: four stages ----------------------------------------------------
    def training_step(self, ticket, batch_idx):
        step = self.train_batches_seen
        timings = {}

        def timed(stage, fn, *args):
            started = time.perf_counter()
            out = fn(*args)
            timings[f"perf/{stage}_s"] = time.perf_counter() - started
            return out

        with full_weights(self.policy):  # FSDP: one gather for all rounds (ranks may sample different numbers)
            exp, metrics, has_signal = timed("collect", self.collect, step)
        if self.constraint is not None:  # the cost joins the reward here, with the trainer's lambda
            exp, constraint_metrics = self.apply_constraint(exp)
            metrics.update(constraint_metrics)
        exp = timed("annotate", self.annotate, exp.without_trailing_padding())
        exp, advantage_metrics = timed("advantages", self.compute_advantages, exp)
        stats = timed("update", self.update, exp, has_signal)

        if self.kl_controller is not None and "policy/kl" in stats:
            # one beta on every rank, that of the whole batch: each rank's KL stat is its share
            # of the global aggregate times the world size (global token counts), so their mean
            # is the global KL; the controller counts the rows of every rank
            world = rank_and_world()[1]
            kl_sum, rows = all_reduce_sum(torch.tensor([stats["policy/kl"], float(len(exp))],
                                                       dtype=torch.float64, device=self.device)).tolist()
            self.kl_controller.update(kl_sum / world, n_steps=int(rows))
            metrics["policy/kl_coef"] = float(self.kl_controller.value)
        metrics.update(stats)
        self.check_mismatch_budget(metrics, step)
        metrics.update(advantage_metrics)
        metrics.update(self.rollout_metrics(exp))
        metrics.update(timings)
        # the sampler's speed: over this rank's generate calls when a producer sampled ahead (the
        # trainer's collect stage then only waited for it)
        sampling_s = metrics.get("perf/generate_s", timings["perf/collect_s"])
        metrics["perf/tokens_per_s"] = float(exp.response_mask.sum()) / max(sampling_s, 1e-9)
        metrics["perf/elapsed_s"] = self.elapsed_s()
        feedback = {"step": step + 1, "train_accuracy": metrics.get("rollout/prefilter_accuracy")}
        metrics.update(self.curriculum.on_step_end(**feedback))
        self.train_batches_seen += 1
        with full_weights(self.policy):  # FSDP: each rank hands its producer the whole weights
            self.producer.publish(self.train_batches_seen, self.policy, feedback)
        metrics["rollout/batch"] = float(self.train_batches_seen)
        metrics["rollout/samples_seen"] = float(self.samples_seen)
        metrics["rollout/tokens_seen"] = float(self.tokens_seen)
        self.log_step_metrics(metrics)

    # --- 1. collect --------------------------------------------------------------------------
    def sampling_params(self) -> SamplingParams:
        r = self.rollout_cfg
        # looping responses are stopped and flagged (rollout.repetition; evaluation does not use it)
        # rollout.dtype: the fast sampler rounds its weights to it; vLLM took it when it started
        dtype = r.get("dtype", "auto")
        weights_dtype = DTYPES[dtype] if dtype != "auto" and r.engine != "vllm" else None
        return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                              top_k=r.top_k, return_support=self.keep_sampling_mask,
                              repetition=repetition_rule(r.get("repetition")), weights_dtype=weights_dtype)

    def rank_seed(self, base: int) -> int:
        """A generator seed of this rank: the run's own seed in a single process."""
        return rank_seed(base, *rank_and_world())

    def sample_and_score(self, examples, first_group: int, generator, group_size: int | None = None):
        """`group_size` (default: the algorithm's) samples of each example with the trainer's
        policy, scored: (Experience, reward metrics)."""
        self.collector.version = self.train_batches_seen
        return self.collector.sample_and_score(examples, first_group, generator, group_size)

    def collect(self, step: int) -> tuple[Experience, dict, bool]:
        """Rollout batch `step` from the producer (the synchronous one: sampled now, by this
        process), with what the ranks must agree on all-reduced. Returns the batch, its
        metrics, and whether any rank has a group with a reward spread (without one, no
        optimiser step is taken)."""
        produced = self.producer.next_batch(step)
        if not isinstance(self.producer, InlineProducer):
            # the producer drew the prompts: its curriculum's state after this batch becomes ours
            self.curriculum.load_state_dict(produced.state["curriculum"])
        self.collector_state = produced.state
        exp = produced.experience.to(self.device)
        metrics = dict(produced.metrics)
        if self.max_staleness or self.partial_budget or not isinstance(self.producer, InlineProducer):
            metrics.update(self.staleness_metrics(exp, step, produced.generate_s,
                                                  metrics.pop("rollout/pending_responses", 0.0)))
        # the first round is an unbiased sample of the policy: what curricula and logs should
        # see, over every rank's first round, so that a curriculum decides alike on every rank
        # (a NaN accuracy, a reward without a verifier, is NaN on every rank); in the same
        # collective, the budget counters: the completions and response tokens sampled for the
        # batch, dynamic sampling's dropped rounds included
        reward_sum, correct_sum, rows, sampled_rows, sampled_tokens = all_reduce_sum(
            torch.tensor(produced.first_round + produced.sampled, dtype=torch.float64, device=self.device)).tolist()
        self.samples_seen += int(sampled_rows)
        self.tokens_seen += int(sampled_tokens)
        metrics["rollout/prefilter_reward_mean"] = reward_sum / rows
        if not math.isnan(correct_sum):
            metrics["rollout/prefilter_accuracy"] = correct_sum / rows
        has_signal = bool(all_reduce_sum(torch.tensor(float(produced.kept_any), device=self.device)) > 0)
        return exp, metrics, has_signal

    def staleness_metrics(self, exp: Experience, step: int, generate_s: list[float],
                          pending: float) -> dict[str, float]:
        """How far behind the trainer's policy (version `step`) the batch's tokens were sampled,
        and how many responses were continued from an earlier generate call (partial rollouts),
        over every rank's rows; and this rank's generate calls (the longest is how long the batch
        waited for its longest response). `pending`: this rank's responses under way."""
        mask = exp.response_mask
        lag = (step - exp.policy_version).double() * mask
        continued = (exp.segments > 1).double()
        sums = all_reduce_sum(torch.stack([lag.sum(), mask.double().sum(), continued.sum(),
                                           torch.tensor(float(len(exp)), dtype=torch.float64, device=self.device),
                                           torch.tensor(pending, dtype=torch.float64, device=self.device)])).tolist()
        maxima = all_reduce_max(torch.stack([lag.max(), exp.segments.double().max()])).tolist()
        metrics = {"rollout/staleness_mean": sums[0] / max(sums[1], 1.0), "rollout/staleness_max": maxima[0]}
        if self.partial_budget:
            metrics.update({"rollout/continued_frac": sums[2] / max(sums[3], 1.0), "rollout/segments_max": maxima[1],
                            "rollout/pending_responses": sums[4]})
        if generate_s:
            metrics.update({"perf/generate_s": sum(generate_s), "perf/longest_generate_s": max(generate_s)})
        return metrics

    def any_rank_needs(self, need: int) -> bool:
        """Whether some rank's batch still needs groups: the ranks take the same number of
        sampling rounds."""
        return bool(all_reduce_max(torch.tensor(need, device=self.device)) > 0)

    @torch.no_grad()
    def apply_constraint(self, exp: Experience) -> tuple[Experience, dict]:
        """reward.constraint, E[cost] <= limit: each sample's reward becomes
        r - lambda * max(0, cost - limit) with the lambda of this batch (core.constrained_reward), then
        lambda takes its step from the batch's mean cost (core.pid_multiplier_step: dual ascent with
        kp = kd = 0). The mean is
        over every rank's rows, so every rank holds one lambda, that of a 1-process run on the union
        of their batches. Every later stage (advantages, rollout/reward_mean) sees the penalised
        reward; rewards/total/mean stays the reward stage's, without it. Logged: the lambda after
        the step (the next batch's), the mean cost, its excess over the limit, the share of samples
        over it and the mean penalty."""
        limit, applied = self.constraint["limit"], self.multiplier.value
        scores = core.constrained_reward(exp.scores, exp.cost, applied, limit)
        cost = exp.cost.double()
        sums = torch.stack([cost.sum(), (cost > limit).double().sum(), (exp.scores - scores).double().sum(),
                            torch.tensor(float(len(exp)), dtype=torch.float64, device=cost.device)])
        cost_sum, over, penalty, rows = all_reduce_sum(sums).tolist()
        mean_cost = cost_sum / rows
        self.multiplier = core.pid_multiplier_step(self.multiplier, mean_cost, limit, ki=self.constraint["lr"],
                                                   kp=self.constraint.get("kp", 0.0), kd=self.constraint.get("kd", 0.0))
        metrics = {"rewards/constraint/lambda": self.multiplier.value, "rewards/constraint/cost_mean": mean_cost,
                   "rewards/constraint/violation": mean_cost - limit, "rewards/constraint/over_limit_frac": over / rows,
                   "rewards/constraint/penalty_mean": penalty / rows}
        return replace(exp, scores=scores), metrics

    # --- 2. annotate -------------------------------------------------------------------------
    @torch.no_grad()
    def annotate(self, exp: Experience) -> Experience:
        for field, score in self.scorers:
            setattr(exp, field, score(exp))
        return exp

    # --- 3. advantages -----------------------------------------------------------------------
    @torch.no_grad()
    def compute_advantages(self, exp: Experience) -> tuple[Experience, dict]:
        mask = exp.response_mask
        last = (mask.sum(dim=1).long() - 1).clamp(min=0)
        step_options = {}
        if self.advantage_name == "prm_step":
            # each step's process reward at its last token; the other components' part of the
            # score (an outcome reward mixed in) joins it at the last token, which ends the last step
            token_rewards = exp.step_rewards.clone()
            token_rewards[torch.arange(len(last)), last] += exp.scores.float() - exp.step_rewards.sum(dim=1)
            step_options["step_mask"] = exp.step_mask
        else:
            token_rewards = torch.zeros_like(mask)
            token_rewards[torch.arange(len(last)), last] = exp.scores.float()
        metrics = {}
        if self.kl_in_reward:
            kl = core.kl_penalty(self.kl_name, exp.old_logp, exp.ref_logp, exp.old_logp, **self.kl_options)
            token_rewards = core.apply_kl_in_reward(token_rewards, kl, self.kl_controller.value, mask)
            # the KL part of each sequence's return, batch mean
            metrics["rewards/kl_penalty"] = float(-self.kl_controller.value * core.masked_sum(kl, mask) / len(exp))
        exp.token_rewards = token_rewards
        # batch statistics (whitening, scale=batch) are those of every rank's rows together
        exp.advantages, exp.returns = core.compute_advantages(self.advantage_name, token_rewards, mask,
                                                              exp.group_index, values=exp.values,
                                                              batch_sum=all_reduce_sum,
                                                              **self.advantage_options, **step_options)
        if self.distill_mode == "reward":
            # on-policy distillation: each token's own reward coef * (log p_T(y_t) - log p_S(y_t)),
            # the negated sample of reverse KL, is added to its advantage as it is (no baseline,
            # no discount): E[grad] of the policy loss is then -coef * grad KL(p_S || p_T)
            distill_reward = -self.distill_coef() * core.reverse_kl_sampled(exp.old_logp, exp.teacher_logp)
            exp.advantages = exp.advantages + distill_reward * mask
            metrics["distill/reward_mean"] = float(core.masked_mean(distill_reward, mask))
        if exp.values is not None:
            metrics["critic/explained_var"] = float(core.explained_variance(exp.values, exp.returns, mask))
            metrics["critic/returns_mean"] = float(core.masked_mean(exp.returns, mask))
        return exp, metrics

    # --- 4. update ---------------------------------------------------------------------------
    def loss_mask(self, exp: Experience) -> torch.Tensor:
        """The tokens the loss terms see: every generated token, less the truncated responses
        when `mask_truncated` is set (overlong filtering). Counts follow this mask."""
        if not self.mask_truncated:
            return exp.response_mask
        return core.drop_truncated(exp.response_mask, exp.truncated)

    def update(self, exp: Experience, has_signal: bool = True) -> dict[str, float]:
        """ppo_epochs x num_minibatches optimiser steps on one rollout batch (see module doc)."""
        self.batches_without_signal = 0 if has_signal else self.batches_without_signal + 1
        if self.batches_without_signal >= MAX_BATCHES_WITHOUT_SIGNAL:
            raise RewardError(f"{self.batches_without_signal} rollout batches in a row had no group with a reward "
                              f"spread, so no step was taken: check the reward (reward=...) and the prompts' "
                              f"difficulty (data.*, data_curriculum=...)")
        train_policy = has_signal and self.train_batches_seen >= self.critic_warmup_batches
        if not train_policy and self.critic is None:
            return {"perf/skipped_update": 1.0}
        generator = torch.Generator().manual_seed(self.rank_seed(self.seed * 7919 + self.train_batches_seen))
        # what a rank computes, weighted 0, in the micro-batches it runs beyond its own rows (see
        # accumulate_gradients), also in a minibatch it has no rows of (more minibatches than rows)
        stand_in = exp.select(torch.zeros(1, dtype=torch.long, device=self.device))
        totals: dict[str, float] = {}
        updates: dict[str, int] = {}
        mismatch: dict[str, float] = {}
        for _ in range(self.ppo_epochs):
            order = torch.randperm(len(exp), generator=generator).to(self.device)
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
            metrics.update(self.mismatch_metrics(mismatch))
        metrics["perf/nonfinite_grad_steps"] = float(self.nonfinite_steps)
        if not train_policy:
            metrics["perf/skipped_update"] = 1.0
        return metrics

    def minibatch_step(self, exp: Experience, train_policy: bool, stand_in: Experience | None = None) -> dict[str, float]:
        """One optimiser step per trainable role over a minibatch (`stand_in`: see accumulate_gradients)."""
        optimizers = self.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        for optimizer in optimizers:
            optimizer.zero_grad()
        sums = self.accumulate_gradients(exp, train_policy, stand_in)
        if train_policy:
            sums["policy/grad_norm"] = self.optimiser_step(optimizers[0], self.policy_parameters(), self.max_grad_norm,
                                                           count_step=True)
        if self.critic is not None:  # also in the critic's warm-up, when the policy does not step
            sums["critic/grad_norm"] = self.optimiser_step(optimizers[1], self.critic_parameters(),
                                                           self.critic_cfg.max_grad_norm, count_step=False)
        for optimizer in optimizers:  # set to None: a policy-sized buffer would otherwise sit through the rollout
            optimizer.zero_grad(set_to_none=True)
        return sums

    def accumulate_gradients(self, exp: Experience, train_policy: bool = True,
                             stand_in: Experience | None = None) -> dict[str, float]:
        """Backward of the summed loss terms over the minibatch's micro-batches, with token and
        sequence counts summed over micro-batches and ranks (so the gradient is the full
        batch's, however it is split). Returns the terms' stats.

        Every rank runs as many micro-batches as the rank with the most (under FSDP each forward
        and backward is a collective): a rank with fewer rows pads with micro-batches of
        `stand_in` (a one-row Experience; default: exp's first row) whose loss is weighted 0, so
        they add exactly nothing to the gradient or the stats."""
        mask = self.loss_mask(exp)
        num_tokens, num_seqs = core.count_tokens_and_seqs(mask, count_empty_rows=self.aggregation["count_empty_rows"])
        counts = dict(num_tokens=all_reduce_sum(num_tokens), num_seqs=all_reduce_sum(num_seqs),
                      dp_size=rank_and_world()[1])
        aggregation = {**self.aggregation, **counts}
        train_critic = self.critic is not None
        micro = self.micro_batch_size or max(1, len(exp))
        starts = range(0, len(exp), micro)
        num_micro = int(all_reduce_max(torch.tensor(len(starts), device=self.device)))
        stand_in = stand_in if stand_in is not None else exp.select(torch.zeros(1, dtype=torch.long, device=self.device))
        sums: dict[str, float] = {}
        for index in range(num_micro):
            padding = index >= len(starts)
            if padding:
                part, part_mask = stand_in, self.loss_mask(stand_in)
            else:
                start = starts[index]
                part = exp.select(torch.arange(start, min(start + micro, len(exp)), device=self.device))
                part_mask = mask[start:start + micro]
            logp, entropy, values, logits = self.training_forward(part, with_values=train_critic)
            teacher_logits = None
            if self.distill_mode == "full" and train_policy:
                teacher_logits = self.teacher_logits(part)
                part.teacher_logp = self.logprobs_from(teacher_logits, part, with_entropy=False)[0]
            mb = MicroBatch(exp=part, mask=part_mask, logp=logp, entropy=entropy, values=values,
                            old_logp=logp.detach() if part.old_logp is None else part.old_logp,
                            aggregation=aggregation, logits=logits if teacher_logits is not None else None,
                            teacher_logits=teacher_logits)
            losses, stats = [], {}
            for term in (self.terms if train_policy else []) + ([self.value_term] if train_critic else []):
                loss, term_stats = term(mb)
                losses.append(loss)
                stats.update({f"{term.prefix}/{k}": float(v) for k, v in term_stats.items()})
            if losses:
                # a stand-in's backward still runs (FSDP's reduce-scatter), with a zero gradient
                self.manual_backward(torch.stack(losses).sum() * (0.0 if padding else 1.0))
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
        if train_policy and self.ptx_coef:
            sums.update(self.ptx_step())
        return sums

    def mismatch_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """`rollout/mismatch/*` of the whole batch, every rank's tokens together, from the
        policy term's sums (core.mismatch_metrics): the same values on every rank."""
        added = all_reduce_sum(torch.tensor([sums.get(k, 0.0) for k in core.MISMATCH_SUM_KEYS],
                                            dtype=torch.float64, device=self.device))
        maxima = all_reduce_max(torch.tensor([sums.get(k, 0.0) for k in core.MISMATCH_MAX_KEYS],
                                             dtype=torch.float64, device=self.device))
        reduced = {**dict(zip(core.MISMATCH_SUM_KEYS, added)), **dict(zip(core.MISMATCH_MAX_KEYS, maxima))}
        return {f"rollout/mismatch/{k}": float(v) for k, v in core.mismatch_metrics(reduced).items()}

    def check_mismatch_budget(self, metrics: dict[str, float], step: int) -> None:
        """`rollout.mismatch_budget`: a batch whose mismatch KL or masked share (all-reduced, so
        every rank decides alike) is over its ceiling is counted, and warned about or stops the
        run. The count, `rollout/mismatch/over_budget_batches`, goes into summary.json, and
        posttrain-report marks a run with any such batch invalid."""
        budget = self.mismatch_budget
        ceilings = {"kl": budget.get("kl"), "masked_frac": budget.get("masked_frac")}
        if all(ceiling is None for ceiling in ceilings.values()):
            return
        over = [f"rollout/mismatch/{name} = {metrics[f'rollout/mismatch/{name}']:.4g} > {ceiling}"
                for name, ceiling in ceilings.items()
                if ceiling is not None and metrics.get(f"rollout/mismatch/{name}", 0.0) > ceiling]
        if over:
            self.mismatch_over_budget += 1
            message = (f"rollout batch {step}: the sampler and the trainer disagree beyond rollout.mismatch_budget "
                       f"({'; '.join(over)})")
            if budget.get("action", "warn") == "stop":
                raise MismatchError(f"{message}; the run stops (rollout.mismatch_budget.action=stop)")
            if rank_and_world()[0] == 0:
                log.warning(f"{message}: the run is marked invalid (summary.json, posttrain-report)")
        metrics["rollout/mismatch/over_budget_batches"] = float(self.mismatch_over_budget)

    def training_forward(self, exp: Experience, with_values: bool):
        """(log pi_theta (with gradient), entropy (with gradient only when weighted), the critic's
        V(s_t) or None — one backbone pass when the critic shares the policy's — and the logits
        [b, T, V] or None). The log-probs come from hidden states with the LM head applied chunk
        by chunk (models.forward.sequence_logprobs): no [b, T, V] logits exist, except under
        distill.mode=full, whose full-vocabulary divergence reads them (the only case that
        returns them)."""
        options = dict(with_entropy=True, entropy_grad=bool(self.entropy_coef), **self.scoring_options(exp))
        batch = (exp.prompt_ids, exp.prompt_mask, exp.response_ids, exp.response_mask)
        logits = None
        if with_values and self.shared_critic:
            hidden = sequence_hidden_states(self.policy, *batch)
            values = self.critic.values(hidden)
            weight, bias = lm_head_weights(self.policy)
            if self.distill_mode == "full":
                logits = torch.nn.functional.linear(hidden, weight, bias)
                logp, entropy = self.logprobs_from(logits, exp, with_entropy=True, entropy_grad=options["entropy_grad"])
            else:
                logp, entropy = logprobs_from_hidden(hidden, weight, bias, exp.response_ids, exp.response_mask,
                                                     **options)
            return logp, entropy, values, logits
        if self.distill_mode == "full":
            logits = sequence_logits(self.policy, *batch)
            logp, entropy = self.logprobs_from(logits, exp, with_entropy=True, entropy_grad=options["entropy_grad"])
        else:
            logp, entropy = sequence_logprobs(self.policy, *batch, **options)
        values = self.critic(*batch) if with_values else None
        return logp, entropy, values, logits

    def token_logprobs(self, model, exp: Experience):
        """(log-probs, None) of the response tokens under ``model`` (a scorer's forward), from its
        hidden states chunk by chunk (no [b, T, V] logits)."""
        return sequence_logprobs(model, exp.prompt_ids, exp.prompt_mask, exp.response_ids, exp.response_mask,
                                 with_entropy=False, **self.scoring_options(exp))

    @torch.no_grad()
    def teacher_logits(self, exp: Experience) -> torch.Tensor:
        """The frozen teacher's logits [b, T, V] on a micro-batch (distill.mode=full)."""
        return sequence_logits(self.teacher, exp.prompt_ids, exp.prompt_mask, exp.response_ids, exp.response_mask)

    def distill_coef(self) -> float:
        """The distillation weight at this rollout batch: `distill.coef`, annealed by
        `distill.coef_schedule` (core.scheduled_coef)."""
        schedule = dict(self.distill.get("coef_schedule") or {"name": "constant"})
        return core.scheduled_coef(schedule.pop("name"), self.train_batches_seen, start=self.distill["coef"],
                                   **schedule)

    def reference_logprobs(self, exp: Experience) -> torch.Tensor:
        """log pi_ref of the response tokens: the frozen reference's, or a LoRA policy's with its
        adapter switched off (models.lora.reference_model)."""
        with reference_model(self.policy, self.reference) as model:
            return self.token_logprobs(model, exp)[0]

    def logprobs_from(self, logits, exp: Experience, with_entropy: bool, entropy_grad: bool = True):
        """Per-token log-probs (and entropy) of full logits (distill.mode=full), with the options
        of `scoring_options`, computed in fp32 chunk by chunk."""
        return core.token_logprobs_and_entropy(logits, exp.response_ids, with_entropy=with_entropy,
                                               entropy_grad=entropy_grad, **self.scoring_options(exp))

    def scoring_options(self, exp: Experience) -> dict:
        """How every log-prob is taken: at the sampling temperature, over the sampler's kept
        top-k/top-p support when keep_sampling_mask (V3.2)."""
        return dict(support_size=exp.support_size if self.keep_sampling_mask else None,
                    temperature=self.sampling_params().logprob_temperature)

    def policy_parameters(self):
        return [p for p in self.policy.parameters() if p.requires_grad]

    def critic_parameters(self):
        """What the critic's optimiser steps: with a shared backbone only the value head (the
        backbone is the policy's, stepped by the policy's optimiser with the value loss's
        gradient in it), else the critic's own backbone and head."""
        return list(self.critic.head.parameters()) if self.shared_critic else self.critic.trainable_parameters()

    def optimiser_step(self, optimizer, parameters, max_norm, count_step: bool) -> float:
        """Average gradients over ranks, skip (and count) a step whose gradient norm is not
        finite, clip (`clip_by_norm`), step, advance the schedule. `count_step`: the policy's
        steps are Lightning's global step; the critic's are not."""
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
            self.clip_by_norm(optimizer, parameters, max_norm, total)
        schedules = self.lr_schedulers()
        schedules = schedules if isinstance(schedules, list) else [schedules]
        if count_step:
            optimizer.step()
            schedules[0].step()
            self.policy_updated()
        else:
            optimizer.optimizer.step()  # the raw optimiser: not one of Lightning's global steps
            schedules[1].step()
        return norm

    def ptx_step(self) -> dict[str, float]:
        """PPO-ptx (InstructGPT): + ptx_coef * (-mean log pi) on a batch of pretraining text
        (algorithm.ptx_data) or, without one, of the task's supervised data, accumulated into
        the policy's gradient before its step."""
        if self.ptx_data is None:  # the task's supervised data: the loss on the reference responses
            batch = collate_sft(self.ptx_cursor.take(self.ptx_batch_size), self.tokenizer)
        else:  # chunks of pretraining text: the loss on every token after the first
            ids = torch.stack(self.ptx_cursor.take(self.ptx_batch_size))
            batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        batch = {k: v.to(self.device) for k, v in batch.items()}
        logits = self.policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        labels = batch["labels"][:, 1:]
        logp, _ = core.token_logprobs_and_entropy(logits, labels, with_entropy=False)
        mask = (labels >= 0).float()
        num_tokens = all_reduce_sum(mask.sum())
        loss = core.ptx_loss(logp, mask, num_tokens=num_tokens, dp_size=rank_and_world()[1])
        self.manual_backward(self.ptx_coef * loss)
        return {"ptx/loss": float(loss.detach())}

    # --- pass rates (curricula) ----------------------------------------------------------------
    @torch.no_grad()
    def estimate_pass_rates(self, examples, samples_per_prompt: int = 8) -> list[float]:
        """Fraction of correct samples per prompt under the current policy (curricula)."""
        rates = []
        generator = torch.Generator(device=self.device).manual_seed(self.seed + 7)
        chunk = max(1, 256 // samples_per_prompt)
        for start in range(0, len(examples), chunk):
            exp, _ = self.sample_and_score(examples[start:start + chunk], start, generator, samples_per_prompt)
            rates += exp.correct.view(-1, samples_per_prompt).mean(dim=1).tolist()
        return rates

    @staticmethod
    def rollout_metrics(exp: Experience) -> dict[str, float]:
        lengths = exp.response_mask.sum(dim=1)
        informative = core.informative_groups(exp.scores, exp.group_index)
        flat_groups = exp.group_index[~informative].unique().numel() / exp.group_index.unique().numel()
        metrics = {
            "rollout/reward_mean": float(exp.scores.mean()),
            "rollout/reward_std": float(exp.scores.std()) if len(exp.scores) > 1 else 0.0,
            "rollout/response_len_mean": float(lengths.mean()),
            "rollout/truncated_frac": float(exp.truncated.float().mean()),
            "rollout/frac_zero_std_groups": flat_groups,
        }
        if exp.repeated is not None:
            metrics["rollout/repetition_frac"] = float(exp.repeated.float().mean())
        if exp.prm_stopped is not None:
            metrics["rollout/prm_stop_frac"] = float(exp.prm_stopped.float().mean())
        if not torch.isnan(exp.correct).any():
            metrics["rollout/accuracy"] = float(exp.correct.mean())
        return metrics


def autocast_dtype(precision) -> torch.dtype | None:
    """The autocast dtype of a Lightning precision setting (None: no autocast)."""
    return {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(str(precision))


def process_reward_of(reward_fn):
    """The composite's process reward component (reward=prm) when it weighs in, else None."""
    for fn, weight in reward_fn.components:
        if hasattr(fn, "take_step_rewards") and weight:
            return fn
    return None


def check_process_options(module: OnlineRLModule, advantage_name: str) -> None:
    """ConfigErrors naming the keys for step-level options without a process reward to read."""
    rules.refuse(rules.prm_step_problem(advantage_name, module.process_reward is not None))
    if advantage_name == "prm_step" and module.kl_in_reward:
        raise ConfigError("advantage=prm_step reads rewards at step ends only, so kl_estimator.placement=in_reward "
                          "would drop the per-token KL: use kl_estimator.placement=as_loss")
    if module.prm_stop_below is not None and module.process_reward is None:
        raise ConfigError(f"rollout.prm_stop_below={module.prm_stop_below} cuts responses at a low process reward, "
                          f"but the reward has no PRM: use reward=prm, or rollout.prm_stop_below=null")


def check_distill(distill: dict, advantage_name: str, teacher_role) -> None:
    """ConfigErrors naming the key for an `algorithm.distill` node that cannot run, before
    the teacher is loaded."""
    has_teacher = bool(teacher_role.get("name_or_path") or teacher_role.get("init_from"))
    rules.refuse(rules.teacher_problem(True, has_teacher, "algorithm.distill"))
    if "mode" not in distill:
        raise ConfigError(f"algorithm.distill.mode is not set: one of {list(DISTILL_MODES)}")
    choices = {"mode": DISTILL_MODES, "mask": DISTILL_MASKS, "divergence": tuple(core.DISTILL_DIVERGENCES),
               "estimator": tuple(core.KDRL_ESTIMATORS)}
    for key, allowed in choices.items():
        if key in distill and distill[key] not in allowed:
            raise ConfigError(f"algorithm.distill.{key}={distill[key]!r} is not one of {list(allowed)}")
    rules.refuse(rules.distill_reward_problem(distill["mode"], advantage_name))
    schedule = dict(distill.get("coef_schedule") or {"name": "constant"})
    try:
        core.scheduled_coef(schedule.pop("name", None), 0, start=distill.get("coef", 0.0), **schedule)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"algorithm.distill.coef_schedule: {err}") from None


def check_core_options(module: OnlineRLModule) -> None:
    """Run the configured advantage, policy loss and KL estimator once on a dummy batch of two
    one-token samples, so that an option a formula does not take (dual_clip with gspo, a clamp
    on an estimator without one) or a bad value is a ConfigError at start-up, not a crash at
    the first step."""
    ones = torch.ones(2, 1)
    values = ones if module.advantage_name == "gae" else None
    steps = {"step_mask": ones.bool()} if module.advantage_name == "prm_step" else {}
    try:
        core.compute_advantages(module.advantage_name, ones, ones, torch.tensor([0, 0]), values=values,
                                **module.advantage_options, **steps)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"advantage={module.advantage_name}: {err}") from None
    try:
        core.compute_policy_loss(module.policy_loss, ones, ones, ones, ones, **module.loss_options,
                                 **module.aggregation)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"algorithm.policy_loss={module.policy_loss}: {err}") from None
    if module.uses_reference:
        try:
            core.kl_penalty(module.kl_name, ones, ones, ones, **module.kl_options)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"kl_estimator={module.kl_name}: {err}") from None
