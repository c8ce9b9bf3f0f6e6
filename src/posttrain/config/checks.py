"""Start-up validation of the composed config, before anything is built or written.

One pass, three layers, every problem found reported together in one `ConfigError`:

1. **values**: each key has a `Spec` in `SPECS` (type, range or allowed choices); a value
   that does not fit is named with the key, its repr and what is allowed, e.g.
   `trainer.max_steps='abc' is not valid: expected a positive integer (optimiser steps).`
   Keys without a spec pass (`+trainer.max_time=...` is Lightning's to check), but every
   key of conf/ has one: tests/config/test_config_validation.py composes every option and fails
   on a key without a spec.
2. **rules across keys** (`RULES`): combinations that crash late or train on nothing,
   e.g. a group-based advantage with groups of one sample.
3. **dry runs** of the checks the builders do themselves (algorithm arguments, reward
   components, curriculum options, the core formulas' options), which would otherwise
   fail only after the SFT warm start has trained. They run only when 1 and 2 pass, so
   they never see a value of the wrong type.
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any, Callable, Iterator

from omegaconf import DictConfig, ListConfig, OmegaConf

from posttrain.algorithms.online import KL_PLACEMENT_KEYS, OnlineRLModule, check_core_options, distills
from posttrain.conf import CONFIG_DIR
from posttrain.core.advantages import ADVANTAGE_ESTIMATORS, SCALE_MODES, SINGLETON_MODES
from posttrain.core.aggregation import AGGREGATION_MODES
from posttrain.core.distill import DISTILL_DIVERGENCES, KDRL_ESTIMATORS
from posttrain.core.kl import KL_CONTROLLERS, KL_ESTIMATORS
from posttrain.core.policy_loss import POLICY_LOSSES, RATIO_LEVELS
from posttrain.core.preference import PREFERENCE_LOSSES
from posttrain.core.schedules import SCHEDULES
from posttrain.data.arithmetic import SPLITS, STYLES
from posttrain.data.curriculum import CURRICULA
from posttrain.data.hub import REQUIRED_COLUMNS
from posttrain.data.sources import SOURCES, TRUNCATE_OPTIONS
from posttrain.data.templates import TEMPLATES
from posttrain.errors import ConfigError
from posttrain.models.loading import DTYPES
from posttrain.rewards import build_reward
from posttrain.rewards.composite import ON_ERROR_MODES
from posttrain.rollout import ALL_ROLLOUT_ENGINES
from posttrain.rollout.vllm import SLEEP_LEVELS

ONLINE_ONLY_GROUPS = ("advantage", "kl_estimator", "data_curriculum")
# Advantages that compare the samples of one prompt's group with each other.
GROUP_ADVANTAGES = ("group_norm", "group_mean", "rloo", "reinforce_pp_baseline")
# Numbers the checks below and Lightning's `seed_everything` accept as a seed (numpy's uint32).
MAX_SEED = 2**32 - 1


# --- what one key accepts -----------------------------------------------------------------

@dataclass(frozen=True)
class Spec:
    """What one config key accepts: `accepts(value)` decides, `expected` says it in words
    for the error message. `descend`: a mapping value is a node whose own keys have specs
    (checked one by one) rather than one value."""

    accepts: Callable[[Any], bool]
    expected: str
    descend: bool = False

    def about(self, meaning: str) -> Spec:
        """The same spec, its description followed by what the key means."""
        return replace(self, expected=f"{self.expected} ({meaning})")


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # YAML's true is not 1


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def integer(low: int | None = None, high: int | None = None) -> Spec:
    if low is not None and high is not None:
        expected = f"an integer in [{low}, {high}]"
    elif low == 1:
        expected = "a positive integer"
    elif low is not None:
        expected = f"an integer >= {low}"
    else:
        expected = "an integer"
    return Spec(lambda v: is_int(v) and (low is None or v >= low) and (high is None or v <= high), expected)


def number(low: float | None = None, high: float | None = None, *, low_open: bool = False) -> Spec:
    """A finite number (an integer is one too) in [low, high], or (low, high] with `low_open`."""

    def accepts(value) -> bool:
        if not is_number(value):
            return False
        above = low is None or (value > low if low_open else value >= low)
        return above and (high is None or value <= high)

    if low is not None and high is not None:
        expected = f"a number in {'(' if low_open else '['}{low}, {high}]"
    elif low is not None:
        expected = f"a number {'>' if low_open else '>='} {low}"
    else:
        expected = "a finite number"
    return Spec(accepts, expected)


def boolean() -> Spec:
    return Spec(lambda v: isinstance(v, bool), "true or false")


def text() -> Spec:
    return Spec(lambda v: isinstance(v, str) and v.strip() != "", "a non-empty string")


def choice(*options) -> Spec:
    # compared by type too: Hydra reads `1` as an int, and `true` as a bool equal to 1
    def accepts(value) -> bool:
        return any(type(value) is type(option) and value == option for option in options)

    return Spec(accepts, f"one of {', '.join(repr(o) for o in options)}")


def pattern(regex: str, expected: str) -> Spec:
    return Spec(lambda v: isinstance(v, str) and re.fullmatch(regex, v) is not None, expected)


def list_of(item: Spec, length: int | None = None) -> Spec:
    def accepts(value) -> bool:
        return isinstance(value, list) and (length is None or len(value) == length) and all(map(item.accepts, value))

    count = "a list" if length is None else f"a list of {length} values"
    return Spec(accepts, f"{count}, each {item.expected}")


def mapping(example: str, non_empty: bool = False) -> Spec:
    def accepts(value) -> bool:
        return isinstance(value, dict) and (bool(value) or not non_empty)

    return Spec(accepts, f"a {'non-empty ' if non_empty else ''}mapping, e.g. {example}", descend=True)


def anything() -> Spec:
    return Spec(lambda v: True, "any value")


def optional(spec: Spec) -> Spec:
    return Spec(lambda v: v is None or spec.accepts(v), f"null or {spec.expected}", spec.descend)


def either(*specs: Spec, expected: str) -> Spec:
    return Spec(lambda v: any(s.accepts(v) for s in specs), expected, any(s.descend for s in specs))


def lightning_strategy(value) -> bool:
    if isinstance(value, dict) or value == "auto":
        return True
    from lightning.pytorch.strategies import StrategyRegistry

    return value in StrategyRegistry.available_strategies()


SEED = integer(0, MAX_SEED)
POSITIVE = number(0, low_open=True)
BELOW_ONE = Spec(lambda v: is_number(v) and 0 <= v < 1, "a number in [0, 1)")
CLAMP = optional(POSITIVE).about("null: no clamp")
PROBABILITY = number(0, 1)
DURATION = pattern(r"\d+:\d{1,2}:\d{1,2}:\d{1,2}", "a duration 'DD:HH:MM:SS'")
# Lightning's precision names (lightning.fabric.plugins.precision.precision._PRECISION_INPUT).
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true", "transformer-engine",
              "transformer-engine-float16", "32", "16", "64", "bf16", 32, 16, 64)
# Lightning's accelerator names (AcceleratorRegistry, plus its aliases "auto" and "gpu").
ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps", "tpu")
ARCHITECTURES = ("qwen2", "llama")


def optimiser(prefix: str) -> dict[str, Spec]:
    """The keys of an `optim` node (AdamW with warm-up and cosine decay, base.make_optimizer)."""
    return {
        f"{prefix}.lr": POSITIVE.about("learning rate"),
        f"{prefix}.weight_decay": number(0),
        f"{prefix}.betas": list_of(BELOW_ONE, length=2).about("AdamW's beta1, beta2"),
        f"{prefix}.warmup_steps": integer(0).about("optimiser steps of linear warm-up"),
        f"{prefix}.min_lr_ratio": PROBABILITY.about("the cosine decays to lr * min_lr_ratio"),
    }


# Every key of conf/, by dotted path. `*` stands for any one key (reward components, roles).
# An exact key wins over a pattern; patterns are tried in this order.
SPECS: dict[str, Spec] = {
    # --- top level (conf/train.yaml) ---
    "seed": SEED,
    "num_threads": optional(integer(1)).about("torch threads on CPU; null: torch's default"),
    "ckpt_path": optional(text()).about("a Lightning checkpoint, 'last', or 'auto' (the run dir's newest intact "
                                         "checkpoint, if any)"),
    "task_name": either(text(), integer(), expected="a non-empty name").about("names the run directory"),
    "print_config": boolean(),
    "eval.split": choice(*SPLITS),
    "eval.num_prompts": integer(1).about("held-out prompts"),
    "eval.batch_size": integer(1),
    "eval.max_new_tokens": integer(1).about("generation budget in tokens"),
    "eval.at_start": boolean(),
    "eval.log_samples": integer(0).about("prompts in the samples table at each eval; 0: none"),
    "eval.pass_k": optional(list_of(integer(1))).about("each k <= eval.num_samples; null: no pass@k"),
    "eval.num_samples": integer(1).about("sampled responses per prompt for pass@k"),
    "eval.temperature": POSITIVE.about("sampling temperature for pass@k"),
    "roles.*.name_or_path": optional(text()).about("a hub id or HF directory; null: a copy of the policy"),
    "roles.*.init_from": optional(text()).about("'policy', a checkpoint or an HF directory"),
    "roles.*.dtype": optional(choice(*DTYPES)).about("null: the policy's"),
    "roles.*.trainable": boolean(),
    "roles.critic.shared_backbone": boolean(),
    "teacher": optional(text()).about("an HF directory, a checkpoint or run directory, or tiny_concise / tiny_verbose"),
    "teacher_recipe.model": mapping("{hidden_size: 256, num_layers: 4}").about("overrides of conf/model/tiny.yaml"),
    "teacher_recipe.model.hidden_size": integer(1),
    "teacher_recipe.model.num_layers": integer(1),
    "teacher_recipe.model.num_heads": integer(1),
    "teacher_recipe.model.intermediate_size": integer(1),
    # further keys of conf/model/tiny.yaml (+teacher_recipe.model.architecture=llama): checked
    # as model.<key> when the recipe's SFT run starts
    "teacher_recipe.model.*": anything(),
    "teacher_recipe.steps": integer(1).about("SFT steps, or their cap with until_accuracy"),
    "teacher_recipe.until_accuracy": optional(number(0, 1, low_open=True)).about("held-out greedy accuracy to "
                                                                                 "stop at; null: all steps"),
    "teacher_recipe.eval_every": integer(1).about("SFT steps between held-out evaluations"),
    "teacher_recipe.lr": POSITIVE.about("learning rate"),
    "teacher_recipe.batch_size": integer(1),
    "teacher_recipe.seed": SEED,

    # --- trainer: Lightning Trainer arguments; keys not listed here are Lightning's to check ---
    "trainer._target_": text(),
    "trainer.accelerator": either(choice(*ACCELERATORS), mapping("{_target_: ...}"),
                                  expected=f"one of {', '.join(map(repr, ACCELERATORS))}"),
    "trainer.devices": either(integer(1), choice(-1, "auto"), list_of(integer(0)),
                              pattern(r"\s*\d+\s*(,\s*\d+\s*)*,?", ""),
                              expected="a positive integer, -1 (all), 'auto', or a list of device indices"),
    "trainer.num_nodes": integer(1),
    "trainer.precision": choice(*PRECISIONS),
    "trainer.max_steps": integer(1).about("optimiser steps"),
    # a budget in rollout batches (sweeps/): one epoch of limit_train_batches, max_steps a cap
    "trainer.max_epochs": optional(integer(1)).about("sweeps/: 1, with trainer.limit_train_batches"),
    "trainer.limit_train_batches": optional(integer(1)).about("training (RL: rollout) batches per epoch"),
    "trainer.max_time": optional(either(DURATION, mapping("{hours: 1}"), expected="a duration 'DD:HH:MM:SS'")),
    "trainer.val_check_interval": either(integer(1), DURATION, expected="a positive integer or a duration "
                                         "'DD:HH:MM:SS'").about("training batches between held-out evaluations; "
                                                                "RL: rollout batches"),
    "trainer.check_val_every_n_epoch": optional(integer(1)).about("the training stream is endless: null"),
    "trainer.log_every_n_steps": integer(1),
    "trainer.gradient_clip_val": Spec(lambda v: v is None, "null (posttrain clips gradients itself at "
                                                           "algorithm.max_grad_norm: set that instead)"),
    "trainer.accumulate_grad_batches": integer(1),
    "trainer.num_sanity_val_steps": integer(-1).about("-1: all"),
    "trainer.enable_model_summary": boolean(),
    "trainer.default_root_dir": optional(text()),
    "trainer.strategy": Spec(lightning_strategy, "'auto', a Lightning strategy name such as 'ddp', or a strategy "
                                                 "node with _target_ (trainer=ddp)", descend=True),
    "trainer.strategy._target_": text(),
    "trainer.strategy.data_parallel_size": either(integer(1), choice("auto"), expected="a positive integer or "
                                                  "'auto'").about("processes; trainer.devices x trainer.num_nodes"),
    "trainer.strategy.tensor_parallel_size": choice(1).about("posttrain shards no tensors: data parallelism only"),
    "trainer.strategy.save_distributed_checkpoint": boolean(),
    "trainer.strategy.reshard_after_forward": boolean().about("trainer=fsdp: free gathered weights after forward"),
    "trainer.strategy.param_dtype": optional(choice("float32", "bfloat16", "float16")).about(
        "trainer=fsdp: compute dtype of the gathered weights; master weights stay fp32"),
    "trainer.strategy.reduce_dtype": choice("float32", "bfloat16", "float16").about(
        "trainer=fsdp: dtype of the gradient reduce-scatter"),
    "trainer.strategy.activation_checkpointing": boolean().about("trainer=fsdp: recompute decoder blocks"),
    "trainer.strategy.frozen_roles": choice("shard", "replicate_bf16").about(
        "trainer=fsdp: how frozen roles (reference) are held"),

    # --- algorithm ---
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
    "algorithm.offpolicy_mask_delta": optional(number(0)),
    "algorithm.keep_sampling_mask": boolean(),
    # distillation from a frozen teacher (opd, kdrl, long2short): algorithms/online.py, DistillTerm
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
    "algorithm.length_normalize": boolean().about("IPO on per-token log-ratios"),
    "algorithm.warm_start.steps": integer(0).about("SFT steps, or their cap with until_accuracy; 0: no warm start"),
    "algorithm.warm_start.seed": optional(SEED).about("null: the run's seed"),
    "algorithm.warm_start.until_accuracy": optional(number(0, 1, low_open=True)).about("held-out greedy accuracy "
                                                                                        "at which the SFT stops"),
    "algorithm.warm_start.eval_every": integer(1).about("SFT steps between held-out evaluations"),
    "algorithm.warm_start.lr": POSITIVE.about("learning rate"),
    "algorithm.warm_start.batch_size": integer(1),

    # --- rollout ---
    "rollout.engine": choice(*ALL_ROLLOUT_ENGINES),
    "rollout.temperature": POSITIVE,
    "rollout.top_p": number(0, 1, low_open=True).about("1: off"),
    "rollout.top_k": integer(0).about("0: off"),
    "rollout.max_new_tokens": integer(1).about("generation budget in tokens"),
    "rollout.prm_stop_below": optional(number()).about("cut a response after a step the PRM scores below this; "
                                                       "null: off"),
    "rollout.repetition.ngram": optional(integer(1)).about("longest repeated block looked for, in tokens; null: off"),
    "rollout.repetition.window": integer(2).about("a loop fills the last window tokens; >= 2 x ngram"),
    # rollout=vllm's engine settings (rollout/vllm.py)
    "rollout.gpu_memory_utilization": number(0, 1, low_open=True).about("fraction of the GPU's memory for vLLM"),
    "rollout.max_model_len": optional(integer(1)).about("prompt + response tokens; null: the model's context"),
    "rollout.dtype": choice("auto", *DTYPES).about("vLLM's compute dtype; auto: the policy's"),
    "rollout.enforce_eager": boolean().about("true: no CUDA graphs"),
    "rollout.sleep_level": choice(*SLEEP_LEVELS).about("0: stay awake between rollouts; 1: weights to CPU; "
                                                       "2: weights freed"),

    # --- data ---
    "data.source": choice(*SOURCES),
    "data.min_digits": integer(1),
    "data.max_digits": integer(1),
    "data.num_operands": integer(2),
    "data.style": choice(*STYLES),
    "data.verbose_share": number(0, 1).about("style=mixed: share of problems with a verbose reference solution"),
    "data.seed": SEED,
    "data.step_separators": optional(list_of(pattern(r"(?s).+", "a non-empty string"))).about("process rewards: a step ends at each token holding one"),
    "data.max_response_tokens": integer(1).about("generation budget in tokens"),
    "data.max_prompt_tokens": optional(integer(1)).about("null: the model's context decides"),
    "data.truncate_prompts": optional(choice(*TRUNCATE_OPTIONS)).about("null: an over-long prompt is an error"),
    "data.files.train": text().about("a JSON-lines file"),
    "data.files.validation": optional(text()).about("a JSON-lines file"),
    "data.files.test": optional(text()).about("a JSON-lines file"),
    "data.path": text().about("a hub dataset name, or a local directory or json/jsonl/parquet file"),
    "data.config": optional(text()).about("the hub config, e.g. main"),
    "data.splits.train": text().about("the dataset's split to train on"),
    "data.splits.validation": optional(text()).about("null: hold out data.validation_size training examples"),
    "data.splits.test": optional(text()).about("null: none"),
    "data.validation_size": integer(0).about("training examples held out when there is no validation split"),
    "data.validation_seed": SEED.about("which training examples are held out"),
    "data.columns.prompt": text().about("the column holding the question"),
    "data.columns.answer": optional(text()).about("the column holding the final answer"),
    "data.columns.solution": optional(text()).about("the column holding the reference solution"),
    "data.template": choice(*TEMPLATES).about("how a question is asked"),
    "data.chat": boolean().about("true: prompts as chat messages, rendered with the model's chat template"),
    "data.verify_timeout_s": POSITIVE.about("seconds per answer check; longer counts as wrong"),

    # --- model ---
    "model.name_or_path": optional(text()).about("a hub id or HF directory; null: the embedded tiny model"),
    "model.init_from": optional(text()).about("a Lightning checkpoint (trainer=fsdp: a directory) or an HF directory"),
    "model.architecture": choice(*ARCHITECTURES),
    "model.hidden_size": integer(1),
    "model.num_layers": integer(1),
    "model.num_heads": integer(1),
    "model.num_kv_heads": integer(1),
    "model.intermediate_size": integer(1),
    "model.max_position_embeddings": integer(1),
    "model.tie_word_embeddings": boolean(),
    "model.dtype": choice(*DTYPES),
    "model.gradient_checkpointing": boolean().about("HF gradient checkpointing of the trainable policy"),
    "model.allow_low_precision_weights": boolean().about("true: let AdamW step bfloat16/float16 weights"),
    "model.lora.r": optional(integer(1)).about("LoRA rank; null: LoRA off"),
    "model.lora.alpha": POSITIVE.about("LoRA scale alpha / r"),
    "model.lora.dropout": BELOW_ONE.about("dropout on the adapter's input"),
    "model.lora.target_modules": either(text(), list_of(text()),
                                        expected="'all-linear' or a list of module names, e.g. [q_proj, v_proj]"),
    "model.lora.export_merged": boolean().about("true: hf_model/ is the merged full model"),

    # --- kl_estimator ---
    "kl_estimator.name": choice("none", *KL_ESTIMATORS),
    "kl_estimator.coef": number(0),
    "kl_estimator.placement": choice("in_reward", "as_loss", "none"),
    "kl_estimator.controller": choice(*KL_CONTROLLERS),
    "kl_estimator.target": optional(POSITIVE).about("the adaptive controller's target KL"),
    "kl_estimator.horizon": optional(POSITIVE).about("the adaptive controller's horizon"),
    "kl_estimator.value_clamp": CLAMP,
    "kl_estimator.log_ratio_clamp": CLAMP,
    "kl_estimator.unbiased_gradient": boolean(),
    "kl_estimator.straight_through": boolean(),
    "kl_estimator.is_weight_cap": optional(POSITIVE),

    # --- advantage ---
    "advantage.name": choice("none", *ADVANTAGE_ESTIMATORS),
    "advantage.eps": number(0),
    "advantage.scale": choice(*SCALE_MODES),
    "advantage.singleton": choice(*SINGLETON_MODES).about("what a group of one sample gets"),
    "advantage.keep_degenerate": boolean(),
    "advantage.gamma": PROBABILITY.about("discount"),
    "advantage.lam": PROBABILITY.about("GAE lambda"),
    "advantage.whiten": boolean(),
    "advantage.whiten_eps": POSITIVE,

    # --- reward ---
    "reward.name": text(),
    "reward.on_error": choice(*ON_ERROR_MODES),
    "reward.failure_score": number(),
    "reward.components": mapping("{accuracy: {weight: 1.0}}", non_empty=True),
    "reward.components.overlong.cache_len": integer(0).about("tokens"),
    "reward.components.overlong.max_len": optional(integer(1)).about("tokens; null: rollout.max_new_tokens"),
    "reward.components.format.match_score": number(),
    "reward.components.format.miss_score": number(),
    "reward.components.length_penalty.warmup": integer(0).about("rollout batches before the length reward switches on"),
    "reward.components.length_penalty.only_groups_with_a_correct_answer": boolean().about(
        "0 in a group with no right answer (false: Kimi's formula)"),
    "reward.path": optional(text()).about("a reward model directory (reward=reward_model)"),
    "reward.paths": optional(list_of(text())).about("reward model directories: an ensemble"),
    "reward.components.reward_model.path": optional(text()).about("a reward model directory"),
    "reward.components.reward_model.paths": optional(list_of(text())).about("reward model directories: an ensemble"),
    "reward.components.reward_model.std_coef": number(0).about("k of an ensemble's mean - k * std"),
    "reward.components.reward_model.batch_size": integer(1).about("rows per reward-model forward"),
    "reward.components.reward_model.share_tokenizer": boolean(),
    "reward.components.prm.step_reward": choice("marginal", "raw", "min").about(
        "step rewards from PRM scores: s_k - s_(k-1) | s_k | PURE's min-form"),
    "reward.components.prm.model": choice("oracle", "learned").about("the PRM (from the prm group)"),
    "reward.components.prm.path": optional(text()).about("a learned PRM's directory"),
    "reward.components.prm.oracle_score": choice("prefix", "step"),
    "reward.components.prm.batch_size": integer(1).about("rows per PRM forward"),
    "prm.model": choice("oracle", "learned").about("oracle: the task's step verifier | learned: an algorithm=prm export"),
    "prm.path": optional(text()).about("the hf_model/ of an algorithm=prm run (prm=learned)"),
    "prm.oracle_score": choice("prefix", "step").about("prefix: 1 while every step so far is right | step: each alone"),
    "prm.batch_size": integer(1).about("rows per PRM forward"),
    "reward.components.*": mapping("{weight: 1.0} (drop a component with ~reward.components.<name>)"),
    "reward.components.*.weight": number(),
    "reward.components.*.target": pattern(r"[\w.]+\.\w+", "a dotted path 'package.module.function'"),
    # a component's own options: checked against its function's signature by the dry run below
    "reward.components.*.*": anything(),

    # --- data_curriculum ---
    "data_curriculum.name": choice(*CURRICULA),
    "data_curriculum.max_extra_rounds": integer(0).about("extra generation rounds per step"),
    "data_curriculum.filter_on": choice("reward", "accuracy"),
    "data_curriculum.low": PROBABILITY.about("lowest pass rate kept"),
    "data_curriculum.high": PROBABILITY.about("highest pass rate kept"),
    "data_curriculum.pool_size": integer(1).about("prompts scored for their pass rate"),
    "data_curriculum.milestones": list_of(integer(1)).about("rollout batches at which the difficulty rises"),
    "data_curriculum.accuracy_threshold": optional(PROBABILITY),
    "data_curriculum.max_level": integer(0),

    # --- callbacks ---
    "callbacks.checkpoint.every_n_train_steps": integer(1),
    "callbacks.checkpoint.save_top_k": integer(-1).about("-1: keep every checkpoint"),
    "callbacks.progress_bar": choice("rich", "none"),
    "callbacks.stop_at_step": optional(integer(1)),
    "callbacks.stop_at_accuracy": optional(number(0, 1, low_open=True)),

    # --- logger ---
    "logger.backend": choice("wandb", "csv", "none"),
    "logger.project": text(),
    "logger.entity": optional(text()),
    "logger.mode": choice("auto", "online", "offline", "disabled"),
    "logger.tags": list_of(text()),
    "logger.group": optional(text()).about("the W&B group; null: the task name, or the sweep's name and time"),
    "logger.job_type": text().about("the W&B job type"),

    # --- paths ---
    "paths.root_dir": text(),
    "paths.log_dir": text(),
    "paths.cache_dir": text(),
    "paths.output_dir": text(),

    # --- numerics: each peer's conventions, read by the components through interpolation ---
    "numerics.name": text(),
    "numerics.advantage.std_eps": number(0),
    "numerics.advantage.singleton": choice(*SINGLETON_MODES),
    "numerics.advantage.keep_degenerate": boolean(),
    "numerics.kl.value_clamp": CLAMP,
    "numerics.kl.k3_log_ratio_clamp": CLAMP,
    "numerics.kl.k3_value_clamp": CLAMP,
    "numerics.kl.unbiased_gradient": boolean(),
    "numerics.kl.is_weight_cap": optional(POSITIVE),
    "numerics.policy.log_ratio_clamp": CLAMP,
    "numerics.policy.gspo_log_ratio_clamp": CLAMP,
    "numerics.policy.gspo_seq_log_ratio_clamp": CLAMP,
    "numerics.policy.dual_clip": optional(number(1, low_open=True)),
    "numerics.policy.count_empty_rows": boolean(),
    "numerics.preference.ipo_length_normalize": boolean(),

    # --- preference pairs (data/preference.py) and the reward model (algorithm=reward_model) ---
    "preference.source": choice("embedded", "dataset"),
    "preference.num_train_pairs": integer(1).about("embedded: training prompts, a pair each"),
    "preference.num_validation_pairs": integer(1).about("embedded: held-out prompts, a pair each"),
    "preference.samples_per_prompt": integer(2).about("embedded: a right and a wrong sample need two"),
    "preference.temperature": POSITIVE.about("embedded: sampling temperature"),
    "preference.seed": SEED,
    "preference.cache": boolean(),
    "preference.path": optional(text()).about("dataset: a hub name or a local file or directory"),
    "preference.config": optional(text()),
    "preference.splits.train": text(),
    "preference.splits.validation": optional(text()).about("null: hold out preference.validation_size pairs"),
    "preference.validation_size": integer(0),
    "preference.validation_seed": SEED,
    "preference.columns.prompt": text(),
    "preference.columns.chosen": text(),
    "preference.columns.rejected": text(),
    "preference.chat": boolean(),
    "algorithm.margin": number().about("Bradley-Terry margin m: -log sigma(s_w - s_l - m)"),
    "algorithm.center_coef": number(0).about("reward centering: + center_coef (s_w + s_l)^2"),
    # --- the process reward model (algorithm=prm) and its step rows (data/process.py) ---
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

PATTERNS = [key for key in SPECS if "*" in key]


def spec_for(key: str) -> Spec | None:
    """The spec of a dotted key: its own, else the first pattern that matches it."""
    if key in SPECS:
        return SPECS[key]
    parts = key.split(".")
    for candidate in PATTERNS:
        wanted = candidate.split(".")
        if len(wanted) == len(parts) and all(w in ("*", p) for w, p in zip(wanted, parts)):
            return SPECS[candidate]
    return None


# --- reading the config -------------------------------------------------------------------

MISSING = object()  # a `???` value: the user must supply it


@dataclass
class Entry:
    key: str
    value: Any          # plain Python (containers converted), or MISSING
    is_leaf: bool       # a value checked against its spec; False: a node whose keys are checked


def entries(node: DictConfig, prefix: str = "") -> Iterator[Entry]:
    """Every key of the config, depth first: nodes (with their plain value, for the rules)
    and leaves. A node is descended into unless its spec says it is one value."""
    for key in node.keys():
        path = f"{prefix}{key}"
        if path == "hydra":
            continue
        if OmegaConf.is_missing(node, key):
            yield Entry(path, MISSING, is_leaf=True)
            continue
        value = node[key]
        if isinstance(value, (DictConfig, ListConfig)):
            plain = OmegaConf.to_container(value, resolve=True)
            spec = spec_for(path)
            if isinstance(value, DictConfig) and len(value) and (spec is None or spec.descend):
                yield Entry(path, plain, is_leaf=False)
                yield from entries(value, f"{path}.")
                continue
            value = plain
        yield Entry(path, value, is_leaf=True)


def keys_without_spec(cfg: DictConfig) -> list[str]:
    """The leaf keys of `cfg` that have no spec (tests: every key of conf/ must have one)."""
    return [e.key for e in entries(cfg) if e.is_leaf and spec_for(e.key) is None]


def value_problems(cfg: DictConfig) -> tuple[list[str], set[str]]:
    """A message per value that its spec refuses, and the keys that were refused."""
    problems, bad = [], set()
    for entry in entries(cfg):
        spec = spec_for(entry.key)
        if not entry.is_leaf or spec is None:
            continue
        if entry.value is MISSING:
            problems.append(f"{entry.key} has no value (???): expected {spec.expected}")
            bad.add(entry.key)
        elif not spec.accepts(entry.value):
            problems.append(f"{entry.key}={entry.value!r} is not valid: expected {spec.expected}")
            bad.add(entry.key)
    return problems, bad


# --- rules across keys --------------------------------------------------------------------

class Unusable(Exception):
    """A rule read a key that is absent, `???` or already reported: the rule does not apply."""


class Values:
    """The config's values by dotted key, as the rules read them."""

    def __init__(self, cfg: DictConfig, bad: set[str], choices: dict[str, str]):
        self.values = {e.key: e.value for e in entries(cfg)}
        self.bad = bad
        self.choices = choices

    def __getitem__(self, key: str):
        value = self.values.get(key, MISSING)
        if value is MISSING or key in self.bad:
            raise Unusable(key)
        return value

    def get(self, key: str, default=None):
        """The value, or `default` when the key is absent (as the code that reads it does)."""
        if key not in self.values:
            return default
        return self[key]

    def online(self) -> bool:
        return self.get("algorithm.kind") == "online"


