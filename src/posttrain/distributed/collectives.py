"""The few collective operations online RL needs under data parallelism, as no-ops in a single
process. Gradients are averaged by hand (not by a DDP wrapper) because one rollout batch runs
several backward passes and optimiser steps inside one `training_step`; under FSDP2
(trainer=fsdp) the reduce-scatter of each backward has averaged them already."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """x summed over ranks (a new tensor; x itself in a single process)."""
    return all_reduced(x, dist.ReduceOp.SUM)


def all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """x's maximum over ranks (a new tensor; x itself in a single process): how many times a
    loop of collectives must run on every rank when its trip count depends on the rank's data."""
    return all_reduced(x, dist.ReduceOp.MAX)


def any_rank_needs(need: int) -> bool:
    """Whether `need` > 0 on some rank: the ranks run a loop (dynamic sampling's rounds) as long
    as any of them still needs to. The count travels on the device the backend reduces on."""
    nccl = dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else None
    return bool(all_reduce_max(torch.tensor(need, device=device)) > 0)


def all_reduced(x: torch.Tensor, op) -> torch.Tensor:
    if rank_and_world()[1] == 1:
        return x
    out = x.detach().clone()
    dist.all_reduce(out, op=op)
    return out


def rank_share(num_items: int) -> tuple[list[int], list[bool]]:
    """This rank's share of `num_items` items that the ranks go through together (held-out
    rows, whose forwards and generate calls are collectives under FSDP): (item indices, counted
    flags). Rank r of W takes items r, r+W, r+2W, ..., so the shares are disjoint and together
    hold every item once; a shorter share is padded at its end to ceil(num_items / W) items
    with stand-ins (item 0, flagged not counted), so every rank has as many items and, batched
    alike, as many batches of the same sizes."""
    rank, world = rank_and_world()
    mine = list(range(rank, num_items, world))
    stand_ins = -(-num_items // world) - len(mine)
    return mine + [0] * stand_ins, [True] * len(mine) + [False] * stand_ins


def average_gradients(parameters) -> None:
    """Average every gradient over ranks, in place (what DDP's reducer would do). Sharded
    gradients (DTensors, FSDP2) are left alone: FSDP2 averaged them in its reduce-scatter,
    and averaging again would divide by the world size twice."""
    world = rank_and_world()[1]
    if world == 1:
        return
    for p in parameters:
        if p.grad is None:  # unused by the loss on every rank alike (the same graph everywhere)
            continue
        if is_dtensor(p.grad):
            continue
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad.div_(world)


def is_dtensor(x) -> bool:
    return isinstance(x, DTensor)


# Environment variables that give a process its global rank and the job's number of processes:
# torchrun (and Lightning's own launcher), a SLURM job's tasks, submitit's local executor.
RANK_VARIABLES = (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS"),
                  ("SUBMITIT_LOCAL_GLOBALID", "SUBMITIT_LOCAL_NTASKS"))


def job_rank_and_size() -> tuple[int, int]:
    """(global rank, number of processes) of this process's job, from its launcher's
    environment; (0, 1) outside a multi-process job. Read before any process group exists."""
    for rank_name, size_name in RANK_VARIABLES:
        if rank_name in os.environ and size_name in os.environ:
            return int(os.environ[rank_name]), int(os.environ[size_name])
    return 0, 1


def with_every_rank(checkpoint: dict, key: str, state) -> None:
    """Store this rank's `state` under `key` (rank 0's: what a run on another number of ranks
    resumes) and every rank's under `<key>_by_rank`. A collective: every rank must call it, as
    every rank builds the checkpoint dict (Lightning's dump_checkpoint) before rank 0 writes it."""
    world = rank_and_world()[1]
    states = [state]
    if world > 1:
        states = [None] * world
        dist.all_gather_object(states, state)
    checkpoint[key] = states[0]
    checkpoint[f"{key}_by_rank"] = states


def this_ranks(checkpoint: dict, key: str):
    """This rank's state stored by `with_every_rank`; rank 0's when the checkpoint was written by
    another number of ranks (the ranks' streams are interleaved by the world size: no exact
    mapping exists) or before states were stored per rank."""
    rank, world = rank_and_world()
    by_rank = checkpoint.get(f"{key}_by_rank")
    return by_rank[rank] if by_rank is not None and len(by_rank) == world else checkpoint[key]


def device_count(devices) -> int | None:
    """How many devices `trainer.devices` asks for on each node; None when Lightning decides."""
    if isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1:  # YAML's true is not 1
        return devices
    if isinstance(devices, list):
        return len(devices)
    if isinstance(devices, str) and devices != "auto":
        return len([part for part in devices.split(",") if part.strip()])
    return None
