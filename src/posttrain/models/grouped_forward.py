"""The scoring forward of online RL: hidden states (and logits) of sampled responses, each
prompt computed once, with fused attention.

An online-RL batch holds every prompt `group_size` times (its group's samples). The
training forward, the reference forward and the old/teacher log-probs all run the whole
prompt + response through the model, so with short answers most of their work is the same
prompt, repeated. Here each unique prompt runs once: its keys and values are shared by the
responses of its group, and the gradient of every response flows back into the one shared
prompt computation (autograd sums it, as it would over the copies). The log-probs and the
gradients are those of the plain forward (tested to float32 rounding).

It is the lean functional decoder of `models/functional.py` (fused q/k/v and gate/up
matmuls, folded norm gains, RoPE as one complex multiply), written out of place so autograd
can run through it. The decoder is a loop of per-layer steps (prompt block, then response
block), and each step fuses its own layer's weights from the parameters (`DecoderWeights.fuse`,
a differentiable `cat`): without grad one layer's fused copy exists at a time; with grad each
layer's copy is kept for the backward (its matmuls save it), unless checkpointing is on.

Activation checkpointing: when the Hugging Face model has it on (`gradient_checkpointing_enable`)
and grad is enabled, each layer's step runs inside the checkpoint function its layer was given
(`distributed/recompute.py`: non-reentrant), so the backward keeps only each layer's inputs (the
prompt and response hidden states; "selective": and its matmuls' and attention's outputs) and
rebuilds the fused weights and the rest in the recompute. The same ops run again: log-probs and
gradients are those of the plain grouped forward.

FSDP2 (trainer=fsdp, `distributed/sharding.py:shard_lm`: every decoder layer and the model are
FSDP units): each layer's step runs as a forward of that layer's unit and the whole grouped
forward (embedding, final norm, and the caller's LM-head scoring) as one of the model's, through
`register_fsdp_forward_method`: a unit's weights are gathered just before its step and freed
after it (reshard_after_forward), gathered again for its backward, and its gradients
reduce-scattered as after the model's own forward; one layer is whole at a time. Checkpointing composes with it as in Hugging Face's layers: FSDP's hooks
outside the checkpoint, so the recompute reads the weights that the backward gathered.

Memory is linear in the response length. Attention is
`torch.nn.functional.scaled_dot_product_attention`, never explicit scores: on CPU its flash
kernel (`_scaled_dot_product_flash_attention_for_cpu`, forward and backward; checked with the
profiler), on CUDA the memory-efficient kernel is expected (a mask rules out flash there; not
measured, no GPU was at hand for this change). Neither materialises the [T, T] scores, and the
backward saves only q, k, v, the output, the log-sum-exp and a reference to the one shared mask
per layer (tests/models/test_grouped_forward.py counts the saved tensors). Layout:

    prompt block    queries [U, heads, P, D] over the prompt's keys [U, kv_heads, P, D]
    response block  queries [B, heads, T', D] over [the group's prompt keys ++ the row's own
                    response keys] [B, kv_heads, P + T', D]        (T' = T - 1 positions)

The response block copies each prompt's keys and values into its group's rows (k/v only:
linear in T, as every row's own keys are). Each block reads ONE additive float mask built
once per forward and shared by all layers, [U, 1, P, P] (causal, left padding) and
[B, 1, T', P + T'] (the prompt's real keys ++ causal over the response). It is a float mask,
not a boolean one, on purpose: SDPA converts a boolean mask into a float copy at every call,
and the backward keeps that copy, so a boolean mask would cost [B, T', P + T'] floats per
layer; a float mask is read in place (the same storage for every layer). Its rows are 16-aligned
in memory, so that the CUDA memory-efficient kernel reads it without padding a copy either.
A mask, not `is_causal`: SDPA's `is_causal` is top-left aligned, while response queries
need the bottom-right alignment (query t sees the P prompt keys and responses 0..t). The
layout that reaches `is_causal` (each row as [prompt ++ response] with dummy queries at the
prompt positions) measured slower on CPU than the masked flash kernel: one layer's attention,
forward + backward, 16 rows, 9 heads (3 kv), P = 64, T' = 1024, one thread: masked 2.8 s,
`is_causal` with dummy queries 3.3 s, the old explicit attention 15.7 s.

GQA: on CPU `enable_gqa=True` (the CPU flash kernel takes it with a mask and with grad, and
it is ~8% faster than repeating the kv heads); on CUDA the kv heads are repeated, since
masked GQA makes CUDA's SDPA fall back to its math kernel, which materialises the scores.

The response stream stays packed: the matmuls run only on the tokens whose output predicts a
real token (a response's last token and its padding predict nothing), [N, H] rows. With every
response full (nothing to skip) the packing costs 0.3% of the step's CPU time (its index_copy /
index_select and their backward, profiled at T = 256, benchmarks/memory_vs_length.py's setup);
with uneven lengths it skips the padding's matmuls, so it stays.

Attention needs a rectangular layout, so the packed tokens are laid out again for it, in length
buckets (`response_buckets`): the rows sorted by length and cut into runs, each run padded only
to its own longest row, [b, heads, T_b, D] over [b, kv_heads, P + T_b, D] with its own mask. A
bucket is one more SDPA call per layer, so rows are split only where the padded query-key pairs
a split removes outweigh `BUCKET_COST_PAIRS` (the fixed cost of a call and its copies, in
pairs): a batch of even lengths, or of short ones (the embedded task), stays one bucket of every
row in its own order, the padded [B, T'] layout above. The log-probs and the gradients do not
depend on the buckets (each query's keys and mask are the same; tested in fp32 against one
bucket). The prompt block stays padded to the longest prompt: it runs once per group.

`group_size=1` is the plain forward of every row (nothing is shared).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.distributed.recompute import checkpointing_on, layer_checkpoint
from posttrain.models.functional import (
    DecoderWeights,
    _unit_rms,
    real_token_positions,
    rotation,
    unsupported_reason,
    without_adapter_wrapper,
)
from posttrain.models.length_buckets import length_buckets

try:
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
except ImportError:  # torch built without distributed
    FSDPModule = None

# The CUDA memory-efficient kernel wants a mask whose rows start 16-aligned (else it pads a copy).
MASK_ALIGNMENT = 16
# What one more attention bucket costs (an SDPA call per layer, forward and backward, and its
# layout copies), in padded query-key pairs: a split must remove more pairs than this.
BUCKET_COST_PAIRS = 1 << 15


def grouped_forward_unsupported_reason(model: nn.Module) -> Optional[str]:
    """None if `grouped_logits` reproduces ``model``'s forward (in its current mode), else why not."""
    hf_model = without_adapter_wrapper(model)
    reason = unsupported_reason(hf_model, allow_sharded=True)
    if reason is not None:
        return reason
    if model.training and float(getattr(hf_model.config, "attention_dropout", 0.0) or 0.0) > 0:
        return "attention dropout is on"
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
    """Logits predicting each response token, [B, T, V], as `forward.sequence_logits`.

    prompt_ids / prompt_mask [B, P] left-padded; response_ids / response_mask [B, T], each
    mask a prefix of ones; rows come in groups of `group_size` consecutive rows with identical
    prompts (`functional.prompt_group_size`). Logits of positions that predict padding are 0.
    Differentiable when grad is enabled. The whole [B, T, V] exists: the training forward
    reads `grouped_hidden_states` instead and applies the LM head chunk by chunk."""
    def logits(w, first, rest, rows):  # the head on the computed positions only
        return _unpacked(_head(w, first), _head(w, rest), rows, group_size, response_ids.shape)

    return _grouped(model, logits, prompt_ids, prompt_mask, response_ids, response_mask, group_size)