Rule = Callable[[Values], Iterator[str]]
RULES: list[Rule] = []


def rule(fn: Rule) -> Rule:
    RULES.append(fn)
    return fn


@rule
def offline_algorithm_takes_no_online_components(v: Values):
    if v["algorithm.kind"] not in ("offline", "preference", "process"):  # these train on fixed pairs / step rows
        return
    algorithm = v.choices.get("algorithm", v.get("algorithm.name"))
    for group in ONLINE_ONLY_GROUPS:
        option = v.get(f"{group}.name", "none")
        if option != "none":
            yield (f"algorithm={algorithm} trains offline on fixed data, so {group}={option} has no effect; "
                   f"drop the override or set {group}=none")


@rule
def repetition_window_holds_two_blocks(v: Values):
    ngram, window = v.get("rollout.repetition.ngram"), v.get("rollout.repetition.window")
    if ngram is not None and window is not None and window < 2 * ngram:
        yield (f"rollout.repetition.window={window} must be at least 2 x rollout.repetition.ngram = {2 * ngram}, "
               f"so that a block is repeated at least twice")


@rule
def preference_algorithm_reads_no_reward(v: Values):
    """A preference algorithm trains on fixed pairs: a reward (a scorer of online samples) is never read."""
    if v["algorithm.kind"] != "preference":
        return
    algorithm = v.choices.get("algorithm", v.get("algorithm.name"))
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
        algorithm = v.choices.get("algorithm", v.get("algorithm.name"))
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
    if v.get("algorithm.length_normalize", False) and loss != "ipo":
        yield (f"algorithm.length_normalize=true is IPO's option (simpo always normalises, dpo and hinge never), "
               f"but algorithm.loss={loss}; set it to false")


