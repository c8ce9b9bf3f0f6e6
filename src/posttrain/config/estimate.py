"""`posttrain-estimate <overrides>`: what a run will cost, before it runs.

It composes the config as `posttrain <overrides>` would (Hydra's compose API: no run
directory), checks it, and from the models' configs alone (built on the meta device: no
weights are read or allocated) prints, per device (data-parallel rank):

* parameters per model role;
* memory by stage (generate, annotate, update, evaluate): weights, gradients, AdamW's moments,
  frozen roles, the sampler's fused weight copies and KV cache, the update's activations
  (with and without activation checkpointing) and chunked logits; the peak is the largest stage;
* FLOPs per rollout batch by stage, and lower bounds on its seconds on a device: this CPU
  (measured once by a short matmul and copy benchmark, cached under paths.cache_dir) or a GPU
  kind from `GPU_SPECS` (vendors' spec-sheet peaks).

The formulas are `posttrain.core.cost`'s; docs/estimate.md says what each term holds and how
the predictions compare with measured runs.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException
from rich.console import Console
from rich.table import Table
from transformers import AutoTokenizer

from posttrain.conf import CONFIG_DIR
from posttrain.config.check import check_config
from posttrain.config.memory import (
    DTYPE_BYTES,
    TRAINABLE_COPIES,
    layout_of,
    meta_parameter_count,
    model_config,
    model_directory,
    role_estimates,
)
from posttrain.config.memory import size as in_units
from posttrain.core import cost
from posttrain.core.cost import DecoderShape
from posttrain.core.logprobs import HIDDEN_CHUNK_ELEMENTS
from posttrain.data.datamodule import prompt_token_ids
from posttrain.data.sources import build_source
from posttrain.errors import ConfigError, DataError, PosttrainError
from posttrain.files import write_json_atomic
from posttrain.models.tiny import build_char_tokenizer, build_tiny_model
from posttrain.prepare.teachers import RECIPES
from posttrain.run.cli import check_group_options

PROGRAM = "posttrain-estimate"
# bf16 dense tensor FLOP/s (no sparsity) and memory bandwidth, from the vendors' spec sheets:
# peaks no run reaches, so the seconds derived from them are lower bounds.
GPU_SPECS = {
    "h100": {"name": "NVIDIA H100 SXM", "flops": 989e12, "bandwidth": 3.35e12},
    "h200": {"name": "NVIDIA H200 SXM", "flops": 989e12, "bandwidth": 4.8e12},
    "a100": {"name": "NVIDIA A100 SXM 80GB", "flops": 312e12, "bandwidth": 2.039e12},
    "l4": {"name": "NVIDIA L4", "flops": 121e12, "bandwidth": 0.3e12},
}
CPU_DEVICE = "cpu"
HALF_PRECISIONS = ("bf16-mixed", "16-mixed", "bf16-true", "16-true", "bf16", "16")
NO_RUN_DIR = "<no run directory: posttrain-estimate>"
PROMPTS_SAMPLED = 64  # training prompts tokenised to find the prompt length (the longest of them)


# --- the run's shapes ------------------------------------------------------------------------

@dataclass(frozen=True)
class Batch:
    """The sizes of one rollout batch on one device and of the update's micro-batch."""

    prompts: int           # unique prompts per rollout batch (algorithm.prompts_per_step)
    rows: int              # sampled responses: prompts x group_size
    prompt_tokens: int     # padded prompt width
    response_tokens: int   # generation budget (every response assumed full)
    micro_rows: int        # rows in one forward + backward of the update
    micro_prompts: int     # unique prompts in it (a group's rows share their prompt's forward)
    micro_batches: int     # forwards + backwards per optimiser step
    optimiser_steps: int   # ppo_epochs x num_minibatches per rollout batch
    eval_rows: int         # held-out prompts per eval generate call
    eval_tokens: int       # their generation budget


