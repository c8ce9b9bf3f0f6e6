"""The fused sampler under autocast (trainer.precision=bf16-mixed samples inside it) casts the
matmuls' weights once, not at every decode step, and computes exactly what it did before."""

from __future__ import annotations

import torch
import transformers

from posttrain.models.functional import FunctionalDecoder, FusedWeights


def _llama():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=72, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                                      attention_bias=True)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _decoded(decoder, ids, mask, steps=8):
    logits = [decoder.prefill(ids, mask)]
    for _ in range(steps):
        logits.append(decoder.step(logits[-1].argmax(-1)))
    return torch.stack(logits)


def test_under_autocast_the_weights_and_cache_are_in_its_dtype_and_the_logits_unchanged():
    model = _llama()
    ids = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(1)).repeat_interleave(2, 0)
    mask = torch.ones_like(ids)
    mask[2:, :2] = 0  # left padding on the second prompt
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        cast_once = FunctionalDecoder(model, 4, 20)
        # handed float32 weights, the decoder leaves them as they are: autocast casts them per call
        per_call = FunctionalDecoder(model, 4, 20, weights=FusedWeights(model))
        got, expected = _decoded(cast_once, ids, mask), _decoded(per_call, ids, mask)
    assert cast_once.w.layers[0].w_qkv.dtype == torch.bfloat16 and cast_once.w.lm_head.dtype == torch.bfloat16
    assert per_call.w.layers[0].w_qkv.dtype == torch.float32
    assert cast_once.w.embed.dtype == torch.float32  # the embedding (and the tied head's source) stays
    assert cast_once.k_cache.dtype == cast_once.decode_mask.dtype == torch.bfloat16
    assert torch.equal(got, expected)


def test_without_autocast_nothing_is_cast():
    model = _llama()
    decoder = FunctionalDecoder(model, 2, 10)
    assert decoder.w.layers[0].w_qkv.dtype == decoder.k_cache.dtype == torch.float32
    assert decoder.w.lm_head is decoder.w.embed  # still tied: one tensor


def test_a_kept_decoder_is_reused_under_autocast_with_its_weights_cast_alike():
    """The fixed-shape decoder kept between calls (rollout.cuda_graphs) reloads the model's weights
    at every call: under autocast they are cast as at its construction, so it is reused, not
    rebuilt (on CUDA a rebuild would capture its graphs again)."""
    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.fast import FastSampler

    model = _llama()
    ids = torch.randint(3, 64, (4, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    params = SamplingParams(max_new_tokens=5, greedy=True)
    sampler = FastSampler(cuda_graphs=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        first = sampler.generate(model, ids, mask, params, 999, 0)
        kept = sampler._decoders.kept[-1]
        second = sampler.generate(model, ids, mask, params, 999, 0)
    assert sampler._decoders.kept == [kept] and kept.w.layers[0].w_qkv.dtype == torch.bfloat16
    assert torch.equal(first.response_ids, second.response_ids) and torch.equal(first.logprobs, second.logprobs)


def _forced(decoder, ids, mask, tokens):
    """Logits of a prefill and one decode step per column of ``tokens`` [B, S] (teacher-forced)."""
    logits = [decoder.prefill(ids, mask)]
    for column in tokens.t():
        logits.append(decoder.step(column))
    return torch.stack(logits).float()


def test_a_bf16_decode_step_on_the_cpu_runs_sdpa_on_the_written_columns(monkeypatch):
    """On a CPU a bf16 decode step runs SDPA on the cache's written columns (bmm would copy the
    slice first): the logits are those of the bmm attention up to bf16 rounding, at every step of
    a left-padded batch, and the columns beyond the step are never read."""
    model = _llama()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 64, (4, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    tokens = torch.randint(3, 64, (4, 12), generator=g)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        sdpa = FunctionalDecoder(model, 4, 20)
        sdpa.k_cache.fill_(float("nan"))  # an unwritten column that were read would poison every logit
        sdpa.v_cache.fill_(float("nan"))
        got = _forced(sdpa, ids, mask, tokens)
        monkeypatch.setattr(FunctionalDecoder, "DECODES_WITH_SDPA", False)
        bmm = FunctionalDecoder(model, 4, 20)
        expected = _forced(bmm, ids, mask, tokens)
    assert sdpa.sdpa_decode and not bmm.sdpa_decode
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, atol=3e-2, rtol=3e-2)
    # the padding mask reaches SDPA: unmasked, row 1's left pads change its logits
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        monkeypatch.setattr(FunctionalDecoder, "DECODES_WITH_SDPA", True)
        unmasked = FunctionalDecoder(model, 4, 20)
        unmasked.prefill(ids, mask)
        unmasked.decode_mask.zero_()
        step = unmasked.step(tokens[:, 0]).float()
    assert (step[1] - expected[1, 1]).abs().max() > 0.1
    torch.testing.assert_close(step[0], expected[1, 0], atol=3e-2, rtol=3e-2)


def test_a_float32_cache_reads_only_the_columns_written():
    decoder = FunctionalDecoder(_llama(), 2, 10)
    assert not decoder.sdpa_decode