@rule
def preference_dataset_is_named(v: Values):
    if v["algorithm.kind"] == "preference" and v["preference.source"] == "dataset" and not v["preference.path"]:
        yield ("preference.source=dataset needs preference.path (a local json/jsonl/parquet file or directory, or "
               "a hub name, with columns prompt/chosen/rejected)")


@rule
def online_algorithm_needs_an_advantage(v: Values):
    if v.online() and v["advantage.name"] == "none":
        algorithm = v.choices.get("algorithm", v.get("algorithm.name"))
        yield (f"algorithm={algorithm} is an online RL algorithm and needs an advantage estimator "
               f"(advantage=none was chosen)")


@rule
def advantage_fits_the_algorithm(v: Values):
    if not v.online():
        return
    advantage, critic = v["advantage.name"], v.get("algorithm.critic")
    if advantage == "prm_step" and not v.get("reward.components.prm.weight"):
        yield ("advantage=prm_step credits each step with a process reward model's reward, but the reward has none: use "
               "reward=prm (prm=oracle | learned), or group_norm, group_mean, rloo, reinforce_pp, "
               "reinforce_pp_baseline, or gae with a critic (algorithm=ppo)")
    elif (advantage == "gae") != (critic is not None):
        yield ("advantage=gae needs a critic and a critic needs advantage=gae: use algorithm=ppo, or another "
               f"advantage (got advantage={advantage}, algorithm.critic={'set' if critic is not None else 'null'})")


