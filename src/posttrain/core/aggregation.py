"""Loss aggregation: how a per-token loss matrix [B, T] becomes one scalar.

The mode is always explicit (DAPO, GRPO and Dr. GRPO differ exactly here):

  token-mean               sum_{i,t} l_it / N_tok                         (DAPO)
  seq-mean-token-mean      sum_i (sum_t l_it / |y_i|) / N_seq             (GRPO)
  seq-mean-token-sum       sum_i (sum_t l_it) / N_seq
  seq-mean-token-sum-norm  sum_i (sum_t l_it / C) / N_seq, C constant     (Dr. GRPO)
  token-sum                sum_{i,t} l_it                                 (no normalisation)

and every mode is then multiplied by ``dp_size`` (default 1).

``num_tokens`` (N_tok) and ``num_seqs`` (N_seq) are *global* counts: over every
micro-batch of the optimizer step (and every rank). With them, summing the micro-batch
losses (gradient accumulation) gives exactly the full-batch loss. Left as None they are the
counts of this call's ``mask`` (see ``count_tokens_and_seqs``).

``count_empty_rows`` decides what N_seq counts: by default only sequences with at least
one valid token (all-padding rows contribute nothing and are not counted; verl, OpenRLHF);
with ``count_empty_rows=True`` every row of the batch, all-padding rows included (TRL
divides its per-sequence means by all B rows, and Dr. GRPO's loss by B * max_len). It only
matters in the ``seq-mean-*`` modes.

``dp_size``: DDP/FSDP average gradients over the data-parallel ranks, while a loss
normalised by a count over all ranks wants their sum; so the loss is multiplied by the
number of ranks (verl's and OpenRLHF's ``dp_size``: ``masked_sum / batch_num_tokens *
dp_size``, and ``/ global_batch_size * dp_size`` in the sequence modes).

``norm_constant`` C defaults to T of ``loss_mat``; with micro-batches padded to different
lengths pass it explicitly (Dr. GRPO uses the maximum response length).
"""

from __future__ import annotations

from numbers import Integral

import torch

from .checks import check_finite, check_shape, lookup, valid_mask
from .masked import _safe_div, masked_count, masked_mean, masked_sum

AGGREGATION_MODES = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "token-sum",
)


def _check_count_empty_rows(count_empty_rows) -> None:
    if not isinstance(count_empty_rows, bool):
        raise ValueError(f"count_empty_rows must be True or False, got {count_empty_rows!r}")


def count_tokens_and_seqs(mask: torch.Tensor, count_empty_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(number of valid tokens, number of sequences) of ``mask``: the sequences with >= 1
    valid token, or every row with ``count_empty_rows=True`` (as ``aggregate_loss`` counts).

    Sum these over micro-batches (and all-reduce over ranks) to get the global counts.
    """
    _check_count_empty_rows(count_empty_rows)
    if count_empty_rows:
        n_seq = torch.tensor(float(mask.shape[0]), device=mask.device)
    else:
        n_seq = valid_mask(mask).any(dim=-1).sum().to(torch.float32)
    return masked_count(mask), n_seq


def _count(value, default: torch.Tensor, like: torch.Tensor, name: str) -> torch.Tensor:
    if value is None:
        return default.to(device=like.device, dtype=like.dtype)
    out = torch.as_tensor(value, dtype=like.dtype, device=like.device)
    if out.numel() != 1 or not torch.isfinite(out) or out < 0:
        raise ValueError(f"{name} must be a finite non-negative scalar, got {value!r}")
    return out.reshape(())


def _token_mean(loss_mat, mask, num_tokens, num_seqs, norm_constant, count_empty_rows):
    n = _count(num_tokens, masked_count(mask), loss_mat, "num_tokens")
    return _safe_div(masked_sum(loss_mat, mask), n)


def _token_sum(loss_mat, mask, num_tokens, num_seqs, norm_constant, count_empty_rows):
    return masked_sum(loss_mat, mask)


def _seq_reduce(per_seq: torch.Tensor, mask: torch.Tensor, num_seqs, count_empty_rows) -> torch.Tensor:
    has_tokens = valid_mask(mask).any(dim=-1)
    local = torch.tensor(float(mask.shape[0]), device=mask.device) if count_empty_rows else has_tokens.sum()
    n = _count(num_seqs, local, per_seq, "num_seqs")
    return _safe_div(torch.where(has_tokens, per_seq, torch.zeros_like(per_seq)).sum(), n)


def _seq_mean_token_mean(loss_mat, mask, num_tokens, num_seqs, norm_constant, count_empty_rows):
    return _seq_reduce(masked_mean(loss_mat, mask, dim=-1), mask, num_seqs, count_empty_rows)


def _seq_mean_token_sum(loss_mat, mask, num_tokens, num_seqs, norm_constant, count_empty_rows):
    return _seq_reduce(masked_sum(loss_mat, mask, dim=-1), mask, num_seqs, count_empty_rows)


def _seq_mean_token_sum_norm(loss_mat, mask, num_tokens, num_seqs, norm_constant, count_empty_rows):
    c = loss_mat.shape[-1] if norm_constant is None else norm_constant
    if not float(c) > 0:
        raise ValueError(f"norm_constant must be > 0, got {norm_constant!r}")
    return _seq_reduce(masked_sum(loss_mat, mask, dim=-1) / float(c), mask, num_seqs, count_empty_rows)


_AGGREGATORS = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
    "token-sum": _token_sum,
}


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    num_tokens=None,
    num_seqs=None,
    norm_constant=None,
    dp_size: int = 1,
    count_empty_rows: bool = False,
) -> torch.Tensor:
    """Scalar loss from ``loss_mat`` [B, T] under ``mode``, times ``dp_size`` (see module doc);
    0 if nothing is valid."""
    fn = lookup(_AGGREGATORS, mode, "loss aggregation mode")
    check_shape("mask", mask, loss_mat.shape, "loss_mat")
    if loss_mat.dim() != 2:
        raise ValueError(f"loss_mat must be [B, T], got shape {tuple(loss_mat.shape)}")
    if isinstance(dp_size, bool) or not isinstance(dp_size, Integral) or dp_size < 1:
        raise ValueError(f"dp_size must be an int >= 1 (the number of data-parallel ranks), got {dp_size!r}")
    _check_count_empty_rows(count_empty_rows)
    # Last line of defence: a NaN at a valid token would silently poison the whole step.
    check_finite("loss_mat", loss_mat, mask)
    return fn(loss_mat, mask, num_tokens, num_seqs, norm_constant, count_empty_rows) * int(dp_size)
