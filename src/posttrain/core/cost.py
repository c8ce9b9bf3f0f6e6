"""What a step costs, from the shapes alone: bytes held and floating-point operations done by
the pieces of an online-RL step (generation, scoring forwards, the update), and lower bounds on
their time on a device of given peak speed. Pure arithmetic on integers (no tensors): the
estimator (estimate/) puts the pieces together for a configured run.

The activation counts follow what this codebase's training forward saves for the backward
(models/grouped_forward.py), per token and decoder layer, in elements (counted on the autograd
graph of the tiny model: tests/estimate/test_estimate.py):

* ``4 H``: the inputs of the two RMS norms (the layer's input, the residual after attention)
  and their normalised outputs, which the q/k/v and gate/up matmuls read;
* ``5 q`` (q = heads x head_dim): the rotated queries, the padded queries and the output that
  the attention saves, the output's packed copy that the output projection reads, and the
  query part of the fused q/k/v output (kept whole because the values are a view of it);
* ``3 kv`` (kv = kv_heads x head_dim): the rotated keys and the key and value parts of that
  fused output;
* ``4 I``: the gate and up projections (one [.., 2I] tensor), the SiLU of the gate, and the
  product the down projection reads;
* per response row, the keys and values the attention reads: its prompt's and its own,
  ``2 kv (P + T)``.

Each unique prompt is computed once per group (the grouped forward), the responses per row.
Under autograd each layer's fused weights exist twice (the concatenation and its copy with the
norm gain folded in, both saved by their backward), `FUSED_COPIES_WITH_GRAD`.
"""

from __future__ import annotations

from dataclasses import dataclass

# Elements saved for the backward per token and decoder layer, as multiples of the hidden size
# H, the query width q, the key/value width kv and the MLP width I (module docstring).
SAVED_HIDDEN, SAVED_QUERY, SAVED_KV, SAVED_MLP = 4, 5, 3, 4
# Copies of a layer's fused q/k/v and gate/up weights the training forward keeps per layer.
FUSED_COPIES_WITH_GRAD = 2
# fp32 [chunk, V] buffers alive at once while the LM head's chunks are scored and their backward
# recomputed, at most: two float32 ones and the matmul's output (core/head_logprobs.py).
LOGIT_BUFFERS = 3
FLOAT32_BYTES = 4


