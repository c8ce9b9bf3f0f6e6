"""FSDP2 sharding for `trainer=fsdp`: which modules are sharded and how, and the few places
that need the full weights back (generation, the Hugging Face export).

The policy is a `ShardingPolicy` carried by the Lightning strategy
(`ShardedModelParallelStrategy`, a `ModelParallelStrategy` with the sharding settings as
extra arguments), so `trainer=fsdp` holds every setting and `PosttrainModule.configure_model`
applies it with `shard_module`:

- trainable roles (the policy, a critic with its own backbone): `fully_shard` on every
  decoder block, then on the role itself (embeddings, final norm, heads). Their parameters
  are kept in fp32 (the master weights, also when the model was loaded in bf16: pure-bf16
  AdamW silently drops updates smaller than bf16's resolution); `param_dtype` is the dtype
  the gathered weights are computed in, `reduce_dtype` the one gradients are reduced in.
- frozen roles (`module.frozen_roles()`: the reference; later a teacher, a reward model):
  sharded the same way (`frozen_roles: shard`), or cast to bf16 and kept whole on every
  rank (`replicate_bf16`). They have no optimiser state either way.
- activation checkpointing: Hugging Face's own, per decoder block (non-reentrant, which
  composes with FSDP2), so the model's structure and parameter names do not change.

FSDP2's reduce-scatter averages gradients over the data-parallel ranks, so
`distributed.average_gradients` leaves sharded gradients alone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from posttrain.distributed.recompute import checkpointing_on, enable_activation_checkpointing
from posttrain.errors import CheckpointError, ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FROZEN_ROLE_MODES = ("shard", "replicate_bf16")
# Lightning's file of non-tensor state inside a distributed (directory) checkpoint.
METADATA_FILENAME = "meta.pt"


@dataclass(frozen=True)
class ShardingPolicy:
    reshard_after_forward: bool = True      # free gathered weights after each block's forward
    param_dtype: str | None = None          # compute dtype of gathered weights; None: the parameters' (fp32)
    reduce_dtype: str = "float32"           # dtype of the gradient reduce-scatter
    activation_checkpointing: bool = False  # recompute each decoder block's activations in backward
    frozen_roles: str = "shard"             # shard | replicate_bf16

    def __post_init__(self):
        for key in ("param_dtype", "reduce_dtype"):
            value = getattr(self, key)
            if value is not None and value not in DTYPES:
                raise ConfigError(f"trainer.strategy.{key}={value!r} is not one of {sorted(DTYPES)}")
        if self.frozen_roles not in FROZEN_ROLE_MODES:
            raise ConfigError(f"trainer.strategy.frozen_roles={self.frozen_roles!r} is not one of "
                              f"{list(FROZEN_ROLE_MODES)}")

    def mixed_precision(self):
        param_dtype = DTYPES[self.param_dtype] if self.param_dtype else None
        return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=DTYPES[self.reduce_dtype])


class PosttrainModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ModelParallelStrategy (data parallel only), able to resume both kinds of
    checkpoint it writes. Lightning's own resume reads only sharded (DTensor) models, which
    plain data parallelism (trainer=ddp) does not have, and reads a distributed checkpoint
    strictly, while frozen roles are rebuilt from their config, not stored."""

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        # A directory rewritten in place (last.ckpt, every time) and killed half-way would mix
        # two saves' shards under an intact-looking meta.pt: every rank writes beside it, then
        # rank 0 swaps the finished directory in.
        path = Path(self.broadcast(filepath))
        staging = path.with_name(f".{path.name}.partial")
        if self.global_rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        self.barrier()
        super().save_checkpoint(checkpoint, staging, storage_options)
        self.barrier()
        if self.global_rank == 0:
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
            os.replace(staging, path)
        self.barrier()

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        path = Path(self.broadcast(checkpoint_path))
        if is_distributed_checkpoint(path):
            return load_distributed_checkpoint(path, self.model, self.optimizers, skip=frozen_prefixes(self.model))
        if is_sharded(self.model):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        # an ordinary checkpoint file and an unsharded model: what Lightning's plain
        # strategies do; the weights follow in load_model_state_dict, after the module's
        # on_load_checkpoint has put the frozen roles back into the state dict
        checkpoint = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(state)  # Lightning does not restore optimisers under this strategy
        return checkpoint

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        if not is_sharded(self.model):  # a sharded model was loaded in load_checkpoint
            self.lightning_module.load_state_dict(checkpoint["state_dict"], strict=strict)


