"""Per-token log-probabilities and entropy from logits.

No shifting happens here: pass ``logits[:, t]`` aligned with the token it scores
(``logits[:, :-1]`` with ``labels[:, 1:]`` for a causal LM).

Memory: the vocabulary is large (V ~ 150k), so a float32 copy of the whole [B, T, V]
logits (or of the softmax built from it) can outweigh the model.  Everything here works on
chunks of ``chunk_tokens`` positions: only one chunk at a time is upcast to float32, and
under autograd each chunk is recomputed in the backward (activation checkpointing) rather
than having its float32 intermediates kept alive until then.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch
from torch.utils.checkpoint import checkpoint

from .checks import check_shape

_HALF = (torch.float16, torch.bfloat16)


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    with_entropy: bool,
    entropy_grad: bool = True,
    support_size: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    chunk_tokens: int = 4096,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(log pi(y_t) [..], entropy H_t [..] or None) for logits [.., V] and labels [..].

    * ``labels < 0`` (ignore index) give log-prob 0.
    * ``with_entropy=False`` skips the entropy entirely (it costs as much as the log-probs);
      ``entropy_grad=False`` computes it under ``no_grad``, for logging only (entropy
      coefficient 0): the result has no ``grad_fn`` and no backward is paid for it.
    * ``support_size`` [..] int (from ``RolloutBatch.support_size``): renormalise pi over
      the top-``support_size`` tokens of these logits at each position, i.e. the top-k /
      top-p support the sampler drew from (DeepSeek-V3.2 "keep sampling mask").  0 means
      no restriction (padding, unfiltered).  Ties at the boundary are all kept, and the
      label is always kept (the set is widened to reach it), so a sampler/trainer rounding
      mismatch at the boundary cannot turn a log-prob into -inf.
    * ``temperature`` divides each chunk after the float32 upcast (cheaper and more exact
      than dividing the half-precision [B, T, V] tensor beforehand).

    Results are float32 for half-precision logits, else the logits' dtype.
    """
    check_shape("labels", labels, logits.shape[:-1], "logits[..., 0]")
    if support_size is not None:
        check_shape("support_size", support_size, logits.shape[:-1], "logits[..., 0]")
    return _chunked(logits, labels, support_size, temperature, with_entropy, entropy_grad, chunk_tokens)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log pi(y_t) = z[y_t] - logsumexp(z) -> [B, T]; labels < 0 (ignore index) give 0."""
    return token_logprobs_and_entropy(logits, labels, with_entropy=False)[0]


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H = -sum_v p_v log p_v with p = softmax(z) -> [B, T]; -inf logits (banned tokens) add 0."""
    return _chunked(logits, None, None, 1.0, True, True, 4096)[1]


# --------------------------------------------------------------------------- internals


def _chunked(logits, labels, support_size, temperature, with_entropy, entropy_grad, chunk_tokens):
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    lead = logits.shape[:-1]
    pieces = _position_chunks(logits, chunk_tokens)
    sizes = [piece.shape[0] for piece in pieces]

    def split(x):
        return [None] * len(pieces) if x is None else x.reshape(-1).split(sizes)

    fn = partial(_score_chunk, temperature=temperature, with_entropy=with_entropy, entropy_grad=entropy_grad)
    # Recompute in the backward only when there is one: under no_grad the plain call is cheaper.
    recompute = torch.is_grad_enabled() and logits.requires_grad
    logps, entropies = [], []
    for z, y, k in zip(pieces, split(labels), split(support_size)):
        if recompute:
            logp, entropy = checkpoint(fn, z, y, k, use_reentrant=False, preserve_rng_state=False)
        else:
            logp, entropy = fn(z, y, k)
        logps.append(logp)
        entropies.append(entropy)

    def join(parts):
        if not parts or parts[0] is None:
            return None
        return torch.cat(parts).view(lead)

    return join(logps), join(entropies)


def _position_chunks(logits: torch.Tensor, chunk_tokens: int) -> list[torch.Tensor]:
    """[n, V] pieces covering all positions in order, views of ``logits`` where it can be
    flattened, else copies of at most about ``chunk_tokens`` positions each (never of all).

    A sliced ``logits[:, P - 1 : -1]`` cannot be flattened without copying it, so such a
    tensor is cut into blocks of whole leading rows, each flattened on its own (one kernel a
    block, not one per row: a row is a few positions)."""
    if logits.dim() == 1:
        raise ValueError("logits must have at least 2 dimensions [..., V]")
    if logits.dim() == 2:
        return list(logits.split(chunk_tokens)) if logits.shape[0] else [logits]
    try:
        return _position_chunks(logits.view(-1, logits.shape[-1]), chunk_tokens)
    except RuntimeError:  # not viewable as [N, V]
        row_positions = logits[0].numel() // logits.shape[-1] if len(logits) else 1
        rows = max(1, chunk_tokens // max(row_positions, 1))
        return [piece for block in logits.split(rows) for piece in _position_chunks(block.reshape(-1, logits.shape[-1]), chunk_tokens)]


def _score_chunk(z, labels, support_size, *, temperature, with_entropy, entropy_grad):
    """Log-prob of ``labels`` and entropy for one [n, V] chunk, in float32 (or float64)."""
    if z.dtype in _HALF:
        z = z.float()
    if temperature != 1.0:
        z = z / temperature
    if support_size is not None:
        z = _restrict_to_support(z, support_size, labels)
    lse = torch.logsumexp(z, dim=-1)
    logp = None
    if labels is not None:
        picked = z.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)  # in-range index on padding
        logp = torch.where(labels < 0, torch.zeros_like(lse), picked - lse)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            logp_all = z - lse.unsqueeze(-1)
            p = logp_all.exp()
            # Banned tokens have p = 0, logp = -inf: 0 * -inf is NaN (in the value and in the
            # backward of the product), so replace logp first; their contribution is 0 by continuity.
            entropy = -(p * torch.where(p > 0, logp_all, torch.zeros_like(logp_all))).sum(-1)
    return logp, entropy


@torch.no_grad()
def _threshold(z: torch.Tensor, support_size: torch.Tensor, labels: Optional[torch.Tensor]) -> torch.Tensor:
    """Per-row logit cut-off: the k-th largest logit, lowered to the label's logit if the
    label ranks below it; -inf where k = 0 (no restriction)."""
    k = support_size.long().clamp(0, z.shape[-1])
    kmax = int(k.max()) if k.numel() else 0
    if kmax == 0:
        return torch.full_like(z[:, 0], float("-inf"))
    kth = z.topk(kmax, dim=-1).values.gather(-1, (k - 1).clamp_min(0).unsqueeze(-1)).squeeze(-1)
    if labels is not None:
        label_logit = z.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
        kth = torch.where(labels >= 0, torch.minimum(kth, label_logit), kth)
    return torch.where(k > 0, kth, torch.full_like(kth, float("-inf")))


def _restrict_to_support(z: torch.Tensor, support_size: torch.Tensor, labels: Optional[torch.Tensor]) -> torch.Tensor:
    """Logits outside each row's top-``support_size`` set -> -inf (a [n, V] bool lives only here)."""
    return z.masked_fill(z < _threshold(z, support_size, labels).unsqueeze(-1), float("-inf"))
