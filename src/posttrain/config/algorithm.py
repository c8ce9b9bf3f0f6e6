"""What `algorithm.*` accepts (conf/algorithm/: the online RL family, the preference losses,
the reward model and the process reward model, and the SFT warm start of each), and the
rules about the algorithm's own keys and about what an algorithm of each kind can run with."""

from __future__ import annotations

import re
from pathlib import Path

from posttrain.algorithms import rules
from posttrain.algorithms.online.learner import LEARNER_OPTIONS
from posttrain.algorithms.online.parts import critic, distillation, ptx
from posttrain.config.spec import (BELOW_ONE, POSITIVE, PROBABILITY, SEED, Spec, Values, boolean, choice, either,
                                   integer, is_number, list_of, mapping, number, option_specs, optional, rule, text)
from posttrain.core.policy_loss import POLICY_LOSSES, loss_options
from posttrain.core.preference import PREFERENCE_LOSSES
from posttrain.core.schedules import SCHEDULES
from posttrain.data.pretraining import names_a_file

# The groups only online RL reads: an algorithm of another kind refuses a choice in them.
ONLINE_ONLY_GROUPS = ("advantage", "kl_estimator", "data_curriculum", "env")
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
    **optimiser("algorithm.optim"),
    # the online learner, its policy loss and its parts: their declarations (max_grad_norm is every algorithm's)
    **option_specs("algorithm", LEARNER_OPTIONS + ptx.OPTIONS),
    "algorithm.policy_loss": either(choice(*POLICY_LOSSES), mapping("{_target_: my_losses.soft_clip, <its options>}"),
                                    expected=f"one of {', '.join(map(repr, POLICY_LOSSES))}, or a mapping "
                                             f"{{_target_: my_losses.my_loss, <its options>}} naming your own"),
    "algorithm.policy_loss._target_": text().about("a function declared with @posttrain.core.policy_loss"),
    **option_specs("algorithm", loss_options().values()),
    "algorithm.critic": optional(mapping("{warmup_batches: 0, vf_coef: 1.0, ...}")).about("PPO's value model"),
    **option_specs("algorithm.critic", critic.OPTIONS),
    **optimiser("algorithm.critic.optim"),
    # distillation from a frozen teacher (opd, kdrl, long2short): algorithms/online/parts/distillation.py
    "algorithm.distill": optional(mapping("{mode: reward, coef: 1.0}")).about("null: no distillation"),
    **option_specs("algorithm.distill", distillation.OPTIONS),
    "algorithm.distill.coef_schedule.name": choice(*SCHEDULES),
    "algorithm.distill.coef_schedule.end": number(0).about("the weight from coef_schedule.steps on"),
    "algorithm.distill.coef_schedule.steps": integer(1).about("rollout batches from coef to end"),
    "algorithm.distill.coef_schedule.step_every": integer(1).about("step: rollout batches between drops"),
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
    "algorithm.warm_start.pretrained": boolean().about("also warm-start a pretrained policy (model.name_or_path); "
                                                       "set steps and lr for it: the defaults are the embedded model's"),
    "algorithm.warm_start.with_env": boolean().about("train on the environment's worked episodes (envs/worked.py): "
                                                     "its prompts, its tools' calls, their results masked"),
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
        if group == "env" and v["algorithm.kind"] == "offline":
            continue  # SFT trains on an environment's worked episodes (envs/worked.py)
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
    if v["algorithm.kind"] in ("preference", "process") and v.get("rollout.engine") in ("vllm", "vllm_server"):
        algorithm, engine = v.algorithm(), v.get("rollout.engine")
        yield (f"algorithm={algorithm} trains on fixed data it samples once (preference pairs, step rows): "
               f"rollout={engine} (online RL's sampler) is not supported with it; use rollout=fast or rollout=hf")


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
