"""The training forward: log-probs (policy, reference, old, teacher), last hidden states
(critic) and, where a loss reads the whole distribution, logits, at the positions that
predict each response token of a (prompt, response) batch.

Memory is linear in the response length on every path:

* attention is fused (SDPA) and never materialises [T, T] scores per layer: the lean grouped
  forward (models/grouped_forward.py) where the architecture allows (whole or FSDP2-sharded
  weights, with or without activation checkpointing), else the model's own forward with its
  SDPA attention (transformers' default), on rows laid out without padding in length buckets
  (models/plain_forward.py), each given one float [b, 1, W, W] mask built once (a boolean or
  2-D mask would make SDPA convert a float copy at every layer and keep it for the backward)
  where that mask is exact for the model;
* `sequence_logprobs` never builds the [B, T, V] logits: the LM head runs chunk by chunk
  inside `core.token_logprobs_and_entropy_from_hidden`, recomputed in the backward. It runs
  inside the model's forward, where FSDP2 has gathered the head's weight and whose backward
  hooks see the scores as the forward's output: in the grouped forward as its last step, on the
  model's own forward as its LM head, swapped for the scorer for the duration of the call. Only
  models whose logits are exactly `lm_head(hidden)` take that path; the others (softcapped or
  scaled logits) score full logits.

Only `sequence_logits` (full-vocabulary distillation, the tests' reference) returns logits.
"""

from __future__ import annotations

import contextlib

import torch

from posttrain.core.logprobs import token_logprobs_and_entropy, token_logprobs_and_entropy_from_hidden
from posttrain.models.functional import (
    any_sharded,
    effective_weight,
    prompt_group_size,
    without_adapter_wrapper,
)
from posttrain.models.grouped_forward import grouped_forward_unsupported_reason, grouped_hidden_states, grouped_logits
from posttrain.models.plain_forward import picked_outputs, placed_outputs, plain_buckets

# Architectures whose logits are exactly lm_head(last hidden state): no softcapping, no scale
# after the head. The scorer replaces their LM head; any other model scores full logits.
PLAIN_HEAD_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3",
                          "olmo2", "smollm3")
# config attributes that change the logits after the head (Gemma 2/3, Cohere, Granite, Falcon-H1)
HEAD_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier")


def sequence_logits(model, prompt_ids, prompt_mask, response_ids, response_mask) -> torch.Tensor:
    """Logits predicting each response token, [B, T, V], in the model's dtype. The whole
    tensor exists: only a loss over the full vocabulary reads this (`distill.mode=full`);
    log-probs come from `sequence_logprobs`. Positions count real tokens only, as the samplers
    do, so left padding does not shift a prompt's positions. Only the response positions go
    through the LM head.

    Where the architecture allows, this is the lean grouped forward (models/grouped_forward.py):
    rows in runs of identical prompts (an online-RL batch: a group's samples) run their prompt
    once. Otherwise the model's own forward runs every row whole."""
    if grouped_forward_unsupported_reason(model) is None:
        group_size = prompt_group_size(prompt_ids, prompt_mask)
        return grouped_logits(model, prompt_ids, prompt_mask, response_ids, response_mask, group_size)
    buckets = _plain_buckets(model, prompt_ids, prompt_mask, response_ids, response_mask)
    logits = [picked_outputs(b, model(**b.inputs, logits_to_keep=b.kept).logits) for b in buckets]
    return placed_outputs(buckets, logits, response_ids.shape)


def sequence_hidden_states(model, prompt_ids, prompt_mask, response_ids, response_mask) -> torch.Tensor:
    """Last hidden states, after the final norm, at the positions that predict each response
    token, [B, T, H]: the input of the LM head (policy) or of a value head (critic). The
    grouped forward where the architecture allows (positions that predict padding are 0
    there), else the model's decoder."""
    if grouped_forward_unsupported_reason(model) is None:
        group_size = prompt_group_size(prompt_ids, prompt_mask)
        return grouped_hidden_states(model, prompt_ids, prompt_mask, response_ids, response_mask, group_size)
    buckets = _plain_buckets(model, prompt_ids, prompt_mask, response_ids, response_mask)
    hidden = [picked_outputs(b, model.get_decoder()(**b.inputs).last_hidden_state[:, -b.kept:]) for b in buckets]
    return placed_outputs(buckets, hidden, response_ids.shape)


def sequence_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask, *, with_entropy: bool = False,
                      entropy_grad: bool = True, support_size=None, temperature: float = 1.0,
                      chunk_tokens: int | None = None):
    """(log pi(y_t) [B, T], entropy H_t [B, T] or None) of the response tokens under ``model``,
    with the options of `core.token_logprobs_and_entropy` (temperature, the sampler's
    top-k/top-p ``support_size``, ``entropy_grad``). Positions after a response's end (response
    mask 0) are not scored: they give 0. No [B, T, V] logits tensor is built (see the module
    docstring), except for models whose logits are not `lm_head(hidden)`."""
    options = dict(with_entropy=with_entropy, entropy_grad=entropy_grad, temperature=temperature)
    if grouped_forward_unsupported_reason(model) is None:
        group_size = prompt_group_size(prompt_ids, prompt_mask)

        def score(hidden, weight, bias):  # inside the grouped forward (FSDP2: the LM head gathered)
            return logprobs_from_hidden(hidden, weight, bias, response_ids, response_mask, support_size=support_size,
                                        chunk_tokens=chunk_tokens, **options)

        return grouped_hidden_states(model, prompt_ids, prompt_mask, response_ids, response_mask, group_size,
                                     then=score)
    if head_is_plain(model):
        return _scored_by_the_model(model, prompt_ids, prompt_mask, response_ids, response_mask,
                                    support_size=support_size, chunk_tokens=chunk_tokens, **options)
    logits = sequence_logits(model, prompt_ids, prompt_mask, response_ids, response_mask)
    logp, entropy = token_logprobs_and_entropy(logits, response_ids, support_size=support_size, **options)
    return _unscored_padding(logp, response_mask), _unscored_padding(entropy, response_mask)


