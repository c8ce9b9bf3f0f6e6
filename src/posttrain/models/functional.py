"""A lean functional forward for Llama/Qwen2/Mistral-family decoders, for sampling.

It reads the weights of the Hugging Face module directly and runs the same math with
far fewer Python-level operations per token than the HF module stack: on small models
the per-token cost of HF decoding is Python and dispatcher overhead, not arithmetic.
What makes it lean:

* q, k and v come out of ONE matmul, and gate and up out of one more.  At decode batch
  sizes these matmuls are bound by reading the weights, so fewer weight bytes is speed.
* RoPE is one in-place complex multiply.  HF's ``rotate_half`` pairs dimension i of a head
  with i + D/2; the q and k rows of each head are permuted so that those pairs sit side
  by side, and then a pair rotated by the angle of position p is the complex number
  (a + ib) * e^{i theta p}.  Scores q.k are unchanged because q and k share the
  permutation (and the cache holds the permuted k, which only ever meets permuted q).
* each RMSNorm gain (times sqrt(H)) is folded into the columns of the matmul that reads
  the normed activations, leaving x / sqrt(||x||^2 + H eps): a norm, a ``hypot`` and a
  divide.
* residual adds are fused into the o_proj / down_proj matmuls (``addmm``); SiLU and the
  gating multiply run in place.
* a preallocated static KV cache ``[layers, B, kv_heads, P+T, head_dim]``; left padding
  is one additive key mask built once; the rotations e^{i theta p} for every step are
  built once up front, at per-row positions (a prompt's continuation does not depend on
  how much padding its batch gave it; this is also what HF ``generate`` does).
* a prompt repeated G times in a row (online RL's groups) is prefilled once: the forward
  runs on one row per run and its keys/values are copied to the G rows of the cache.
* attention is an explicit ``baddbmm`` (mask + scaled scores in one op), softmax, ``bmm``:
  for a single decode query ~2x, for a short prompt ~10x cheaper on CPU than SDPA.  GQA needs
  no ``repeat_kv`` copy: the query heads sharing a kv head act as that head's queries.

The logits equal ``model(input_ids, attention_mask).logits`` (tested to 1e-4 in float32,
and in bfloat16 to HF's own rounding error; RoPE is relative, so the per-row position
offset of left padding only moves rounding).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


def unsupported_reason(model: nn.Module, *, allow_sharded: bool = False) -> Optional[str]:
    """None if the functional path reproduces ``model`` exactly, else why not. FSDP2-sharded
    weights are refused unless ``allow_sharded``: the sampler reads whole weights, while the
    grouped forward (models/grouped_forward.py) reads each FSDP unit's inside a call that
    gathers them."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} is not silu"
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or [])):
        return "sliding-window layers are not supported"
    if model_type == "mistral" and getattr(config, "sliding_window", None) is not None:
        return "sliding-window attention is not supported"
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") not in ("default", "linear", "llama3", "yarn"):
        return f"rope_type {rope.get('rope_type')!r} is not position-static"
    base = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if base is None or not all(hasattr(base, n) for n in needed) or not hasattr(model, "lm_head"):
        return "module layout is not <ForCausalLM>.model.{embed_tokens,layers,norm,rotary_emb} + lm_head"
    attn = base.layers[0].self_attn
    if any(hasattr(attn, n) for n in ("q_norm", "k_norm")):
        return "q/k norms (Qwen3-style) are not supported"
    if not allow_sharded and any_sharded(model):
        return "parameters are sharded DTensors (FSDP2): gather them first, or use the HF loop"
    return _rotary_reason(base.rotary_emb, config, base.embed_tokens.weight.device)


# rotary module -> (head_dim, device, its reason): the check runs the module, and it is asked
# at every training forward and sampling call (a few % of a small step), for the same answer
_ROTARY_REASONS: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _rotary_reason(rotary: nn.Module, config, device: torch.device) -> Optional[str]:
    """The decoder rotates (i, i + D/2) pairs of every head dimension by one angle, as
    ``rotate_half`` does: cos/sin must span the head and repeat their first half. Computed once
    per rotary module, head dimension and device."""
    head_dim = _head_dim(config)
    cached = _ROTARY_REASONS.get(rotary)
    if cached is not None and cached[:2] == (head_dim, device):
        return cached[2]
    reason = _measured_rotary_reason(rotary, head_dim, device)
    _ROTARY_REASONS[rotary] = (head_dim, device, reason)
    return reason


