"""Length-based reward terms, per response -> [B]: Kimi k1.5's group-relative length reward,
DAPO's soft overlong punishment and a linear per-token penalty."""

from __future__ import annotations

import torch

from .checks import check_finite, check_shape
from .groups import group_ids, group_max, group_min


def kimi_length_reward(lengths: torch.Tensor, correct: torch.Tensor, group_index: torch.Tensor,
                       only_groups_with_a_correct_answer: bool = False) -> torch.Tensor:
    """Kimi k1.5 length reward (Long2Short): lambda = 0.5 - (len - min_len) / (max_len - min_len)
    within the group; correct -> lambda, incorrect -> min(0, lambda).

    A group whose responses all have the same length (including a group of one) gets 0:
    there is no shorter or longer answer to prefer.

    `only_groups_with_a_correct_answer`: a group with no right answer gets 0 too. The reward
    is there to pick the shorter of the right answers; in an all-wrong group min(0, lambda)
    would still rank the wrong answers by length, pushing a policy that fails a prompt towards
    its shortest wrong answer, down to an empty one (a collapse when accuracy is low).
    """
    lengths = torch.as_tensor(lengths)
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be [B], got shape {tuple(lengths.shape)}")
    correct = torch.as_tensor(correct, device=lengths.device)
    check_shape("correct", correct, lengths.shape, "lengths")
    length = lengths.to(torch.float32) if not lengths.is_floating_point() else lengths
    check_finite("lengths", length)
    g = group_ids(torch.as_tensor(group_index, device=lengths.device), lengths.shape[0])
    lo, hi = group_min(length, g), group_max(length, g)
    span = hi - lo
    lam = 0.5 - (length - lo) / torch.where(span > 0, span, torch.ones_like(span))
    lam = torch.where(span > 0, lam, torch.zeros_like(lam))
    reward = torch.where(correct.bool(), lam, lam.clamp(max=0.0))
    if only_groups_with_a_correct_answer:
        some_correct = group_max(correct.to(torch.float32), g) > 0
        reward = torch.where(some_correct, reward, torch.zeros_like(reward))
    return reward


def dapo_overlong_penalty(lengths: torch.Tensor, max_len: int, cache_len: int) -> torch.Tensor:
    """DAPO soft overlong punishment: 0 if len <= L_max - L_cache;
    (L_max - L_cache - len) / L_cache inside the cache window; -1 if len > L_max."""
    if not 0 <= cache_len <= max_len:
        raise ValueError(f"need 0 <= cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}")
    lengths = torch.as_tensor(lengths)
    length = lengths.to(torch.float32) if not lengths.is_floating_point() else lengths
    check_finite("lengths", length)
    expected = float(max_len - cache_len)
    ramp = (expected - length) / max(cache_len, 1)  # only selected when cache_len > 0
    out = torch.where(length <= expected, torch.zeros_like(length), ramp)
    return torch.where(length > max_len, torch.full_like(length, -1.0), out)


def linear_length_penalty(lengths: torch.Tensor, coef: float, normalizer: float = 1.0) -> torch.Tensor:
    """Linear length penalty -coef * len / normalizer, per response: every token costs the same,
    wherever it falls and whatever the rest of the group does (unlike Kimi's group-relative
    reward). normalizer=1: `coef` is the cost of one token; normalizer = the generation budget:
    `coef` is the cost of a response that fills it."""
    if not normalizer > 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer}")
    lengths = torch.as_tensor(lengths)
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be [B], got shape {tuple(lengths.shape)}")
    length = lengths.to(torch.float32) if not lengths.is_floating_point() else lengths
    check_finite("lengths", length)
    return -coef * length / normalizer
