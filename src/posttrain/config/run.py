"""What a run's own keys accept, by concept: the top-level scalars of conf/train.yaml (seed,
threads, checkpoint, task name), `trainer.*` (Lightning's Trainer: processes, devices,
precision), `callbacks.*` and `logger.*` (with the user's own), `paths.*`, and `eval.*`
(held-out evaluation); and the rules across them."""

from __future__ import annotations

from typing import Iterator

import torch
from lightning.pytorch.strategies import StrategyRegistry

from posttrain.algorithms.eval_suites import SUITE_OPTIONS, suite_problems
from posttrain.config.spec import (POSITIVE, SEED, Spec, Values, boolean, choice, either, integer, is_int, list_of,
                                   mapping, number, option_specs, optional, pattern, rule, text)
from posttrain.data.arithmetic import SPLITS
from posttrain.data.hub import REQUIRED_COLUMNS
from posttrain.distributed.collectives import device_count


# --- top_level --------------------------------------------------------------------------

TOP_LEVEL_SPECS: dict[str, Spec] = {
    "seed": SEED,
    "num_threads": optional(integer(1)).about("torch threads on CPU; null: torch's default"),
    "host_mmap_threshold_kib": optional(either(integer(4), choice("auto"), expected="an integer >= 4 or 'auto'")).about(
        "CPU runs: allocations of at least this many KiB are returned to the system when freed; auto: 2048 where "
        "the policy is checkpointed and PyTorch's allocator has transparent huge pages, else glibc's default; "
        "null: glibc's default"),
    "ckpt_path": optional(text()).about("a Lightning checkpoint, 'last', or 'auto' (the run dir's newest intact "
                                         "checkpoint, if any)"),
    "task_name": either(text(), integer(), expected="a non-empty name").about("names the run directory"),
    "print_config": boolean(),
}


# --- trainer ----------------------------------------------------------------------------

DURATION = pattern(r"\d+:\d{1,2}:\d{1,2}:\d{1,2}", "a duration 'DD:HH:MM:SS'")
# Lightning's precision names (lightning.fabric.plugins.precision.precision._PRECISION_INPUT).
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true", "transformer-engine",
              "transformer-engine-float16", "32", "16", "64", "bf16", 32, 16, 64)
# Lightning's accelerator names (AcceleratorRegistry, plus its aliases "auto" and "gpu").
ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps", "tpu")


def lightning_strategy(value) -> bool:
    return isinstance(value, dict) or value == "auto" or value in StrategyRegistry.available_strategies()


TRAINER_SPECS: dict[str, Spec] = {
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
}


def is_sharded_strategy(v: Values) -> bool:
    """Whether the trainer shards the model (trainer=fsdp's strategy)."""
    strategy = v.get("trainer.strategy")
    return isinstance(strategy, dict) and str(strategy.get("_target_", "")).endswith("ShardedModelParallelStrategy")


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
def online_rl_steps_its_own_optimiser(v: Values):
    accumulate = v.get("trainer.accumulate_grad_batches", 1)
    if v.online() and accumulate != 1:
        yield (f"trainer.accumulate_grad_batches={accumulate} is not valid with an online algorithm, which steps "
               f"its optimiser itself: expected 1; accumulate with algorithm.micro_batch_size instead")


@rule
def accelerator_is_present(v: Values):
    accelerator = v.get("trainer.accelerator", "auto")
    if accelerator in ("cuda", "gpu"):
        if not torch.cuda.is_available():
            yield (f"trainer.accelerator={accelerator!r} but no CUDA device is visible on this machine; use "
                   f"trainer=cpu, or trainer.accelerator=auto")
    elif accelerator == "mps":
        if not torch.backends.mps.is_available():
            yield "trainer.accelerator='mps' but MPS is not available on this machine; use trainer=cpu"


# --- paths ------------------------------------------------------------------------------

PATHS_SPECS: dict[str, Spec] = {
    "paths.root_dir": text(),
    "paths.log_dir": text(),
    "paths.cache_dir": text(),
    "paths.output_dir": text(),
}


# --- callbacks --------------------------------------------------------------------------

