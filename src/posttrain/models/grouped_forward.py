"""The scoring forward of online RL: logits of sampled responses, each prompt computed once.

An online-RL batch holds every prompt `group_size` times (its group's samples). The
training forward, the reference forward and the old/teacher log-probs all run the whole
prompt + response through the model, so with short answers most of their work is the same
prompt, repeated. Here each unique prompt runs once: its keys and values are shared by the
responses of its group, and the gradient of every response flows back into the one shared
prompt computation (autograd sums it, as it would over the copies). The log-probs and the
gradients are those of the plain forward (tested to float32 rounding).

It is the lean functional decoder of `models/functional.py` (fused q/k/v and gate/up
matmuls, folded norm gains, RoPE as one complex multiply, explicit attention), written
out of place so autograd can run through it. The fused weights are rebuilt from the
parameters at each call (a differentiable `cat`): an extra copy of the projections for the
forward's lifetime (kept for the backward when grad is on).

Attention for a response query runs over its prompt's keys (shared by the group) and its
own response's keys (causal); both score blocks are laid out so that one softmax covers
them without copying a prompt's keys into each row:

    queries  [U, kv_heads, G, n_rep, T', D]     (U prompts, G responses each, T' = T - 1 positions)
    vs prompt keys    [U, kv_heads, P, D]        -> scores [U*kv, G*n_rep*T', P]
    vs response keys  [U, kv_heads, G, T', D]    -> scores [U*kv*G, n_rep*T', T']

`group_size=1` is the plain forward of every row (nothing is shared).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.models.functional import (
    FusedWeights,
    _unit_rms,
    additive_mask,
    final_logits,
    prompt_attention_bias,
    real_token_positions,
    rotation,
    softmax_last,
    unsupported_reason,
    without_adapter_wrapper,
)


def grouped_forward_unsupported_reason(model: nn.Module) -> Optional[str]:
    """None if `grouped_logits` reproduces ``model``'s forward (in its current mode), else why not."""
    hf_model = without_adapter_wrapper(model)
    reason = unsupported_reason(hf_model)
    if reason is not None:
        return reason
    if model.training and float(getattr(hf_model.config, "attention_dropout", 0.0) or 0.0) > 0:
        return "attention dropout is on"
    checkpointing = getattr(hf_model, "is_activation_checkpointing", None)  # transformers >= 5.x's name
    if checkpointing if checkpointing is not None else getattr(hf_model, "is_gradient_checkpointing", False):
        return "gradient checkpointing is on (the HF forward recomputes its blocks)"
    if model.training and hasattr(model, "peft_config"):  # a PEFT model: its adapters' input dropout
        for module in model.modules():
            if any(isinstance(d, nn.Dropout) and d.p > 0 for d in getattr(module, "lora_dropout", {}).values()):
                return "LoRA dropout is on"
    return None


def _rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """x [..., D] (rotary pairs adjacent) rotated by the complex ``rotation`` [..., D/2], out of place."""
    rotated = torch.view_as_complex(x.float().unflatten(-1, (-1, 2))) * rotation
    return torch.view_as_real(rotated).flatten(-2).to(x.dtype)