@dataclass(frozen=True)
class Role:
    """One model of the run on one device."""

    role: str
    model: str
    parameters: int
    shape: DecoderShape | None  # None: its architecture is not read (FLOPs not counted)
    weight_bytes: float         # bytes per parameter of its weights on this device
    trainable: bool


@dataclass
class Estimate:
    model: str
    shape: dict
    batch: dict
    roles: list[dict]
    memory: dict[str, dict[str, float]]      # stage -> term -> bytes
    peak: dict[str, float]                    # stage -> bytes; "peak": the largest
    activations: dict[str, float]             # the update's, with and without checkpointing
    checkpointing: bool
    flops: dict[str, float]                   # stage -> FLOPs per rollout batch
    seconds: dict[str, dict[str, float]] = field(default_factory=dict)  # device -> stage -> s
    notes: list[str] = field(default_factory=list)


def shape_of(config) -> DecoderShape:
    """The decoder shape of a Hugging Face config."""
    heads = config.num_attention_heads
    return DecoderShape(layers=config.num_hidden_layers, hidden=config.hidden_size,
                        intermediate=config.intermediate_size, heads=heads,
                        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                        vocab=config.vocab_size)


def tiny_model(model_cfg, vocab_size: int):
    """The embedded model of `model_cfg`, built on the meta device (no weights allocated)."""
    with torch.device("meta"):
        return build_tiny_model(vocab_size=vocab_size, architecture=model_cfg.architecture,
                                hidden_size=model_cfg.hidden_size, num_layers=model_cfg.num_layers,
                                num_heads=model_cfg.num_heads, num_kv_heads=model_cfg.num_kv_heads,
                                intermediate_size=model_cfg.intermediate_size,
                                max_position_embeddings=model_cfg.max_position_embeddings,
                                tie_word_embeddings=model_cfg.tie_word_embeddings)


def pretrained_architecture(name_or_path: str, key: str):
    """(config, parameters, directory) of a pretrained model, from its config.json alone."""
    directory = model_directory(name_or_path)
    config = model_config(directory) if directory is not None else None
    parameters = meta_parameter_count(config) if config is not None else None
    if parameters is None:
        raise ConfigError(f"{key}={name_or_path!r}: its config.json cannot be read (a GGUF model is read once it "
                          f"has been converted: run it once)")
    return config, parameters, directory


def policy_architecture(cfg, alphabet) -> tuple[DecoderShape, int, object]:
    """(shape, parameters, tokenizer) of the policy: the embedded model's from its settings and
    the task's alphabet, a pretrained one's from its config.json and tokenizer files."""
    name = cfg.model.get("name_or_path")
    if name is None:
        tokenizer = build_char_tokenizer(alphabet, model_max_length=cfg.model.max_position_embeddings)
        model = tiny_model(cfg.model, len(tokenizer))
        return shape_of(model.config), sum(p.numel() for p in model.parameters()), tokenizer
    config, parameters, directory = pretrained_architecture(name, "model.name_or_path")
    return shape_of(config), parameters, AutoTokenizer.from_pretrained(directory)


def prompt_length(cfg, source, tokenizer) -> int:
    """The padded prompt width: data.max_prompt_tokens when set, else the longest of the first
    `PROMPTS_SAMPLED` training prompts as the model sees them."""
    if cfg.data.get("max_prompt_tokens"):
        return int(cfg.data.max_prompt_tokens)
    available = source.size("train")
    count = PROMPTS_SAMPLED if available is None else min(PROMPTS_SAMPLED, available)
    return max(len(prompt_token_ids(source.example("train", i), tokenizer)) for i in range(count))