def grouped_hidden_states(model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                          response_ids: torch.Tensor, response_mask: torch.Tensor, group_size: int, then=None):
    """The final-normed hidden states (the LM head's input) at the positions predicting each
    response token, [B, T, H]: `grouped_logits` without the LM head. Positions that predict
    padding are 0. With ``then``, ``then(hidden, lm_head_weight, lm_head_bias)`` is returned
    instead, computed in the same forward: under FSDP2 that is where the LM head is gathered
    (`forward.sequence_logprobs` scores the tokens chunk by chunk there)."""
    def hidden(w, first, rest, rows):
        h = _unpacked(first, rest, rows, group_size, response_ids.shape)
        return h if then is None else then(h, w.lm_head, w.lm_head_bias)

    return _grouped(model, hidden, prompt_ids, prompt_mask, response_ids, response_mask, group_size)


def _grouped(model, finish, prompt_ids, prompt_mask, response_ids, response_mask, group_size):
    """``finish(weights, *_trunk(...))``, the whole run as a forward of ``model`` (`_as_forward_of`)."""
    hf_model = without_adapter_wrapper(model)
    checkpointed = checkpointing_on(hf_model) and torch.is_grad_enabled()

    def forward(prompt_ids, prompt_mask, response_ids, response_mask):
        w = DecoderWeights(hf_model)  # read here: an FSDP2 root's weights are whole only inside its forward
        return finish(w, *_trunk(w, prompt_ids, prompt_mask, response_ids, response_mask, group_size, checkpointed))

    return _as_forward_of(model, forward, prompt_ids, prompt_mask, response_ids, response_mask)