def lm_head_weights(model) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight [V, H], bias [V] or None) of the model's LM head, a LoRA update included."""
    head = without_adapter_wrapper(model).get_output_embeddings()
    return effective_weight(head), getattr(head, "bias", None)


def logprobs_from_hidden(hidden, weight, bias, response_ids, response_mask, *, with_entropy: bool,
                         entropy_grad: bool = True, support_size=None, temperature: float = 1.0,
                         chunk_tokens: int | None = None):
    """`sequence_logprobs` from the LM head's input hidden [B, T, H] and its weight and bias:
    only the positions of real response tokens are scored (packed), the others give 0."""
    scored = response_mask.bool()
    logp, entropy = token_logprobs_and_entropy_from_hidden(
        hidden[scored], weight, response_ids[scored], bias=bias, with_entropy=with_entropy,
        entropy_grad=entropy_grad, support_size=None if support_size is None else support_size[scored],
        temperature=temperature, chunk_tokens=chunk_tokens)

    def unpacked(x):
        return None if x is None else x.new_zeros(scored.shape).masked_scatter(scored, x)

    return unpacked(logp), unpacked(entropy)


def head_is_plain(model) -> bool:
    """Whether the model's logits are exactly ``lm_head(last hidden state)`` (see
    `PLAIN_HEAD_MODEL_TYPES`), so that the LM head can be replaced by the chunked scorer."""
    hf_model = without_adapter_wrapper(model)
    config = getattr(hf_model, "config", None)
    if getattr(config, "model_type", None) not in PLAIN_HEAD_MODEL_TYPES:
        return False
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in HEAD_POSTPROCESSING):
        return False
    head = hf_model.get_output_embeddings() if hasattr(hf_model, "get_output_embeddings") else None
    return head is not None and hasattr(head, "weight")


def _scored_by_the_model(model, prompt_ids, prompt_mask, response_ids, response_mask, *, support_size=None,
                         **options):
    """`sequence_logprobs` through the model's own forward (`plain_forward`: rows without padding,
    in length buckets), its LM head replaced by the chunked scorer for the duration of each call.
    The scorer runs inside the model's forward (where FSDP2 has gathered the head's weight) and
    its scores are the forward's output "logits" [n, 2] (log-prob, entropy of each real response
    token), so that FSDP2's backward hooks are attached to them."""
    head = without_adapter_wrapper(model).get_output_embeddings()
    labels = response_ids.reshape(-1)
    support = None if support_size is None else support_size.reshape(-1)
    buckets = _plain_buckets(model, prompt_ids, prompt_mask, response_ids, response_mask)
    scores = []
    for bucket in buckets:
        def score(hidden, bucket=bucket):  # [b, kept, H]
            weight, bias = effective_weight(head), getattr(head, "bias", None)
            logp, entropy = token_logprobs_and_entropy_from_hidden(
                picked_outputs(bucket, hidden), weight, labels[bucket.placed], bias=bias,
                support_size=None if support is None else support[bucket.placed], **options)
            return torch.stack([logp, logp.new_zeros(()).expand_as(logp) if entropy is None else entropy], dim=-1)

        with _replaced_forward(head, score):
            scores.append(model(**bucket.inputs, logits_to_keep=bucket.kept).logits)
    logp, entropy = placed_outputs(buckets, scores, response_ids.shape).unbind(-1)
    if not options["with_entropy"]:
        entropy = None
    elif not options["entropy_grad"]:
        entropy = entropy.detach()
    return logp, entropy


@contextlib.contextmanager
def _replaced_forward(module, forward):
    """``module(x)`` calls ``forward(x)`` inside (its hooks still run), the module's own outside
    (an instance-level forward, such as accelerate's, is put back)."""
    missing = object()
    own = module.__dict__.get("forward", missing)
    module.forward = forward
    try:
        yield
    finally:
        if own is missing:
            del module.forward
        else:
            module.forward = own


def _unscored_padding(x, response_mask):
    return None if x is None else torch.where(response_mask.bool(), x, torch.zeros_like(x))


def _plain_buckets(model, prompt_ids, prompt_mask, response_ids, response_mask) -> list:
    """The model's own forward's calls for prompt ++ response (`plain_forward.plain_buckets`): one
    additive float [b, 1, W, W] mask each, read in place by every layer's SDPA, where that is
    exact for the model (`_float_mask_dtype`); else the [b, W] padding mask, from which the model
    builds its own."""
    return plain_buckets(model, prompt_ids, prompt_mask, response_ids, response_mask,
                         _float_mask_dtype(model, prompt_ids.device))


def _float_mask_dtype(model, device: torch.device) -> torch.dtype | None:
    """The dtype of the queries of ``model``'s SDPA attention, if a custom 4-D float mask is
    exact for it (one of the plain decoders of `PLAIN_HEAD_MODEL_TYPES`, SDPA attention, every
    layer full causal attention, weights not sharded: a sharded model's compute dtype is FSDP's,
    unknown here), else None."""
    hf_model = without_adapter_wrapper(model)
    config = getattr(hf_model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not head_is_plain(model):
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        if any(t != "full_attention" for t in layer_types):
            return None
    elif getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return None
    if next(hf_model.parameters(), None) is None or any_sharded(hf_model):
        return None
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return hf_model.get_input_embeddings().weight.dtype
