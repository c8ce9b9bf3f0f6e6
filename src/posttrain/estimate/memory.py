"""Will the run's models fit on the device? An estimate from parameter counts, checked before
any weights are loaded, so a model too large fails in seconds with its sizes named instead
of after a download and a warm start, with an out-of-memory traceback.

The estimate counts what a run holds for its whole length, per model role:

- a trainable role (the policy; PPO's critic with its own backbone): its weights, their
  gradients and AdamW's two moments, all four in the weights' dtype, so 4 x 4 = 16 bytes per
  parameter in fp32 (under trainer=fsdp the master weights are fp32 whatever model.dtype);
- a frozen role (the KL reference): its weights only, in roles.<name>.dtype (null: the
  policy's), so 4 bytes per parameter in fp32 and 2 in bf16.

It leaves out activations, the KV cache of generation, logits and autocast's bf16 copies of
the weights: these depend on batch and sequence sizes and can be cut (gradient
checkpointing, micro-batches). So the estimate is a floor, and only an estimate above the
device's free memory is refused (the run cannot fit); above WARN_FRACTION of it is a
warning (the rest likely will not fit). Parameters are counted by building the model from
its config.json on the meta device (no weights are read or allocated). A GGUF model
(`gguf:<package>` or a `.gguf` file, models/gguf.py) is counted from its converted directory
when the cache holds one, else from the tensor shapes in the file's header (memory-mapped,
nothing dequantised), so the check runs before the first conversion too.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from posttrain.distributed.collectives import device_count
from posttrain.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)

WARN_FRACTION = 0.8  # of the device's free memory, taken by the estimate: warn above it
# Copies of the trainable weights a run holds, in the weights' dtype: the weights, their
# gradients, and AdamW's exp_avg and exp_avg_sq.
TRAINABLE_COPIES = 4
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SHARDED_STRATEGY = "ShardedModelParallelStrategy"  # trainer=fsdp (posttrain.distributed.sharding)
EMBEDDED_MODEL = "embedded tiny model"  # the policy of model=tiny (model.name_or_path: null), in messages


@dataclass(frozen=True)
class RoleMemory:
    """One model role's share of the estimate, on one process."""

    role: str
    model: str            # what is loaded: a hub id or directory
    parameters: int
    bytes_per_parameter: float
    what: str             # the bytes per parameter in words
    trainable: bool = False  # bytes_per_parameter counts weights, gradients and AdamW's 2 moments alike

    @property
    def bytes(self) -> float:
        return self.parameters * self.bytes_per_parameter


def parameter_count(name_or_path: str) -> int | None:
    """Parameters of the causal LM at `name_or_path` (tied weights once), from its config
    alone on the meta device; None when the config cannot be read (the loader, which runs
    next, then reports why with the key that named it). A GGUF is counted from its cached
    Hugging Face directory, else from the file itself (`gguf_parameter_count`)."""
    directory = model_directory(name_or_path)
    if directory is None:
        file = installed_gguf(name_or_path)
        return gguf_parameter_count(file) if file is not None else None
    config = model_config(directory)
    return meta_parameter_count(config) if config is not None else None


def model_directory(name_or_path: str) -> str | None:
    """Where the config.json of `name_or_path` is read: the name itself, or for a GGUF its
    converted Hugging Face directory; None for a GGUF not converted yet or not installed."""
    # start-up: models/ (and transformers with it) loads only when a pretrained model's size is asked for
    from posttrain.models.gguf import cache_entry, cache_root, names_gguf

    if not names_gguf(name_or_path):
        return os.path.expanduser(name_or_path)
    file = installed_gguf(name_or_path)
    converted = cache_root() / cache_entry(file) if file is not None else None  # models/gguf.py's hf_directory
    return str(converted) if converted is not None and converted.is_dir() else None


def installed_gguf(name_or_path: str):
    """The .gguf file a GGUF name points to, or None when it names none that is installed (the
    loader, which runs next, says so with its key)."""
    from posttrain.models.gguf import gguf_file  # start-up: as model_directory

    try:
        return gguf_file(name_or_path)
    except CheckpointError as err:
        log.debug(f"memory check skipped for {name_or_path!r}: {err}")
        return None


