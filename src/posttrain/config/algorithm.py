"""What `algorithm.*` accepts (conf/algorithm/: the online RL family, the preference losses,
the reward model and the process reward model, and the SFT warm start of each), and the
rules about the algorithm's own keys and about what an algorithm of each kind can run with."""

from __future__ import annotations

import re
from pathlib import Path

from posttrain.algorithms import rules
from posttrain.config.spec import (BELOW_ONE, CLAMP, POSITIVE, PROBABILITY, SEED, Spec, Values, boolean, choice,
                                   integer, is_number, list_of, mapping, number, optional, rule, text)
from posttrain.core.aggregation import AGGREGATION_MODES
from posttrain.core.distill import DISTILL_DIVERGENCES, KDRL_ESTIMATORS
from posttrain.core.policy_loss import POLICY_LOSSES, RATIO_LEVELS
from posttrain.core.preference import PREFERENCE_LOSSES
from posttrain.core.schedules import SCHEDULES
from posttrain.data.pretraining import names_a_file

# The groups only online RL reads: an algorithm of another kind refuses a choice in them.
ONLINE_ONLY_GROUPS = ("advantage", "kl_estimator", "data_curriculum")
# The preference losses with an `algorithm.length_normalize` option (core.per_token_log_ratios)
LENGTH_NORMALIZED_LOSSES = ("dpo", "ipo")


def optimiser(prefix: str) -> dict[str, Spec]:
    """The keys of an `optim` node (AdamW with warm-up and cosine decay, base.make_optimizer)."""
    return {
        f"{prefix}.lr": POSITIVE.about("learning rate"),
        f"{prefix}.weight_decay": number(0),
        f"{prefix}.betas": list_of(BELOW_ONE, length=2).about("AdamW's beta1, beta2"),
        f"{prefix}.warmup_steps": integer(0).about("optimiser steps of linear warm-up"),
        f"{prefix}.min_lr_ratio": PROBABILITY.about("the cosine decays to lr * min_lr_ratio"),
    }