class ShardedModelParallelStrategy(PosttrainModelParallelStrategy):
    """The same with a sharding policy (trainer=fsdp), which the module applies in
    `configure_model`."""

    def __init__(self, *, reshard_after_forward: bool = True, param_dtype: str | None = None,
                 reduce_dtype: str = "float32", activation_checkpointing: bool = False,
                 frozen_roles: str = "shard", **kwargs):
        super().__init__(**kwargs)
        self.sharding = ShardingPolicy(reshard_after_forward, param_dtype, reduce_dtype, activation_checkpointing,
                                       frozen_roles)


def is_distributed_checkpoint(path: Path) -> bool:
    """A finished distributed checkpoint (trainer=fsdp): a directory with rank 0's meta.pt,
    which Lightning writes after every rank's shards."""
    return path.is_dir() and (path / METADATA_FILENAME).is_file()


def policy_weights_from_distributed_checkpoint(path: Path, key: str) -> dict[str, torch.Tensor]:
    """The policy's whole weights (`policy.*`, prefix removed) from a distributed checkpoint
    directory, read in one process with no process group (`dcp.load(no_dist=True)` assembles
    each tensor from every rank's shards), so `model.init_from` can start a run of any
    parallelism from an FSDP run's checkpoint. `key` names the setting in errors."""
    prefix = "state_dict.policy."  # how DCP flattens {"state_dict": {"policy.<name>": ...}}
    try:
        stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as err:  # noqa: BLE001 - any unreadable directory is the user's culprit
        raise CheckpointError(f"{key}={str(path)!r} is not a readable distributed checkpoint: {err}") from None
    weights = {name[len(prefix):]: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
               for name, meta in stored.items() if name.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}
    if not weights:
        raise CheckpointError(f"{key}={str(path)!r} is a distributed checkpoint without 'policy.*' weights")
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process": yes
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"state_dict": {f"policy.{name}": tensor for name, tensor in weights.items()}}, checkpoint_id=path,
                 no_dist=True)
    return weights


def frozen_prefixes(module) -> tuple[str, ...]:
    return tuple(f"{role}." for role in getattr(module, "frozen_roles", list)())


def load_distributed_checkpoint(path: Path, model: nn.Module, optimizers, skip: tuple[str, ...]) -> dict:
    """Weights and optimiser states from a distributed checkpoint directory (written by any
    number of ranks: DCP reshards onto this run's mesh), in place; returns the rest of the
    checkpoint (counters, callbacks, the module's own keys) for Lightning's hooks."""
    weights = {k: v for k, v in get_model_state_dict(model).items() if not k.startswith(skip)}
    dcp.load({"state_dict": weights}, checkpoint_id=path)
    set_model_state_dict(model, weights, options=StateDictOptions(strict=False))  # the frozen roles are absent
    for index, optimizer in enumerate(optimizers):
        key = f"optimizer_{index}"  # how ModelParallelStrategy.save_checkpoint names them
        state = {key: get_optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=path)
        set_optimizer_state_dict(model, optimizer, optim_state_dict=state[key])
    checkpoint = torch.load(path / METADATA_FILENAME, map_location="cpu", weights_only=False)
    # the weights are already in place (the strategy's load_model_state_dict does nothing);
    # an empty state_dict keeps on_load_checkpoint hooks that add to it working
    checkpoint["state_dict"] = {}
    return checkpoint


# --- applying the policy ------------------------------------------------------------------

def is_sharded(model: nn.Module) -> bool:
    return any(isinstance(m, FSDPModule) for m in model.modules())


def decoder_blocks(lm: nn.Module) -> list[nn.Module]:
    """The decoder blocks of a Hugging Face causal LM (`lm.model.layers` for Llama/Qwen2)."""
    layers = getattr(lm.get_decoder(), "layers", None)
    if layers is None:
        raise ConfigError(f"trainer=fsdp: {type(lm).__name__} has no decoder blocks at .get_decoder().layers to shard")
    return list(layers)