def user_components(kind: str) -> Spec:
    """A list of a user's own `kind` objects, each `{_target_: package.module.Class, <options>}`;
    the class and its options are checked at start-up by run/user_components.py."""
    entry = Spec(lambda v: isinstance(v, dict) and isinstance(v.get("_target_"), str),
                 f"{{_target_: package.module.Class, <options>}} ({kind}; docs/extending.md)")
    return list_of(entry)


CALLBACKS_SPECS: dict[str, Spec] = {
    "callbacks.checkpoint.every_n_train_steps": integer(1),
    "callbacks.checkpoint.save_top_k": integer(-1).about("-1: keep every checkpoint"),
    "callbacks.progress_bar": choice("rich", "none"),
    "callbacks.stop_at_step": optional(integer(1)),
    "callbacks.stop_at_accuracy": optional(number(0, 1, low_open=True)),
    "callbacks.extra": user_components("a lightning.pytorch.callbacks.Callback subclass"),
}


# --- logger -----------------------------------------------------------------------------

LOGGER_SPECS: dict[str, Spec] = {
    "logger.backend": choice("wandb", "csv", "none"),
    "logger.project": text(),
    "logger.entity": optional(text()),
    "logger.mode": choice("auto", "online", "offline", "disabled"),
    "logger.tags": list_of(text()),
    "logger.group": optional(text()).about("the W&B group; null: the task name, or the sweep's name and time"),
    "logger.job_type": text().about("the W&B job type"),
    "logger.extra": user_components("a lightning.pytorch.loggers.Logger subclass, beside logger.backend"),
}


# --- eval -------------------------------------------------------------------------------

EVAL_SPECS: dict[str, Spec] = {
    "eval.split": choice(*SPLITS),
    "eval.num_prompts": integer(1).about("held-out prompts"),
    "eval.batch_size": integer(1),
    "eval.max_new_tokens": integer(1).about("generation budget in tokens"),
    "eval.at_start": boolean(),
    "eval.log_samples": integer(0).about("prompts in the samples table at each eval; 0: none"),
    "eval.pass_k": optional(list_of(integer(1))).about("each k <= eval.num_samples; null: no pass@k"),
    "eval.num_samples": integer(1).about("sampled responses per prompt for pass@k"),
    "eval.temperature": POSITIVE.about("sampling temperature for pass@k"),
    "eval.panel.size": integer(0).about("prompts of the panel (docs/panel.md); 0: no panel"),
    "eval.panel.seed": SEED.about("which held-out prompts make the panel, the same in every run"),
    "eval.panel.file": optional(text()).about("a JSON-lines file of the panel's examples; null: drawn from eval.split"),
    "eval.suites": optional(mapping("{same: {samples: 1}, words: {data: word_problems, samples: 4}}")).about(
        "evaluation suites by name, each its own data, decoding and metrics (algorithms/eval_suites.py); null: none"),
    "eval.suites.*": mapping("{samples: 4, temperature: 1.0, metrics: [accuracy, pass@4, maj@4]}"),
    **option_specs("eval.suites.*", SUITE_OPTIONS),
}


@rule
def eval_suites_are_well_formed(v: Values):
    """A suite's name, unknown keys and metrics (k <= samples); and a module that generates."""
    suites = v.get("eval.suites") or {}
    for name, given in suites.items():
        yield from suite_problems(name, given)
    if suites and v.get("algorithm.name") in ("reward_model", "prm"):
        yield (f"eval.suites={sorted(suites)}: algorithm={v.algorithm()} scores pairs or steps and generates no "
               f"responses, so it has no suite to evaluate; drop eval.suites")
    if suites and v.get("env.name", None) not in (None, "none"):
        for name, given in suites.items():
            if isinstance(given, dict) and given.get("data") is not None:
                yield (f"eval.suites.{name}.data={given['data']!r}: with an environment (env={v.get('env.name')}) "
                       f"held-out prompts are its episodes, so a suite evaluates the run's own data: set "
                       f"eval.suites.{name}.data=null")


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


SPECS: dict[str, Spec] = {**TOP_LEVEL_SPECS, **TRAINER_SPECS, **PATHS_SPECS, **CALLBACKS_SPECS, **LOGGER_SPECS,
                          **EVAL_SPECS}
