"""One online-RL LightningModule for every online algorithm: the GRPO family (GRPO, Dr. GRPO,
DAPO, GSPO, CISPO, SAPO, the DeepSeek-V3.2 fixes), PPO, on-policy distillation (OPD), KDRL,
Long2Short and PRM-RL are configurations of it (docs/algorithms.md).

This file is the small core: Lightning's hooks and the four-stage step. The update is the
learner's (learner.py); who samples, the producer's (rollouts.py, collect.py, producer.py);
every optional capability is a part (part.py, parts/), built only when its config is on:

  reference.py        the KL against the frozen reference, in the reward or as a loss
  critic.py           PPO's value model, GAE's values, the value loss, its own optimiser
  distillation.py     a frozen teacher: a per-token reward, a full-vocabulary or a KDRL loss
  ptx.py              PPO-ptx: the LM loss on pretraining text
  process_rewards.py  a PRM's step rewards (reward=prm, advantage=prm_step)
  constraint.py       reward.constraint's Lagrange multiplier
  mismatch.py         the train-inference correction's budget (rollout.mismatch_budget)

One `training_step` is one rollout batch, four named and timed stages over an `Experience`
(`perf/<stage>_s`), as in the papers' algorithm boxes:

  1. collect     prompts from the curriculum -> `group_size` samples each -> rewards, by this
                 process or a producer up to rollout.max_staleness versions ahead
  2. annotate    each scorer fills one Experience field: old log-probs (only when a stage reads
                 them), and the parts' (reference log-probs, critic values, teacher log-probs)
  3. advantages  the score at the last token, shaped by the parts (step rewards, the KL in
                 the reward) -> `core.compute_advantages`; then the parts' additions
  4. update      the learner: ppo_epochs x minibatches x micro-batches of the summed terms

`trainer.max_steps` counts policy optimiser steps; `train_batches_seen` counts rollout
batches (evaluation, logging and curricula follow it). What a decision reads (a controller,
lambda, a curriculum's accuracy, the "no signal" skip, whitening) is reduced over the ranks.
"""

from __future__ import annotations

import hashlib
import time

import torch

from posttrain import core
from posttrain.algorithms import rules
from posttrain.algorithms.base import PosttrainModule
from posttrain.algorithms.experience import Experience, last_token_index
from posttrain.algorithms.formulas import check_formulas, resolve_formulas
from posttrain.algorithms.online.collect import CollectSettings
from posttrain.algorithms.online.learner import LEARNER_OPTIONS, Learner, Scoring, Steppers
from posttrain.algorithms.online.parts import in_hook_order, model_parts, reward_parts, update_parts
from posttrain.algorithms.online.parts import ptx as ptx_part
from posttrain.algorithms.online.parts.mismatch import correction_of
from posttrain.algorithms.online.rollouts import Rollouts, rollout_metrics, sampling_params
from posttrain.algorithms.online.sampler import PolicySampler
from posttrain.algorithms.online.terms import EntropyTerm, PolicyTerm
from posttrain.core.options import resolve_options
from posttrain.data.curriculum import build_curriculum
from posttrain.data.datamodule import ExampleCursor
from posttrain.distributed.collectives import all_reduce_sum, is_dtensor, rank_and_world, this_ranks, with_every_rank
from posttrain.distributed.sharding import full_weights
from posttrain.envs.build import build_env, turn_tokens
from posttrain.errors import ConfigError
from posttrain.models.loading import stop_token_ids
from posttrain.rewards import build_reward

# The model roles a part may bring (attributes of the module, so Lightning moves and shards them).
ROLES = ("reference", "critic", "teacher")
FROZEN_ROLES = ("reference", "teacher")
# algorithm keys the module reads itself, besides the learner's and the parts' declared options
PART_NODES = ("critic", "distill")


