"""Per-token log-probabilities and entropy from logits.

No shifting happens here: pass ``logits[:, t]`` aligned with the token it scores
(``logits[:, :-1]`` with ``labels[:, 1:]`` for a causal LM).
Half-precision logits are processed one sequence at a time in float32, so the
full [B, T, V] tensor is never upcast at once (vocabularies are large).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .checks import check_shape

_HALF = (torch.float16, torch.bfloat16)


def _rowwise(fn: Callable[[torch.Tensor], torch.Tensor], logits: torch.Tensor) -> torch.Tensor:
    """Apply ``fn`` in float32; row by row for half dtypes to bound peak memory."""
    if logits.dtype not in _HALF:
        return fn(logits)
    return torch.stack([fn(row.float()) for row in logits.unbind(0)], dim=0)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log pi(y_t) = z[y_t] - logsumexp(z) -> [B, T]; labels < 0 (ignore index) give 0."""
    check_shape("labels", labels, logits.shape[:-1], "logits[..., 0]")
    ignore = labels < 0
    safe = labels.clamp_min(0).unsqueeze(-1)  # gather needs an in-range index even on padding
    if logits.dtype in _HALF:
        out = torch.stack(
            [
                row.float().gather(-1, lab).squeeze(-1) - torch.logsumexp(row.float(), dim=-1)
                for row, lab in zip(logits.unbind(0), safe.unbind(0))
            ],
            dim=0,
        )
    else:
        # logsumexp form: only a [B, T] intermediate besides the logits themselves.
        out = logits.gather(-1, safe).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return torch.where(ignore, torch.zeros_like(out), out)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H = -sum_v p_v log p_v with p = softmax(z) -> [B, T]; -inf logits (banned tokens) add 0."""

    def _entropy(z: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(z, dim=-1)
        p = logp.exp()
        # Banned tokens have p = 0, logp = -inf: 0 * -inf is NaN (in the value and in the
        # backward of the product), so replace logp first; their contribution is 0 by continuity.
        safe_logp = torch.where(p > 0, logp, torch.zeros_like(logp))
        return -(p * safe_logp).sum(-1)

    return _rowwise(_entropy, logits)
