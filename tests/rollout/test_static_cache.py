"""The fixed-shape decode step of rollout/static_cache.py (`rollout.cuda_graphs`).

On the CPU the step runs eagerly (``FastSampler(cuda_graphs=True)``): these tests check that it
samples what the default eager step (``cuda_graphs=False``) samples, on the embedded tiny model
and on a Qwen2-shaped model with GQA and biases, with ragged prompts, rows that end at different
steps (EOS), the repetition stop, top-k / top-p with their kept support, and across the
attention windows. The tolerance: log-probs within 1e-5 in float32 (the two steps sum the same
attention terms in another order: the window adds masked columns of weight exactly 0), the
same tokens. The graph capture itself needs CUDA: the `gpu` tests at the end (``-m gpu``).
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers

from posttrain.models.functional import FunctionalDecoder
from posttrain.rollout import FastSampler, SamplingParams, build_rollout, engine_options
from posttrain.rollout.repetition import RepetitionRule
from posttrain.rollout.static_cache import (
    KEPT_DECODERS,
    PROMPT_BLOCK,
    StaticDecoder,
    pad_prompts_left,
    padded_prompt_width,
    window_sizes,
)

LOGPROB_ATOL = 1e-5  # float32: the same sums in another order


def _init(model_cls, config, seed=0):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return model_cls(config).eval()


@pytest.fixture(scope="module")
def tiny():
    """(tokenizer, model, prompt_ids, prompt_mask): the embedded tiny model (`model=tiny`, random
    init) and 12 arithmetic prompts of ragged lengths, left-padded."""
    from omegaconf import OmegaConf

    from posttrain.conf import CONFIG_DIR
    from posttrain.data.datamodule import collate_prompts
    from posttrain.data.sources import ArithmeticSource
    from posttrain.models.loading import load_tokenizer_and_model

    source = ArithmeticSource(min_digits=1, max_digits=3)  # operands of 1-3 digits: ragged prompts
    model_cfg = OmegaConf.load(Path(CONFIG_DIR) / "model" / "tiny.yaml")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        tokenizer, model = load_tokenizer_and_model(model_cfg, source.alphabet)
    prompts = collate_prompts([source.example("train", i) for i in range(12)], tokenizer)
    assert (prompts["prompt_mask"].sum(1) != prompts["prompt_mask"].shape[1]).any(), "test needs ragged prompts"
    return tokenizer, model.eval(), prompts["prompt_ids"], prompts["prompt_mask"]


@pytest.fixture(scope="module")
def qwen_gqa():
    """A Qwen2-shaped model: GQA (4 query / 2 kv heads), q/k/v biases, untied head, random norm
    gains and biases (the functional path folds the gains into its matmuls)."""
    config = transformers.Qwen2Config(vocab_size=48, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=96, max_position_embeddings=512,
                                      tie_word_embeddings=False)
    model = _init(transformers.Qwen2ForCausalLM, config, seed=2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            generator = torch.Generator().manual_seed(len(name))
            if name.endswith("bias"):
                p.normal_(0.0, 0.1, generator=generator)
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5, generator=generator)
        model.lm_head.weight.mul_(4.0)  # peaked: greedy rows differ, some tokens end rows often
    return model


def _ragged(vocab, pads, plen, seed=0, pad_id=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (len(pads), plen), generator=g)
    mask = torch.ones_like(ids)
    for row, n in enumerate(pads):
        ids[row, :n] = pad_id
        mask[row, :n] = 0
    return ids, mask


def _frequent_token(model, prompt_ids, prompt_mask, budget) -> int:
    """A token (not 0) that ends some rows early and not others: the one whose share of a
    sampled batch is nearest 1 / budget."""
    out = FastSampler(cuda_graphs=False).generate(model, prompt_ids, prompt_mask, SamplingParams(max_new_tokens=budget),
                                                  -1, 0, generator=torch.Generator(prompt_ids.device).manual_seed(1))
    freq = torch.bincount(out.response_ids.flatten(), minlength=model.config.vocab_size).double()
    freq = freq / freq.sum()
    freq[0] = float("inf")
    return int((freq - 1.0 / budget).abs().argmin())


def _stop_token(model, prompt_ids, prompt_mask, params) -> int:
    """A token (not 0) that, as the EOS, ends the rows of this call at the most different steps
    (never, for some): read off a run without an EOS."""
    out = FastSampler(cuda_graphs=False).generate(model, prompt_ids, prompt_mask, params, -1, 0,
                                                  generator=torch.Generator(prompt_ids.device).manual_seed(0))
    budget = out.response_ids.shape[1]
    best, best_count = 1, -1
    for token in range(1, model.config.vocab_size):
        hits = out.response_ids == token
        first = torch.where(hits.any(1), hits.float().argmax(1), torch.full_like(hits[:, 0], budget, dtype=torch.long))
        ends = set(first.tolist())
        count = len(ends) + (len(ends) > 1 and budget in ends)  # rather a token some rows never reach
        if count > best_count:
            best, best_count = token, count
    return best


def _both(model, prompt_ids, prompt_mask, params, eos, pad=0, seed=0):
    """(eager, static) rollouts of the same call, each from a generator seeded alike."""
    outs = []
    for cuda_graphs in (False, True):
        sampler = FastSampler(cuda_graphs=cuda_graphs)
        outs.append(sampler.generate(model, prompt_ids, prompt_mask, params, eos, pad,
                                     generator=torch.Generator(prompt_ids.device).manual_seed(seed)))
    return outs


def _assert_same(eager, static):
    for field in ("response_ids", "response_mask", "truncated", "repeated", "support_size"):
        a, b = getattr(eager, field), getattr(static, field)
        assert (a is None and b is None) or torch.equal(a, b), field
    torch.testing.assert_close(static.logprobs, eager.logprobs, atol=LOGPROB_ATOL, rtol=0)
    if eager.support_logprobs is not None:
        torch.testing.assert_close(static.support_logprobs, eager.support_logprobs, atol=LOGPROB_ATOL, rtol=0)


# ---------------------------------------------------------------- the same rollouts as the eager step

PARAMS = {
    "greedy": SamplingParams(max_new_tokens=24, greedy=True),
    "sampled": SamplingParams(max_new_tokens=24, temperature=1.0),
    "T0.7-topk5-topp0.9-support": SamplingParams(max_new_tokens=24, temperature=0.7, top_k=5, top_p=0.9,
                                                 return_support=True),
}


@pytest.mark.parametrize("params", list(PARAMS.values()), ids=list(PARAMS))
def test_the_tiny_model_samples_the_same_rollouts(tiny, params):
    tokenizer, model, prompt_ids, prompt_mask = tiny
    # the random model rarely emits its EOS: end rows on the token that ends them at the most different steps
    eos = [tokenizer.eos_token_id, _stop_token(model, prompt_ids, prompt_mask, params)]
    eager, static = _both(model, prompt_ids, prompt_mask, params, eos, tokenizer.pad_token_id)
    _assert_same(eager, static)
    if not params.greedy:  # greedy, the random tiny model writes one token forever (ragged EOS: the Qwen2 tests)
        assert len(set(eager.response_lengths().tolist())) > 1, "test needs rows ending at different steps"


@pytest.mark.parametrize("params", list(PARAMS.values()), ids=list(PARAMS))
def test_a_qwen2_shaped_model_samples_the_same_rollouts(qwen_gqa, params):
    prompt_ids, prompt_mask = _ragged(48, (0, 3, 1, 5, 2, 0, 4, 1), 9)
    eos = _stop_token(qwen_gqa, prompt_ids, prompt_mask, params)
    eager, static = _both(qwen_gqa, prompt_ids, prompt_mask, params, eos)
    _assert_same(eager, static)
    ended = ~eager.truncated
    assert ended.any() and (~ended).any(), "test needs rows that end at an EOS and rows that run to the budget"
    assert len(set(eager.response_lengths()[ended].tolist())) > 1, "test needs rows ending at different steps"


def test_prompt_groups_share_their_prefill_on_both_paths(qwen_gqa):
    """Runs of G identical prompts (online RL's groups), prefilled once per prompt."""
    prompt_ids, prompt_mask = (x.repeat_interleave(4, dim=0) for x in _ragged(48, (0, 2, 5), 7, seed=3))
    params = SamplingParams(max_new_tokens=16, temperature=0.8, top_k=8)
    _assert_same(*_both(qwen_gqa, prompt_ids, prompt_mask, params, 5, seed=4))


def test_decoding_across_several_attention_windows(qwen_gqa):
    """A budget of 150 tokens after a prompt padded to 64 columns crosses the windows 128, 192
    and 214: the same tokens at every step."""
    prompt_ids, prompt_mask = _ragged(48, (0, 6, 2), 10, seed=5)
    params = SamplingParams(max_new_tokens=150, temperature=1.0)
    eager, static = _both(qwen_gqa, prompt_ids, prompt_mask, params, 999)  # no EOS: every row to the budget
    assert eager.truncated.all()
    _assert_same(eager, static)
    assert window_sizes(PROMPT_BLOCK + 150) == [64, 128, 192, 214]


def test_the_repetition_stop_cuts_and_flags_the_same_rows(qwen_gqa):
    prompt_ids, prompt_mask = _ragged(48, (0, 1, 2, 0, 0, 1, 3, 0), 5, seed=6)
    with torch.no_grad():
        model = copy.deepcopy(qwen_gqa)
        model.lm_head.weight.mul_(3.0)  # greedy decoding on a very peaked model falls into loops
    params = SamplingParams(max_new_tokens=40, greedy=True, repetition=RepetitionRule(ngram=4, window=8))
    eos = _stop_token(model, prompt_ids, prompt_mask, params)
    eager, static = _both(model, prompt_ids, prompt_mask, params, eos)
    _assert_same(eager, static)
    assert eager.repeated.any(), "test needs looping rows"


def test_a_bfloat16_sampler_takes_the_same_greedy_tokens(qwen_gqa):
    """rollout.dtype=bfloat16 on an fp32 policy: both paths decode with the same bf16 weights;
    their log-probs agree to bf16's rounding."""
    prompt_ids, prompt_mask = _ragged(48, (0, 3, 1, 5), 9, seed=7)
    params = SamplingParams(max_new_tokens=12, greedy=True, weights_dtype=torch.bfloat16)
    eager, static = _both(qwen_gqa, prompt_ids, prompt_mask, params, 999)
    assert torch.equal(eager.response_ids, static.response_ids)
    torch.testing.assert_close(static.logprobs, eager.logprobs, atol=0.05, rtol=0)


# ---------------------------------------------------------------- kept between calls

def test_a_kept_decoder_is_reused_and_reads_the_current_weights(qwen_gqa):
    """The second call with the same shapes reuses the decoder; an update between the calls, in
    place or by a new tensor, is what it samples from (never stale weights)."""
    model = copy.deepcopy(qwen_gqa)
    prompt_ids, prompt_mask = _ragged(48, (0, 2, 4), 6, seed=8)
    params = SamplingParams(max_new_tokens=10, greedy=True)
    sampler = FastSampler(cuda_graphs=True)
    first = sampler.generate(model, prompt_ids, prompt_mask, params, 999, 0)
    decoder = sampler._decoders.kept[-1]
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(-3.0)  # in place
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.roll(1, dims=0))  # a new tensor
    second = sampler.generate(model, prompt_ids, prompt_mask, params, 999, 0)
    assert sampler._decoders.kept == [decoder]
    expected = FastSampler(cuda_graphs=False).generate(model, prompt_ids, prompt_mask, params, 999, 0)
    assert not torch.equal(first.response_ids, expected.response_ids), "the update must change the rollout"
    _assert_same(expected, second)