def grouped_logits(model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                   response_ids: torch.Tensor, response_mask: torch.Tensor, group_size: int) -> torch.Tensor:
    """Logits predicting each response token, [B, T, V], as `experience.sequence_logits`.

    prompt_ids / prompt_mask [B, P] left-padded; response_ids / response_mask [B, T], each
    mask a prefix of ones; rows come in groups of `group_size` consecutive rows with identical
    prompts (`rollout.functional.prompt_group_size`). Each group's prompt runs once, and the response
    stream holds only the tokens whose output predicts a real token (a response's last token
    and its padding predict nothing): the matmuls run on those tokens alone, packed, and
    attention on a padded [B, T - 1] layout. Logits of positions that predict padding are 0.
    Differentiable when grad is enabled."""
    hf_model = without_adapter_wrapper(model)
    w = FusedWeights(hf_model)
    pad = w.embed_padding_idx  # its row gets no gradient, as in nn.Embedding
    batch, width = response_ids.shape
    g, u = group_size, batch // group_size
    prompt_ids, prompt_mask = prompt_ids[::g], prompt_mask[::g].bool()  # [U, P]
    hq, hkv = w.num_heads, w.num_kv_heads
    dtype, device = w.embed.dtype, w.embed.device

    # positions count real tokens only (left padding shifts nothing), as the samplers do
    prompt_rot = rotation(w, real_token_positions(prompt_mask), dtype)[:, :, None, :]  # [U, P, 1 (heads), D/2]
    hp = F.embedding(prompt_ids, w.embed, padding_idx=pad)       # [U, P, H]

    # the response stream: position t predicts token t + 1, so only positions t < T - 1 whose
    # next token is real are computed, packed into [N, H] rows
    span = width - 1
    needed = response_mask[:, 1:].bool().reshape(-1)              # [B * (T - 1)]
    rows = needed.nonzero().squeeze(1)
    hr = F.embedding(response_ids[:, :span].reshape(-1)[rows], w.embed, padding_idx=pad)  # [N, H]
    response_pos = prompt_mask.long().sum(dim=1, keepdim=True) + torch.arange(span, device=device)  # [U, T-1]
    response_pos = response_pos.repeat_interleave(g, dim=0).reshape(-1)[rows]
    response_rot = rotation(w, response_pos, dtype)[:, None, :]  # [N, 1 (heads), D/2]

    prompt_bias, response_bias = _attention_biases(prompt_mask, span, hkv, hq // hkv, dtype)
    for layer in w.layers:
        hp, kp, vp = _prompt_block(w, layer, hp, prompt_rot, prompt_bias)
        if len(rows):
            hr = _response_block(w, layer, hr, rows, (u, g, span), kp, vp, response_rot, response_bias)

    # the last prompt position predicts each response's first token
    first = final_logits(w, hp[:, -1]).repeat_interleave(g, dim=0)[:, None]  # [B, 1, V]
    rest = final_logits(w, hr)                                              # [N, V]
    rest = rest.new_zeros(batch * span, rest.shape[-1]).index_copy(0, rows, rest).view(batch, span, -1)
    return torch.cat([first, rest], dim=1)


def _attention_biases(prompt_mask: torch.Tensor, span: int, hkv: int, n_rep: int, dtype):
    """Additive masks. A prompt query sees the earlier real keys of its prompt
    (`rollout.functional.prompt_attention_bias`, [U * kv_heads, n_rep * P, P]). A response
    query sees its prompt's real keys and its response up to itself: [U, 1, T-1, P + T-1]."""
    u, plen = prompt_mask.shape
    causal_r = torch.ones(span, span, dtype=torch.bool, device=prompt_mask.device).tril()
    allowed_r = torch.cat([prompt_mask[:, None, None, :].expand(u, 1, span, plen),
                           causal_r.expand(u, 1, span, span)], dim=-1)
    return prompt_attention_bias(prompt_mask, hkv, n_rep, dtype), additive_mask(allowed_r, dtype)


def _split_qkv(w: FusedWeights, out: torch.Tensor):
    # one split (its backward is one cat), not three slices (each a zero-filled full-size gradient)
    nq, nk = w.num_heads * w.head_dim, w.num_kv_heads * w.head_dim
    return out.split((nq, nk, nk), dim=-1)


def _mlp(layer, h: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(_unit_rms(h, layer.floor2), layer.w_gate_up, layer.b_gate_up).chunk(2, -1)
    return h + F.linear(F.silu(gate) * up, layer.w_down_t.t(), layer.b_down)


def _prompt_block(w: FusedWeights, layer, hp, rotation, bias):
    """One decoder layer over the unique prompts [U, P, H]; also returns their keys and values
    [U * kv_heads, P, D] for the responses to attend to."""
    u, plen, _ = hp.shape
    hq, hkv, d = w.num_heads, w.num_kv_heads, w.head_dim
    q, k, v = _split_qkv(w, F.linear(_unit_rms(hp, layer.floor1), layer.w_qkv, layer.b_qkv))
    q = _rotate(q.unflatten(-1, (hq, d)), rotation).transpose(1, 2).reshape(u * hkv, -1, d)  # query heads of a kv head stacked
    k = _rotate(k.unflatten(-1, (hkv, d)), rotation).transpose(1, 2).reshape(u * hkv, plen, d)
    v = v.unflatten(-1, (hkv, d)).transpose(1, 2).reshape(u * hkv, plen, d)
    scores = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=d**-0.5)
    a = torch.bmm(softmax_last(scores), v).view(u, hq, plen, d).transpose(1, 2).reshape(u, plen, hq * d)
    return _mlp(layer, hp + F.linear(a, layer.w_o_t.t(), layer.b_o)), k, v


def _response_block(w: FusedWeights, layer, hr, rows, shape, kp, vp, rotation, bias):
    """One decoder layer over the packed response tokens hr [N, H] (`rows` of the [B * (T-1)]
    layout, `rotation` [N, 1, D/2] their RoPE). Attention runs on that padded layout, queries
    as [U, kv_heads, G, n_rep, T-1]: against the group's prompt keys in one batch per (prompt,
    kv head), against each response's own keys in one batch per (prompt, kv head, response),
    one softmax over both."""
    u, g, span = shape
    hq, hkv, d = w.num_heads, w.num_kv_heads, w.head_dim
    n_rep, plen = hq // hkv, kp.shape[1]
    q, k, v = _split_qkv(w, F.linear(_unit_rms(hr, layer.floor1), layer.w_qkv, layer.b_qkv))
    q = _padded(_rotate(q.unflatten(-1, (hq, d)), rotation), rows, u * g * span)
    k = _padded(_rotate(k.unflatten(-1, (hkv, d)), rotation), rows, u * g * span)
    v = _padded(v, rows, u * g * span)
    q = q.view(u, g, span, hkv, n_rep, d).permute(0, 3, 1, 4, 2, 5).reshape(u * hkv, g * n_rep * span, d)
    k = k.view(u, g, span, hkv, d).permute(0, 3, 1, 2, 4).reshape(u * hkv * g, span, d)
    v = v.view(u, g, span, hkv, d).permute(0, 3, 1, 2, 4).reshape(u * hkv * g, span, d)
    to_prompt = torch.bmm(q, kp.transpose(1, 2)).view(u, hkv * g * n_rep, span, plen)
    to_response = torch.bmm(q.reshape(u * hkv * g, n_rep * span, d), k.transpose(1, 2)).view(u, hkv * g * n_rep, span, span)
    probs = softmax_last(torch.cat([to_prompt, to_response], dim=-1) * d**-0.5 + bias)
    a = (torch.bmm(probs[..., :plen].reshape(u * hkv, g * n_rep * span, plen), vp).view(u * hkv * g, n_rep * span, d)
         + torch.bmm(probs[..., plen:].reshape(u * hkv * g, n_rep * span, span), v))
    a = a.view(u, hkv, g, n_rep, span, d).permute(0, 2, 4, 1, 3, 5).reshape(u * g * span, hq * d).index_select(0, rows)
    return _mlp(layer, hr + F.linear(a, layer.w_o_t.t(), layer.b_o))


def _padded(x: torch.Tensor, rows: torch.Tensor, total: int) -> torch.Tensor:
    """Packed rows x [N, ...] placed at `rows` of a zero [total, prod(...)] layout."""
    x = x.flatten(1)
    return x.new_zeros(total, x.shape[1]).index_copy(0, rows, x)
