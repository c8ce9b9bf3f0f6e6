"""The model's own forward over (prompt, response) rows laid out without padding, in length buckets.

The fallback of the training forward (`models/forward.py`) for architectures the grouped forward
refuses (Qwen3's q/k norms, sliding windows, softcapped heads...). A batch arrives as prompts
left-padded to the longest prompt and responses right-padded to the longest response, so a row's
real tokens sit between two runs of padding. Here each row is laid out again as its prompt's real
tokens ++ its response's real tokens ++ padding at the end, and the rows are sorted by that
length and cut into buckets (`length_buckets`), each padded only to its own longest row: a short
answer beside a long one costs its own length, not the long one's. Positions count real tokens,
as before, so the outputs at the real tokens are those of the padded layout (tested to float32
rounding, log-probs and gradients).

A bucket is one more forward of the model, so rows are split only where the padded tokens a
split removes (their matmuls, and their attention pairs, in `ATTENTION_PAIRS_PER_TOKEN`) outweigh
`BUCKET_COST_TOKENS`. Under FSDP2 every forward of the model gathers its weights, a collective,
and each rank's lengths are its own, so a sharded model runs one bucket (every row, laid out
again): every rank makes the same calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.models.functional import additive_mask, any_sharded, without_adapter_wrapper
from posttrain.models.length_buckets import length_buckets

# One more forward of the model (its Python and per-layer kernel launches), in padded tokens: on a
# CPU a token's matmuls are slow beside a call; on an accelerator a call's launches cost as much as
# many tokens (an estimate: not measured on one).
BUCKET_COST_TOKENS = {"cpu": 64}
ACCELERATOR_BUCKET_COST_TOKENS = 1024
# How many query-key pairs of attention cost as much as one token's matmuls (a 135M model's
# layer: ~7 MFLOP a token against ~2 kFLOP a pair; larger models have more per token).
ATTENTION_PAIRS_PER_TOKEN = 2048


@dataclass(frozen=True)
class PlainBucket:
    """One forward of the model: its rows, their inputs, and where its outputs go."""
    rows: torch.Tensor    # [b]: its rows of the batch
    inputs: dict          # the model's keyword inputs, [b, W] right-padded
    kept: int             # the last `kept` positions of the W are the ones any output is read from
    picked: torch.Tensor  # [n]: the outputs predicting each real response token, in [b * kept], row-major
    placed: torch.Tensor  # [n]: their places in the [B * T] layout of the response tokens


def plain_buckets(model, prompt_ids, prompt_mask, response_ids, response_mask,
                  float_mask_dtype: torch.dtype | None) -> list[PlainBucket]:
    """The buckets of the rows (prompt_ids / prompt_mask [B, P] left-padded, response_ids /
    response_mask [B, T], a prefix of ones). ``float_mask_dtype``: the dtype of one additive float
    [b, 1, W, W] mask the model's attention reads in place (where that mask is exact for it), or
    None for the [b, W] padding mask the model builds its own from."""
    prompt_lengths = prompt_mask.long().sum(dim=1)
    response_lengths = response_mask.long().sum(dim=1)
    if bool((prompt_lengths == 0).any()):
        raise ValueError("a row's prompt is empty: its first response token has no position to be predicted from")
    lengths = (prompt_lengths + response_lengths).tolist()
    if any_sharded(without_adapter_wrapper(model)):
        plan = [list(range(len(lengths)))]
    else:
        call_cost = BUCKET_COST_TOKENS.get(prompt_ids.device.type, ACCELERATOR_BUCKET_COST_TOKENS)
        plan = length_buckets(lengths, row_cost, call_cost)
    tokens = torch.cat([prompt_ids, response_ids], dim=1)
    return [_bucket(torch.tensor(rows, device=tokens.device), tokens, prompt_ids.shape[1], prompt_lengths,
                    response_lengths, response_ids.shape[1], float_mask_dtype) for rows in plan]


def row_cost(width: int) -> float:
    """What a row costs in a bucket ``width`` tokens wide, in tokens: its matmuls, and its
    attention pairs in `ATTENTION_PAIRS_PER_TOKEN`."""
    return width + width * width / ATTENTION_PAIRS_PER_TOKEN


def _bucket(rows, tokens, padded_prompt, prompt_lengths, response_lengths, width, float_mask_dtype) -> PlainBucket:
    p, n = prompt_lengths[rows][:, None], response_lengths[rows][:, None]  # [b, 1]
    span = int((p + n).max())
    column = torch.arange(span, device=tokens.device)[None, :]  # [1, W]
    real = column < p + n
    # column j of a row: its prompt's j-th real token (they end at the padded prompt's end), then
    # its response's (j - p)-th; the padding after them repeats a real token (masked, never read)
    source = torch.where(column < p, padded_prompt - p + column, padded_prompt + column - p)
    input_ids = tokens[rows].gather(1, torch.where(real, source, padded_prompt - 1))
    if float_mask_dtype is None:
        attention_mask = real.long()
    else:  # causal over the row's real keys; a padding query sees itself (never a row of -inf)
        allowed = torch.ones(span, span, dtype=torch.bool, device=tokens.device).tril() & real[:, None, :]
        allowed |= torch.eye(span, dtype=torch.bool, device=tokens.device)
        attention_mask = additive_mask(allowed, float_mask_dtype)[:, None]
    position_ids = column.expand(len(rows), span)
    # response token t of a row is predicted at position p - 1 + t; the earliest read is min(p) - 1
    kept = span - int(p.min()) + 1
    t = torch.arange(width, device=tokens.device)[None, :]
    scored = t < n  # [b, T]
    picked = (torch.arange(len(rows), device=tokens.device)[:, None] * kept + (p - 1 + t) - (span - kept))[scored]
    placed = (rows[:, None] * width + t)[scored]
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return PlainBucket(rows, inputs, kept, picked, placed)


def picked_outputs(bucket: PlainBucket, outputs: torch.Tensor) -> torch.Tensor:
    """[n, ...]: of the model's outputs at the last ``bucket.kept`` positions [b, kept, ...], those
    predicting each real response token."""
    return outputs.flatten(0, 1).index_select(0, bucket.picked)


def placed_outputs(buckets: list[PlainBucket], outputs: list[torch.Tensor], shape) -> torch.Tensor:
    """[B, T, ...] (``shape`` = (B, T)) from each bucket's packed outputs [n, ...]; 0 at the
    positions that predict padding."""
    packed = torch.cat(outputs)
    flat = packed.new_zeros(shape[0] * shape[1], *packed.shape[1:])
    return flat.index_copy(0, torch.cat([bucket.placed for bucket in buckets]), packed).view(*shape, *packed.shape[1:])