def shard_module(module) -> None:
    """Apply the strategy's sharding policy to every role of `module` (a PosttrainModule);
    nothing without one (trainer=ddp, a single process). Idempotent: Lightning calls
    configure_model at every fit and validate."""
    trainer = getattr(module, "_trainer", None)
    policy = getattr(getattr(trainer, "strategy", None), "sharding", None)
    if policy is None or is_sharded(module.policy):
        return
    mesh = module.device_mesh["data_parallel"]
    frozen = list(module.frozen_roles()) if hasattr(module, "frozen_roles") else []
    critic = getattr(module, "critic", None)
    if critic is not None and critic.lm is module.policy:
        # the critic's value head reads hidden states that the policy's decoder computes
        # outside the policy's own forward, where FSDP2 gathers the root's weights
        raise ConfigError("roles.critic.shared_backbone=true is not supported with trainer=fsdp; use "
                          "roles.critic.shared_backbone=false (the critic's own backbone), or trainer=ddp")

    shard_lm(module.policy, mesh, policy, trainable=True)
    if critic is not None:
        shard_lm(critic.lm, mesh, policy, trainable=True, root=critic)
    for role in frozen:
        model = getattr(module, role)
        if policy.frozen_roles == "replicate_bf16":
            model.to(torch.bfloat16)
        else:
            shard_lm(model, mesh, policy, trainable=False)


def shard_lm(lm: nn.Module, mesh, policy: ShardingPolicy, trainable: bool, root: nn.Module | None = None) -> None:
    """fully_shard every decoder block of `lm`, then `root` (default: `lm` itself), which
    holds the rest (embeddings, final norm, heads) and is the module whose forward runs."""
    root = root if root is not None else lm
    if trainable:
        # fp32 master weights: the optimiser steps on these, whatever the compute dtype
        lm.posttrain_export_dtype = next(lm.parameters()).dtype
        root.float()
        if policy.activation_checkpointing and not checkpointing_on(lm):  # model.gradient_checkpointing's mode wins
            enable_activation_checkpointing(lm)
    mixed_precision = policy.mixed_precision()
    for unit in decoder_blocks(lm) + [root]:
        fully_shard(unit, mesh=mesh, mp_policy=mixed_precision, reshard_after_forward=policy.reshard_after_forward)
        unit.posttrain_reshard_after_forward = policy.reshard_after_forward  # full_weights sets it back


# --- full weights back --------------------------------------------------------------------

@contextlib.contextmanager
def full_weights(model: nn.Module):
    """Inside, every parameter of `model` is whole on every rank (one all-gather per FSDP
    unit, in the compute dtype), so generation runs many forwards with no collective; the
    shards are restored on exit. A no-op for an unsharded model, and inside an outer
    `full_weights` of the same model: a stage whose number of generate calls differs between
    ranks (dynamic sampling's extra rounds) gathers once around all of them, since a gather
    per call would be a collective that some ranks never join."""
    if getattr(model, "posttrain_gathered", False):
        yield model
        return
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.unshard()
        # a forward inside (the generic HF loop) must not free the weights again: each
        # re-gather would be a collective that ranks stopping at other lengths never join
        unit.set_reshard_after_forward(False, recurse=False)
    model.posttrain_gathered = True
    try:
        yield model
    finally:
        model.posttrain_gathered = False
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(getattr(unit, "posttrain_reshard_after_forward", True), recurse=False)


class GatheringEngine:
    """A rollout engine whose model is gathered whole once per `generate` call (see
    `full_weights`): the rollout, held-out evaluation and pass-rate estimates all generate
    through the module's engine."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, model, *args, **kwargs):
        with full_weights(model):
            return self.engine.generate(model, *args, **kwargs)

    def __getattr__(self, name):
        if name == "engine":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.engine, name)


def full_state_dict(model: nn.Module, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The whole state dict of a sharded `model`, on CPU; every rank must call it (it
    gathers). With `rank0_only`, the other ranks get an empty dict."""
    if not is_sharded(model):
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
    return {k: v.detach().cpu() for k, v in get_model_state_dict(model, options=options).items()}


def consolidated_model(model: nn.Module) -> nn.Module | None:
    """What the Hugging Face export writes: `model` itself when it is not sharded, else an
    unsharded copy with the full weights on rank 0 (None on the other ranks), in the dtype the
    model was loaded in. Any Hugging Face model class: a causal LM, or the token and sequence
    classifiers of the PRM and the reward model. Every rank must call it (it gathers)."""
    if not is_sharded(model):
        return model
    state = full_state_dict(model, rank0_only=True)
    if dist.get_rank() != 0:
        return None
    with torch.device("meta"):
        full = type(model)(model.config)  # FSDP2's subclass constructs the model's own class
    full.load_state_dict(state, assign=True)
    full.tie_weights()  # assign=True gave tied weights (embeddings, LM head) two tensors
    if full.can_generate():  # a classifier has no generation settings
        full.generation_config = model.generation_config
    return full.to(getattr(model, "posttrain_export_dtype", torch.float32)).eval()
