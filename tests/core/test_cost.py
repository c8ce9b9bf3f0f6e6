"""core/cost.py against values worked out by hand for a small decoder.

The shape: 2 layers, hidden 8, MLP 16, 2 query heads and 1 kv head of width 4, vocabulary 10;
so the query width q = 8 and the key/value width kv = 4."""

from __future__ import annotations

import pytest

from posttrain.core import cost
from posttrain.core.cost import DecoderShape

SHAPE = DecoderShape(layers=2, hidden=8, intermediate=16, heads=2, kv_heads=1, head_dim=4, vocab=10)


def test_parameter_counts():
    # q, k, v: 8x8 + 8x4 + 8x4 = 128; o: 8x8 = 64; gate, up, down: 3 x 8x16 = 384
    assert cost.layer_matmul_parameters(SHAPE) == 576
    assert cost.matmul_parameters(SHAPE) == 2 * 576 + 10 * 8  # and the LM head
    assert cost.fused_layer_parameters(SHAPE) == 128 + 8 * 32  # q/k/v and gate/up


def test_kv_cache_counts_keys_and_values_of_every_layer_row_and_position():
    # 2 (k, v) x 2 layers x 3 rows x 5 positions x 4 (kv width) x 2 bytes
    assert cost.kv_cache_bytes(SHAPE, rows=3, positions=5, dtype_bytes=2) == 480


def test_saved_activations_of_a_layer():
    # 4 H + 5 q + 3 kv + 4 I = 32 + 40 + 12 + 64
    assert cost.saved_elements_per_token(SHAPE) == 148
    # 1 prompt of 3 tokens once, 2 rows of 4 response tokens, each row's keys and values over
    # 3 + 4 positions: (3 x 148 + 8 x 148 + 2 x 7 x 2 x 4) elements of 4 bytes
    assert cost.layer_activation_bytes(SHAPE, 1, 3, 2, 4, 4) == (444 + 1184 + 112) * 4
    # checkpointed: the layer's input only, (3 + 8) tokens x 8
    assert cost.checkpointed_layer_bytes(SHAPE, 1, 3, 2, 4, 4) == 11 * 8 * 4
    # selective: and its matmuls' and attention's outputs, 3 H + 2 q + 2 kv + 2 I = 24 + 16 + 8 + 32
    assert cost.selective_layer_bytes(SHAPE, 1, 3, 2, 4, 4) == 11 * 80 * 4
    assert cost.forward_working_elements_per_token(SHAPE) == 3 * 8 + 4 * 16


def test_logit_chunks_hold_at_most_a_chunk_of_positions():
    assert cost.logit_chunk_bytes(vocab=10, scored_tokens=7, chunk_tokens=5, buffers=4) == 4 * 5 * 10 * 4
    assert cost.logit_chunk_bytes(vocab=10, scored_tokens=3, chunk_tokens=5, buffers=4) == 4 * 3 * 10 * 4


def test_flops():
    assert cost.causal_pairs(4) == 10
    # matmuls: 2 x 1232 weights x (3 prompt + 8 response tokens) = 27104; attention: 4 x 2 layers
    # x q 8 x (prompt 3 x 4 / 2 = 6 pairs + 2 rows x (4 x 3 prompt keys + 10 own pairs))
    assert cost.forward_flops(SHAPE, 1, 3, 2, 4) == 27104 + 64 * (6 + 44)
    assert cost.generation_flops(SHAPE, 1, 3, 2, 4) == cost.forward_flops(SHAPE, 1, 3, 2, 4)
    assert cost.training_flops(100, checkpointed=False) == 300
    assert cost.training_flops(100, checkpointed=True) == 400
    assert cost.training_flops(100, checkpointed="selective") == 300  # no matmul runs twice


def test_decode_reads_the_weights_every_step_and_the_cache_so_far():
    # 4 steps x 1000 weight bytes; k/v of one position over 2 rows: 2 x 2 x 2 x 4 x 2 = 64 bytes,
    # read at 4 x 3 prompt positions + 1 + 2 + 3 + 4 generated ones
    assert cost.decode_bytes_read(1000, SHAPE, rows=2, prompt_tokens=3, new_tokens=4, kv_dtype_bytes=2) == 4000 + 64 * 22


def test_a_stage_takes_at_least_its_compute_and_its_memory_traffic():
    assert cost.seconds_at_least(100, 10) == pytest.approx(10)
    assert cost.seconds_at_least(100, 10, bytes_read=1000, bandwidth=50) == pytest.approx(20)
    assert cost.seconds_at_least(1000, 10, bytes_read=1000, bandwidth=50) == pytest.approx(100)