def _as_forward_of(module: nn.Module, fn, *args):
    """``fn(*args)``, run as a forward of ``module``. For an FSDP2 unit, FSDP's forward hooks
    run around it as around ``module(*args)``: the unit's weights are gathered for the call
    (and freed after it, as its reshard_after_forward says), the outputs' backward gathers them
    again, and the unit's gradients are reduce-scattered when its backward is done. Otherwise
    just ``fn(*args)``. Tensors that need gradients must come in ``args`` (FSDP hooks the
    unit's backward onto them), not in ``fn``'s closure."""
    if FSDPModule is None or not isinstance(module, FSDPModule):
        return fn(*args)
    # register_fsdp_forward_method wraps a method the module has: one that calls fn, for this call
    module.posttrain_grouped_forward = _call
    register_fsdp_forward_method(module, "posttrain_grouped_forward")
    try:
        return module.posttrain_grouped_forward(fn, *args)
    finally:
        del module.posttrain_grouped_forward


def _call(fn, *args):
    return fn(*args)


def _unpacked(first: torch.Tensor, rest: torch.Tensor, rows: torch.Tensor, group_size: int, shape) -> torch.Tensor:
    """[B, T, F] (``shape`` = (B, T)) from each prompt's last position ``first`` [U, F] (shared
    by its group's rows) and the packed response positions ``rest`` [N, F] (at ``rows`` of the
    [B * (T - 1)] layout); 0 at the positions that predict padding."""
    batch, width = shape
    first = first.repeat_interleave(group_size, dim=0)[:, None]  # [B, 1, F]
    rest = rest.new_zeros(batch * (width - 1), rest.shape[-1]).index_copy(0, rows, rest).view(batch, width - 1, -1)
    return torch.cat([first, rest], dim=1)


def _final_norm(w: DecoderWeights, h: torch.Tensor) -> torch.Tensor:
    return _unit_rms(h, w.final_floor) * w.final_gain


def _head(w: DecoderWeights, normed: torch.Tensor) -> torch.Tensor:
    return F.linear(normed, w.lm_head, w.lm_head_bias)


def _trunk(w: DecoderWeights, prompt_ids, prompt_mask, response_ids, response_mask, group_size,
           checkpointed: bool = False):
    """The decoder over each group's prompt once and over the packed response tokens, layer by
    layer (`_decoder_layer`; each step checkpointed if ``checkpointed``).
    Returns (final-normed hidden state of each prompt's last position [U, H] (it predicts its
    responses' first tokens), final-normed hidden states of the packed response tokens [N, H],
    their `rows` in the [B * (T - 1)] layout)."""
    pad = w.embed_padding_idx  # its row gets no gradient, as in nn.Embedding
    width = response_ids.shape[1]
    g = group_size
    prompt_ids, prompt_mask = prompt_ids[::g], prompt_mask[::g].bool()  # [U, P]
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

    query_dtype = _query_dtype(dtype, device)
    prompt_attention = _additive(_prompt_allowed(prompt_mask)[:, None], query_dtype)
    buckets = _buckets(response_mask, rows, prompt_mask, g, query_dtype)
    for block in w.blocks:
        step = functools.partial(_decoder_layer, w, block, rotations=(prompt_rot, response_rot),
                                 prompt_attention=prompt_attention, buckets=buckets)
        if checkpointed:  # the backward keeps the step's inputs (and, selective, its matmuls' outputs)
            step = functools.partial(layer_checkpoint(block), step)
        hp, hr = _as_forward_of(block, step, hp, hr)
    return _final_norm(w, hp[:, -1]), _final_norm(w, hr), rows