@dataclass(frozen=True)
class DecoderShape:
    """A Llama/Qwen-style decoder: what its memory and FLOPs depend on."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @property
    def query_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim


def layer_matmul_parameters(shape: DecoderShape) -> int:
    """Weights of one decoder layer's matmuls: q, k, v, o and the MLP's gate, up and down."""
    h = shape.hidden
    return h * (shape.query_width + 2 * shape.kv_width) + shape.query_width * h + 3 * h * shape.intermediate


def matmul_parameters(shape: DecoderShape) -> int:
    """Weights a token's forward multiplies by: every layer's matmuls and the LM head (the
    embedding is a lookup, not a matmul)."""
    return shape.layers * layer_matmul_parameters(shape) + shape.vocab * shape.hidden


def fused_layer_parameters(shape: DecoderShape) -> int:
    """Elements of one layer's fused copies (q/k/v as one matrix, gate/up as one): made per
    layer by the sampler and by the training forward (models/functional.py's `fuse`)."""
    return shape.hidden * (shape.query_width + 2 * shape.kv_width) + shape.hidden * 2 * shape.intermediate


def kv_cache_bytes(shape: DecoderShape, rows: int, positions: int, dtype_bytes: int) -> int:
    """Keys and values of every layer for `rows` sequences of `positions` tokens."""
    return 2 * shape.layers * rows * positions * shape.kv_width * dtype_bytes


def saved_elements_per_token(shape: DecoderShape) -> int:
    """Elements one decoder layer saves for the backward per token (the attention's keys and
    values over a row aside)."""
    return (SAVED_HIDDEN * shape.hidden + SAVED_QUERY * shape.query_width + SAVED_KV * shape.kv_width
            + SAVED_MLP * shape.intermediate)


def forward_working_elements_per_token(shape: DecoderShape) -> int:
    """Elements per token a decoder layer holds at once in a forward without autograd, at its
    widest point, the MLP: the layer's input, the residual after attention and its normalised
    copy (3 H), the gate/up output (2 I), the SiLU of the gate and the product (2 I)."""
    return 3 * shape.hidden + 4 * shape.intermediate


def layer_activation_bytes(shape: DecoderShape, unique_prompts: int, prompt_tokens: int, rows: int,
                           response_tokens: int, dtype_bytes: int) -> int:
    """Bytes one decoder layer keeps for the backward over a micro-batch: `unique_prompts`
    prompts of `prompt_tokens` computed once, `rows` responses of `response_tokens`, each row
    attending over its prompt's keys and values and its own."""
    per_token = saved_elements_per_token(shape)
    prompt = unique_prompts * prompt_tokens * per_token
    response = rows * response_tokens * per_token + rows * (prompt_tokens + response_tokens) * 2 * shape.kv_width
    return (prompt + response) * dtype_bytes


def checkpointed_layer_bytes(shape: DecoderShape, unique_prompts: int, prompt_tokens: int, rows: int,
                             response_tokens: int, dtype_bytes: int) -> int:
    """Bytes one checkpointed layer keeps: only its input hidden states, recomputed from them
    in the backward."""
    return (unique_prompts * prompt_tokens + rows * response_tokens) * shape.hidden * dtype_bytes


def selective_layer_bytes(shape: DecoderShape, unique_prompts: int, prompt_tokens: int, rows: int,
                          response_tokens: int, dtype_bytes: int) -> int:
    """Bytes one selectively checkpointed layer keeps (distributed/recompute.py): per token its
    input (H), the fused q/k/v output (q + 2 kv), the attention's output (q), the output and
    down projections' outputs (2 H) and the gate/up output (2 I)."""
    per_token = 3 * shape.hidden + 2 * shape.query_width + 2 * shape.kv_width + 2 * shape.intermediate
    return (unique_prompts * prompt_tokens + rows * response_tokens) * per_token * dtype_bytes


def logit_chunk_bytes(vocab: int, scored_tokens: int, chunk_tokens: int, buffers: int = LOGIT_BUFFERS) -> int:
    """fp32 logits of the LM head applied chunk by chunk: `buffers` [chunk, V] tensors at once,
    a chunk being at most `chunk_tokens` positions."""
    return buffers * min(scored_tokens, chunk_tokens) * vocab * FLOAT32_BYTES


def forward_flops(shape: DecoderShape, unique_prompts: int, prompt_tokens: int, rows: int,
                  response_tokens: int) -> int:
    """FLOPs of one scoring forward: 2 per matmul weight per token (prompts once per group,
    responses per row), plus causal attention, 2 x 2 q per (query, key) pair (scores and the
    weighted sum)."""
    tokens = unique_prompts * prompt_tokens + rows * response_tokens
    pairs = unique_prompts * causal_pairs(prompt_tokens) + rows * (response_tokens * prompt_tokens
                                                                    + causal_pairs(response_tokens))
    return 2 * matmul_parameters(shape) * tokens + 4 * shape.layers * shape.query_width * pairs


def causal_pairs(tokens: int) -> int:
    """(query, key) pairs of causal attention over `tokens` positions: n (n + 1) / 2."""
    return tokens * (tokens + 1) // 2


def training_flops(forward: int, checkpointed: bool | str) -> int:
    """Forward and backward: the backward costs two forwards (gradients of the inputs and of
    the weights); full checkpointing (True) runs the forward once more, "selective" only its
    elementwise ops (no matmul FLOPs)."""
    return (4 if checkpointed is True else 3) * forward


def generation_flops(shape: DecoderShape, unique_prompts: int, prompt_tokens: int, rows: int, new_tokens: int) -> int:
    """Prefill of each unique prompt once, then `new_tokens` decode steps of every row, each
    attending over the prompt and the tokens before it."""
    return forward_flops(shape, unique_prompts, prompt_tokens, rows, new_tokens)


def decode_bytes_read(weight_bytes: int, shape: DecoderShape, rows: int, prompt_tokens: int, new_tokens: int,
                      kv_dtype_bytes: int) -> int:
    """Bytes a generation reads from memory at least: the weights once per decode step, and at
    step t the keys and values of the P + t positions so far."""
    kv_per_position = kv_cache_bytes(shape, rows, 1, kv_dtype_bytes)
    positions_read = new_tokens * prompt_tokens + causal_pairs(new_tokens)
    return new_tokens * weight_bytes + kv_per_position * positions_read


def seconds_at_least(flops: int, peak_flops_per_s: float, bytes_read: int = 0, bandwidth: float = float("inf")) -> float:
    """A stage's time cannot be below the larger of its compute at peak speed and its memory
    traffic at peak bandwidth."""
    return max(flops / peak_flops_per_s, bytes_read / bandwidth)