@rule
def groups_of_one_carry_no_signal(v: Values):
    """A group-based advantage compares a sample with the other samples of its prompt: with
    one sample per prompt every advantage is 0 and the run trains on nothing."""
    if not v.online() or v["algorithm.group_size"] != 1:
        return
    advantage = v["advantage.name"]
    if advantage in GROUP_ADVANTAGES and v.get("advantage.singleton", "zero") == "zero":
        yield (f"algorithm.group_size=1 with advantage={advantage} gives every sample an advantage of 0 (a group "
               f"of one sample has nothing to be compared with), so nothing would be trained: set "
               f"algorithm.group_size >= 2, or advantage.singleton=raw or unit_std to score groups of one, or use "
               f"advantage=reinforce_pp")
    if v.get("data_curriculum.name") == "dynamic_sampling":
        yield ("data_curriculum=dynamic_sampling keeps only groups whose rewards differ, which a group of "
               "algorithm.group_size=1 never does, so every batch would be dropped: set algorithm.group_size >= 2")


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
    if v.online() and v.get("algorithm.keep_sampling_mask") and v["rollout.top_k"] == 0 and v["rollout.top_p"] >= 1.0:
        yield ("algorithm.keep_sampling_mask=true renormalises over the sampler's top-k / top-p support, but "
               "neither filter is on: set rollout.top_k > 0 or rollout.top_p < 1, or keep_sampling_mask=false")