def _decoder_layer(w: DecoderWeights, block: nn.Module, hp, hr, *, rotations, prompt_attention, buckets):
    """One decoder layer over the unique prompts hp [U, P, H] and the packed response tokens
    hr [N, H], with its fused weights, built here from ``block``'s parameters (whole in this
    call under FSDP2; built again in a checkpoint's recompute)."""
    layer = w.fuse(block)
    hp, kp, vp = _prompt_block(w, layer, hp, rotations[0], prompt_attention)
    if buckets.layouts:
        hr = _response_block(w, layer, hr, kp, vp, rotations[1], buckets)
    return hp, hr


def _query_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the attention's queries will have: autocast's, where it is on (a mask of
    another dtype would be cast, a copy per layer), else the weights'."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else dtype


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``allowed``, -inf elsewhere, in rows whose storage is `MASK_ALIGNMENT`-aligned
    (a view of a wider tensor: SDPA reads it in place)."""
    width = allowed.shape[-1]
    stored = -(-width // MASK_ALIGNMENT) * MASK_ALIGNMENT
    bias = torch.zeros(*allowed.shape[:-1], stored, dtype=dtype, device=allowed.device)[..., :width]
    return bias.masked_fill_(~allowed, float("-inf"))


def _prompt_allowed(prompt_mask: torch.Tensor) -> torch.Tensor:
    """[U, P, P]: a prompt query sees the earlier real keys of its prompt (a pad query, which
    would see no key at all, sees itself)."""
    plen = prompt_mask.shape[1]
    causal = torch.ones(plen, plen, dtype=torch.bool, device=prompt_mask.device).tril()
    return (causal & prompt_mask[:, None, :]) | torch.eye(plen, dtype=torch.bool, device=prompt_mask.device)


def response_buckets(lengths: list[int], prompt_length: int, cost_pairs: int | None = None) -> list[list[int]]:
    """The rows of each attention bucket (`length_buckets`), given each row's number of response
    queries ``lengths``: a bucket of rows whose longest has L queries costs rows x L x (P + L)
    query-key pairs, and each extra bucket ``cost_pairs`` (default `BUCKET_COST_PAIRS`)."""
    cost_pairs = BUCKET_COST_PAIRS if cost_pairs is None else cost_pairs
    return length_buckets(lengths, lambda n: n * (prompt_length + n), cost_pairs)


@dataclass(frozen=True)
class _Layout:
    """One attention bucket: its rows, their prompts, and where its packed tokens go."""
    rows: int             # b
    span: int             # T_b: queries of its longest row
    groups: torch.Tensor  # [b]: each row's prompt (an index into the prompt block's keys)
    tokens: Optional[torch.Tensor]  # [n_b]: its tokens' indices in the packed stream (None: all, in order)
    slots: torch.Tensor   # [n_b]: their places in the [b * T_b] layout
    mask: torch.Tensor    # [b, 1, T_b, P + T_b], additive


@dataclass(frozen=True)
class _Buckets:
    layouts: list
    unsorted: Optional[torch.Tensor]  # the packed order of the buckets' concatenated outputs (None: in order)


def _buckets(response_mask: torch.Tensor, rows: torch.Tensor, prompt_mask: torch.Tensor, group_size: int,
             dtype: torch.dtype) -> _Buckets:
    """The attention layouts of the packed response tokens (at ``rows`` of [B * (T - 1)]), built
    once per forward and read by every layer. A response query sees its prompt's real keys and
    its response up to itself."""
    batch, span = response_mask.shape[0], response_mask.shape[1] - 1
    device = rows.device
    if len(rows) == 0:
        return _Buckets([], None)

    def layout(members: torch.Tensor, width: int, tokens, slots) -> _Layout:
        groups = members // group_size
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        allowed = torch.cat([prompt_mask[groups][:, None, :].expand(-1, width, -1),
                             causal.expand(len(members), width, width)], dim=-1)
        return _Layout(len(members), width, groups, tokens, slots, _additive(allowed[:, None], dtype))

    lengths = response_mask[:, 1:].sum(dim=1).long()
    plan = response_buckets(lengths.tolist(), prompt_mask.shape[1])
    if len(plan) == 1:  # every row in its own order: the padded [B, T - 1] layout, where the tokens sit at `rows`
        return _Buckets([layout(torch.arange(batch, device=device), span, None, rows)], None)
    row_of, position = rows // span, rows % span
    layouts, tokens_in_order = [], []
    for members in plan:
        members = torch.tensor(members, device=device)
        width = int(lengths[members].max())
        slot_of_row = torch.full((batch,), -1, dtype=torch.long, device=device)
        slot_of_row[members] = torch.arange(len(members), device=device)
        tokens = (slot_of_row[row_of] >= 0).nonzero().squeeze(1)
        layouts.append(layout(members, width, tokens, slot_of_row[row_of[tokens]] * width + position[tokens]))
        tokens_in_order.append(tokens)
    return _Buckets(layouts, torch.cat(tokens_in_order).argsort())


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA of q [N, heads, L, D] over k, v [N, kv_heads, S, D] (see the module docstring on GQA)."""
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1 and q.device.type != "cpu":  # masked GQA would run CUDA's math kernel
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=n_rep > 1 and q.device.type == "cpu")


