"""The GRPO family as one LightningModule: GRPO, Dr. GRPO, DAPO, GSPO, CISPO and the
DeepSeek-V3.2 off-policy fixes. Each preset in conf/algorithm/ is only a choice of
policy loss, clip range, aggregation, advantage, KL estimator, reward and curriculum.

One training step (one rollout batch), as in the papers' algorithm boxes:
  1. prompts     <- curriculum.next_prompts(prompts_per_step)
  2. rollout     <- the engine samples `group_size` completions per prompt
  3. rewards     <- reward(samples); dynamic sampling repeats 1-3, dropping flat groups
  4. old / reference log-probs (no grad); KL subtracted from the reward if so placed
  5. advantages  <- core.compute_advantages(advantage.name, ...)
  6. ppo_epochs x minibatches: policy loss (+ beta * KL as loss - entropy bonus), one
     optimiser step per minibatch.
`trainer.max_steps` counts optimiser steps (Lightning's global step): with the default
ppo_epochs=1 and num_minibatches=1 that is one step per rollout batch.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, fields, replace

import torch

from posttrain import core
from posttrain.algorithms.base import PosttrainModule, decode_responses
from posttrain.data.curriculum import build_curriculum
from posttrain.data.datamodule import ExampleCursor
from posttrain.errors import ConfigError
from posttrain.rewards import ScoredSample, build_reward
from posttrain.rollout import SamplingParams


@dataclass
class Experience:
    """A scored rollout batch: B = prompts x group_size rows, T response columns."""

    prompt_ids: torch.Tensor        # [B, P] left-padded
    prompt_mask: torch.Tensor       # [B, P]
    response_ids: torch.Tensor      # [B, T]
    response_mask: torch.Tensor     # [B, T] float, 1 = generated token (incl. EOS)
    rollout_logprobs: torch.Tensor  # [B, T] from the sampler
    truncated: torch.Tensor         # [B] bool
    scores: torch.Tensor            # [B] total reward
    correct: torch.Tensor           # [B] float, verifier accuracy (nan when no accuracy reward)
    group_index: torch.Tensor       # [B] prompt id
    sampling_mask: torch.Tensor | None = None  # [B, T, V] kept top-k/top-p support

    def without_trailing_padding(self) -> "Experience":
        """Drop the response columns that are padding in every row. Attention is causal, so
        they never touch a real token: removing them changes no log-prob, only the cost."""
        width = max(1, int(self.response_mask.sum(dim=1).max()))
        per_token = ("response_ids", "response_mask", "rollout_logprobs", "sampling_mask")
        return replace(self, **{name: getattr(self, name)[:, :width] for name in per_token
                                if getattr(self, name) is not None})

    def select(self, rows: torch.Tensor) -> "Experience":
        return Experience(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[rows]
                             for f in fields(self)})

    @staticmethod
    def concat(parts: list["Experience"], pad_token_id: int) -> "Experience":
        """Stack rounds; prompts of different widths are left-padded to the widest."""
        width = max(p.prompt_ids.shape[1] for p in parts)

        def left_pad(x: torch.Tensor, value: int) -> torch.Tensor:
            return torch.nn.functional.pad(x, (width - x.shape[1], 0), value=value)

        merged = {}
        for f in fields(Experience):
            values = [getattr(p, f.name) for p in parts]
            if values[0] is None:
                merged[f.name] = None
            elif f.name == "prompt_ids":
                merged[f.name] = torch.cat([left_pad(v, pad_token_id) for v in values])
            elif f.name == "prompt_mask":
                merged[f.name] = torch.cat([left_pad(v, 0) for v in values])
            else:
                merged[f.name] = torch.cat(values)
        return Experience(**merged)


# Keys of the kl_estimator group that place and weigh the KL; every other key is an estimator option.
KL_PLACEMENT_KEYS = ("name", "coef", "placement", "controller", "target", "horizon")


def check_core_options(module: "GRPOModule") -> None:
    """Run the configured advantage, policy loss and KL estimator once on a dummy batch of two
    one-token samples, so that an option a formula does not take (dual_clip with gspo, a clamp
    on an estimator without one) or a bad value is a ConfigError at start-up, not a crash at
    the first step."""
    ones = torch.ones(2, 1)
    try:
        core.compute_advantages(module.advantage_name, ones, ones, torch.tensor([0, 0]), **module.advantage_options)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"advantage={module.advantage_name}: {err}") from None
    try:
        core.compute_policy_loss(module.policy_loss, ones, ones, ones, ones, **module.loss_options)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"algorithm.policy_loss={module.policy_loss}: {err}") from None
    if module.reference is not None:
        try:
            core.kl_penalty(module.kl_name, ones, ones, ones, **module.kl_options)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"kl_estimator={module.kl_name}: {err}") from None


def sequence_logits(model, prompt_ids, prompt_mask, response_ids, response_mask) -> torch.Tensor:
    """Logits predicting each response token, [B, T, V]. Positions count real tokens only,
    as the samplers do, so left padding does not shift a prompt's positions."""
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask.long(), response_mask.long()], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    width = prompt_ids.shape[1]
    return logits[:, width - 1 : -1].float()


