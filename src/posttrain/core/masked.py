"""Masked reductions over padded [B, T] tensors.

``mask`` may be bool or float. A float mask acts as weights (1 = real token, 0 = padding);
padded entries are removed with ``torch.where`` before weighting, so NaN/inf stored in
padding never leaks into a result (``inf * 0`` would be NaN). Empty selections give 0,
never a division by zero.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .checks import valid_mask

# Sums a statistic of this part of a batch over every part (under data parallelism: an
# all-reduce over the ranks, which the caller passes in; core runs no collective itself).
BatchSum = Callable[[torch.Tensor], torch.Tensor]


def _weights(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return mask.to(like.dtype)


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den where den > 0, else 0 (the denominator is replaced first so no inf is formed)."""
    ok = den > 0
    return torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(num))


def zero_padding(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x at valid entries, 0 at padding (``torch.where``: the gradient to padding is exactly 0).

    Apply it to the *inputs* of a per-token computation, not only to its output: a NaN left in
    padding survives a final ``where`` in the backward pass (``0 * d exp(NaN) = NaN``).
    """
    return torch.where(valid_mask(mask), x, torch.zeros_like(x))


def masked_sum(
    x: torch.Tensor, mask: torch.Tensor, dim: int | None = None, keepdim: bool = False
) -> torch.Tensor:
    """sum(x * m) over ``dim`` (all dims if None), padded entries dropped."""
    m = _weights(mask, x)
    xs = torch.where(valid_mask(mask), x, torch.zeros_like(x)) * m
    return xs.sum() if dim is None else xs.sum(dim=dim, keepdim=keepdim)


def masked_count(mask: torch.Tensor, dim: int | None = None, keepdim: bool = False, dtype=torch.float32):
    """sum(m): number (or total weight) of valid entries."""
    m = mask.to(dtype)
    return m.sum() if dim is None else m.sum(dim=dim, keepdim=keepdim)


def _summed_over_batch(batch_sum: BatchSum | None, dim: int | None) -> BatchSum:
    """The sum over the whole batch of a statistic of this part of it: ``batch_sum`` (it adds
    the parts held elsewhere, e.g. the data-parallel ranks'), or the statistic itself."""
    if batch_sum is None:
        return lambda total: total
    if dim is not None:
        raise ValueError("batch_sum sums statistics over every entry of the batch: it needs dim=None")
    return batch_sum


def masked_mean(
    x: torch.Tensor, mask: torch.Tensor, dim: int | None = None, keepdim: bool = False,
    batch_sum: BatchSum | None = None,
) -> torch.Tensor:
    """sum(x * m) / sum(m); 0 where nothing is valid. With ``batch_sum`` (dim None), the sums
    are the whole batch's (see `_summed_over_batch`)."""
    summed = _summed_over_batch(batch_sum, dim)
    total = summed(masked_sum(x, mask, dim=dim, keepdim=keepdim))
    count = summed(masked_count(mask, dim=dim, keepdim=keepdim, dtype=x.dtype))
    return _safe_div(total, count)


def masked_var(
    x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True, dim: int | None = None,
    keepdim: bool = False, batch_sum: BatchSum | None = None,
) -> torch.Tensor:
    """sum(m (x - mean)^2) / (n - 1) (unbiased) or / n; 0 when n <= 1 (unbiased) or n == 0.

    Defining the variance of a single element as 0 (instead of torch's NaN) keeps whitening
    of tiny batches finite: the centred value is 0 there anyway. With ``batch_sum`` (dim
    None), mean, sums and n are the whole batch's.
    """
    return _mean_and_var(x, mask, unbiased, dim, keepdim, batch_sum)[1]


def _mean_and_var(x, mask, unbiased: bool, dim: int | None = None, keepdim: bool = False,
                  batch_sum: BatchSum | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean kept over ``dim``, variance) as masked_mean and masked_var define them, with the
    count, sum and squared sum each taken (and, with ``batch_sum``, summed over the batch) once."""
    summed = _summed_over_batch(batch_sum, dim)
    count = summed(masked_count(mask, dim=dim, keepdim=True, dtype=x.dtype))
    mean = _safe_div(summed(masked_sum(x, mask, dim=dim, keepdim=True)), count)
    sq = summed(masked_sum((x - mean) ** 2, mask, dim=dim, keepdim=keepdim))
    n = count if keepdim or dim is None else count.squeeze(dim)
    return mean, _safe_div(sq, n - 1 if unbiased else n)


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8,
    batch_sum: BatchSum | None = None,
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over all valid entries (unbiased var); padding -> 0.

    With ``shift_mean=False`` the mean is added back (scale only). Zero-variance input maps
    to 0 (or to the mean), not NaN, thanks to ``eps`` and the n <= 1 convention above. With
    ``batch_sum`` the statistics are the whole batch's, of which ``x`` is a part.
    """
    valid = valid_mask(mask)
    mean, var = _mean_and_var(x, mask, unbiased=True, batch_sum=batch_sum)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(valid, out, torch.zeros_like(out))


def drop_truncated(mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """Overlong filtering (DAPO; TRL ``mask_truncated_completions``): ``mask`` with the rows of
    truncated responses (``truncated`` [B] bool) set to padding, so that they leave the loss
    and its token counts. Whether such a now-empty row still counts as a sequence is the
    aggregation's ``count_empty_rows`` choice (TRL counts it, verl and OpenRLHF do not)."""
    if truncated.shape != mask.shape[:1]:
        raise ValueError(f"truncated has shape {tuple(truncated.shape)} but mask has {mask.shape[0]} rows")
    keep = ~truncated.to(torch.bool, copy=False).unsqueeze(-1)
    return torch.where(keep, mask, torch.zeros_like(mask))
