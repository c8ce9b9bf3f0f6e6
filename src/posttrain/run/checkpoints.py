"""Which checkpoint a run resumes from, and whether it can: refused before anything is
built when another algorithm wrote it or its weights have other shapes.

`ckpt_path`: a file; `last`: the newest intact checkpoint of this run directory (an error
if there is none); `auto`: the same, or a fresh start when there is none, so a requeued
job, which runs the same command in the same directory, continues where it stopped. The
temporaries of saves that a kill cut short are removed when a run starts."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch
from omegaconf import DictConfig

from posttrain.distributed.sharding import is_distributed_checkpoint
from posttrain.errors import CheckpointError

log = logging.getLogger("posttrain")


def resolve_ckpt_path(ckpt_path: str | None, output_dir: Path) -> str | None:
    if ckpt_path is None:
        return None
    if ckpt_path in ("last", "auto"):
        found = newest_intact_checkpoint(output_dir / "checkpoints")
        if found is None and ckpt_path == "last":
            raise CheckpointError(f"ckpt_path=last: no intact checkpoint in {output_dir / 'checkpoints'}")
        return None if found is None else str(found)
    path = Path(ckpt_path).expanduser()
    if not path.is_file() and not is_distributed_checkpoint(path):  # a file, or a sharded checkpoint's directory
        raise CheckpointError(f"ckpt_path={ckpt_path!r}: no checkpoint file at {path}")
    return str(path)


# What a checkpoint save writes before renaming it into place, by our writers' naming:
# `.<name>.ckpt.<pid>.tmp` (run/preemption.py, AtomicCheckpointIO) and the staging directory
# `.<name>.ckpt.partial` of a sharded checkpoint (distributed/sharding.py, trainer=fsdp).
INTERRUPTED_SAVES = (".*.ckpt.*.tmp", ".*.ckpt.partial")


def remove_interrupted_saves(directory: Path) -> None:
    """Remove the temporaries that a save killed half-way (kill -9) left in `directory`; only
    ours, by name. Called when a run starts, before any rank saves: none is being written."""
    leftovers = [path for pattern in INTERRUPTED_SAVES for path in directory.glob(pattern)] if directory.is_dir() else []
    for path in leftovers:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)  # another rank of the job may have removed it first
    if leftovers:
        log.info(f"posttrain: removed what interrupted checkpoint saves left: {', '.join(p.name for p in leftovers)}")


def newest_intact_checkpoint(directory: Path) -> Path | None:
    """The readable checkpoint of `directory` with the highest global step (ties: the newer
    file), or None. Every `*.ckpt` is considered, not only last.ckpt: a kill between the
    periodic `stepNNNNNN.ckpt` and `last.ckpt` leaves the newer state in the former. An
    unreadable file (truncated by a kill during a save of an older version) is skipped
    with a warning, never picked and then failed on."""
    candidates = []
    for path in sorted(directory.glob("*.ckpt")) if directory.is_dir() else []:
        step = checkpoint_step(path)
        if step is None:
            log.warning(f"posttrain: skipping unreadable checkpoint {path}")
            continue
        candidates.append((step, path.stat().st_mtime, path))
    return max(candidates)[2] if candidates else None


def checkpoint_step(path: Path) -> int | None:
    """The global step a checkpoint was written at, or None if it cannot be read.
    (Memory-mapped: the tensors are not read, so this is cheap even for large models.) A
    sharded checkpoint (trainer=fsdp) is a directory whose `meta.pt`, written by rank 0 after
    every shard, holds the step: without it the save did not finish."""
    try:
        if path.is_dir():
            return int(torch.load(path / "meta.pt", map_location="cpu", weights_only=False)["global_step"])
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
        return int(checkpoint["global_step"])
    except Exception:  # any way of being unreadable (truncated zip, empty file, no global_step) counts
        return None


def check_checkpoint_algorithm(ckpt_path: str, cfg: DictConfig) -> dict | None:
    """Refuse, before anything is built, a checkpoint written by another algorithm; returns
    the shapes of its weights for `check_checkpoint_shapes` (None for a sharded checkpoint,
    whose loader checks them). (Memory-mapped: cheap to read.)"""
    sharded = Path(ckpt_path).is_dir()
    checkpoint = torch.load(Path(ckpt_path) / "meta.pt" if sharded else ckpt_path, map_location="cpu",
                            mmap=not sharded, weights_only=False)
    written_by = checkpoint.get("callbacks", {}).get("RunRecord", {}).get("algorithm")
    if written_by is not None and written_by != cfg.algorithm.name:
        raise CheckpointError(f"ckpt_path={ckpt_path} was written by algorithm={written_by}, but this run is "
                              f"algorithm={cfg.algorithm.name}; resume it as it was started with "
                              f"`posttrain resume=<its run dir>`, or start from its weights with "
                              f"model.init_from={ckpt_path}")
    return None if sharded else {k: v.shape for k, v in checkpoint["state_dict"].items()}


def check_checkpoint_shapes(ckpt_path: str, stored: dict | None, module) -> None:
    """Refuse weights of another shape than this run's model (the run was started with other
    overrides: `posttrain resume=<run dir>` replays them) before Lightning fails on them."""
    if stored is None:
        return  # a sharded checkpoint: torch.distributed.checkpoint refuses mismatched shapes itself
    frozen = tuple(f"{role}." for role in getattr(module, "frozen_roles", list)())
    expected = {k: v.shape for k, v in module.state_dict().items() if not k.startswith(frozen)}
    for key in sorted(expected.keys() | stored.keys()):
        if expected.get(key) != stored.get(key):
            describe = lambda shape: "absent" if shape is None else f"of shape {tuple(shape)}"  # noqa: E731
            raise CheckpointError(f"ckpt_path={ckpt_path} does not fit this run's model: {key} is "
                                  f"{describe(stored.get(key))} there and {describe(expected.get(key))} here. "
                                  f"Resume a run with the overrides it was started with: "
                                  f"`posttrain resume=<its run dir>`")


# --- state that differs between ranks --------------------------------------------------------------
# A checkpoint is one rank 0's dict (one file, or meta.pt beside the shards). What each rank holds
# apart (its curriculum: dynamic sampling draws extra rounds per rank, so the ranks' data positions
# drift apart) is stored for every rank under "<key>_by_rank", and each rank resumes its own.