def batch_of(cfg, prompt_tokens: int, response_tokens: int | None) -> Batch:
    algorithm = cfg.algorithm
    online = algorithm.get("kind") == "online"
    prompts = int(algorithm.get("prompts_per_step", 1)) if online else 1
    group = int(algorithm.get("group_size", 1)) if online else 1
    rows = prompts * group if online else int(algorithm.get("batch_size", 1))
    minibatches = int(algorithm.get("num_minibatches", 1) or 1)
    minibatch_rows = math.ceil(rows / minibatches)
    micro_rows = min(int(algorithm.get("micro_batch_size") or minibatch_rows), minibatch_rows)
    # rows stay in batch order in one minibatch: groups stay whole when the micro-batch holds
    # whole groups; a random minibatch splits them (every row then runs its own prompt)
    shares_prompts = online and minibatches == 1 and micro_rows % group == 0
    return Batch(prompts=prompts, rows=rows, prompt_tokens=prompt_tokens,
                 response_tokens=response_tokens or int(cfg.rollout.get("max_new_tokens") or
                                                        cfg.data.max_response_tokens),
                 micro_rows=micro_rows, micro_prompts=micro_rows // group if shares_prompts else micro_rows,
                 micro_batches=math.ceil(minibatch_rows / micro_rows),
                 optimiser_steps=int(algorithm.get("ppo_epochs", 1) or 1) * minibatches,
                 eval_rows=min(int(cfg.eval.batch_size), int(cfg.eval.num_prompts)),
                 eval_tokens=int(cfg.eval.max_new_tokens))


def teacher_role(cfg, alphabet_vocab: int) -> tuple[str, int, DecoderShape] | None:
    """(model, parameters, shape) of the distillation teacher, or None when there is none."""
    teacher = cfg.get("teacher")
    named = cfg.roles.teacher.get("name_or_path") or teacher
    if named is None:
        return None
    if teacher in RECIPES:
        model_cfg = cfg.model.copy() if cfg.model.get("name_or_path") is None else None
        if model_cfg is None:
            return None
        for key, value in cfg.teacher_recipe.model.items():
            model_cfg[key] = value
        model = tiny_model(model_cfg, alphabet_vocab)
        return f"embedded {teacher}", sum(p.numel() for p in model.parameters()), shape_of(model.config)
    config, parameters, _ = pretrained_architecture(named, "teacher")
    return named, parameters, shape_of(config)


def model_roles(cfg, shape: DecoderShape, parameters: int, vocab: int) -> tuple[list[Role], list[str]]:
    """Every model the run holds on a device, with its bytes per parameter there (memory.py's
    layout: fsdp shards, frozen roles' dtypes), and notes on what is not counted."""
    layout = layout_of(cfg)
    notes = []
    roles = []
    for r in role_estimates(cfg, policy_parameters=parameters):
        per_parameter = r.bytes_per_parameter / memory_copies(r.trainable)
        same = r.parameters == parameters
        roles.append(Role(r.role, r.model, r.parameters, shape if same else None, per_parameter, r.trainable))
    if cfg.algorithm.get("kind") == "online":
        teacher = teacher_role(cfg, vocab)
        if teacher is not None:
            model, count, teacher_shape = teacher
            dtype = cfg.roles.teacher.get("dtype") or cfg.model.dtype
            frozen = layout.frozen("teacher", model, count, dtype)
            roles.append(Role("teacher", model, count, teacher_shape, frozen.bytes_per_parameter, False))
        for path in reward_model_paths(cfg):
            config, count, _ = pretrained_architecture(path, "reward.path")
            frozen = layout.frozen("reward model", path, count, cfg.model.dtype)
            roles.append(Role("reward model", path, count, shape_of(config), frozen.bytes_per_parameter, False))
            notes.append(f"reward model {path!r} counted as its causal LM (its score head as an LM head)")
    if cfg.model.get("lora", {}).get("r") is not None:
        notes.append("model.lora: the policy's base is frozen; the adapter's weights and AdamW state are left out")
    return roles, notes


def memory_copies(trainable: bool) -> int:
    """How many copies memory.py's bytes per parameter hold: weights, gradients and AdamW's two
    moments for a trainable role, the weights alone for a frozen one."""
    return TRAINABLE_COPIES if trainable else 1


def reward_model_paths(cfg) -> list[str]:
    components = (cfg.get("reward") or {}).get("components") or {}
    paths = []
    for component in components.values():
        if hasattr(component, "get") and (component.get("path") or component.get("paths")):
            paths += [component.path] if component.get("path") else list(component.paths)
    return paths


