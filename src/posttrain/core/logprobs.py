"""Per-token log-probabilities and entropy from logits, or from hidden states and the LM head.

No shifting happens here: pass ``logits[:, t]`` aligned with the token it scores
(``logits[:, :-1]`` with ``labels[:, 1:]`` for a causal LM).

Memory: the vocabulary is large (V ~ 150k), so a float32 copy of the whole [B, T, V]
logits (or of the softmax built from it) can outweigh the model.  Everything here works on
chunks of ``chunk_tokens`` positions: only one chunk at a time is upcast to float32, and
under autograd each chunk is recomputed in the backward (activation checkpointing) rather
than having its float32 intermediates kept alive until then.

`token_logprobs_and_entropy_from_hidden` goes one step further: it takes the LM head's input
[B, T, H] and weight [V, H], and the head's matmul is part of the recomputed chunk, so no
[B, T, V] logits tensor exists at all, in any dtype: only one [chunk, V] at a time. For the
log-probs with an entropy for logging (every online forward), `core.head_logprobs` runs the
chunks with a written-out backward and reused buffers; a weighted entropy and the sampler's
top-k/top-p support take the same chunk loop and chunk body (`_score_chunk`) as the logits path.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from . import head_logprobs
from .head_logprobs import HALF_DTYPES
from .checks import check_shape

# The hidden-state path's default chunk: positions whose [chunk, V] float32 logits hold about
# this many elements (2^24: 64 MB per buffer; 341 positions at V = 49k, 111 at V = 151k).
HIDDEN_CHUNK_ELEMENTS = 1 << 24


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
    _check_chunk_tokens(chunk_tokens)
    return _chunked(_score_chunk, logits, (), labels, support_size, temperature, with_entropy, entropy_grad,
                    chunk_tokens)


def token_logprobs_and_entropy_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    with_entropy: bool,
    entropy_grad: bool = True,
    support_size: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    chunk_tokens: Optional[int] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`token_logprobs_and_entropy` of the logits ``hidden @ weight.T + bias``, the LM head
    applied chunk by chunk: hidden [.., H] (the LM head's input), weight [V, H], bias [V] or
    None, labels [..]. Each chunk's logits are computed in the hidden states' dtype (as the
    head itself would), upcast to float32 and scored inside one checkpoint, so the backward
    recomputes them: no [.., V] tensor outlives its chunk, and the gradients reach hidden,
    weight and bias. The options are those of `token_logprobs_and_entropy`;
    ``chunk_tokens=None`` takes chunks of about `HIDDEN_CHUNK_ELEMENTS` logits."""
    check_shape("labels", labels, hidden.shape[:-1], "hidden[..., 0]")
    if support_size is not None:
        check_shape("support_size", support_size, hidden.shape[:-1], "hidden[..., 0]")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [V, {hidden.shape[-1]}] (the LM head's), got {tuple(weight.shape)}")
    if chunk_tokens is None:
        chunk_tokens = max(1, HIDDEN_CHUNK_ELEMENTS // weight.shape[0])
    _check_chunk_tokens(chunk_tokens)
    if head_logprobs.covers(support_size, with_entropy, entropy_grad):
        lead = hidden.shape[:-1]
        logp, entropy = head_logprobs.head_logprobs(
            hidden.reshape(-1, hidden.shape[-1]), weight, bias, labels.reshape(-1), temperature=temperature,
            with_entropy=with_entropy, chunk_tokens=chunk_tokens)
        return logp.view(lead), None if entropy is None else entropy.view(lead)
    return _chunked(_score_hidden_chunk, hidden, (weight, bias), labels, support_size, temperature, with_entropy,
                    entropy_grad, chunk_tokens)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log pi(y_t) = z[y_t] - logsumexp(z) -> [B, T]; labels < 0 (ignore index) give 0."""
    return token_logprobs_and_entropy(logits, labels, with_entropy=False)[0]


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H = -sum_v p_v log p_v with p = softmax(z) -> [B, T]; -inf logits (banned tokens) add 0."""
    return _chunked(_score_chunk, logits, (), None, None, 1.0, True, True, 4096)[1]


# --------------------------------------------------------------------------- internals


def _check_chunk_tokens(chunk_tokens: int) -> None:
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")


def _chunked(body, x, params, labels, support_size, temperature, with_entropy, entropy_grad, chunk_tokens):
    """``body(chunk, *params, labels, support_size, ...)`` over [n, last] chunks of x [.., last]
    (logits, or hidden states with ``params`` the LM head's weight and bias), each one
    checkpointed when a backward will run, the results joined back to x's leading shape."""
    lead = x.shape[:-1]
    pieces = _position_chunks(x, chunk_tokens)
    sizes = [piece.shape[0] for piece in pieces]

    def split(t):
        return [None] * len(pieces) if t is None else t.reshape(-1).split(sizes)

    fn = partial(body, temperature=temperature, with_entropy=with_entropy, entropy_grad=entropy_grad)
    # Recompute in the backward only when there is one: under no_grad the plain call is cheaper.
    recompute = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, *params))
    logps, entropies = [], []
    for z, y, k in zip(pieces, split(labels), split(support_size)):
        if recompute:
            once = _first_call_only_entropy(fn, with_entropy and not entropy_grad)
            logp, entropy = checkpoint(once, z, *params, y, k, use_reentrant=False, preserve_rng_state=False)
        else:
            logp, entropy = fn(z, *params, y, k)
        logps.append(logp)
        entropies.append(entropy)

    def join(parts):
        if not parts or parts[0] is None:
            return None
        return torch.cat(parts).view(lead)

    return join(logps), join(entropies)