@rule
def kl_term_is_placed_and_controlled(v: Values):
    if not v.online() or v["kl_estimator.name"] == "none" or not v.get("kl_estimator.coef", 0) > 0:
        return
    name, placement = v["kl_estimator.name"], v.get("kl_estimator.placement")
    if placement not in ("in_reward", "as_loss"):
        yield (f"kl_estimator.placement={placement!r} is not valid with kl_estimator={name}: expected 'in_reward' "
               f"or 'as_loss'")
    if v.get("kl_estimator.controller", "fixed") == "adaptive":
        target, horizon = v.get("kl_estimator.target"), v.get("kl_estimator.horizon")
        if target is None or horizon is None:
            yield (f"kl_estimator.controller=adaptive needs kl_estimator.target (the KL to hold) and "
                   f"kl_estimator.horizon (steps to adapt over), both > 0; got target={target!r}, horizon={horizon!r}")


@rule
def digit_range_is_ordered(v: Values):
    if v.get("data.source") == "arithmetic" and v["data.min_digits"] > v["data.max_digits"]:
        yield (f"data.min_digits={v['data.min_digits']} is larger than data.max_digits={v['data.max_digits']}; "
               f"expected min_digits <= max_digits (the operands' digit range)")


@rule
def eval_split_has_data(v: Values):
    if v.get("data.source") in REQUIRED_COLUMNS:
        yield from dataset_split_exists(v, v["eval.split"])
    if v.get("data.source") != "jsonl":
        return
    split = v["eval.split"]
    if v.get(f"data.files.{split}") is None:
        yield (f"eval.split={split} needs data.files.{split} (a JSON-lines file of held-out examples), which is "
               f"null; set it, or evaluate on a split that has a file with eval.split=...")