def _split_qkv(w: DecoderWeights, out: torch.Tensor):
    # one split (its backward is one cat), not three slices (each a zero-filled full-size gradient)
    nq, nk = w.num_heads * w.head_dim, w.num_kv_heads * w.head_dim
    return out.split((nq, nk, nk), dim=-1)


def _mlp(layer, h: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(_unit_rms(h, layer.floor2), layer.w_gate_up, layer.b_gate_up).chunk(2, -1)
    return h + F.linear(F.silu(gate) * up, layer.w_down_t.t(), layer.b_down)


def _prompt_block(w: DecoderWeights, layer, hp, rotation, mask):
    """One decoder layer over the unique prompts [U, P, H]; also returns their keys and values
    [U, kv_heads, P, D] for the responses to attend to."""
    u, plen, _ = hp.shape
    hq, hkv, d = w.num_heads, w.num_kv_heads, w.head_dim
    q, k, v = _split_qkv(w, F.linear(_unit_rms(hp, layer.floor1), layer.w_qkv, layer.b_qkv))
    q = _rotate(q.unflatten(-1, (hq, d)), rotation).transpose(1, 2)  # [U, heads, P, D]
    k = _rotate(k.unflatten(-1, (hkv, d)), rotation).transpose(1, 2)
    v = v.unflatten(-1, (hkv, d)).transpose(1, 2)
    a = _attention(q, k, v, mask).transpose(1, 2).reshape(u, plen, hq * d)
    return _mlp(layer, hp + F.linear(a, layer.w_o_t.t(), layer.b_o)), k, v


def _response_block(w: DecoderWeights, layer, hr, kp, vp, rotation, buckets: _Buckets):
    """One decoder layer over the packed response tokens hr [N, H] (`rotation` [N, 1, D/2] their
    RoPE). Attention runs bucket by bucket: each row's queries over its prompt's keys followed
    by its own response's keys, on the bucket's padded layout, with the bucket's mask."""
    hq, hkv, d = w.num_heads, w.num_kv_heads, w.head_dim
    q, k, v = _split_qkv(w, F.linear(_unit_rms(hr, layer.floor1), layer.w_qkv, layer.b_qkv))
    q = _rotate(q.unflatten(-1, (hq, d)), rotation).flatten(1)
    k = _rotate(k.unflatten(-1, (hkv, d)), rotation).flatten(1)
    v = v.flatten(1)

    def laid_out(x, heads, layout):  # packed [N, heads * D] -> [b, heads, T_b, D], zeros at the padding
        x = x if layout.tokens is None else x.index_select(0, layout.tokens)
        return _padded(x, layout.slots, layout.rows * layout.span).view(layout.rows, layout.span, heads, d).transpose(1, 2)

    outputs = []
    for layout in buckets.layouts:
        keys = torch.cat([kp.index_select(0, layout.groups), laid_out(k, hkv, layout)], dim=2)  # [b, kv, P + T_b, D]
        values = torch.cat([vp.index_select(0, layout.groups), laid_out(v, hkv, layout)], dim=2)
        a = _attention(laid_out(q, hq, layout), keys, values, layout.mask)  # [b, heads, T_b, D]
        outputs.append(a.transpose(1, 2).reshape(layout.rows * layout.span, hq * d).index_select(0, layout.slots))
    a = outputs[0] if buckets.unsorted is None else torch.cat(outputs).index_select(0, buckets.unsorted)
    return _mlp(layer, hr + F.linear(a, layer.w_o_t.t(), layer.b_o))


def _padded(x: torch.Tensor, rows: torch.Tensor, total: int) -> torch.Tensor:
    """Packed rows x [N, ...] placed at `rows` of a zero [total, prod(...)] layout."""
    x = x.flatten(1)
    return x.new_zeros(total, x.shape[1]).index_copy(0, rows, x)