# --- memory ----------------------------------------------------------------------------------

def activation_dtype_bytes(cfg) -> int:
    precision = str(cfg.trainer.get("precision", "32-true"))
    return 2 if precision in HALF_PRECISIONS else DTYPE_BYTES[cfg.model.dtype]


def sampler_dtype_bytes(cfg) -> int:
    dtype = cfg.rollout.get("dtype", "auto")
    return DTYPE_BYTES[cfg.model.dtype] if dtype in (None, "auto") else DTYPE_BYTES[dtype]


def checkpointing_on(cfg) -> bool:
    strategy = cfg.trainer.get("strategy")
    sharded = hasattr(strategy, "get") and bool(strategy.get("activation_checkpointing", False))
    return bool(cfg.model.get("gradient_checkpointing", False)) or sharded


def update_activations(shape: DecoderShape, batch: Batch, act_bytes: int, weight_bytes: float,
                       checkpointed: bool) -> dict[str, float]:
    """What the update's micro-batch holds for its backward: per layer its activations and its
    fused weight copies (both only for the one layer being recomputed when checkpointed), the
    final hidden states, and the attention masks shared by every layer."""
    args = (shape, batch.micro_prompts, batch.prompt_tokens, batch.micro_rows, batch.response_tokens, act_bytes)
    full_layer = cost.layer_activation_bytes(*args)
    fused_layer = cost.FUSED_COPIES_WITH_GRAD * cost.fused_layer_parameters(shape) * weight_bytes
    scored = batch.micro_rows * batch.response_tokens
    head = 2 * scored * shape.hidden * act_bytes  # the last layer's output and its final-normed copy
    masks = mask_bytes(batch, act_bytes)
    if checkpointed:
        kept = shape.layers * cost.checkpointed_layer_bytes(*args) + full_layer
        fused = fused_layer
    else:
        kept = shape.layers * full_layer
        fused = shape.layers * fused_layer
    return {"activations": kept + head + masks, "fused weight copies": fused}