def dataset_split_exists(v: Values, split: str) -> Iterator[str]:
    if v.get(f"data.splits.{split}") is not None:
        return
    if split != "validation":
        yield (f"eval.split={split} needs data.splits.{split} (the dataset's {split} split), which is null; set "
               f"it, or evaluate on another split with eval.split=...")
    elif v["data.validation_size"] == 0:
        yield ("eval.split=validation needs data.splits.validation (the dataset's validation split) or "
               "data.validation_size > 0 (training examples held out), but they are null and 0")


@rule
def dataset_columns_are_named(v: Values):
    source = v.get("data.source")
    for key in REQUIRED_COLUMNS.get(source, ()):
        if v.get(f"data.columns.{key}") is None:
            yield f"data.source={source} reads data.columns.{key}, which is null; name the column that holds it"


@rule
def curriculum_has_what_it_reads(v: Values):
    if not v.online():
        return
    name = v.get("data_curriculum.name", "none")
    if name == "pass_rate_filter" and v["data_curriculum.low"] > v["data_curriculum.high"]:
        yield (f"data_curriculum.low={v['data_curriculum.low']} is larger than "
               f"data_curriculum.high={v['data_curriculum.high']}; expected low <= high (the band of pass rates kept)")
    if name == "difficulty_schedule":
        if v.get("data.source") != "arithmetic":
            yield ("data_curriculum=difficulty_schedule raises the task's difficulty, which only data=arithmetic "
                   f"has (data.source={v.get('data.source')!r})")
        if not v.get("data_curriculum.milestones") and v.get("data_curriculum.accuracy_threshold") is None:
            yield ("data_curriculum=difficulty_schedule needs data_curriculum.milestones or "
                   "data_curriculum.accuracy_threshold, or it never changes anything")
    # correctness comes from the reward component named accuracy (rewards/composite.py)
    needs_accuracy = {
        "pass_rate_filter": "estimates pass rates",
        "dynamic_sampling": "filter_on=accuracy filters" if v.get("data_curriculum.filter_on") == "accuracy" else None,
        "difficulty_schedule": ("accuracy_threshold reads the training accuracy"
                                if v.get("data_curriculum.accuracy_threshold") is not None else None),
    }.get(name)
    components = v.get("reward.components")
    if needs_accuracy and isinstance(components, dict) and "accuracy" not in components:
        yield (f"data_curriculum={name} {needs_accuracy} from the reward's accuracy component, but "
               f"reward.components has none ({sorted(components)}); add reward.components.accuracy")


@rule
def a_reward_model_path_needs_the_reward_model_component(v: Values):
    """reward.path / reward.paths only feed reward.components.reward_model: without it they'd be ignored."""
    components = v.get("reward.components")
    for key in ("reward.path", "reward.paths"):
        if v.get(key) and isinstance(components, dict) and "reward_model" not in components:
            yield (f"{key} is set, but the reward has no reward_model component to read it "
                   f"(reward.components: {sorted(components)}); use reward=reward_model, or add "
                   f"+reward.components.reward_model.{key.rpartition('.')[2]}=...")


@rule
def a_role_with_its_own_model_does_not_copy_the_policy(v: Values):
    for role in ("reference", "critic"):
        if v.get(f"roles.{role}.name_or_path") and v.get(f"roles.{role}.init_from") == "policy":
            yield (f"roles.{role}.init_from=policy copies the policy's weights into another model "
                   f"(roles.{role}.name_or_path={v[f'roles.{role}.name_or_path']!r}); set roles.{role}.init_from=null "
                   f"to keep its own weights, or to a checkpoint or HF directory")


@rule
def a_sharded_policy_has_no_shared_critic(v: Values):
    """The shared critic runs the policy's decoder and LM head outside the policy's forward,
    where FSDP2 never gathers the policy's own (root) weights: see sharding.shard_module."""
    if is_sharded_strategy(v) and v.get("algorithm.critic") is not None and v.get("roles.critic.shared_backbone"):
        yield ("roles.critic.shared_backbone=true is not supported with trainer=fsdp (the value head reads the "
               "policy's decoder outside the policy's forward, where FSDP2 gathers the embeddings, final norm and "
               "LM head); use roles.critic.shared_backbone=false (the critic's own backbone), or trainer=ddp")


@rule
def a_pretrained_model_is_named(v: Values):
    # model=hf's name_or_path is null rather than `???`, so that this message, which names the
    # fix, is the one the user sees
    if v.choices.get("model") == "hf" and v.get("model.name_or_path") is None:
        yield ("model=hf needs model.name_or_path (a hub id or a local Hugging Face model directory), e.g. "
               "model.name_or_path=Qwen/Qwen2.5-0.5B-Instruct")


# Half of the spacing between neighbouring values, relative to the value: AdamW's updates
# smaller than this round away. Keyed by model.dtype and by the Lightning precisions that
# cast the module's weights themselves.
HALF_PRECISION_RESOLUTION = {"bfloat16": "0.4%", "float16": "0.05%", "bf16-true": "0.4%", "16-true": "0.05%"}


def is_sharded_strategy(v: Values) -> bool:
    """Whether the trainer shards the model (trainer=fsdp's strategy)."""
    strategy = v.get("trainer.strategy")
    return isinstance(strategy, dict) and str(strategy.get("_target_", "")).endswith("ShardedModelParallelStrategy")


@rule
def trainable_weights_are_not_half_precision(v: Values):
    """AdamW on bf16 weights rounds away every update below half a bf16 ulp of the weight
    (~0.4% of it): at RL learning rates (1e-6 x an O(1) Adam step) most updates vanish and
    training silently stalls. fp32 master weights with bf16 autocast compute cost 2 extra
    bytes per parameter and keep every update; trainer=fsdp upcasts trainable roles itself."""
    if v.get("model.allow_low_precision_weights", False):
        return
    sharded = is_sharded_strategy(v)
    dtype = v.get("model.dtype", "float32")
    fix = ("keep model.dtype=float32 with trainer.precision=bf16-mixed (fp32 master weights, bf16 compute), or set "
           "model.allow_low_precision_weights=true to accept it")
    # a LoRA policy's half-precision base is frozen: AdamW steps only the adapter, which PEFT keeps in fp32
    if dtype in HALF_PRECISION_RESOLUTION and not sharded and v.get("model.lora.r") is None:
        yield (f"model.dtype={dtype!r} makes AdamW step {dtype} weights, which rounds away updates smaller than "
               f"~{HALF_PRECISION_RESOLUTION[dtype]} of a weight (most updates at RL learning rates): training "
               f"would silently stall; {fix}")
    precision = v.get("trainer.precision")
    if precision in HALF_PRECISION_RESOLUTION:
        yield (f"trainer.precision={precision!r} casts the trainable weights to half precision, so AdamW rounds "
               f"away updates smaller than ~{HALF_PRECISION_RESOLUTION[precision]} of a weight: training would "
               f"silently stall; {fix}")


# The embedded model's own settings (conf/model/tiny.yaml), which a pretrained model's
# config.json replaces; model=hf and its presets inherit them unused.
EMBEDDED_MODEL_KEYS = ("architecture", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                       "max_position_embeddings", "tie_word_embeddings")