def test_a_lora_policy_samples_alike_and_its_adapter_updates_reach_the_kept_decoder(qwen_gqa):
    """model.lora: the fused weights hold base + adapter; a kept decoder re-fuses them each call."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(qwen_gqa), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    prompt_ids, prompt_mask = _ragged(48, (0, 2, 4), 6, seed=14)
    params = SamplingParams(max_new_tokens=10, greedy=True)
    eager, static = _both(model, prompt_ids, prompt_mask, params, 999)
    _assert_same(eager, static)
    sampler = FastSampler(cuda_graphs=True)
    first = sampler.generate(model, prompt_ids, prompt_mask, params, 999, 0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(-2.0)
    second = sampler.generate(model, prompt_ids, prompt_mask, params, 999, 0)
    expected = FastSampler(cuda_graphs=False).generate(model, prompt_ids, prompt_mask, params, 999, 0)
    assert not torch.equal(first.response_ids, expected.response_ids), "the update must change the rollout"
    assert len(sampler._decoders.kept) == 1
    _assert_same(expected, second)


def test_other_shapes_get_their_own_decoder_and_few_are_kept(qwen_gqa):
    sampler = FastSampler(cuda_graphs=True)
    params = SamplingParams(max_new_tokens=4, greedy=True)
    for batch in (2, 3, 4):
        sampler.generate(qwen_gqa, *_ragged(48, (0,) * batch, 5), params, 999, 0)
    assert [d.batch_size for d in sampler._decoders.kept] == [3, 4][-KEPT_DECODERS:]
    sampler.generate(qwen_gqa, *_ragged(48, (0, 0, 0, 0), PROMPT_BLOCK + 1), params, 999, 0)  # a wider prompt
    assert sampler._decoders.kept[-1].max_len == 2 * PROMPT_BLOCK + 4
    sampler.release()
    assert sampler._decoders.kept == []


def test_under_autocast_both_steps_sample_alike_and_decoders_are_not_shared_across_it(qwen_gqa):
    """bf16-mixed samples inside bf16 autocast: the fixed-shape step computes what the eager step
    does there; a decoder kept from an autocast call is not reused outside autocast (a graph
    would replay the casts it captured)."""
    prompt_ids, prompt_mask = _ragged(48, (0, 3, 1, 5), 9, seed=13)
    params = SamplingParams(max_new_tokens=10, greedy=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager, static = _both(qwen_gqa, prompt_ids, prompt_mask, params, 999)
    assert torch.equal(eager.response_ids, static.response_ids)
    torch.testing.assert_close(static.logprobs, eager.logprobs, atol=0.05, rtol=0)
    sampler = FastSampler(cuda_graphs=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sampler.generate(qwen_gqa, prompt_ids, prompt_mask, params, 999, 0)
    under_autocast = sampler._decoders.kept[-1]
    plain = sampler.generate(qwen_gqa, prompt_ids, prompt_mask, params, 999, 0)
    assert sampler._decoders.kept[-1] is not under_autocast and len(sampler._decoders.kept) == 2
    _assert_same(FastSampler(cuda_graphs=False).generate(qwen_gqa, prompt_ids, prompt_mask, params, 999, 0), plain)


def test_a_sampler_is_pickled_without_its_kept_decoders(qwen_gqa):
    """A producer process gets the engine pickled: the kept decoders (tensors, a weak reference
    to the model) stay behind; the copy builds its own."""
    import pickle

    sampler = FastSampler(cuda_graphs=True)
    sampler.generate(qwen_gqa, *_ragged(48, (0, 1), 5), SamplingParams(max_new_tokens=3), 999, 0)
    assert len(sampler._decoders.kept) == 1
    for clone in (pickle.loads(pickle.dumps(sampler)), copy.deepcopy(sampler)):
        assert clone.cuda_graphs is True and clone._decoders.kept == []
    assert len(sampler._decoders.kept) == 1


def test_auto_falls_back_to_the_eager_step_when_a_capture_fails(qwen_gqa, monkeypatch, caplog):
    """rollout.cuda_graphs=auto: a failed capture is warned about once, and the call is sampled
    again by the eager step from the same generator state (as if graphs had been off); with
    cuda_graphs=true the error stands. (The capture is simulated: this runs on the CPU.)"""
    from posttrain.rollout.static_cache import GraphCaptureError

    def failing(*args, **kwargs):
        torch.rand(3, generator=args[-1])  # the failed attempt had drawn from the generator
        raise GraphCaptureError("window 128: simulated")

    prompt_ids, prompt_mask = _ragged(48, (0, 2, 1), 6, seed=12)
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    expected = FastSampler(cuda_graphs=False).generate(qwen_gqa, prompt_ids, prompt_mask, params, 999, 0,
                                                       generator=torch.Generator().manual_seed(3))
    sampler = FastSampler()
    monkeypatch.setattr(sampler, "cuda_graphs", "auto")
    monkeypatch.setattr(sampler, "_generate_static", failing)
    monkeypatch.setattr(FastSampler, "uses_static_cache", lambda self, device: not self._graphs_failed)
    with caplog.at_level("WARNING", logger="posttrain.rollout.fast"):
        out = sampler.generate(qwen_gqa, prompt_ids, prompt_mask, params, 999, 0,
                               generator=torch.Generator().manual_seed(3))
    assert "capturing the decode step as a CUDA graph failed" in caplog.text
    assert torch.equal(out.response_ids, expected.response_ids) and sampler._graphs_failed
    strict = FastSampler(cuda_graphs=True)
    monkeypatch.setattr(strict, "_generate_static", failing)
    with pytest.raises(GraphCaptureError, match="simulated"):
        strict.generate(qwen_gqa, prompt_ids, prompt_mask, params, 999, 0, generator=torch.Generator().manual_seed(3))


def test_the_eager_default_keeps_nothing_between_calls(qwen_gqa):
    sampler = FastSampler()  # auto: off on the CPU
    assert not sampler.uses_static_cache(torch.device("cpu"))
    sampler.generate(qwen_gqa, *_ragged(48, (0, 1), 5), SamplingParams(max_new_tokens=3), 999, 0)
    assert sampler._decoders.kept == []


def test_extra_left_padding_leaves_the_logits_unchanged(qwen_gqa):
    prompt_ids, prompt_mask = _ragged(48, (0, 3, 1), 7, seed=9)
    wide_ids, wide_mask = pad_prompts_left(prompt_ids, prompt_mask, padded_prompt_width(7), pad_token_id=0)
    assert wide_ids.shape == (3, PROMPT_BLOCK) and torch.equal(wide_ids[:, -7:], prompt_ids)
    with torch.inference_mode():
        narrow = FunctionalDecoder(qwen_gqa, 3, 9).prefill(prompt_ids, prompt_mask)
        wide = StaticDecoder(qwen_gqa, 3, PROMPT_BLOCK + 2).prefill(wide_ids, wide_mask)
    torch.testing.assert_close(wide, narrow, atol=LOGPROB_ATOL, rtol=0)


def test_window_sizes_cover_the_cache_in_few_blocks():
    assert window_sizes(64) == [64]
    assert window_sizes(100) == [64, 100]
    assert window_sizes(64 + 512) == [64 * k for k in range(1, 9)] + [576]
    long = window_sizes(8192 + 64)
    assert len(long) <= 17 and long[-1] == 8256 and all(b > a for a, b in zip(long, long[1:]))


# ---------------------------------------------------------------- the option

def test_the_option_is_declared_once_and_reaches_the_sampler():
    from omegaconf import OmegaConf

    from posttrain.config.check import SPECS
    from posttrain.conf import CONFIG_DIR

    spec = SPECS["rollout.cuda_graphs"]
    assert all(spec.accepts(v) for v in ("auto", True, False)) and not spec.accepts("yes") and not spec.accepts(1)
    fast_cfg = OmegaConf.load(Path(CONFIG_DIR) / "rollout" / "fast.yaml")
    assert fast_cfg.cuda_graphs == "auto"
    for value in ("auto", False, True):
        fast_cfg.cuda_graphs = value
        assert build_rollout("fast", **engine_options(fast_cfg)).cuda_graphs == value
    with pytest.raises(ValueError, match="cuda_graphs must be one of"):
        FastSampler(cuda_graphs="yes")


def test_a_bad_value_is_refused_before_anything_is_built():
    from omegaconf import OmegaConf

    from posttrain.config.check import check_config
    from posttrain.errors import ConfigError

    from conftest import compose_config

    cfg = compose_config(["algorithm=grpo", "rollout.cuda_graphs=false"])
    OmegaConf.resolve(cfg)
    check_config(cfg, {})
    cfg = compose_config(["algorithm=grpo", "rollout.cuda_graphs=yes"])
    OmegaConf.resolve(cfg)
    with pytest.raises(ConfigError, match="rollout.cuda_graphs='yes'"):
        check_config(cfg, {})


# ---------------------------------------------------------------- CUDA: the graphs themselves

@pytest.fixture(scope="module")
def qwen_cuda(qwen_gqa):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return copy.deepcopy(qwen_gqa).cuda()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_a_replayed_graph_computes_the_eager_step(qwen_cuda, dtype):
    """Every window's graph is captured; replaying one gives the logits of the same fixed-shape
    step run eagerly, and of the FunctionalDecoder's step, token after token."""
    prompt_ids, prompt_mask = (x.cuda() for x in _ragged(48, (0, 3, 1, 5), 9, seed=10))
    steps = 70  # crosses from the 128-column window into the last one (138)
    tokens = torch.randint(3, 48, (steps, 4), generator=torch.Generator().manual_seed(11)).cuda()
    with torch.inference_mode():
        width = padded_prompt_width(9)
        wide_ids, wide_mask = pad_prompts_left(prompt_ids, prompt_mask, width, 0)
        graphed = StaticDecoder(qwen_cuda, 4, width + steps, dtype=dtype, graphs=True)
        graphed.capture_all()
        assert graphed.captured_windows == window_sizes(width + steps) == [64, 128, 134]
        eager_static = StaticDecoder(qwen_cuda, 4, width + steps, dtype=dtype)
        reference = FunctionalDecoder(qwen_cuda, 4, 9 + steps, dtype=dtype)
        first = [d.prefill(i, m) for d, i, m in ((graphed, wide_ids, wide_mask), (eager_static, wide_ids, wide_mask),
                                                 (reference, prompt_ids, prompt_mask))]
        got, same_step, ref = [first[0]], [first[1]], [first[2]]
        for t in range(steps - 1):
            got.append(graphed.step(tokens[t]).clone())
            same_step.append(eager_static.step(tokens[t]))
            ref.append(reference.step(tokens[t]))
        torch.cuda.synchronize()
    got, same_step, ref = (torch.stack(x).float() for x in (got, same_step, ref))
    torch.testing.assert_close(got, same_step, atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=0)
    scale = ref.abs().max()
    assert (got - ref).abs().max() <= (1e-4 if dtype == torch.float32 else 0.02) * max(float(scale), 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_the_sampler_with_graphs_samples_what_the_eager_step_samples(qwen_cuda):
    prompt_ids, prompt_mask = (x.cuda() for x in _ragged(48, (0, 3, 1, 5, 2, 0, 4, 1), 9))
    eos = _frequent_token(qwen_cuda, prompt_ids, prompt_mask, 24)
    for params in PARAMS.values():
        params = replace(params, repetition=RepetitionRule(ngram=4, window=8))
        outs = []
        for cuda_graphs in (False, True):
            generator = torch.Generator(device="cuda").manual_seed(0)
            outs.append(FastSampler(cuda_graphs=cuda_graphs).generate(qwen_cuda, prompt_ids, prompt_mask, params, eos,
                                                                      0, generator=generator))
        assert torch.equal(outs[0].response_ids, outs[1].response_ids)
        torch.testing.assert_close(outs[1].logprobs, outs[0].logprobs, atol=1e-4, rtol=0)
    # bf16-mixed samples under bf16 autocast: the graphs capture its casts
    greedy = SamplingParams(max_new_tokens=24, greedy=True)
    outs = []
    for cuda_graphs in (False, True):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outs.append(FastSampler(cuda_graphs=cuda_graphs).generate(qwen_cuda, prompt_ids, prompt_mask, greedy, eos,
                                                                      0))
    same = (outs[0].response_ids == outs[1].response_ids).cumprod(dim=1).bool()
    assert same.float().mean() > 0.9  # bf16 rounding may break a near-tie late in a row
    assert (outs[0].logprobs - outs[1].logprobs)[same].abs().max() < 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_auto_captures_what_it_needs_once_and_replays_with_fresh_weights(qwen_cuda, monkeypatch):
    from posttrain.rollout import static_cache

    captures = []
    original = static_cache.StaticDecoder._capture
    monkeypatch.setattr(static_cache.StaticDecoder, "_capture",
                        lambda self, window: captures.append(window) or original(self, window))
    model = copy.deepcopy(qwen_cuda)
    prompt_ids, prompt_mask = (x.cuda() for x in _ragged(48, (0, 2, 4), 6, seed=8))
    params = SamplingParams(max_new_tokens=10, greedy=True)
    sampler = FastSampler()  # auto
    assert sampler.uses_static_cache(prompt_ids.device)
    sampler.generate(model, prompt_ids, prompt_mask, params, 999, 0)
    width = padded_prompt_width(6)
    assert captures == [w for w in window_sizes(width + 10) if w > width]  # those a step needed, once each
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(-3.0)
    second = sampler.generate(model, prompt_ids, prompt_mask, params, 999, 0)
    assert len(captures) == len([w for w in window_sizes(width + 10) if w > width]), "the second call captures none"
    expected = FastSampler(cuda_graphs=False).generate(model, prompt_ids, prompt_mask, params, 999, 0)
    assert torch.equal(second.response_ids, expected.response_ids)
    torch.testing.assert_close(second.logprobs, expected.logprobs, atol=1e-4, rtol=0)
