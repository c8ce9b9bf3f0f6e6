"""Per-group statistics for grouped rollouts (G samples of one prompt share a group id).

Group ids need not be contiguous or sorted: ``torch.unique(..., return_inverse=True)``
maps them to 0..G-1, and every statistic is broadcast back to the [B] samples.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class GroupIndex(NamedTuple):
    inverse: torch.Tensor  # [B] long in 0..G-1
    counts: torch.Tensor  # [G] long
    num_groups: int


def group_ids(group_index: torch.Tensor, batch_size: int) -> GroupIndex:
    """Dense group ids for ``group_index`` [B] (any integer labels)."""
    if not torch.is_tensor(group_index):
        group_index = torch.as_tensor(group_index)
    if group_index.dim() != 1 or group_index.numel() != batch_size:
        raise ValueError(
            f"group_index must have shape [{batch_size}] (one id per sequence), "
            f"got {tuple(group_index.shape)}"
        )
    if group_index.is_floating_point() or group_index.dtype == torch.bool:
        raise ValueError(f"group_index must be an integer tensor, got {group_index.dtype}")
    _, inverse, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    return GroupIndex(inverse, counts, int(counts.numel()))


def group_sum(x: torch.Tensor, g: GroupIndex) -> torch.Tensor:
    """[G] sums of x [B] per group."""
    out = torch.zeros(g.num_groups, dtype=x.dtype, device=x.device)
    return out.index_add(0, g.inverse, x)


def group_mean(x: torch.Tensor, g: GroupIndex) -> torch.Tensor:
    """[B] mean of each sample's group."""
    return (group_sum(x, g) / g.counts.to(x.dtype))[g.inverse]


def group_std(x: torch.Tensor, g: GroupIndex, unbiased: bool = True) -> torch.Tensor:
    """[B] std of each sample's group; 0 for groups too small to define it (size 1 if unbiased)."""
    mean = group_mean(x, g)
    sq = group_sum((x - mean) ** 2, g)
    den = (g.counts - 1 if unbiased else g.counts).to(x.dtype)
    var = torch.where(den > 0, sq / den.clamp_min(1), torch.zeros_like(sq))
    return var.sqrt()[g.inverse]


def group_min(x: torch.Tensor, g: GroupIndex) -> torch.Tensor:
    """[B] minimum of each sample's group."""
    init = torch.full((g.num_groups,), float("inf"), dtype=x.dtype, device=x.device)
    return init.scatter_reduce(0, g.inverse, x, reduce="amin", include_self=True)[g.inverse]


def group_max(x: torch.Tensor, g: GroupIndex) -> torch.Tensor:
    """[B] maximum of each sample's group."""
    init = torch.full((g.num_groups,), float("-inf"), dtype=x.dtype, device=x.device)
    return init.scatter_reduce(0, g.inverse, x, reduce="amax", include_self=True)[g.inverse]


def informative_groups(scores: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """[B] bool: True where the sample's group has a reward spread (max > min).

    Groups whose rewards all agree give zero advantage under every group baseline, so
    they carry no policy-gradient signal (DAPO's dynamic sampling drops them).
    """
    g = group_ids(group_index, scores.numel())
    scores = scores.float()
    return group_max(scores, g) > group_min(scores, g)
