"""The few collective operations online RL needs under data parallelism, as no-ops in a single
process. Gradients are averaged by hand (not by a DDP wrapper) because one rollout batch runs
several backward passes and optimiser steps inside one `training_step`; under FSDP2
(trainer=fsdp) the reduce-scatter of each backward has averaged them already."""

from __future__ import annotations

import torch
import torch.distributed as dist


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """x summed over ranks (a new tensor; x itself in a single process)."""
    if rank_and_world()[1] == 1:
        return x
    out = x.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


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
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)
