"""The estimate of a run. Its config is composed as `posttrain <overrides>` would compose it
(Hydra's compose API: no run directory) and checked; then, from the models' configs alone (built
on the meta device: no weights are read or allocated), per device (data-parallel rank):

* parameters per model role;
* memory by stage (generate, annotate, update, evaluate): weights, gradients, AdamW's moments,
  frozen roles, the sampler's fused weight copies and KV cache, the update's activations
  (with and without activation checkpointing) and chunked logits; the peak is the largest stage;
* FLOPs per rollout batch by stage, and lower bounds on its seconds on a device: this CPU
  (the best reading so far of a short matmul and copy benchmark, kept under paths.cache_dir) or a GPU
  kind from `GPU_SPECS` (vendors' spec-sheet peaks).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf, open_dict

from posttrain.conf import CONFIG_DIR
from posttrain.config.check import check_config
from posttrain.estimate.architecture import Role, model_roles, policy_architecture
from posttrain.estimate.batch import batch_of, prompt_length, task_source
from posttrain.estimate.speed import device_speeds
from posttrain.estimate.stages import flops_by_stage, memory_by_stage, seconds_by_stage
from posttrain.run.cli import check_group_options

NO_RUN_DIR = "<no run directory: posttrain-estimate>"


@dataclass
class Estimate:
    model: str
    shape: dict
    batch: dict
    roles: list[dict]
    memory: dict[str, dict[str, float]]      # stage -> term -> bytes
    peak: dict[str, float]                    # stage -> bytes; "peak": the largest
    activations: dict[str, float]             # the update's, without, with and with selective checkpointing
    checkpointing: bool | str                 # model.gradient_checkpointing (or the fsdp strategy's)
    flops: dict[str, float]                   # stage -> FLOPs per rollout batch
    seconds: dict[str, dict[str, float]] = field(default_factory=dict)  # device -> stage -> s
    notes: list[str] = field(default_factory=list)


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


def role_summary(role: Role) -> dict:
    return {"role": role.role, "model": role.model, "parameters": role.parameters,
            "bytes_per_parameter": role.weight_bytes, "trainable": role.trainable}