SPECS: dict[str, Spec] = {
    "algorithm._target_": text().about("the LightningModule class"),
    "algorithm.name": text(),
    "algorithm.kind": choice("online", "offline", "preference", "process"),
    "algorithm.batch_size": integer(1).about("examples per optimiser step"),
    "algorithm.max_grad_norm": optional(number(0)).about("null or 0: no clipping"),
    **optimiser("algorithm.optim"),
    "algorithm.prompts_per_step": integer(1).about("prompts per rollout batch, per process"),
    "algorithm.group_size": integer(1).about("samples per prompt"),
    "algorithm.ppo_epochs": integer(1),
    "algorithm.num_minibatches": integer(1),
    "algorithm.micro_batch_size": optional(integer(1)).about("null: the whole minibatch at once"),
    "algorithm.policy_loss": choice(*POLICY_LOSSES),
    "algorithm.clip_low": optional(BELOW_ONE).about("the ratio's lower bound is 1 - clip_low"),
    "algorithm.clip_high": optional(number(0)),
    "algorithm.dual_clip": optional(number(1, low_open=True)).about("the dual-clip constant c > 1"),
    "algorithm.delta": optional(number(1, low_open=True)).about("cap on the unclipped ratio, > 1 + clip_high"),
    "algorithm.log_ratio_clamp": CLAMP,
    "algorithm.seq_log_ratio_clamp": CLAMP,
    "algorithm.ratio_level": choice(*RATIO_LEVELS),
    "algorithm.tau_pos": POSITIVE,
    "algorithm.tau_neg": POSITIVE,
    "algorithm.kimi_tau": POSITIVE.about("kimi: weight of the pull towards pi_old"),
    "algorithm.loss_agg_mode": choice(*AGGREGATION_MODES),
    "algorithm.norm_constant": optional(POSITIVE).about("null: the generation budget"),
    "algorithm.count_empty_rows": boolean(),
    "algorithm.mask_truncated": boolean(),
    "algorithm.entropy_coef": number(),
    "algorithm.critic": optional(mapping("{warmup_batches: 0, vf_coef: 1.0, ...}")).about("PPO's value model"),
    "algorithm.critic.warmup_batches": integer(0).about("rollout batches that train only the critic"),
    "algorithm.critic.value_clip": optional(POSITIVE).about("null: plain squared error"),
    "algorithm.critic.vf_coef": number(0),
    "algorithm.critic.max_grad_norm": optional(number(0)).about("null or 0: no clipping"),
    **optimiser("algorithm.critic.optim"),
    "algorithm.ptx_coef": number(0),
    "algorithm.ptx_batch_size": integer(1),
    "algorithm.ptx_data": optional(text()).about("null: the task's supervised data; else pretraining text: a text "
                                                 "file, a .jsonl with a 'text' field, or a hub name[:config]"),
    "algorithm.ptx_seq_len": integer(2).about("ptx_data: tokens per chunk of pretraining text"),
    "algorithm.offpolicy_mask_delta": optional(number(0)),
    "algorithm.keep_sampling_mask": boolean(),
    # distillation from a frozen teacher (opd, kdrl, long2short): algorithms/online/parts/distillation.py
    "algorithm.distill": optional(mapping("{mode: reward, coef: 1.0}")).about("null: no distillation"),
    "algorithm.distill.mode": choice("reward", "full", "loss").about("per-token reward | full-vocabulary loss | "
                                                                     "sampled k2/k3 loss"),
    "algorithm.distill.coef": number(0).about("the distillation weight at rollout batch 0"),
    "algorithm.distill.coef_schedule.name": choice(*SCHEDULES),
    "algorithm.distill.coef_schedule.end": number(0).about("the weight from coef_schedule.steps on"),
    "algorithm.distill.coef_schedule.steps": integer(1).about("rollout batches from coef to end"),
    "algorithm.distill.coef_schedule.step_every": integer(1).about("step: rollout batches between drops"),
    "algorithm.distill.divergence": choice(*DISTILL_DIVERGENCES),
    "algorithm.distill.beta": number(0, 1, low_open=True).about("generalized_jsd's teacher weight, in (0, 1)"),
    "algorithm.distill.temperature": POSITIVE,
    "algorithm.distill.estimator": choice(*KDRL_ESTIMATORS),
    "algorithm.distill.mask": choice("none", "low_reward"),
    "algorithm.distill.reward_threshold": number().about("mask=low_reward distils samples with reward <= this"),
    # preference algorithms (dpo, ipo, hinge, simpo): algorithms/preference.py
    "algorithm.loss": choice(*PREFERENCE_LOSSES),
    "algorithm.beta": POSITIVE.about("the preference loss's inverse temperature (IPO: tau)"),
    "algorithm.gamma": number(0).about("SimPO's target reward margin; 0 elsewhere"),
    "algorithm.label_smoothing": Spec(lambda v: is_number(v) and 0 <= v < 0.5, "a number in [0, 0.5)").about(
        "cDPO: the assumed probability that a preference label is flipped"),
    "algorithm.length_normalize": boolean().about("dpo, ipo: on per-token log-ratios (each / its response length)"),
    "algorithm.warm_start.steps": integer(0).about("SFT steps, or their cap with until_accuracy; 0: no warm start"),
    "algorithm.warm_start.seed": optional(SEED).about("null: the run's seed"),
    "algorithm.warm_start.until_accuracy": optional(number(0, 1, low_open=True)).about("held-out greedy accuracy "
                                                                                        "at which the SFT stops"),
    "algorithm.warm_start.eval_every": integer(1).about("SFT steps between held-out evaluations"),
    "algorithm.warm_start.lr": POSITIVE.about("learning rate"),
    "algorithm.warm_start.batch_size": integer(1),
    # the reward model (algorithm=reward_model), trained on the preference pairs (preference.py)
    "algorithm.margin": number().about("Bradley-Terry margin m: -log sigma(s_w - s_l - m)"),
    "algorithm.center_coef": number(0).about("reward centering: + center_coef (s_w + s_l)^2"),
    "algorithm.heads": Spec(lambda v: isinstance(v, list) and len(v) > 0 and len(set(v)) == len(v)
                            and all(isinstance(h, str) and re.fullmatch(r"\w+", h) for h in v),
                            "a non-empty list of distinct names (letters, digits, _)").about(
        "the reward model's heads, one scalar score each"),
    # the process reward model (algorithm=prm) and its step rows (data/process.py)
    "algorithm.labels": choice("verifier", "monte_carlo").about("where the step labels come from"),
    "algorithm.process_data.num_train_prompts": integer(1).about("training prompts sampled from"),
    "algorithm.process_data.num_validation_prompts": integer(1).about("held-out prompts sampled from"),
    "algorithm.process_data.samples_per_prompt": integer(1).about("sampled responses per prompt"),
    "algorithm.process_data.temperature": POSITIVE.about("sampling temperature"),
    "algorithm.process_data.rollouts_per_step": integer(1).about("monte_carlo: completions from each step's prefix"),
    "algorithm.process_data.hard_labels": boolean().about("monte_carlo: any completion right (HE) or the share (SE)"),
    "algorithm.process_data.seed": SEED,
    "algorithm.process_data.cache": boolean(),
}