@rule
def a_pretrained_model_ignores_no_setting(v: Values):
    """`model.hidden_size=64` next to a name_or_path would be ignored in silence: refuse it."""
    if v.get("model.name_or_path") is None:
        return

    embedded = OmegaConf.load(f"{CONFIG_DIR}/model/tiny.yaml")
    changed = [f"model.{key}={v.get(f'model.{key}')!r}" for key in EMBEDDED_MODEL_KEYS
               if f"model.{key}" in v.values and v.get(f"model.{key}") != embedded.get(key)]
    if changed:
        yield (f"{', '.join(changed)} would be ignored: they shape the embedded model, and model.name_or_path="
               f"{v['model.name_or_path']!r} brings its own architecture and size (its config.json); drop them")


@rule
def tiny_model_heads_fit(v: Values):
    if v.get("model.name_or_path") is not None or "model.hidden_size" not in v.values:
        return
    hidden, heads, kv_heads = v["model.hidden_size"], v["model.num_heads"], v["model.num_kv_heads"]
    if hidden % heads:
        yield (f"model.hidden_size={hidden} is not a multiple of model.num_heads={heads} (each attention head "
               f"gets hidden_size / num_heads dimensions)")
    elif (hidden // heads) % 2:
        yield (f"model.hidden_size / model.num_heads = {hidden} / {heads} = {hidden // heads} is odd; expected an "
               f"even head size (rotary position embeddings rotate pairs of dimensions)")
    if heads % kv_heads:
        yield (f"model.num_heads={heads} is not a multiple of model.num_kv_heads={kv_heads} (each key/value head "
               f"serves num_heads / num_kv_heads query heads)")


@rule
def several_devices_need_the_data_parallel_strategy(v: Values):
    """Online RL averages gradients itself (distributed.py), so more than one process needs
    Lightning's ModelParallelStrategy (trainer=ddp), which does not wrap the module."""
    per_node = device_count(v.get("trainer.devices", 1))
    nodes = v.get("trainer.num_nodes", 1)
    processes = per_node * nodes if per_node is not None else None
    strategy = v.get("trainer.strategy", "auto")
    model_parallel = isinstance(strategy, dict) and str(strategy.get("_target_", "")).endswith("ModelParallelStrategy")
    if processes is not None and processes > 1 and not model_parallel:
        yield (f"trainer.devices={v['trainer.devices']!r} asks for {processes} processes, but "
               f"trainer.strategy={strategy!r} is not the data-parallel strategy posttrain averages gradients "
               f"under; use trainer=ddp")
    if model_parallel and processes is not None:
        data_parallel = strategy.get("data_parallel_size", "auto")
        if is_int(data_parallel) and data_parallel != processes:
            yield (f"trainer.strategy.data_parallel_size={data_parallel} must equal the number of processes, "
                   f"trainer.devices x trainer.num_nodes = {processes}")


@rule
def lora_export_and_start_are_loadable(v: Values):
    """An adapter alone is usable only beside its base on disk: a model directory (name_or_path,
    an init_from directory, or the SFT warm start's export, which an online run starts from)."""
    if v.get("model.lora.r") is None or v["model.lora.export_merged"]:
        return
    init_from, name_or_path = v.get("model.init_from"), v.get("model.name_or_path")
    warm_start = v.get("algorithm.warm_start.steps", 0) if v.online() and not init_from else 0
    if name_or_path is None and not warm_start and (init_from is None or str(init_from).endswith(".ckpt")):
        base = "the embedded tiny model" if init_from is None else f"model.init_from={init_from!r} (a checkpoint)"
        yield (f"model.lora.r={v['model.lora.r']} with model.lora.export_merged=false exports only the adapter, "
               f"but its base, {base}, is not a Hugging Face model on disk to apply it to: set "
               f"model.lora.export_merged=true, or start from an HF directory (model.init_from or model.name_or_path)")


@rule
def lora_is_not_sharded(v: Values):
    if is_sharded_strategy(v) and v.get("model.lora.r") is not None:
        yield (f"model.lora.r={v['model.lora.r']} is not supported with trainer=fsdp "
               f"(trainer.strategy._target_={v['trainer.strategy']['_target_']}): FSDP2 sharding of a "
               f"PEFT-wrapped policy is not built; use trainer=ddp or trainer=cpu with LoRA, or model.lora.r=null")


def teacher_keys(v: Values) -> list[str]:
    """The keys that configure a teacher, as `key=value`."""
    keys = ("teacher", "roles.teacher.name_or_path", "roles.teacher.init_from")
    return [f"{key}={v.get(key)}" for key in keys if v.get(key) is not None]


@rule
def distillation_reads_a_teacher(v: Values):
    """A distilling algorithm needs a teacher; a teacher no stage reads would be loaded (or
    trained) for nothing, and suggests the user meant another algorithm."""
    if not v.online():
        return

    algorithm = v.choices.get("algorithm", v.get("algorithm.name"))
    distill = v.get("algorithm.distill")
    configured = teacher_keys(v)
    if distills(distill) and not configured:
        yield (f"algorithm={algorithm} distils from a teacher, but none is configured: set teacher=<an HF directory, "
               f"a checkpoint or run directory, or tiny_concise / tiny_verbose>")
    elif configured and not distills(distill):
        why = ("algorithm.distill.coef=0" if distill else "it has no algorithm.distill")
        yield (f"{' and '.join(configured)} is set, but algorithm={algorithm} does not read a teacher ({why}); drop "
               f"the teacher, or use algorithm=opd / kdrl, or set algorithm.distill.coef > 0")


@rule
def a_distillation_reward_is_its_own_advantage(v: Values):
    distill = v.get("algorithm.distill")
    if v.online() and distill and distill.get("mode") == "reward" and v["advantage.name"] == "gae":
        yield ("algorithm.distill.mode=reward adds each token's distillation reward to its advantage as it is, but "
               "advantage=gae would need it in a critic's returns: use a group advantage (group_norm, group_mean, "
               "rloo), or algorithm.distill.mode=full or loss")


@rule
def online_rl_steps_its_own_optimiser(v: Values):
    accumulate = v.get("trainer.accumulate_grad_batches", 1)
    if v.online() and accumulate != 1:
        yield (f"trainer.accumulate_grad_batches={accumulate} is not valid with an online algorithm, which steps "
               f"its optimiser itself: expected 1; accumulate with algorithm.micro_batch_size instead")


@rule
def accelerator_is_present(v: Values):
    accelerator = v.get("trainer.accelerator", "auto")
    if accelerator in ("cuda", "gpu"):
        import torch

        if not torch.cuda.is_available():
            yield (f"trainer.accelerator={accelerator!r} but no CUDA device is visible on this machine; use "
                   f"trainer=cpu, or trainer.accelerator=auto")
    elif accelerator == "mps":
        import torch

        if not torch.backends.mps.is_available():
            yield "trainer.accelerator='mps' but MPS is not available on this machine; use trainer=cpu"


@rule
def vllm_rollout_can_run(v: Values):
    """rollout=vllm runs one vLLM engine beside the policy, on the GPU of the one training
    process, and reports log-probs in two conventions only (rollout/vllm.py)."""
    if v.get("rollout.engine") != "vllm":
        return
    import importlib.util

    import torch

    missing = [what for what, present in (("a CUDA GPU", torch.cuda.is_available()),
                                          ("the vllm package", importlib.util.find_spec("vllm") is not None))
               if not present]
    if missing:
        yield (f"rollout=vllm needs a CUDA GPU and the vllm package (pip install 'posttrain[vllm]'); this machine "
               f"lacks {' and '.join(missing)}: use rollout=fast")
    if v.get("trainer.accelerator", "auto") == "cpu":
        yield ("rollout=vllm generates on the GPU next to the policy, but trainer.accelerator='cpu' trains it on the "
               "CPU: use trainer=default (accelerator auto) with rollout=vllm")
    processes = (device_count(v.get("trainer.devices", 1)) or 1) * v.get("trainer.num_nodes", 1)
    if processes > 1:
        yield (f"rollout=vllm runs one engine inside a single training process, but trainer.devices x "
               f"trainer.num_nodes = {processes} processes (trainer=ddp / fsdp) were asked for; use one device, or "
               f"rollout=fast")
    strategy = v.get("trainer.strategy", "auto")
    if isinstance(strategy, dict) and str(strategy.get("_target_", "")).endswith("ShardedModelParallelStrategy"):
        yield ("rollout=vllm copies the policy's whole weights into its engine, but trainer=fsdp shards them; use "
               "trainer=default, or rollout=fast with trainer=fsdp")
    if v.online() and v.get("algorithm.keep_sampling_mask"):
        yield ("algorithm.keep_sampling_mask=true needs the sampler's kept top-k/top-p support, which rollout=vllm "
               "does not report; use rollout=fast, or keep_sampling_mask=false")
    if (v["rollout.top_k"] > 0 or v["rollout.top_p"] < 1.0) and v["rollout.temperature"] != 1.0:
        yield (f"rollout=vllm with rollout.top_k={v['rollout.top_k']} / rollout.top_p={v['rollout.top_p']} needs "
               f"rollout.temperature=1 (got {v['rollout.temperature']}): vLLM reports log-probs at temperature 1 or "
               f"renormalised over the top-k/top-p support, not posttrain's log_softmax(logits / T) over the full "
               f"vocabulary")


def rule_problems(cfg: DictConfig, bad: set[str], choices: dict[str, str]) -> list[str]:
    values = Values(cfg, bad, choices)
    problems = []
    for check in RULES:
        try:
            problems.extend(list(check(values)))
        except Unusable:
            continue  # a key it reads is absent or already reported
    return problems


# --- dry runs of the builders' own checks -------------------------------------------------

# Arguments `train.build_module` passes to the algorithm's module itself, and algorithm keys
# it does not pass (train.py reads them).
SUPPLIED_ARGUMENTS = ("self", "policy", "tokenizer", "source", "rollout", "eval_max_new_tokens", "kl_estimator",
                      "advantage", "reward", "data_curriculum", "roles", "cache_dir", "seed")
NOT_MODULE_ARGUMENTS = ("_target_", "name", "kind", "warm_start")
# The policy loss options, as OnlineRLModule.__init__ gathers them into `loss_options`.
LOSS_OPTION_KEYS = ("clip_low", "clip_high", "dual_clip", "delta", "log_ratio_clamp", "seq_log_ratio_clamp",
                    "ratio_level", "tau_pos", "tau_neg", "kimi_tau")


def import_target(path: str):
    module_path, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module_path), name)