def _measured_rotary_reason(rotary: nn.Module, head_dim: int, device: torch.device) -> Optional[str]:
    with torch.no_grad():
        positions = torch.tensor([[1, 7]], device=device)
        cos, sin = rotary(torch.empty(0, dtype=torch.float32, device=device), positions)
    if cos.shape[-1] != head_dim:
        return f"partial rotary ({cos.shape[-1]} of {head_dim} head dims) is not supported"
    half = head_dim // 2
    if not (torch.equal(cos[..., :half], cos[..., half:]) and torch.equal(sin[..., :half], sin[..., half:])):
        return "the rotary embedding does not rotate (i, i + D/2) pairs by one angle"
    return None


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed
    DTensor = None


def _is_sharded(param: torch.Tensor) -> bool:
    """FSDP2 parameters are DTensors: reading them directly would see one shard."""
    return DTensor is not None and isinstance(param, DTensor)


def any_sharded(model: nn.Module) -> bool:
    """Whether any of ``model``'s parameters is a DTensor. A DTensor lives on a device mesh,
    which needs a process group: without one the walk over every parameter (at every training
    forward and sampling call) is skipped."""
    if DTensor is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return False
    return any(_is_sharded(p) for p in model.parameters())


def _pair_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorder each head's rows (or bias entries) 0, D/2, 1, D/2+1, ...: the dimensions
    that ``rotate_half`` rotates together become adjacent (re, im) pairs."""
    w = weight.reshape(num_heads, -1, *weight.shape[1:])
    half = w.shape[1] // 2
    paired = torch.stack([w[:, :half], w[:, half:]], dim=2)  # [heads, D/2, 2, ...]
    return paired.reshape(weight.shape)


def _scaled_gain(norm: nn.Module) -> torch.Tensor:
    """gain * sqrt(H) in float32: what multiplies ``_unit_rms``'s output to give rms_norm's."""
    return norm.weight.float() * norm.weight.shape[0] ** 0.5


def _fold_norm_gain(weight: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """W' = W * (gain * sqrt(H)) per input column, so that
    linear(rms_norm(x) * gain, W) == linear(x / sqrt(||x||^2 + H eps), W')."""
    return (weight.float() * _scaled_gain(norm)).to(weight.dtype)


def _bias_or_zeros(linear: nn.Linear) -> torch.Tensor:
    if linear.bias is not None:
        return linear.bias
    return linear.weight.new_zeros(linear.weight.shape[0])


def _norm_floor(norm: nn.Module) -> torch.Tensor:
    """sqrt(H eps) of an RMSNorm, as a float32 scalar tensor: ``_unit_rms``'s epsilon in
    units of ||x||."""
    eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
    return torch.tensor((norm.weight.shape[0] * eps) ** 0.5, device=norm.weight.device)


def _unit_rms(x: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """x / sqrt(||x||^2 + H eps) = rms_norm(x) / sqrt(H), statistics in float32; the gain
    and sqrt(H) live in the next matmul's weights (``_fold_norm_gain``).  Three kernels
    (hypot(n, c) = sqrt(n^2 + c^2)); F.rms_norm runs ~8 on CPU."""
    # out of place: the training forward (models/grouped_forward.py) runs this under autograd
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32).hypot(floor)
    if x.dtype == torch.float32:
        return x / norm
    return (x.float() / norm).to(x.dtype)


def _rope_(x: torch.Tensor, rotation: torch.Tensor) -> None:
    """Rotate x [..., D] (rows in ``_pair_rotary_rows`` order) in place by the complex
    ``rotation`` [..., D/2] (broadcast over heads)."""
    if x.dtype in (torch.float32, torch.float64):
        torch.view_as_complex(x.unflatten(-1, (-1, 2))).mul_(rotation)
    else:  # no complex bfloat16: rotate in float32, round once
        rotated = torch.view_as_complex(x.float().unflatten(-1, (-1, 2))) * rotation
        x.copy_(torch.view_as_real(rotated).flatten(-2))


@dataclass
class _Layer:
    floor1: torch.Tensor  # sqrt(H eps) of input_layernorm
    w_qkv: torch.Tensor  # [Nq + 2*Nkv, H]: q, k (rotary pairs adjacent), v; norm1 gain folded in
    b_qkv: Optional[torch.Tensor]
    w_o_t: torch.Tensor  # [Nq, H] transposed view, for addmm
    b_o: Optional[torch.Tensor]
    floor2: torch.Tensor  # sqrt(H eps) of post_attention_layernorm
    w_gate_up: torch.Tensor  # [2I, H], norm2 gain folded in
    b_gate_up: Optional[torch.Tensor]
    w_down_t: torch.Tensor  # [I, H] transposed view
    b_down: Optional[torch.Tensor]


def without_adapter_wrapper(model: nn.Module) -> nn.Module:
    """A PEFT-wrapped policy's Hugging Face model, its LoRA layers in place (``model`` itself
    otherwise): the layout the functional path reads."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def effective_weight(layer: nn.Module) -> torch.Tensor:
    """The weight a linear or embedding layer applies: its own, or for a LoRA layer (PEFT) its
    base weight plus each active adapter's update scale * B @ A (an embedding's: scale *
    (B @ A)^T, [vocab, H]), computed out of place (merging into the base and back would round
    the base weights at every rollout), so that the adapter gets its gradient through it."""
    delta = getattr(layer, "get_delta_weight", None)
    if delta is None or layer.merged or layer.disable_adapters:
        return layer.weight
    weight = layer.base_layer.weight
    for name in layer.active_adapters:
        if name in layer.lora_A or name in layer.lora_embedding_A:
            weight = weight + delta(name).to(weight.dtype)
    return weight


def base_layer(layer: nn.Module) -> nn.Module:
    """The plain torch layer under a LoRA layer (PEFT), ``layer`` itself otherwise: where the
    layer's own settings (an embedding's padding_idx) live."""
    get_base_layer = getattr(layer, "get_base_layer", None)
    return get_base_layer() if callable(get_base_layer) else layer


class DecoderWeights:
    """The model's weights as the functional forwards read them. The embedding, the final norm,
    the LM head and the shapes are read at construction; each decoder layer's fused weights
    (`_Layer`) are built by `fuse` from its module (`blocks`), when a forward needs them: the
    grouped forward fuses one layer at a time, inside that layer's step, so that a layer's
    fused copy lives only as long as that layer needs it (and FSDP2 has gathered the layer's
    weights for the step)."""

    def __init__(self, model: nn.Module, *, allow_sharded: bool = True):
        reason = unsupported_reason(model, allow_sharded=allow_sharded)
        if reason is not None:
            raise ValueError(f"the functional decode path cannot run this model: {reason}")
        config = model.config
        base = model.model
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = _head_dim(config)
        # the embedding and the LM head with their LoRA updates, when model.lora targets them
        self.embed = effective_weight(base.embed_tokens)
        self.embed_padding_idx = base_layer(base.embed_tokens).padding_idx  # its row gets no gradient
        self.final_gain = _scaled_gain(base.norm).to(base.norm.weight.dtype)  # lm_head is not copied
        self.final_floor = _norm_floor(base.norm)
        self.lm_head = effective_weight(model.lm_head)
        self.lm_head_bias = getattr(model.lm_head, "bias", None)
        self.rotary = base.rotary_emb
        self.blocks = list(base.layers[: config.num_hidden_layers])  # the decoder layer modules

    def fuse(self, layer: nn.Module) -> _Layer:
        """One decoder layer's weights, regrouped (see the module docstring): a differentiable
        copy of its q/k/v and gate/up projections."""
        attn, mlp = layer.self_attn, layer.mlp
        hq, hkv = self.num_heads, self.num_kv_heads
        projs = (attn.q_proj, attn.k_proj, attn.v_proj)
        wq, wk, wv = (effective_weight(p) for p in projs)
        w_qkv = torch.cat([_pair_rotary_rows(wq, hq), _pair_rotary_rows(wk, hkv), wv])
        b_qkv = None
        if any(p.bias is not None for p in projs):
            bq, bk, bv = (_bias_or_zeros(p) for p in projs)
            b_qkv = torch.cat([_pair_rotary_rows(bq, hq), _pair_rotary_rows(bk, hkv), bv])
        w_gate_up = torch.cat([effective_weight(mlp.gate_proj), effective_weight(mlp.up_proj)])
        b_gate_up = None
        if mlp.gate_proj.bias is not None or mlp.up_proj.bias is not None:
            b_gate_up = torch.cat([_bias_or_zeros(mlp.gate_proj), _bias_or_zeros(mlp.up_proj)])
        return _Layer(
            floor1=_norm_floor(layer.input_layernorm),
            w_qkv=_fold_norm_gain(w_qkv, layer.input_layernorm),
            b_qkv=b_qkv,
            w_o_t=effective_weight(attn.o_proj).t(),
            b_o=attn.o_proj.bias,
            floor2=_norm_floor(layer.post_attention_layernorm),
            w_gate_up=_fold_norm_gain(w_gate_up, layer.post_attention_layernorm),
            b_gate_up=b_gate_up,
            w_down_t=effective_weight(mlp.down_proj).t(),
            b_down=mlp.down_proj.bias,
        )


class FusedWeights(DecoderWeights):
    """Every decoder layer fused once, for the sampler (see module docstring): whole weights
    only (not FSDP2 shards).

    Holds one extra copy of the q/k/v/gate/up projections, for the duration of one
    ``generate`` call. With ``dtype`` (the sampler's own precision, ``rollout.dtype``) every
    weight the decoder reads is a copy in that dtype, rounded once from the model's: a
    bfloat16 sampler for a float32 policy, as an inference engine would hold it.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype | None = None):
        super().__init__(model, allow_sharded=False)
        self.layers = [self.fuse(layer) for layer in self.blocks]
        if dtype is not None and dtype != self.embed.dtype:
            self.cast_to(dtype)

    def cast_matmul_weights(self, dtype: torch.dtype) -> None:
        """The matmuls' weights (q/k/v, o, gate/up, down, the LM head) in ``dtype``, the rest as
        it is: what autocast would cast them to at every call, cast once. Under autocast the
        decoder computes exactly what it did with the float32 weights (autocast leaves a weight
        already in its dtype alone), without re-casting the model at every decode step."""
        self.lm_head = self.lm_head.to(dtype)  # a tied head becomes a copy: the embedding stays
        for layer in self.layers:
            _cast_layer_matmuls(layer, dtype)

    def cast_to(self, dtype: torch.dtype) -> None:
        """Every weight in ``dtype`` (the norms' floors stay float32 scalars); a tied LM head
        stays one tensor with the embedding."""
        def cast(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(dtype)

        tied = self.lm_head is self.embed
        self.embed = cast(self.embed)
        self.lm_head = self.embed if tied else cast(self.lm_head)
        self.lm_head_bias, self.final_gain = cast(self.lm_head_bias), cast(self.final_gain)
        for layer in self.layers:
            _cast_layer_matmuls(layer, dtype)
            for name in ("b_qkv", "b_o", "b_gate_up", "b_down"):
                setattr(layer, name, cast(getattr(layer, name)))


def _cast_layer_matmuls(layer: _Layer, dtype: torch.dtype) -> None:
    """A fused layer's matmul weights in ``dtype``. The transposed views (o, down) become the
    transposes of contiguous copies: addmm reads them as before."""
    layer.w_qkv, layer.w_gate_up = layer.w_qkv.to(dtype), layer.w_gate_up.to(dtype)
    layer.w_o_t = layer.w_o_t.t().to(dtype).t()
    layer.w_down_t = layer.w_down_t.t().to(dtype).t()


def prompt_group_size(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> int:
    """G if the batch is runs of G > 1 identical consecutive rows (ids and mask), all runs
    the same length -- what ``repeat_interleave(G)`` of the prompts gives; else 1.
    Reads the run lengths back (one sync on an accelerator)."""
    rows = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)
    _, run_lengths = torch.unique_consecutive(rows, dim=0, return_counts=True)
    lengths = set(run_lengths.tolist())
    return lengths.pop() if len(lengths) == 1 else 1


def real_token_positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that count real tokens only ([B, L] mask of a left-padded batch): left
    padding shifts no prompt, as in HF ``generate``. Pads get 0."""
    return (mask.long().cumsum(dim=1) - 1).clamp(min=0)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``allowed``, -inf elsewhere: added to attention scores before the softmax."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def prompt_attention_bias(prompt_mask: torch.Tensor, num_kv_heads: int, n_rep: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask of causal attention within left-padded prompts, in the layout of the
    grouped attention (the query heads of a kv head stacked as its queries, no repeat_kv):
    [rows * kv_heads, n_rep * P, P]. A pad query row would see no key at all (NaN): it sees itself."""
    rows, plen = prompt_mask.shape
    device = prompt_mask.device
    allowed = torch.ones(plen, plen, dtype=torch.bool, device=device).tril() & prompt_mask.bool()[:, None, :]
    allowed |= torch.eye(plen, dtype=torch.bool, device=device)
    bias = additive_mask(allowed, dtype)[:, None, None].expand(rows, num_kv_heads, n_rep, plen, plen)
    return bias.reshape(rows * num_kv_heads, n_rep * plen, plen)


# CPU softmax kernels vectorise the last dimension only from 16 elements on: below that they
# take a scalar path, ~3-9x slower per call (512 x 12 scores: 59 us; padded to 16: 22 us).
# Short rows (a decode step's first keys, a short prompt's) are padded with -inf, weight 0.
SOFTMAX_MIN_WIDTH = 16


def softmax_last(x: torch.Tensor) -> torch.Tensor:
    """softmax over the last dimension, padded to `SOFTMAX_MIN_WIDTH` columns on CPU."""
    width = x.shape[-1]
    if x.device.type != "cpu" or width >= SOFTMAX_MIN_WIDTH:
        return x.softmax(dim=-1)
    return F.pad(x, (0, SOFTMAX_MIN_WIDTH - width), value=float("-inf")).softmax(dim=-1)[..., :width]


def rotation(w: DecoderWeights, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e^{i theta p} per (position, rotary pair) [..., D/2], from HF's own rotary module, so
    every static RoPE variant (theta, llama3, yarn, attention scaling) matches.  HF's cos/sin
    repeat their first half: one angle per ``rotate_half`` pair. The module is given
    ``[1, positions]``, the [batch, sequence] shape of every transformers version's rotary
    modules (before 5.24 some index a second dimension)."""
    cos, sin = w.rotary(torch.empty(0, dtype=dtype, device=positions.device), positions.reshape(1, -1))
    cos, sin = (t.reshape(*positions.shape, t.shape[-1]) for t in (cos, sin))
    half = cos.shape[-1] // 2  # unsupported_reason checked that the halves repeat
    real = torch.float64 if dtype == torch.float64 else torch.float32
    return torch.complex(cos[..., :half].to(real), sin[..., :half].to(real))


def final_logits(w: DecoderWeights, h: torch.Tensor) -> torch.Tensor:
    """The final norm and the LM head."""
    return F.linear(_unit_rms(h, w.final_floor) * w.final_gain, w.lm_head, w.lm_head_bias)


class FunctionalDecoder:
    """Prefill a left-padded prompt batch once, then decode one token per row per ``step``.

    Holds the KV cache of exactly one batch: build a new one per ``generate`` call.
    """

    DECODES_WITH_SDPA = True  # where that is faster (see __init__); the fixed-shape step has its windows

    def __init__(self, model: nn.Module, batch_size: int, max_len: int, weights: FusedWeights | None = None,
                 dtype: torch.dtype | None = None):
        self.w = weights if weights is not None else FusedWeights(model, dtype)
        self.dtype = self.w.embed.dtype
        self.device = self.w.embed.device
        # under autocast (trainer.precision=bf16-mixed samples inside it) the projections run in
        # its dtype: the weights are cast to it once here, not by autocast at every step (about
        # half of a bf16 decode step on SmolLM2), and the keys and values come out in it, so the
        # cache and the masks hold that dtype too (else each step would cast the cache read so far)
        autocast = torch.is_autocast_enabled(self.device.type)
        self.cache_dtype = torch.get_autocast_dtype(self.device.type) if autocast else self.dtype
        # the dtype the matmuls' weights were cast to here (None: as given); weights loaded later
        # into this decoder are cast the same way
        self.matmul_dtype = self.cache_dtype if autocast and weights is None and self.cache_dtype != self.dtype else None
        if self.matmul_dtype is not None:
            self.w.cast_matmul_weights(self.matmul_dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = self.w.num_heads, self.w.num_kv_heads, self.w.head_dim
        self.n_rep = self.num_heads // self.num_kv_heads
        self.scale = self.head_dim**-0.5
        cache_shape = (len(self.w.layers), batch_size, self.num_kv_heads, max_len, self.head_dim)
        # On a CPU, bmm in bfloat16 / float16 copies a batch of matrices whose batch stride is not
        # their size, such as the cache's first `end` columns, before multiplying: the decode
        # attention read the cache twice (the copy was 62% of it: 16 rows x 3 kv heads, 180 of 238
        # columns, one thread, 417 us a layer). There the step runs SDPA's CPU kernel instead,
        # which reads the slice in place (SmolLM2's shapes, one thread, 16 rows: 216 us a layer
        # averaged over a 128-token decode, 504 us over 512, against 312 and 745 us for bmm over
        # the whole cache with its unwritten columns masked); float32's bmm reads a slice in place.
        self.sdpa_decode = (self.DECODES_WITH_SDPA and self.device.type == "cpu"
                            and self.cache_dtype in (torch.bfloat16, torch.float16))
        # empty: attention reads only the columns written so far (prefill: all P, pads included;
        # decode: each before it is read)
        self.k_cache = torch.empty(cache_shape, dtype=self.cache_dtype, device=self.device)
        self.v_cache = torch.empty(cache_shape, dtype=self.cache_dtype, device=self.device)
        self.k_layers = list(self.k_cache.unbind(0))  # per-layer views, indexed once
        self.v_layers = list(self.v_cache.unbind(0))
        self.batch_size = batch_size
        self.max_len = max_len
        self.length = 0  # cache columns filled so far
        self.step_index = 0

    def _rotation(self, positions: torch.Tensor) -> torch.Tensor:
        return rotation(self.w, positions, self.dtype)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return final_logits(self.w, h)

    # ------------------------------------------------------------------ prefill

    def prefill(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, all_logits: bool = False
    ) -> torch.Tensor:
        """Run the whole left-padded prompt in one batched call and fill the cache.

        Returns the next-token logits [B, V] (or [B, P, V] with ``all_logits``).  Also
        builds the per-step RoPE tables and the decode attention mask.

        When the rows come in runs of G identical prompts (online RL repeats each prompt
        ``group_size`` times), the forward runs on one row per run and its keys, values and
        logits are repeated G times: the same result (up to float rounding), G times less
        prefill work.
        """
        batch, plen = prompt_ids.shape
        if batch != self.batch_size or plen >= self.max_len:
            raise ValueError(f"prompt batch {tuple(prompt_ids.shape)} does not fit the cache")
        group = prompt_group_size(prompt_ids, prompt_mask)
        ids, rows_mask = prompt_ids[::group], prompt_mask[::group]  # one row per run
        rows = batch // group
        rotation = self._rotation(real_token_positions(rows_mask))[:, :, None, :]  # [rows, P, 1 (heads), D/2]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        attn_bias = prompt_attention_bias(rows_mask, hkv, self.n_rep, self.dtype)  # [rows * kv_heads, n_rep * P, P]
        nqk = (hq + hkv) * d

        def to_batch(x: torch.Tensor) -> torch.Tensor:
            """[rows, ...] -> [B, ...]: each run's row, repeated for every row of its run."""
            return x if group == 1 else x.repeat_interleave(group, dim=0)

        h = F.embedding(ids, self.w.embed)
        for layer, k_cache, v_cache in zip(self.w.layers, self.k_layers, self.v_layers):
            out = F.linear(_unit_rms(h, layer.floor1), layer.w_qkv, layer.b_qkv)
            qk = out[..., :nqk].unflatten(-1, (hq + hkv, d))
            _rope_(qk, rotation)
            q = qk[:, :, :hq].transpose(1, 2)  # [rows, Hq, P, D]
            k = qk[:, :, hq:].transpose(1, 2)
            v = out[..., nqk:].unflatten(-1, (hkv, d)).transpose(1, 2)
            k_cache[:, :, :plen] = to_batch(k)
            v_cache[:, :, :plen] = to_batch(v)
            # explicit attention, the query heads of a kv head stacked as its queries (no
            # repeat_kv): on short prompts ~10x cheaper on CPU than SDPA's flash kernel
            scores = torch.baddbmm(attn_bias, q.reshape(rows * hkv, -1, d), k.reshape(rows * hkv, plen, d).transpose(1, 2),
                                   alpha=self.scale)
            a = torch.bmm(softmax_last(scores), v.reshape(rows * hkv, plen, d))
            a = a.view(rows, hq, plen, d).transpose(1, 2).reshape(rows, plen, hq * d)
            h = h + F.linear(a, layer.w_o_t.t(), layer.b_o)
            gate, up = F.linear(_unit_rms(h, layer.floor2), layer.w_gate_up, layer.b_gate_up).chunk(2, -1)
            h = h + F.linear(F.silu(gate) * up, layer.w_down_t.t(), layer.b_down)
        self.length = plen
        self.step_index = 0

        # Decode-time tables, built once.  RoPE of row b at step t sits at [t, b]
        # (position = number of real prompt tokens + t).
        steps = self.max_len - plen
        real_len = prompt_mask.long().sum(dim=1)
        step_pos = real_len[None, :] + torch.arange(steps, device=self.device)[:, None]  # [T, B]
        self.step_rotation = self._rotation(step_pos)[:, :, None, :].contiguous()  # [T, B, 1, D/2]
        # additive key mask hiding the left padding, in the [B * kv_heads, 1, S] layout
        # of the decode attention's baddbmm (a generated column is visible once written)
        key_ok = torch.ones(batch, self.max_len, dtype=torch.bool, device=self.device)
        key_ok[:, :plen] = prompt_mask.bool()
        self.decode_mask = additive_mask(key_ok, self.cache_dtype).repeat_interleave(hkv, dim=0)[:, None, :].contiguous()

        return to_batch(self._logits(h if all_logits else h[:, -1]))

    # ------------------------------------------------------------------ decode

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row ([B] long), return the next-token logits [B, V]."""
        col = self.length
        if col >= self.max_len:
            raise RuntimeError("KV cache is full")
        end = col + 1
        rotation = self.step_rotation[self.step_index]
        mask = self.decode_mask[..., :end]
        hq, hkv, d, n_rep, s = self.num_heads, self.num_kv_heads, self.head_dim, self.n_rep, self.max_len
        nqk = (hq + hkv) * d
        batch = tokens.shape[0]

        h = F.embedding(tokens, self.w.embed)  # [B, H]
        for layer, k_cache, v_cache in zip(self.w.layers, self.k_layers, self.v_layers):
            out = F.linear(_unit_rms(h, layer.floor1), layer.w_qkv, layer.b_qkv)
            qk = out[:, :nqk].view(batch, hq + hkv, d)
            _rope_(qk, rotation)
            k_cache[:, :, col] = qk[:, hq:]
            v_cache[:, :, col] = out[:, nqk:].view(batch, hkv, d)
            if self.sdpa_decode:  # a kv head's query heads are its n_rep queries, as below
                a = F.scaled_dot_product_attention(qk[:, :hq].view(batch, hkv, n_rep, d), k_cache[:, :, :end],
                                                   v_cache[:, :, :end], attn_mask=mask.view(batch, hkv, 1, end),
                                                   scale=self.scale)
            else:
                q = qk[:, :hq].reshape(batch * hkv, n_rep, d)
                keys = k_cache.view(batch * hkv, s, d)[:, :end]
                scores = torch.baddbmm(mask, q, keys.transpose(1, 2), alpha=self.scale)
                a = torch.bmm(softmax_last(scores), v_cache.view(batch * hkv, s, d)[:, :end])
            h = torch.addmm(h, a.reshape(batch, hq * d), layer.w_o_t)
            if layer.b_o is not None:
                h += layer.b_o
            gate_up = F.linear(_unit_rms(h, layer.floor2), layer.w_gate_up, layer.b_gate_up)
            inter = gate_up.shape[1] // 2
            act = F.silu(gate_up[:, :inter], inplace=True).mul_(gate_up[:, inter:])
            h = torch.addmm(h, act, layer.w_down_t)
            if layer.b_down is not None:
                h += layer.b_down
        self.length = end
        self.step_index += 1
        return self._logits(h)