@rule
def offline_algorithm_takes_no_online_components(v: Values):
    if v["algorithm.kind"] not in ("offline", "preference", "process"):  # these train on fixed pairs / step rows
        return
    algorithm = v.algorithm()
    for group in ONLINE_ONLY_GROUPS:
        option = v.get(f"{group}.name", "none")
        if option != "none":
            yield (f"algorithm={algorithm} trains offline on fixed data, so {group}={option} has no effect; "
                   f"drop the override or set {group}=none")


@rule
def preference_algorithm_reads_no_reward(v: Values):
    """A preference algorithm trains on fixed pairs: a reward (a scorer of online samples) is never read."""
    if v["algorithm.kind"] != "preference":
        return
    algorithm = v.algorithm()
    chosen = v.choices.get("reward")
    if chosen not in (None, "accuracy") or v.get("reward.path") or v.get("reward.paths"):
        yield (f"algorithm={algorithm} trains on fixed preference pairs and reads no reward, so "
               f"reward={chosen or 'reward_model'} has no effect; drop the override (a learned reward model "
               f"scores online RL: algorithm=grpo reward=reward_model reward.path=<dir>)")


@rule
def preference_algorithm_samples_in_process(v: Values):
    """rollout=vllm is online RL's sampler; a preference run would build one engine for its
    embedded pairs and another for held-out generation, on one GPU."""
    if v["algorithm.kind"] in ("preference", "process") and v.get("rollout.engine") == "vllm":
        algorithm = v.algorithm()
        yield (f"algorithm={algorithm} trains on fixed data it samples once (preference pairs, step rows): "
               f"rollout=vllm (online RL's sampler) is not supported with it; use rollout=fast or rollout=hf")


@rule
def preference_options_fit_the_loss(v: Values):
    """An option the chosen preference loss does not read would be silently ignored (or make
    the core raise after the warm start): refused with the keys named."""
    if v["algorithm.kind"] != "preference":
        return
    loss = v["algorithm.loss"]
    if v.get("algorithm.gamma", 0) and loss != "simpo":
        yield f"algorithm.gamma={v['algorithm.gamma']} is SimPO's target margin, but algorithm.loss={loss}; set it to 0"
    if v.get("algorithm.label_smoothing", 0) and loss not in ("dpo", "simpo"):
        yield (f"algorithm.label_smoothing={v['algorithm.label_smoothing']} smooths the logistic loss of dpo and "
               f"simpo, but algorithm.loss={loss}; set it to 0")
    if v.get("algorithm.length_normalize", False) and loss not in LENGTH_NORMALIZED_LOSSES:
        yield (f"algorithm.length_normalize=true divides the log-ratios of dpo and ipo by the response lengths "
               f"(simpo always normalises, hinge never), but algorithm.loss={loss}; set it to false")


@rule
def minibatches_split_the_batch_evenly(v: Values):
    if not v.online():
        return
    prompts, group, parts = v["algorithm.prompts_per_step"], v["algorithm.group_size"], v["algorithm.num_minibatches"]
    samples = prompts * group
    if samples % parts:
        yield (f"algorithm.num_minibatches={parts} does not divide a rollout batch of algorithm.prompts_per_step x "
               f"algorithm.group_size = {prompts} x {group} = {samples} samples into equal minibatches (the "
               f"remainder would be left out of every update); choose a divisor of {samples}")


@rule
def delta_lies_above_the_clip_range(v: Values):
    delta = v.get("algorithm.delta")
    if delta is None:
        return
    bound = 1.0 + (v.get("algorithm.clip_high") or 0.0)
    if not delta > bound:
        yield (f"algorithm.delta={delta!r} is not valid: expected null or a number > 1 + algorithm.clip_high = "
               f"{bound:g} (it caps the ratio above the clip range)")


@rule
def sampling_mask_needs_a_sampling_filter(v: Values):
    if not v.online():
        return
    problem = rules.sampling_mask_problem(v.get("algorithm.keep_sampling_mask"), v["rollout.top_k"], v["rollout.top_p"])
    if problem:
        yield problem


@rule
def a_distillation_reward_is_its_own_advantage(v: Values):
    distill = v.get("algorithm.distill")
    if v.online() and distill and (problem := rules.distill_reward_problem(distill.get("mode"), v["advantage.name"])):
        yield problem


@rule
def ptx_data_is_a_file_that_exists(v: Values):
    """PPO-ptx's pretraining text is read when training starts (after the warm start): a
    missing local file is refused now."""
    name = v.get("algorithm.ptx_data")
    if name is None or not v.get("algorithm.ptx_coef"):
        return
    if names_a_file(name) and not Path(name).expanduser().is_file():
        yield (f"algorithm.ptx_data={name!r}: no such file (a text file with a document a line, or a .jsonl file "
               f"with a 'text' field; a name without a file ending is read as a hub dataset)")