def unknown_arguments(key: str, constructor, given: list[str], supplied: tuple[str, ...] = ()) -> list[str]:
    """Keys of a node that `constructor` does not take (it would fail with a TypeError)."""
    params = inspect.signature(constructor).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return []
    valid = [name for name in params if name not in supplied]
    unknown = sorted(set(given) - set(valid))
    if not unknown:
        return []
    return [f"{key}: unknown key(s) {unknown}; valid keys: {', '.join(valid)}"]


def algorithm_problems(cfg: DictConfig) -> list[str]:
    target = cfg.algorithm.get("_target_")
    try:
        module_class = import_target(target)
    except Exception as err:  # a missing module or name, or the module failing on import
        return [f"algorithm._target_={target!r} cannot be imported: {type(err).__name__}: {err}"]
    given = [k for k in cfg.algorithm if k not in NOT_MODULE_ARGUMENTS]
    problems = unknown_arguments("algorithm", module_class, given, SUPPLIED_ARGUMENTS)
    params = inspect.signature(module_class).parameters
    missing = [name for name, p in params.items()
               if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               and name not in SUPPLIED_ARGUMENTS and name not in given]
    if missing:
        problems.append(f"algorithm: missing key(s) {missing} that {target} needs")
    return problems


def core_option_problems(cfg: DictConfig) -> list[str]:
    """The advantage, policy loss and KL options on a dummy batch (online.check_core_options),
    from the config rather than from a built module."""
    defaults = {name: p.default for name, p in inspect.signature(OnlineRLModule).parameters.items()}
    algorithm = {k: v for k, v in OmegaConf.to_container(cfg.algorithm, resolve=True).items()}
    setting = lambda key: algorithm.get(key, defaults[key])  # noqa: E731 - a module argument or its default
    kl = OmegaConf.to_container(cfg.kl_estimator, resolve=True)
    uses_kl = kl["name"] != "none" and kl.get("coef", 0) > 0
    stand_in = SimpleNamespace(
        advantage_name=cfg.advantage.name,
        advantage_options={k: v for k, v in OmegaConf.to_container(cfg.advantage, resolve=True).items() if k != "name"},
        policy_loss=setting("policy_loss"),
        loss_options={key: setting(key) for key in LOSS_OPTION_KEYS},
        aggregation=dict(agg_mode=setting("loss_agg_mode"), count_empty_rows=setting("count_empty_rows"),
                         norm_constant=setting("norm_constant") or cfg.rollout.max_new_tokens),
        uses_reference=uses_kl,
        kl_name=kl["name"],
        kl_options={k: v for k, v in kl.items() if k not in KL_PLACEMENT_KEYS},
    )
    try:
        check_core_options(stand_in)
    except ConfigError as err:
        return [str(err)]
    return []


def reward_problems(cfg: DictConfig) -> list[str]:
    """Build the reward (imports user functions, checks each component's options); scoring
    needs no task source, so none is given."""
    try:
        build_reward(cfg.reward, None, cfg.rollout.max_new_tokens)
    except ConfigError as err:
        return [str(err)]
    return []


def curriculum_problems(cfg: DictConfig) -> list[str]:
    name = cfg.data_curriculum.name
    given = [k for k in cfg.data_curriculum if k != "name"]
    return unknown_arguments(f"data_curriculum={name}", CURRICULA[name], given, ("self", "cursor", "cache_dir"))


def dry_run_problems(cfg: DictConfig) -> list[str]:
    problems = algorithm_problems(cfg)
    if problems or cfg.algorithm.kind != "online":
        return problems

    if not issubclass(import_target(cfg.algorithm._target_), OnlineRLModule):
        return problems  # another online module: its own checks apply
    return core_option_problems(cfg) + reward_problems(cfg) + curriculum_problems(cfg)


# --- the one entry point ------------------------------------------------------------------

def as_sentence(message: str) -> str:
    message = message.strip()
    return message if message.endswith(".") else f"{message}."


def check_config(cfg: DictConfig, choices: dict[str, str] | None = None) -> None:
    """Raise one ConfigError listing every bad value and combination of `cfg` (a composed,
    resolved config). `choices`: Hydra's group choices, used to name the algorithm in messages."""
    choices = choices or {}
    problems, bad = value_problems(cfg)
    problems += rule_problems(cfg, bad, choices)
    if not problems:
        problems = dry_run_problems(cfg)
    if len(problems) == 1:
        raise ConfigError(as_sentence(problems[0]))
    if problems:
        numbered = " ".join(f"({i}) {as_sentence(p)}" for i, p in enumerate(problems, start=1))
        raise ConfigError(f"the config has {len(problems)} problems: {numbered}")