class OnlineRLModule(PosttrainModule):
    """Online RL as collect -> annotate -> advantages -> update (see the module docstring)."""

    train_collate = None  # the module draws its own prompts through the curriculum

    def __init__(self, policy, tokenizer, source, optim, rollout, eval_max_new_tokens, *, kl_estimator, advantage,
                 reward, data_curriculum, roles, cache_dir=None, seed: int = 0, env=None, **algorithm):
        refuse_unknown_keys(algorithm)
        declared = LEARNER_OPTIONS + ptx_part.OPTIONS
        own = {k: v for k, v in algorithm.items() if k in {o.name for o in declared}}
        try:
            settings = resolve_options("algorithm", declared, own)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        super().__init__(policy, tokenizer, source, optim, rollout, eval_max_new_tokens, settings["max_grad_norm"])
        rules.refuse(rules.sampling_mask_problem(settings["keep_sampling_mask"], rollout.top_k, rollout.top_p))
        self.automatic_optimization = False
        self.settings, self.seed, self.cache_dir, self.curriculum_cfg = settings, seed, cache_dir, data_curriculum
        self.batch_size = self.prompts_per_step = settings["prompts_per_step"]
        self.group_size = settings["group_size"]
        self.reward_cfg = reward
        self.env, self.turn_tokens = build_env(env, source), turn_tokens(env)  # None: one response per prompt (envs/)

        # the policy loss, the advantage and KL estimators (formulas.py), checked on a dummy batch
        self.formulas = resolve_formulas(algorithm, advantage, kl_estimator, rollout.max_new_tokens)
        check_formulas(self.formulas)
        self.policy_loss, self.loss_options = self.formulas.policy_loss_name, self.formulas.loss_options
        self.aggregation = self.formulas.aggregation
        self.advantage_name, self.advantage_options = self.formulas.advantage_name, self.formulas.advantage_options
        self.sampling = sampling_params(rollout, settings["keep_sampling_mask"])
        self.scoring = Scoring(self.sampling.logprob_temperature, settings["keep_sampling_mask"])

        # the parts that are on, their roles registered here (Lightning moves and shards them)
        parts = model_parts(policy, roles, kl_estimator=kl_estimator, advantage_name=advantage.name,
                            critic=algorithm.get("critic"), distill=algorithm.get("distill"), scoring=self.scoring,
                            batches_seen=lambda: self.train_batches_seen)
        reference = next((p for p in parts if p.name == "reference"), None)
        self.reward_fn = build_reward(reward, source, rollout.max_new_tokens, policy=policy, tokenizer=tokenizer)
        parts += reward_parts(reward, self.reward_fn, source, rollout, advantage_name=advantage.name,
                              kl_in_reward=reference is not None and reference.in_reward)
        steppers = Steppers(backward=self.manual_backward, optimizers=self.optimizers, schedulers=self.lr_schedulers,
                            clip=self.clip_by_norm, policy_stepped=self.policy_updated)
        parts += update_parts(policy, tokenizer, source, rollout, steppers,
                              ptx={o.name: settings[o.name] for o in ptx_part.OPTIONS}, seed=seed)
        self.parts = in_hook_order(parts)
        built = {role: model for part in self.parts for role, model in part.roles().items()}
        for role in ROLES:
            setattr(self, role, built.get(role))

        # the learner: the policy's terms, then each part's
        self.policy_term = PolicyTerm(self.formulas.policy_loss, self.loss_options, settings["offpolicy_mask_delta"],
                                      correction_of(rollout))
        terms = [self.policy_term, EntropyTerm(settings["entropy_coef"])]
        terms += [term for part in self.parts for term in part.policy_terms()]
        self.learner = Learner(policy, self.parts, terms, steppers, self.scoring, settings=settings,
                               aggregation=self.aggregation, seed=seed)

        # annotate: pi_old only when a stage reads it; with one update per batch it is the
        # current policy, whose training forward's own log-probs stand in for it (ratio 1)
        on_policy = settings["ppo_epochs"] == 1 and settings["num_minibatches"] == 1
        self.scorers = []
        if not on_policy or any(part.needs_old_logp for part in self.parts):
            self.scorers.append(("old_logp", lambda exp: self.scoring.logprobs(self.policy, exp)))
        self.scorers += [scorer for part in self.parts for scorer in part.scorers()]
        self.rollouts = Rollouts(rollout)
        self.curriculum = None  # built in setup(), when this process's rank is known
        self.train_started = time.perf_counter()  # reset when training starts (perf/elapsed_s)
        self.elapsed_before = 0.0  # training seconds of the fits before a resume (perf/elapsed_s continues them)

    # --- set-up, optimisers, checkpoints -------------------------------------------------------
    def setup(self, stage: str) -> None:
        if self.curriculum is not None:
            return
        rank, world = rank_and_world()
        cursor = ExampleCursor(self.source, "train", self.seed, rank=rank, world_size=world)
        self.curriculum = build_curriculum(self.curriculum_cfg, cursor, self.cache_dir)
        for part in self.parts:
            part.setup(rank, world)
        self.sampler = PolicySampler(self.engine, self.policy, stop_token_ids(self.tokenizer, self.policy),
                                     self.tokenizer.pad_token_id)
        collect_options = {}
        for part in self.parts:
            collect_options.update(part.collect_options())
        settings = CollectSettings(self.sampling, self.group_size, self.prompts_per_step, self.seed,
                                   self.sampler.eos_ids, partial_budget=self.rollouts.partial_budget, env=self.env,
                                   turn_tokens=self.turn_tokens, **collect_options)
        self.rollouts.build(self.sampler, self.tokenizer, self.source, self.curriculum, self.reward_fn, settings,
                            self.device)

    def configure_model(self) -> None:
        super().configure_model()
        if getattr(self, "sampler", None) is not None:  # sample through the engine the strategy wrapped
            self.sampler.engine = self.engine

    def configure_optimizers(self):
        policy = self.make_optimizer(self.learner.policy_parameters(), self.optim)
        roles = [self.make_optimizer(part.role_parameters(), part.role_optim) for part in self.learner.roles]
        return [policy, *roles] if roles else policy

    def frozen_roles(self) -> list[str]:
        return [role for role in FROZEN_ROLES if getattr(self, role) is not None]

    def on_save_checkpoint(self, checkpoint):
        super().on_save_checkpoint(checkpoint)
        # frozen roles are rebuilt from their config on resume, not stored in every checkpoint
        prefixes = tuple(f"{role}." for role in self.frozen_roles())
        if prefixes:
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith(prefixes)}
        with_every_rank(checkpoint, "curriculum", self.curriculum.state_dict())  # the ranks' positions differ
        checkpoint["nonfinite_steps"] = self.learner.nonfinite_steps
        checkpoint["elapsed_s"] = self.elapsed_s()
        self.rollouts.save(checkpoint)
        for part in self.parts:
            part.save(checkpoint)

    def on_load_checkpoint(self, checkpoint):
        super().on_load_checkpoint(checkpoint)
        for role in self.frozen_roles():
            checkpoint["state_dict"].update({f"{role}.{k}": v for k, v in getattr(self, role).state_dict().items()})
        self.curriculum.load_state_dict(this_ranks(checkpoint, "curriculum"))
        self.learner.nonfinite_steps = checkpoint.get("nonfinite_steps", 0)
        self.elapsed_before = checkpoint.get("elapsed_s", 0.0)
        self.rollouts.load(checkpoint)
        for part in self.parts:
            part.load(checkpoint)

    def on_train_start(self):
        # not on_fit_start: under trainer=ddp and fsdp Lightning restores a checkpoint after
        # on_fit_start, and here a restored curriculum is already in place (it rebuilds from
        # its state and estimates nothing); pass rates are estimated under the training precision
        self.train_started = time.perf_counter()
        settings = {"samples_per_prompt": 8, "rollout": str(self.rollout_cfg), "reward": str(self.reward_cfg),
                    "seed": self.seed}
        with self.training_precision():
            self.curriculum.setup(self.estimate_pass_rates, self.weights_fingerprint, settings)
        with full_weights(self.policy):
            # a producer process samples in the training precision, as this process would
            precision = autocast_dtype(self.trainer.precision) if self.rollouts.kind == "process" else None
            self.rollouts.start(self.train_batches_seen, self.policy, precision)

    def on_train_end(self):
        self.rollouts.close()

    def teardown(self, stage: str) -> None:
        self.rollouts.close()

    def elapsed_s(self) -> float:
        """Wall-clock seconds since training began, those of the fits before a resume included."""
        return self.elapsed_before + time.perf_counter() - self.train_started

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

    # --- the training step: four stages ------------------------------------------------------
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
        for part in self.parts:  # the batch as consumed (the constraint's penalty, with the trainer's lambda)
            exp, part_metrics = part.after_collect(exp)
            metrics.update(part_metrics)
        exp = timed("annotate", self.annotate, exp.without_trailing_padding())
        exp, advantage_metrics = timed("advantages", self.compute_advantages, exp)
        metrics.update(timed("update", self.update, exp, has_signal))
        for part in self.parts:  # controllers step, budgets are checked
            part.after_update(exp, metrics, step)
        metrics.update(advantage_metrics)
        metrics.update(rollout_metrics(exp))
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
            self.rollouts.publish(self.train_batches_seen, self.policy, feedback)
        metrics["rollout/batch"] = float(self.train_batches_seen)
        metrics["rollout/samples_seen"] = float(self.rollouts.samples_seen)
        metrics["rollout/tokens_seen"] = float(self.rollouts.tokens_seen)
        self.log_step_metrics(metrics)

    def part(self, name: str):
        """The part called `name` (part.py), or None when it is off."""
        return next((part for part in self.parts if part.name == name), None)

    # --- 1. collect ----------------------------------------------------------------------------
    def collect(self, step: int) -> tuple[Experience, dict, bool]:
        """Rollout batch `step`, with what the ranks must agree on all-reduced (rollouts.py)."""
        return self.rollouts.next(step, self.curriculum)

    @torch.no_grad()
    def estimate_pass_rates(self, examples, samples_per_prompt: int = 8) -> list[float]:
        """Fraction of correct samples per prompt under the current policy (curricula)."""
        rates = []
        generator = torch.Generator(device=self.device).manual_seed(self.seed + 7)
        chunk = max(1, 256 // samples_per_prompt)
        for start in range(0, len(examples), chunk):
            exp, _ = self.rollouts.sample_and_score(examples[start:start + chunk], start, generator,
                                                    samples_per_prompt, version=self.train_batches_seen)
            rates += exp.correct.view(-1, samples_per_prompt).mean(dim=1).tolist()
        return rates

    # --- 2. annotate ---------------------------------------------------------------------------
    @torch.no_grad()
    def annotate(self, exp: Experience) -> Experience:
        for field, score in self.scorers:
            setattr(exp, field, score(exp))
        return exp

    # --- 3. advantages -------------------------------------------------------------------------
    @torch.no_grad()
    def compute_advantages(self, exp: Experience) -> tuple[Experience, dict]:
        mask = exp.response_mask
        token_rewards = torch.zeros_like(mask)
        residual = exp.scores.float()
        if exp.turn_rewards is not None:  # an environment's rewards where each turn earned them; the rest at the end
            token_rewards += exp.turn_rewards
            residual = residual - exp.turn_rewards.sum(dim=1)
        token_rewards[torch.arange(len(mask)), last_token_index(mask)] += residual
        metrics, options = {}, {}
        for part in self.parts:  # step rewards at step ends, the KL in the reward
            token_rewards, part_metrics = part.shape_rewards(exp, token_rewards, options)
            metrics.update(part_metrics)
        exp.token_rewards = token_rewards
        # batch statistics (whitening, scale=batch) are those of every rank's rows together
        exp.advantages, exp.returns = self.formulas.advantage(token_rewards, mask, exp.group_index, values=exp.values,
                                                              batch_sum=all_reduce_sum,
                                                              **self.advantage_options, **options)
        for part in self.parts:  # a distillation reward, the critic's fit
            metrics.update(part.after_advantages(exp))
        return exp, metrics

    # --- 4. update -----------------------------------------------------------------------------
    def update(self, exp: Experience, has_signal: bool = True) -> dict[str, float]:
        """The learner's ppo_epochs x num_minibatches optimiser steps on the batch (learner.py)."""
        return self.learner.update(exp, has_signal, self.train_batches_seen)


def algorithm_keys() -> list[str]:
    """Every key an online `algorithm` node may hold besides `_target_`, `name`, `kind` and
    `warm_start`: the learner's and the parts' declared options, and the policy loss's."""
    declared = [option.name for option in LEARNER_OPTIONS + ptx_part.OPTIONS]
    return [*declared, *PART_NODES, "policy_loss", *core.loss_options()]


def refuse_unknown_keys(algorithm: dict) -> None:
    unknown = sorted(set(algorithm) - set(algorithm_keys()))
    if unknown:
        raise ConfigError(f"algorithm: unknown key(s) {unknown}; valid keys: {', '.join(algorithm_keys())}")


def autocast_dtype(precision) -> torch.dtype | None:
    """The autocast dtype of a Lightning precision setting (None: no autocast)."""
    return {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(str(precision))