def model_config(directory: str):
    """The Hugging Face config of the model at `directory` (a hub id or a local directory), or
    None when it cannot be read."""
    from transformers import AutoConfig  # start-up: as models/ above

    try:
        return AutoConfig.from_pretrained(directory)
    except Exception as err:  # noqa: BLE001 - unreadable or unreachable: not this check's to report
        log.debug(f"memory check skipped for {directory!r}: {err}")
        return None


def meta_parameter_count(config) -> int | None:
    """Parameters of the causal LM of a Hugging Face `config`, built on the meta device (no
    weights allocated); tied weights count once."""
    from transformers import AutoModelForCausalLM  # start-up: as models/ above

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as err:  # noqa: BLE001 - not a causal LM transformers knows: not this check's to report
        log.debug(f"memory check skipped for {config.__class__.__name__}: {err}")
        return None
    return sum(p.numel() for p in model.parameters())


# llama.cpp tensors that are not weights: the HF model computes them (RoPE scaling factors)
GGUF_NON_PARAMETERS = ("rope_freqs", "rope_factors_long", "rope_factors_short")


def gguf_parameter_count(file) -> int | None:
    """Parameters of the model in a .gguf file: the element counts of its tensors, read from
    the header (the reader memory-maps the file and dequantises nothing). A tied output
    layer is one tensor in the file, as it is one parameter in the model; None when the
    file cannot be read (no `gguf` package, not a GGUF file)."""
    try:
        import gguf  # optional: only a GGUF model needs it (the `real` extra)

        tensors = gguf.GGUFReader(file).tensors
    except Exception as err:  # noqa: BLE001 - unreadable: the conversion, which runs next, says why
        log.debug(f"memory check skipped for {str(file)!r}: {err}")
        return None
    return sum(int(t.n_elements) for t in tensors if t.name.rpartition(".")[0] not in GGUF_NON_PARAMETERS)


@dataclass(frozen=True)
class Layout:
    """How a run holds its models on each process: sharded over `shards` processes
    (trainer=fsdp) or whole, frozen roles whole in bf16 (fsdp's replicate_bf16)."""

    shards: int
    replicate_frozen: bool
    trainable_dtype: str  # fsdp keeps fp32 master weights whatever model.dtype (sharding.py)

    def trainable(self, role: str, model: str, parameters: int) -> RoleMemory:
        per_parameter = TRAINABLE_COPIES * DTYPE_BYTES[self.trainable_dtype] / self.shards
        return RoleMemory(role, model, parameters, per_parameter,
                          f"{self.trainable_dtype} weights, gradients and AdamW's 2 moments{sharded_over(self.shards)}",
                          trainable=True)

    def frozen(self, role: str, model: str, parameters: int, dtype: str) -> RoleMemory:
        if self.replicate_frozen:
            return RoleMemory(role, model, parameters, DTYPE_BYTES["bfloat16"],
                              "bfloat16 weights, whole on each device")
        return RoleMemory(role, model, parameters, DTYPE_BYTES[dtype] / self.shards,
                          f"{dtype} weights{sharded_over(self.shards)}")


def layout_of(cfg) -> Layout:
    strategy = cfg.trainer.get("strategy")
    if hasattr(strategy, "get") and str(strategy.get("_target_", "")).endswith(SHARDED_STRATEGY):
        return Layout(world_size(cfg), strategy.get("frozen_roles") == "replicate_bf16", "float32")
    return Layout(1, False, cfg.model.dtype)