class GRPOModule(PosttrainModule):
    """Group-relative policy optimisation and its variants (see module docstring)."""

    train_collate = None  # the module draws its own prompts through the curriculum

    def __init__(self, policy, tokenizer, source, optim, rollout, eval_max_new_tokens, *,
                 kl_estimator, advantage, reward, data_curriculum, cache_dir=None, seed: int = 0,
                 prompts_per_step: int = 16, group_size: int = 8, ppo_epochs: int = 1, num_minibatches: int = 1,
                 micro_batch_size: int | None = None, policy_loss: str = "ppo_clip", clip_low: float | None = 0.2,
                 clip_high: float | None = 0.2, dual_clip: float | None = None, delta: float | None = None,
                 log_ratio_clamp: float | None = 20.0, seq_log_ratio_clamp: float | None = None,
                 ratio_level: str = "token", tau_pos: float = 1.0, tau_neg: float = 1.05,
                 loss_agg_mode: str = "seq-mean-token-mean", norm_constant: float | None = None,
                 count_empty_rows: bool = False, mask_truncated: bool = False,
                 entropy_coef: float = 0.0, max_grad_norm: float | None = 1.0,
                 offpolicy_mask_delta: float | None = None, keep_sampling_mask: bool = False):
        super().__init__(policy, tokenizer, source, optim, rollout, eval_max_new_tokens, max_grad_norm)
        if policy_loss not in core.POLICY_LOSSES:
            raise ConfigError(f"algorithm.policy_loss={policy_loss!r} is not one of {sorted(core.POLICY_LOSSES)}")
        if loss_agg_mode not in core.AGGREGATION_MODES:
            raise ConfigError(f"algorithm.loss_agg_mode={loss_agg_mode!r} is not one of {core.AGGREGATION_MODES}")
        if advantage.name not in core.ADVANTAGE_ESTIMATORS or advantage.name in ("gae", "prm_step"):
            raise ConfigError(f"advantage={advantage.name} needs a critic or a process reward model, "
                              f"which this algorithm does not have; use group_norm, group_mean, rloo, "
                              f"reinforce_pp or reinforce_pp_baseline")
        if keep_sampling_mask and rollout.top_k == 0 and rollout.top_p >= 1.0:
            raise ConfigError("algorithm.keep_sampling_mask=true needs rollout.top_k > 0 or rollout.top_p < 1")
        self.automatic_optimization = False
        self.batch_size = prompts_per_step
        self.prompts_per_step, self.group_size = prompts_per_step, group_size
        self.ppo_epochs, self.num_minibatches, self.micro_batch_size = ppo_epochs, num_minibatches, micro_batch_size
        # Aggregation settings shared by every loss term (policy, KL), then the policy loss's own.
        self.aggregation = dict(agg_mode=loss_agg_mode, count_empty_rows=count_empty_rows,
                                norm_constant=norm_constant or rollout.max_new_tokens)  # Dr. GRPO: the budget
        self.loss_options = dict(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, delta=delta,
                                 log_ratio_clamp=log_ratio_clamp, seq_log_ratio_clamp=seq_log_ratio_clamp,
                                 ratio_level=ratio_level, tau_pos=tau_pos, tau_neg=tau_neg, **self.aggregation)
        self.policy_loss = policy_loss
        self.mask_truncated = mask_truncated
        self.entropy_coef = entropy_coef
        self.offpolicy_mask_delta, self.keep_sampling_mask = offpolicy_mask_delta, keep_sampling_mask
        self.seed = seed

        self.advantage_name = advantage.name
        self.advantage_options = {k: v for k, v in advantage.items() if k != "name"}
        self.kl_name, self.kl_placement = kl_estimator.name, kl_estimator.placement
        # every key of the kl_estimator group besides its placement and coefficient is an estimator option
        self.kl_options = {k: v for k, v in kl_estimator.items() if k not in KL_PLACEMENT_KEYS}
        uses_kl = self.kl_name != "none" and kl_estimator.coef > 0
        if uses_kl and self.kl_placement not in ("in_reward", "as_loss"):
            raise ConfigError(f"kl_estimator.placement={self.kl_placement!r} must be in_reward or as_loss")
        self.kl_controller = core.build_kl_controller(
            kl_estimator.get("controller", "fixed"),
            **({"beta": kl_estimator.coef} if kl_estimator.get("controller", "fixed") == "fixed" else
               {"init_beta": kl_estimator.coef, "target_kl": kl_estimator.target, "horizon": kl_estimator.horizon}),
        ) if uses_kl else None
        # The frozen reference exists only when a KL term needs it.
        self.reference = copy.deepcopy(policy).requires_grad_(False).eval() if uses_kl else None

        check_core_options(self)
        self.reward_fn = build_reward(reward, source, rollout.max_new_tokens)
        self.curriculum = build_curriculum(data_curriculum, ExampleCursor(source, "train", seed), cache_dir)

    # --- checkpoint state beyond the weights -------------------------------------------------
    def on_save_checkpoint(self, checkpoint):
        super().on_save_checkpoint(checkpoint)
        checkpoint["curriculum"] = self.curriculum.state_dict()
        if self.kl_controller is not None and hasattr(self.kl_controller, "state_dict"):
            checkpoint["kl_controller"] = self.kl_controller.state_dict()

    def on_load_checkpoint(self, checkpoint):
        super().on_load_checkpoint(checkpoint)
        self.curriculum.load_state_dict(checkpoint["curriculum"])
        if "kl_controller" in checkpoint:
            self.kl_controller.load_state_dict(checkpoint["kl_controller"])

    def on_fit_start(self):
        self.curriculum.setup(self.estimate_pass_rates, cache_key=self.pass_rate_cache_key())

    # --- rollout and scoring ---------------------------------------------------------------
    def sampling_params(self, greedy=False) -> SamplingParams:
        r = self.rollout_cfg
        return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                              top_k=r.top_k, return_sampling_mask=self.keep_sampling_mask)

    def sample_and_score(self, examples, first_group: int, generator) -> tuple[Experience, dict]:
        from posttrain.data.datamodule import collate_prompts

        prompts = collate_prompts(examples, self.tokenizer)
        prompt_ids = prompts["prompt_ids"].to(self.device).repeat_interleave(self.group_size, dim=0)
        prompt_mask = prompts["prompt_mask"].to(self.device).repeat_interleave(self.group_size, dim=0)
        batch = self.generate(prompt_ids, prompt_mask, self.sampling_params(), generator=generator)
        texts = decode_responses(self.tokenizer, batch.response_ids, batch.response_mask)
        lengths = batch.response_lengths().tolist()
        groups = [first_group + i // self.group_size for i in range(len(texts))]
        samples = [ScoredSample(examples[i // self.group_size], texts[i], lengths[i], bool(batch.truncated[i]), groups[i])
                   for i in range(len(texts))]
        scored = self.reward_fn(samples, self.source)
        correct = scored.correct.float() if scored.correct is not None else torch.full((len(texts),), float("nan"))
        experience = Experience(
            prompt_ids=batch.prompt_ids, prompt_mask=batch.prompt_mask, response_ids=batch.response_ids,
            response_mask=batch.response_mask.float(), rollout_logprobs=batch.logprobs, truncated=batch.truncated,
            scores=scored.total.to(self.device), correct=correct.to(self.device),
            group_index=torch.tensor(groups, device=self.device), sampling_mask=batch.sampling_mask,
        )
        return experience, scored.metrics

    def collect(self, step: int) -> tuple[Experience, dict]:
        """Steps 1-3, with dynamic sampling's extra rounds when the curriculum asks for them."""
        generator = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + step)
        kept, metrics, rounds, groups_seen, dropped = [], {}, 0, 0, 0
        need = self.prompts_per_step
        first_scores = None
        while need > 0 and rounds <= self.curriculum.max_extra_rounds:
            examples = self.curriculum.next_prompts(need if rounds == 0 else self.prompts_per_step)
            experience, reward_metrics = self.sample_and_score(examples, groups_seen, generator)
            if rounds == 0:
                metrics.update(reward_metrics)
                first_scores = experience
            groups_seen += len(examples)
            keep = self.curriculum.keep_groups(experience.scores, experience.group_index)
            dropped += int((~keep).sum()) // self.group_size
            # keep whole groups only, and no more than the batch still needs
            kept_groups = experience.group_index[keep].unique()[:need]
            kept.append(experience.select(torch.isin(experience.group_index, kept_groups)))
            need -= len(kept_groups)
            rounds += 1
        if self.curriculum.max_extra_rounds:
            metrics.update({"curriculum/extra_rounds": float(rounds - 1), "curriculum/dropped_groups": float(dropped)})
        nonempty = [k for k in kept if len(k.scores)]
        # if every group was flat even after the extra rounds, train on the first round (advantages 0)
        return (Experience.concat(nonempty, self.tokenizer.pad_token_id) if nonempty else first_scores), metrics

    def loss_mask(self, exp: Experience) -> torch.Tensor:
        """The tokens the loss terms see: every generated token, less the truncated responses
        when `mask_truncated` is set (overlong filtering). Counts follow this mask."""
        if not self.mask_truncated:
            return exp.response_mask
        return core.drop_truncated(exp.response_mask, exp.truncated)

    # --- log-probs -------------------------------------------------------------------------
    def logprobs(self, model, exp: Experience, with_entropy: bool = False):
        logits = sequence_logits(model, exp.prompt_ids, exp.prompt_mask, exp.response_ids, exp.response_mask)
        logits = logits / self.sampling_params().logprob_temperature
        if self.keep_sampling_mask and exp.sampling_mask is not None:
            # V3.2: renormalise over the support the sampler actually drew from
            support = exp.sampling_mask | ~exp.response_mask.bool()[..., None]
            logits = logits.masked_fill(~support, float("-inf"))
        logp = core.logprobs_from_logits(logits, exp.response_ids)
        entropy = core.entropy_from_logits(logits) if with_entropy else None
        return logp, entropy

    @torch.no_grad()
    def estimate_pass_rates(self, examples, samples_per_prompt: int = 8) -> list[float]:
        """Fraction of correct samples per prompt under the current policy (curricula)."""
        rates = []
        generator = torch.Generator(device=self.device).manual_seed(self.seed + 7)
        chunk = max(1, 256 // samples_per_prompt)
        saved = self.group_size
        self.group_size = samples_per_prompt
        try:
            for start in range(0, len(examples), chunk):
                exp, _ = self.sample_and_score(examples[start:start + chunk], start, generator)
                rates += exp.correct.view(-1, samples_per_prompt).mean(dim=1).tolist()
        finally:
            self.group_size = saved
        return rates

    def pass_rate_cache_key(self) -> str:
        first = next(self.policy.parameters())
        return f"{self.source.__class__.__name__}|{self.seed}|{float(first.detach().double().sum()):.8e}|{self.rollout_cfg}"

    # --- the training step -----------------------------------------------------------------
    def training_step(self, ticket, batch_idx):
        step = self.train_batches_seen
        started = time.perf_counter()
        exp, metrics = self.collect(step)
        exp = exp.without_trailing_padding()
        rollout_seconds = time.perf_counter() - started

        mask = exp.response_mask
        # With one update per batch the old policy is the current one: the training forward's
        # own log-probs, detached, are pi_old (ratio exactly 1), so the extra forward is skipped.
        on_policy = self.ppo_epochs == 1 and self.num_minibatches == 1
        kl_in_reward = self.reference is not None and self.kl_placement == "in_reward"
        with torch.no_grad():
            old_logp = None if on_policy and not kl_in_reward else self.logprobs(self.policy, exp)[0]
            ref_logp = self.logprobs(self.reference, exp)[0] if self.reference is not None else None
            token_rewards = torch.zeros_like(mask)
            last = (mask.sum(dim=1).long() - 1).clamp(min=0)
            token_rewards[torch.arange(len(last)), last] = exp.scores.float()
            if kl_in_reward:
                kl = core.kl_penalty(self.kl_name, old_logp, ref_logp, old_logp, **self.kl_options)
                token_rewards = core.apply_kl_in_reward(token_rewards, kl, self.kl_controller.value, mask)
            advantages, _ = core.compute_advantages(self.advantage_name, token_rewards, mask, exp.group_index,
                                                    **self.advantage_options)

        train_started = time.perf_counter()
        stats = self.optimise(exp, old_logp, ref_logp, advantages)
        train_seconds = time.perf_counter() - train_started
        if self.kl_controller is not None and "policy/kl" in stats:
            self.kl_controller.update(stats["policy/kl"], n_steps=len(exp.scores))

        generated = float(mask.sum())
        metrics.update(stats)
        metrics.update(self.rollout_metrics(exp))
        metrics.update({"perf/rollout_s": rollout_seconds, "perf/train_s": train_seconds,
                        "perf/tokens_per_s": generated / max(rollout_seconds, 1e-9)})
        if self.kl_controller is not None:
            metrics["policy/kl_coef"] = float(self.kl_controller.value)
        train_accuracy = metrics.get("rollout/accuracy")
        metrics.update(self.curriculum.on_step_end(step + 1, train_accuracy))
        self.train_batches_seen += 1
        shown = {"rollout/reward_mean", "rollout/accuracy"}
        self.log_dict({k: v for k, v in metrics.items() if k not in shown})
        self.log_dict({k: v for k, v in metrics.items() if k in shown}, prog_bar=True)

    def optimise(self, exp: Experience, old_logp, ref_logp, advantages) -> dict[str, float]:
        """Step 6: ppo_epochs x num_minibatches optimiser steps on one rollout batch."""
        optimizer, schedule = self.optimizers(), self.lr_schedulers()
        size = len(exp.scores)
        minibatch = max(1, size // self.num_minibatches)
        generator = torch.Generator().manual_seed(self.seed * 7919 + self.train_batches_seen)
        totals: dict[str, float] = {}
        updates = 0
        for _ in range(self.ppo_epochs):
            order = torch.randperm(size, generator=generator).to(self.device)
            for start in range(0, size - minibatch + 1, minibatch):
                rows = order[start:start + minibatch]
                stats = self.minibatch_step(exp.select(rows), None if old_logp is None else old_logp[rows], advantages[rows],
                                            None if ref_logp is None else ref_logp[rows], optimizer)
                schedule.step()
                for k, v in stats.items():
                    totals[k] = totals.get(k, 0.0) + v
                updates += 1
        return {k: v / updates for k, v in totals.items()}

    def minibatch_step(self, exp: Experience, old_logp, advantages, ref_logp, optimizer) -> dict[str, float]:
        """One optimiser step over a minibatch, accumulated over micro-batches with global token
        and sequence counts. ``old_logp=None`` means on-policy: pi_old is the current policy."""
        mask = self.loss_mask(exp)
        num_tokens, num_seqs = core.count_tokens_and_seqs(mask, count_empty_rows=self.aggregation["count_empty_rows"])
        micro = self.micro_batch_size or len(exp.scores)
        optimizer.zero_grad()
        sums: dict[str, float] = {}
        for start in range(0, len(exp.scores), micro):
            rows = slice(start, start + micro)
            part = exp.select(torch.arange(len(exp.scores), device=self.device)[rows])
            logp, entropy = self.logprobs(self.policy, part, with_entropy=True)
            part_old_logp = logp.detach() if old_logp is None else old_logp[rows]
            part_mask = mask[rows]
            seq_mask = None
            if self.offpolicy_mask_delta is not None:
                seq_mask = core.offpolicy_sequence_mask(logp.detach(), part.rollout_logprobs, advantages[rows],
                                                        part_mask, self.offpolicy_mask_delta)
            loss, stats = core.compute_policy_loss(
                self.policy_loss, logp, part_old_logp, advantages[rows], part_mask,
                num_tokens=num_tokens, num_seqs=num_seqs, seq_mask=seq_mask, **self.loss_options)
            entropy_term = core.aggregate_loss(entropy, part_mask, "token-mean", num_tokens=num_tokens)
            loss = loss - self.entropy_coef * entropy_term
            stats = {f"policy/{k}": v for k, v in stats.items()}
            if ref_logp is not None:
                kl = core.kl_penalty(self.kl_name, logp, ref_logp[rows], part_old_logp, **self.kl_options)
                kl_term = core.aggregate_loss(kl, part_mask, self.aggregation["agg_mode"], num_tokens=num_tokens,
                                              num_seqs=num_seqs, norm_constant=self.aggregation["norm_constant"],
                                              count_empty_rows=self.aggregation["count_empty_rows"])
                if self.kl_placement == "as_loss":
                    loss = loss + self.kl_controller.value * kl_term
                stats["policy/kl"] = kl_term.detach()
            if seq_mask is not None:
                stats["policy/offpolicy_masked_frac"] = 1.0 - seq_mask.float().mean()
            self.manual_backward(loss)
            share = part_mask.sum() / num_tokens.clamp(min=1)  # micro-batch stats weighted by their token share
            stats.update({"policy/loss": loss.detach(),
                          "policy/entropy": entropy_term.detach() * num_tokens / part_mask.sum().clamp(min=1)})
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + float(v) * (float(share) if k not in ("policy/loss", "policy/kl") else 1.0)
        optimizer.step()  # clips first (on_before_optimizer_step)
        sums["policy/grad_norm"] = self.last_grad_norm
        return sums

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
        if not torch.isnan(exp.correct).any():
            metrics["rollout/accuracy"] = float(exp.correct.mean())
        return metrics