def _first_call_only_entropy(fn, detached_entropy: bool):
    """``fn`` for one checkpointed chunk. An entropy without gradient is part of no backward
    graph (it saves nothing), so the backward's recomputation of the chunk leaves it out: its
    [n, V] passes run once, not twice."""
    if not detached_entropy:
        return fn
    calls = []

    def once(*args):
        calls.append(None)
        return fn(*args) if len(calls) == 1 else fn.func(*args, **{**fn.keywords, "with_entropy": False})

    return once


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


def _score_hidden_chunk(h, weight, bias, labels, support_size, **options):
    """`_score_chunk` of one [n, H] chunk of hidden states through the LM head: its logits [n, V]."""
    return _score_chunk(F.linear(h, weight, bias), labels, support_size, **options)


def _score_chunk(z, labels, support_size, *, temperature, with_entropy, entropy_grad):
    """Log-prob of ``labels`` and entropy for one [n, V] chunk, in float32 (or float64)."""
    if z.dtype in HALF_DTYPES:
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
        if entropy_grad and torch.is_grad_enabled():
            entropy = _entropy_with_grad(z, lse)
        else:
            with torch.no_grad():
                entropy = _entropy_for_logging(z, lse)
    return logp, entropy


def _entropy_with_grad(z: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """H = -sum_v p_v log p_v of one [n, V] chunk, differentiable (an entropy bonus)."""
    logp_all = z - lse.unsqueeze(-1)
    p = logp_all.exp()
    # Banned tokens have p = 0, logp = -inf: 0 * -inf is NaN (in the value and in the
    # backward of the product), so replace logp first; their contribution is 0 by continuity.
    return -(p * torch.where(p > 0, logp_all, torch.zeros_like(logp_all))).sum(-1)


def _entropy_for_logging(z: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The same H without a backward, so its [n, V] temporaries are reused in place: one buffer
    for log p, one for p log p, where `_entropy_with_grad` makes five. Same float32 sums (tested
    equal to it). A banned token's log p (-inf) is raised to the dtype's lowest finite value
    first, so its term is exactly 0 * finite = 0, not NaN (a NaN logit still gives NaN)."""
    logp_all = (z - lse.unsqueeze(-1)).clamp_min_(torch.finfo(z.dtype).min)
    return -logp_all.exp().mul_(logp_all).sum(-1)


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