def role_estimates(cfg, policy_parameters: int | None = None) -> list[RoleMemory]:
    """The estimate's terms for the roles this run builds, per process; empty for the
    embedded tiny model (a few MB) or when the policy's config cannot be read, unless its
    `policy_parameters` are given (posttrain-estimate counts the tiny model's)."""
    policy_model = cfg.model.get("name_or_path")
    if policy_parameters is None:
        policy_parameters = parameter_count(policy_model) if policy_model is not None else None
    if policy_parameters is None:
        return []
    policy_model = policy_model or EMBEDDED_MODEL
    layout = layout_of(cfg)
    adapter = (cfg.model.get("lora") or {}).get("r") is not None
    if adapter:  # model.lora: the base is frozen (the adapter's few weights are left out) and is the reference
        roles = [layout.frozen("policy", policy_model, policy_parameters, cfg.model.dtype)]
    else:
        roles = [layout.trainable("policy", policy_model, policy_parameters)]
    online = cfg.algorithm.get("kind") == "online"
    kl = cfg.get("kl_estimator", {})
    if online and not adapter and kl.get("name", "none") != "none" and kl.get("coef", 0) > 0:  # as OnlineRLModule
        roles.append(other_role(cfg, "reference", layout, policy_model, policy_parameters))
    if online and cfg.algorithm.get("critic") is not None and not cfg.roles.critic.get("shared_backbone", False):
        roles.append(other_role(cfg, "critic", layout, policy_model, policy_parameters))
    return [r for r in roles if r is not None]


def other_role(cfg, role: str, layout: Layout, policy_model: str, policy_parameters: int) -> RoleMemory | None:
    """A role beside the policy: its own model (roles.<role>.name_or_path) or a copy of the policy."""
    role_cfg = cfg.roles[role]
    model = role_cfg.get("name_or_path") or policy_model
    parameters = policy_parameters if model == policy_model else parameter_count(model)
    if parameters is None:
        return None
    if role_cfg.get("trainable", False):
        return layout.trainable(role, model, parameters)
    return layout.frozen(role, model, parameters, role_cfg.get("dtype") or cfg.model.dtype)


def sharded_over(shards: int) -> str:
    return f", sharded over {shards} devices" if shards > 1 else ""


def world_size(cfg) -> int:
    return (device_count(cfg.trainer.get("devices", 1)) or 1) * cfg.trainer.get("num_nodes", 1)


def device_memory(cfg) -> tuple[int, str] | None:
    """(bytes free, the device in words) for the run's accelerator, or None where this check
    does not know how to ask (MPS, TPU, a custom accelerator)."""
    accelerator = cfg.trainer.get("accelerator", "auto")
    if accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            return None  # config/trainer.py refuses a CUDA accelerator without CUDA
        index = int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
        free, _total = torch.cuda.mem_get_info(index)
        return free, f"cuda:{index} ({torch.cuda.get_device_name(index)}) has"
    if accelerator in ("cpu", "auto"):
        per_node = device_count(cfg.trainer.get("devices", 1)) or 1  # processes sharing this RAM
        sharing = f", shared by {per_node} processes" if per_node > 1 else ""
        return available_ram() // max(1, per_node), f"the CPU's available RAM{sharing} leaves each process"
    return None


def available_ram() -> int:
    """Memory the kernel can give without swapping (MemAvailable), else the free pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def describe(roles: list[RoleMemory]) -> str:
    return "; ".join(f"{r.role} {r.model!r}: {count(r.parameters)} parameters x {r.bytes_per_parameter:g} bytes "
                     f"({r.what}) = {size(r.bytes)}" for r in roles)


def check_memory_fits(cfg) -> None:
    """Refuse (ConfigError) a run whose models' estimated memory exceeds the device's free
    memory; warn when it takes more than WARN_FRACTION of it. Reads configs only."""
    roles = role_estimates(cfg)
    device = device_memory(cfg) if roles else None
    if device is None:
        return
    free, where = device
    needed = sum(r.bytes for r in roles)
    policy = roles[0]
    sizes = (f"model.name_or_path={policy.model!r} has {policy.parameters:,} parameters; training needs at "
             f"least {size(needed)} before activations ({describe(roles)}), and {where} {size(free)} free")
    if needed > free:
        raise ConfigError(f"{sizes}: the model does not fit. Use a smaller model, trainer=fsdp over more devices, "
                          f"or (frozen roles) roles.reference.dtype=bfloat16")
    if needed > WARN_FRACTION * free:
        log.warning(f"{sizes} ({needed / free:.0%}): activations and generation's KV cache may not fit; consider "
                    f"model.gradient_checkpointing=true and a smaller algorithm.micro_batch_size")