def mask_bytes(batch: Batch, act_bytes: int) -> int:
    """The grouped forward's two additive attention masks, rows padded to 16 elements."""
    def padded(n: int) -> int:
        return -(-n // 16) * 16

    prompt = batch.micro_prompts * batch.prompt_tokens * padded(batch.prompt_tokens)
    response = batch.micro_rows * batch.response_tokens * padded(batch.prompt_tokens + batch.response_tokens)
    return (prompt + response) * act_bytes


def logit_chunk_tokens(vocab: int) -> int:
    return max(1, HIDDEN_CHUNK_ELEMENTS // vocab)


def memory_by_stage(cfg, roles: list[Role], shape: DecoderShape, batch: Batch,
                    scores: bool) -> tuple[dict, dict, bool]:
    """(stage -> term -> bytes, the update's activations with and without checkpointing, whether
    checkpointing is on) on one device. `scores`: whether the annotate stage runs a forward
    (reference, old, teacher log-probs; critic values)."""
    layout = layout_of(cfg)
    policy = roles[0]
    weight_bytes = DTYPE_BYTES[cfg.model.dtype]
    act_bytes = activation_dtype_bytes(cfg)
    held = {f"{r.role} weights": r.parameters * r.weight_bytes for r in roles}
    optimiser = {f"{r.role} AdamW moments": 2 * r.parameters * r.weight_bytes for r in roles if r.trainable}
    gradients = {f"{r.role} gradients": r.parameters * r.weight_bytes for r in roles if r.trainable}
    gathered = {}
    if layout.shards > 1:  # fsdp: the sampler reads the whole weights, gathered for the rollout
        gathered = {"gathered policy weights": policy.parameters * weight_bytes * (1 - 1 / layout.shards)}
    persistent = {**held, **optimiser}

    chunk = logit_chunk_tokens(shape.vocab)
    scored = batch.micro_rows * batch.response_tokens
    logits = cost.logit_chunk_bytes(shape.vocab, scored, chunk)
    head_gradient = shape.vocab * shape.hidden * weight_bytes  # one chunk's LM-head gradient, before it is added
    checkpointed = checkpointing_on(cfg)
    both = {on: update_activations(shape, batch, act_bytes, weight_bytes, on) for on in (False, True)}
    kept = both[checkpointed]
    critic = next((r for r in roles if r.role == "critic" and r.trainable and r.shape is not None), None)
    if critic is not None:  # PPO's critic with its own backbone: its forward's activations too
        critic_kept = update_activations(critic.shape, batch, act_bytes, weight_bytes, checkpointed)
        kept = {**kept, **{f"critic {term}": value for term, value in critic_kept.items()}}
    # the backward frees each layer's activations as it fills that layer's gradients: the stage
    # peaks at its start (activations, the logits' backward) or at its end (every gradient);
    # a later micro-batch runs its forward and backward with the gradients already there
    at_start = sum(kept.values()) + logits + head_gradient
    all_gradients = sum(gradients.values())
    if batch.micro_batches > 1:
        backward = {**gradients, **kept, "logits (chunked)": logits, "LM-head gradient chunk": head_gradient}
    elif at_start >= all_gradients:
        backward = {**kept, "logits (chunked)": logits, "LM-head gradient chunk": head_gradient}
    else:
        backward = gradients

    sampler = sampler_dtype_bytes(cfg)
    fused_sampler = shape.layers * cost.fused_layer_parameters(shape) * sampler
    if sampler != weight_bytes:  # the sampler holds every weight in its own dtype
        fused_sampler = policy.parameters * sampler
    fast = cfg.rollout.get("engine", "fast") == "fast"
    positions = batch.prompt_tokens + batch.response_tokens
    generate = {**persistent, **gathered,
                "KV cache": cost.kv_cache_bytes(shape, batch.rows, positions, sampler),
                "prefill (one layer)": prefill_bytes(shape, batch.prompts, batch.prompt_tokens, sampler)}
    if fast:
        generate["sampler's fused weights"] = fused_sampler
    forward_tokens = batch.micro_prompts * batch.prompt_tokens + scored
    forward_only = {**persistent,
                    "one layer's forward": forward_tokens * cost.forward_working_elements_per_token(shape) * act_bytes,
                    "attention masks": mask_bytes(batch, act_bytes),
                    "logits (chunked)": cost.logit_chunk_bytes(shape.vocab, scored, chunk, buffers=3)}
    evaluate = {**persistent, **gathered,
                "KV cache": cost.kv_cache_bytes(shape, batch.eval_rows, batch.prompt_tokens + batch.eval_tokens, sampler),
                "prefill (one layer)": prefill_bytes(shape, batch.eval_rows, batch.prompt_tokens, sampler)}
    if fast:
        evaluate["sampler's fused weights"] = fused_sampler
    stages = {"generate": generate, "annotate": forward_only, "update": {**persistent, **backward},
              "evaluate": evaluate}
    if not scores:
        del stages["annotate"]
    if cfg.algorithm.get("kind") != "online":
        stages = {"update": stages["update"], "evaluate": evaluate}
    activations = {"without checkpointing": both[False]["activations"], "with checkpointing": both[True]["activations"]}
    return stages, activations, checkpointed


def prefill_bytes(shape: DecoderShape, prompts: int, prompt_tokens: int, dtype_bytes: int) -> int:
    """One layer's working tensors over the unique prompts while the sampler prefills them."""
    return prompts * prompt_tokens * cost.forward_working_elements_per_token(shape) * dtype_bytes


# --- FLOPs and seconds -----------------------------------------------------------------------

def flops_by_stage(cfg, roles: list[Role], shape: DecoderShape, batch: Batch) -> dict[str, float]:
    """FLOPs of one rollout batch on one device, by stage."""
    algorithm = cfg.algorithm
    whole = (shape, batch.prompts, batch.prompt_tokens, batch.rows, batch.response_tokens)
    flops = {}
    if algorithm.get("kind") == "online":
        flops["generate"] = cost.generation_flops(*whole)
        if batch.optimiser_steps > 1:  # pi_old differs from the policy after the first step
            flops["old log-probs"] = cost.forward_flops(*whole)
        for r in roles[1:]:
            if r.shape is not None and r.role in ("reference", "teacher", "reward model"):
                flops[f"{r.role} forward"] = cost.forward_flops(r.shape, *whole[1:])
    epochs = int(algorithm.get("ppo_epochs", 1) or 1)
    prompts_computed = batch.rows * batch.micro_prompts // batch.micro_rows  # once per group within a micro-batch
    policy_forward = cost.forward_flops(shape, prompts_computed, batch.prompt_tokens, batch.rows, batch.response_tokens)
    flops["update"] = epochs * cost.training_flops(policy_forward, checkpointing_on(cfg))
    critic = next((r for r in roles if r.role == "critic" and r.shape is not None), None)
    if critic is not None:
        critic_forward = cost.forward_flops(critic.shape, *whole[1:])
        flops["critic"] = critic_forward + epochs * cost.training_flops(critic_forward, checkpointing_on(cfg))
    return flops


def seconds_by_stage(cfg, flops: dict[str, float], roles: list[Role], shape: DecoderShape, batch: Batch,
                     peak_flops: float, bandwidth: float) -> dict[str, float]:
    """Lower bounds: FLOPs at the device's peak; generation also at least one read of the
    sampler's weights per decode step, and of the KV cache so far, at its bandwidth."""
    sampler = sampler_dtype_bytes(cfg)
    seconds = {}
    for stage, count in flops.items():
        bytes_read = 0
        if stage == "generate":
            weights = cost.matmul_parameters(shape) * sampler
            bytes_read = cost.decode_bytes_read(weights, shape, batch.rows, batch.prompt_tokens,
                                                batch.response_tokens, sampler)
        seconds[stage] = cost.seconds_at_least(count, peak_flops, bytes_read, bandwidth)
    seconds["step"] = sum(seconds.values())
    return seconds


def cpu_speed(cache_dir: Path, dtype: torch.dtype = torch.float32) -> dict:
    """This CPU's matmul FLOP/s in `dtype` (the run's compute dtype: a CPU with bf16 instructions
    multiplies bf16 faster than fp32, and a bound from the fp32 speed would not bound a bf16 run)
    and copy bandwidth at torch's thread count, measured once (about a second) and cached in
    `cache_dir`/estimate/, keyed by processor, threads, dtype and torch. Measure it on an idle
    machine: a speed measured beside other jobs is too low, and the bound it gives too high."""
    threads = torch.get_num_threads()
    key = f"{processor_name()}|{threads}|{dtype}|{torch.__version__}"
    cache = Path(cache_dir) / "estimate" / "cpu_speed.json"
    cached = json.loads(cache.read_text()) if cache.is_file() else {}
    if key not in cached:
        cached[key] = measure_cpu(threads, dtype)
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(cache, cached)
    return cached[key]


def measure_cpu(threads: int, dtype: torch.dtype = torch.float32, size: int = 1024,
                copy_elements: int = 1 << 25) -> dict:
    """The best of a few timed `dtype` matmuls and fp32 tensor copies."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    src = torch.ones(copy_elements)
    dst = torch.empty_like(src)
    a @ b, dst.copy_(src)  # warm-up
    matmul = copy = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        a @ b
        matmul = min(matmul, time.perf_counter() - started)
        started = time.perf_counter()
        dst.copy_(src)
        copy = min(copy, time.perf_counter() - started)
    return {"name": f"this CPU ({processor_name()}, {threads} threads, measured {str(dtype).removeprefix('torch.')})",
            "flops": 2 * size**3 / matmul, "bandwidth": 2 * 4 * copy_elements / copy}


def processor_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_speeds(cfg, device: str | None) -> dict[str, dict]:
    """The devices to bound the seconds on: `device` alone, or this CPU and every GPU kind."""
    if device is not None and device != CPU_DEVICE and device not in GPU_SPECS:
        raise ConfigError(f"--device={device!r} is not a device the estimate knows; use {CPU_DEVICE} or one of "
                          f"{', '.join(GPU_SPECS)}")
    names = [device] if device is not None else [CPU_DEVICE, *GPU_SPECS]
    dtype = torch.bfloat16 if activation_dtype_bytes(cfg) == 2 else torch.float32  # the matmuls' dtype
    return {name: cpu_speed(Path(cfg.paths.cache_dir), dtype) if name == CPU_DEVICE else GPU_SPECS[name]
            for name in names}


# --- the estimate ----------------------------------------------------------------------------

def estimate(cfg, prompt_tokens: int | None = None, response_tokens: int | None = None,
             device: str | None = None, with_seconds: bool = True) -> Estimate:
    """The estimate of a composed, checked config (see the module docstring). `prompt_tokens`,
    `response_tokens`: the lengths to estimate at (default: found from the data, the budget)."""
    source = task_source(cfg, prompt_tokens)
    shape, parameters, tokenizer = policy_architecture(cfg, source.alphabet if source is not None else None)
    if prompt_tokens is None:
        prompt_tokens = prompt_length(cfg, source, tokenizer)
    batch = batch_of(cfg, prompt_tokens, response_tokens)
    roles, notes = model_roles(cfg, shape, parameters, shape.vocab)
    flops = flops_by_stage(cfg, roles, shape, batch)
    scores = any(stage not in ("generate", "update") for stage in flops)
    memory, activations, checkpointed = memory_by_stage(cfg, roles, shape, batch, scores)
    peak = {stage: sum(terms.values()) for stage, terms in memory.items()}
    peak["peak"] = max(peak.values())
    result = Estimate(model=cfg.model.get("name_or_path") or "embedded tiny model", shape=asdict(shape),
                      batch=asdict(batch), roles=[role_summary(r) for r in roles], memory=memory, peak=peak,
                      activations=activations, checkpointing=checkpointed, flops=flops, notes=notes)
    if cfg.rollout.get("engine") == "vllm":
        result.notes.append("rollout=vllm: generation's memory is vLLM's own (rollout.gpu_memory_utilization)")
    if with_seconds:
        for name, speed in device_speeds(cfg, device).items():
            result.seconds[name] = seconds_by_stage(cfg, flops, roles, shape, batch, speed["flops"],
                                                    speed["bandwidth"])
    return result


def task_source(cfg, prompt_tokens: int | None):
    """The task's source, when the estimate needs it: the embedded model's alphabet, or the
    prompts' length (neither `--prompt-tokens` nor data.max_prompt_tokens given); None else, so
    that a hub dataset out of reach does not stop an estimate that does not read it."""
    if cfg.model.get("name_or_path") is not None and (prompt_tokens or cfg.data.get("max_prompt_tokens")):
        return None
    try:
        return build_source(cfg.data)
    except DataError as err:
        raise DataError(f"{err} (posttrain-estimate reads the data only for the prompts' length: give it with "
                        f"--prompt-tokens N or data.max_prompt_tokens=N)") from err


def role_summary(role: Role) -> dict:
    return {"role": role.role, "model": role.model, "parameters": role.parameters,
            "bytes_per_parameter": role.weight_bytes, "trainable": role.trainable}


# --- the command -----------------------------------------------------------------------------

def composed_config(overrides: list[str]):
    """The config `posttrain <overrides>` would run, checked as it would be, without a run dir."""
    check_group_options(overrides)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    HydraConfig().set_config(cfg)  # paths.output_dir reads hydra:runtime
    choices = {k: str(v) for k, v in cfg.hydra.runtime.choices.items() if not k.startswith("hydra")}
    with open_dict(cfg):
        del cfg["hydra"]
        cfg.paths.output_dir = NO_RUN_DIR  # composed outside a Hydra job: nothing is written there
    OmegaConf.resolve(cfg)
    check_config(cfg, choices)
    return cfg


def size(n: float) -> str:
    return in_units(n) if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def render(result: Estimate) -> None:
    """The estimate as tables on the console."""
    console = Console()
    b = result.batch
    console.print(f"[bold]{result.model}[/bold]: {result.shape['layers']} layers, hidden {result.shape['hidden']}, "
                  f"vocab {result.shape['vocab']}; per device: {b['rows']} rows ({b['prompts']} prompts) of "
                  f"{b['prompt_tokens']} prompt + {b['response_tokens']} response tokens, micro-batch "
                  f"{b['micro_rows']} rows x {b['micro_batches']}, {b['optimiser_steps']} optimiser step(s) per batch")
    roles = Table(title="parameters per role (per device)")
    for column in ("role", "model", "parameters", "bytes / parameter", "trainable"):
        roles.add_column(column)
    for r in result.roles:
        roles.add_row(r["role"], r["model"], f"{r['parameters']:,}", f"{r['bytes_per_parameter']:g}",
                      "yes" if r["trainable"] else "no")
    console.print(roles)
    memory = Table(title=f"memory per device by stage (activation checkpointing {'on' if result.checkpointing else 'off'})")
    memory.add_column("term")
    stages = list(result.memory)
    for stage in stages:
        memory.add_column(stage, justify="right")
    terms = list(dict.fromkeys(t for stage in stages for t in result.memory[stage]))
    for term in terms:
        memory.add_row(term, *(size(result.memory[s][term]) if term in result.memory[s] else "" for s in stages))
    memory.add_row("[bold]total[/bold]", *(f"[bold]{size(result.peak[s])}[/bold]" for s in stages))
    console.print(memory)
    console.print(f"peak: [bold]{size(result.peak['peak'])}[/bold]; the update's activations "
                  f"{size(result.activations['without checkpointing'])} without checkpointing, "
                  f"{size(result.activations['with checkpointing'])} with")
    timing = Table(title="FLOPs per rollout batch and lower bounds on seconds (spec peaks for GPUs)")
    timing.add_column("stage")
    timing.add_column("FLOPs", justify="right")
    for device in result.seconds:
        timing.add_column(f"{device} s", justify="right")
    for stage in [*result.flops, "step"]:
        flops = f"{result.flops[stage]:.3g}" if stage in result.flops else f"{sum(result.flops.values()):.3g}"
        timing.add_row(stage, flops, *(f"{result.seconds[d][stage]:.3g}" for d in result.seconds))
    console.print(timing)
    for note in result.notes:
        console.print(f"note: {note}")


def parse_arguments(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog=PROGRAM, description="What a run costs, from its config alone: "
                                     "memory per device by stage, FLOPs and lower bounds on seconds per step.",
                                     epilog="Other arguments are the run's Hydra overrides, as given to posttrain.")
    parser.add_argument("--device", help=f"bound the seconds on this device only: {CPU_DEVICE} (measured) or "
                                         f"{', '.join(GPU_SPECS)} (spec peaks)")
    parser.add_argument("--json", action="store_true", help="print the estimate as JSON")
    parser.add_argument("--prompt-tokens", type=int, help="the prompt width (default: the data's longest prompt)")
    parser.add_argument("--response-tokens", type=int, help="the response length (default: the generation budget)")
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> None:
    args, overrides = parse_arguments(sys.argv[1:] if argv is None else argv)
    try:
        unknown = [a for a in overrides if a.startswith("-")]
        if unknown:
            raise ConfigError(f"unknown option(s) {unknown}; see {PROGRAM} --help")
        cfg = composed_config(overrides)
        result = estimate(cfg, args.prompt_tokens, args.response_tokens, args.device)
    except (PosttrainError, OmegaConfBaseException, HydraException) as err:
        print(f"{PROGRAM}: error: {err}", file=sys.stderr)
        sys.exit(1)
    if args.json:
        print(json.dumps(asdict(result), indent=2))
    else:
        render(result)


if __name__ == "__main__":
    main()
