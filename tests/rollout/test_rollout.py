"""Behaviour of the generation engines (src/posttrain/rollout).

Sizes are tiny so the whole file runs in seconds on 2 CPU cores.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch
import transformers

from posttrain.rollout import ROLLOUT_ENGINES, FastSampler, HFSampler, SamplingParams, build_rollout
from posttrain.models.functional import FunctionalDecoder, unsupported_reason

ENGINES = sorted(ROLLOUT_ENGINES)  # ["fast", "hf"]


def _init(model_cls, config, seed=0):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return model_cls(config).eval()


@pytest.fixture(scope="module")
def qwen():
    """The project default tiny model (Qwen2-style, tied head)."""
    config = transformers.Qwen2Config(
        vocab_size=32,
        hidden_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=384,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    return _init(transformers.Qwen2ForCausalLM, config)


def _small_llama(seed=0, **overrides):
    """A 2-layer GQA Llama (4 query / 2 kv heads) with random biases and norm gains."""
    config = dict(
        vocab_size=40,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        max_position_embeddings=128,
    )
    config = transformers.LlamaConfig(**(config | overrides))
    return _with_random_biases_and_gains(_init(transformers.LlamaForCausalLM, config, seed=seed))


@pytest.fixture(scope="module")
def llama():
    """Untied head, GQA, biases everywhere, non-default RoPE theta."""
    return _small_llama(
        tie_word_embeddings=False,
        attention_bias=True,
        mlp_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    )


@pytest.fixture(scope="module")
def llama_yarn():
    """YaRN RoPE: scaled frequencies and an attention factor on cos/sin."""
    rope = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "attention_factor": 1.3}
    return _small_llama(seed=1, rope_parameters=rope | {"original_max_position_embeddings": 32})


def _with_random_biases_and_gains(model):
    """Random init zeroes biases and sets RMSNorm gains to 1; make both matter (the
    functional path folds the gains into the next matmul)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            generator = torch.Generator().manual_seed(len(name))
            if name.endswith("bias"):
                p.normal_(0.0, 0.5, generator=generator)
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5, generator=generator)
    return model


@pytest.fixture(scope="module")
def peaked():
    """Small vocab, untied head scaled up so next-token distributions are far from uniform
    (a distribution test on a near-uniform model would catch nothing)."""
    config = transformers.Qwen2Config(
        vocab_size=8,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = _init(transformers.Qwen2ForCausalLM, config, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)
    return model


def _left_padded(vocab, pads, plen, seed=0, pad_id=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (len(pads), plen), generator=g)
    mask = torch.ones_like(ids)
    for row, n in enumerate(pads):
        ids[row, :n] = pad_id
        mask[row, :n] = 0
    return ids, mask


# ---------------------------------------------------------------- 1. functional == HF forward


@pytest.mark.parametrize("arch", ["qwen", "llama", "llama_yarn"])
@pytest.mark.parametrize("pads", [(0, 3, 1, 5, 2), (0, 0, 0)])
@pytest.mark.parametrize("group", [1, 3])
def test_functional_logits_match_hf_forward(arch, pads, group, request):
    """Prefill (every prompt position) and decode equal the HF forward; with runs of `group`
    identical prompts the prefill runs once per prompt and is copied to the run's rows."""
    model = request.getfixturevalue(arch)
    assert unsupported_reason(model) is None
    plen, steps = 7, 6
    vocab = model.config.vocab_size
    prompt, prompt_mask = (x.repeat_interleave(group, dim=0) for x in _left_padded(vocab, pads, plen))
    cont = torch.randint(3, vocab, (len(prompt), steps), generator=torch.Generator().manual_seed(1))
    ids = torch.cat([prompt, cont], dim=1)
    mask = torch.cat([prompt_mask, torch.ones_like(cont)], dim=1)
    with torch.inference_mode():
        ref = model(ids, attention_mask=mask).logits
        decoder = FunctionalDecoder(model, len(prompt), plen + steps)
        prefill = decoder.prefill(prompt, prompt_mask, all_logits=True)
        decoded = [decoder.step(cont[:, t]) for t in range(steps - 1)]
    real = prompt_mask.bool()
    torch.testing.assert_close(prefill[real], ref[:, :plen][real], atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.stack(decoded, 1), ref[:, plen : plen + steps - 1], atol=1e-4, rtol=0)


def test_functional_logits_match_hf_forward_in_bfloat16(llama):
    """bf16 (no complex bfloat16: RoPE runs in float32 and rounds once).  Both forwards
    round differently, so each is measured against the float32 forward of the same
    weights: the functional path may err at most 1.5x as much as HF's own (it errs about as much)."""
    model = copy.deepcopy(llama)
    with torch.no_grad():  # peaked attention and logits, so positions (RoPE) move the logits
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
            layer.self_attn.k_proj.weight.mul_(6.0)
        model.lm_head.weight.mul_(20.0)
    model = model.to(torch.bfloat16)
    prompt, prompt_mask = _left_padded(model.config.vocab_size, (0, 2, 4), 6)
    cont = torch.randint(3, model.config.vocab_size, (3, 4), generator=torch.Generator().manual_seed(2))
    ids = torch.cat([prompt, cont], 1)
    mask = torch.cat([prompt_mask, torch.ones_like(cont)], 1)
    with torch.inference_mode():
        hf_bf16 = model(ids, attention_mask=mask).logits[:, 5:9].float()
        decoder = FunctionalDecoder(model, 3, 10)
        first = decoder.prefill(prompt, prompt_mask)
        functional = torch.stack([first] + [decoder.step(cont[:, t]) for t in range(3)], 1)
        exact = model.float()(ids, attention_mask=mask).logits[:, 5:9]
    assert functional.dtype == torch.bfloat16
    hf_error = (hf_bf16 - exact).abs().max()
    assert 0 < hf_error < 0.02 * exact.abs().max()  # bf16 rounding, on logits that vary
    assert (functional.float() - exact).abs().max() <= 1.5 * hf_error


class _EditedRotary(torch.nn.Module):
    """Wraps a model's rotary module and edits the cos/sin it returns."""

    def __init__(self, inner, edit):
        super().__init__()
        self.inner, self.edit = inner, edit

    def forward(self, x, positions):
        return tuple(self.edit(t) for t in self.inner(x, positions))


@pytest.mark.parametrize(
    "edit, reason",
    [
        (lambda t: t[..., : t.shape[-1] // 2], "partial rotary"),
        (lambda t: t * torch.arange(1, t.shape[-1] + 1), "does not rotate (i, i + D/2) pairs"),
    ],
    ids=["partial", "unpaired"],
)
def test_rotary_that_cannot_be_paired_is_left_to_the_hf_loop(edit, reason):
    model = _small_llama()
    assert unsupported_reason(model) is None
    model.model.rotary_emb = _EditedRotary(model.model.rotary_emb, edit)
    assert reason in unsupported_reason(model)
    assert not FastSampler().uses_functional_path(model)


def test_the_rotary_check_runs_once_per_rotary_module_and_nothing_is_sharded_without_a_process_group():
    """Asked at every training forward and sampling call, the check runs the rotary module once
    (then its cached answer); a new rotary module is checked anew (the test above)."""
    from posttrain.models.functional import any_sharded

    model = _small_llama()
    calls = []
    model.model.rotary_emb.register_forward_hook(lambda *args: calls.append(1))
    for _ in range(3):
        assert unsupported_reason(model) is None
    assert len(calls) == 1
    assert not torch.distributed.is_initialized() and not any_sharded(model)


def test_unsupported_architecture_uses_generic_loop_and_matches_hf_greedy():
    config = transformers.GPT2Config(vocab_size=16, n_embd=32, n_layer=2, n_head=2, n_positions=64)
    model = _init(transformers.GPT2LMHeadModel, config)
    assert unsupported_reason(model) is not None
    prompt, mask = _left_padded(16, (0, 0), 5)  # GPT-2 positions are absolute: no padding
    params = SamplingParams(max_new_tokens=6, greedy=True)
    fast = FastSampler().generate(model, prompt, mask, params, eos_token_id=1, pad_token_id=0)
    hf = HFSampler().generate(model, prompt, mask, params, eos_token_id=1, pad_token_id=0)
    assert torch.equal(fast.response_ids, hf.response_ids)
    torch.testing.assert_close(fast.logprobs, hf.logprobs, atol=1e-5, rtol=0)


# ---------------------------------------------------------------- 2. same distribution

SAMPLES_PER_PROMPT = 6000
DELTA = 1e-4


def _tv_tolerance(num_categories, n, delta=DELTA):
    """TV(empirical, true) <= E[TV] + eps with probability >= 1 - delta, where
    E[TV] <= 0.5 * sqrt((K - 1) / n) (Cauchy-Schwarz) and McDiarmid gives
    eps = sqrt(ln(1/delta) / (2 n)) since one sample moves TV by at most 1/n."""
    return 0.5 * math.sqrt((num_categories - 1) / n) + math.sqrt(math.log(1 / delta) / (2 * n))


def _exact_two_token_marginals(model, prompt, params):
    """P(first token) and P(second token), under the processed (sampling) distribution."""
    from posttrain.rollout import sampling_logits_processor

    vocab = model.config.vocab_size
    with torch.inference_mode():
        first_logits = model(prompt[None]).logits[0, -1]
        p1 = sampling_logits_processor(first_logits[None], params)[0].softmax(-1)[0]
        both = torch.cat([prompt.repeat(vocab, 1), torch.arange(vocab)[:, None]], dim=1)
        second_logits = model(both).logits[:, -1]
        p2_given_1 = sampling_logits_processor(second_logits, params)[0].softmax(-1)
    return p1.double(), (p1[:, None] * p2_given_1).sum(0).double()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=2),
        SamplingParams(max_new_tokens=2, temperature=0.7, top_k=4, top_p=0.8),
    ],
    ids=["plain", "T0.7-topk4-topp0.8"],
)
def test_fast_and_hf_sample_the_exact_distribution(peaked, params):
    vocab = peaked.config.vocab_size
    prompts = torch.tensor([[3, 5, 4], [6, 2, 7]])
    n = SAMPLES_PER_PROMPT
    ids = prompts.repeat_interleave(n, dim=0)
    mask = torch.ones_like(ids)
    tol = _tv_tolerance(vocab, n)
    counts = {}
    for seed, name in enumerate(ENGINES):
        out = build_rollout(name).generate(
            peaked, ids, mask, params, eos_token_id=99, pad_token_id=0, generator=torch.Generator().manual_seed(seed)
        )
        assert out.truncated.all()  # EOS 99 is never produced
        counts[name] = out.response_ids
    for p, prompt in enumerate(prompts):
        exact = _exact_two_token_marginals(peaked, prompt, params)
        rows = slice(p * n, (p + 1) * n)
        for position in (0, 1):
            freqs = {}
            for name in ENGINES:
                tokens = counts[name][rows, position]
                freqs[name] = torch.bincount(tokens, minlength=vocab).double() / n
                tv = 0.5 * (freqs[name] - exact[position]).abs().sum().item()
                assert tv < tol, f"{name} prompt {p} token {position}: TV {tv:.4f} >= {tol:.4f}"
                # a dropped token (probability exactly 0) is never sampled
                assert (freqs[name][exact[position] == 0] == 0).all()
            tv_engines = 0.5 * (freqs["fast"] - freqs["hf"]).abs().sum().item()
            assert tv_engines < 2 * tol


# ---------------------------------------------------------------- 3. logprobs


@pytest.mark.parametrize("name", ENGINES)
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 0.9)])
def test_logprobs_equal_teacher_forced_recomputation(qwen, name, temperature, top_k, top_p):
    prompt, mask = _left_padded(32, (0, 4, 2, 1), 6)
    params = SamplingParams(max_new_tokens=8, temperature=temperature, top_k=top_k, top_p=top_p)
    eos = [1, 2, 3]  # frequent enough on this model that some rows stop early
    out = build_rollout(name).generate(qwen, prompt, mask, params, eos, pad_token_id=0, generator=torch.Generator().manual_seed(0))
    ids = torch.cat([out.prompt_ids, out.response_ids], dim=1)
    attn = torch.cat([out.prompt_mask, out.response_mask], dim=1)
    with torch.inference_mode():
        logits = qwen(ids, attention_mask=attn).logits[:, prompt.shape[1] - 1 : -1] / temperature
    expected = logits.log_softmax(-1).gather(2, out.response_ids[..., None]).squeeze(2)
    real = out.response_mask.bool()
    torch.testing.assert_close(out.logprobs[real], expected[real], atol=1e-4, rtol=0)
    assert (out.logprobs[~real] == 0).all()
    assert out.logprobs.dtype == torch.float32


# ---------------------------------------------------------------- 4. EOS handling


def _check_eos_layout(out, eos_ids, pad_id):
    for row in range(out.response_ids.shape[0]):
        ids, mask = out.response_ids[row], out.response_mask[row]
        hits = [t for t in range(len(ids)) if mask[t] and int(ids[t]) in eos_ids]
        if hits:
            end = hits[0]
            assert len(hits) == 1, "nothing after the first EOS may be in the response"
            assert mask[: end + 1].all() and not mask[end + 1 :].any()
            assert (ids[end + 1 :] == pad_id).all()
            assert not out.truncated[row]
            assert out.response_lengths()[row] == end + 1
        else:
            assert mask.all() and out.truncated[row]
            assert out.response_lengths()[row] == len(ids)


def _moderate_token(model, prompt, mask) -> int:
    """A token (not 0) sampled with probability near 0.2 per step, so that some rows stop
    early and others run to the limit; chosen from the model, not hard-coded, since the
    random init differs between transformers versions."""
    params = SamplingParams(max_new_tokens=6)
    out = build_rollout("fast").generate(model, prompt, mask, params, -1, 0, generator=torch.Generator().manual_seed(1))
    freq = torch.bincount(out.response_ids.flatten(), minlength=model.config.vocab_size).float()
    freq = freq / freq.sum()
    freq[0] = float("inf")
    return int((freq - 0.2).abs().argmin())


@pytest.mark.parametrize("name", ENGINES)
@pytest.mark.parametrize("pad_is_eos", [False, True], ids=["pad!=eos", "pad==eos"])
def test_eos_stops_rows_and_pads_after(peaked, name, pad_is_eos):
    eos = _moderate_token(peaked, *_left_padded(8, (0, 2, 1, 0) * 8, 4))
    pad_id = eos if pad_is_eos else 0
    prompt, mask = _left_padded(8, (0, 2, 1, 0) * 8, 4, pad_id=pad_id)
    params = SamplingParams(max_new_tokens=6)
    out = build_rollout(name).generate(peaked, prompt, mask, params, eos, pad_id, generator=torch.Generator().manual_seed(1))
    assert out.response_ids.shape == (32, 6)
    _check_eos_layout(out, {eos}, pad_id)
    assert out.truncated.any() and not out.truncated.all(), "test needs both early stops and truncations"


@pytest.mark.parametrize("name", ENGINES)
def test_all_rows_stopping_at_once_ends_generation_early(qwen, name):
    prompt, mask = _left_padded(32, (0, 3), 5)
    every_token = list(range(32))  # whatever is sampled first is an EOS
    out = build_rollout(name).generate(qwen, prompt, mask, SamplingParams(max_new_tokens=5), every_token, 0)
    assert out.response_ids.shape == (2, 5)
    assert out.response_mask.tolist() == [[1, 0, 0, 0, 0]] * 2
    assert (out.response_ids[:, 1:] == 0).all() and not out.truncated.any()
    assert (out.logprobs[:, 1:] == 0).all() and (out.logprobs[:, 0] < 0).all()


# ---------------------------------------------------------------- 5. greedy


@pytest.mark.parametrize("arch", ["qwen", "llama"])
def test_greedy_equals_hf_greedy_generate(arch, request):
    model = request.getfixturevalue(arch)
    prompt, mask = _left_padded(model.config.vocab_size, (0, 3, 1, 5), 7)
    steps = 10
    with torch.inference_mode():
        ref = model.generate(
            input_ids=prompt, attention_mask=mask, do_sample=False, max_new_tokens=steps, min_new_tokens=steps, pad_token_id=0
        )[:, prompt.shape[1] :]
    params = SamplingParams(max_new_tokens=steps, greedy=True)
    for engine in (FastSampler(), FastSampler(use_functional=False), HFSampler()):
        out = engine.generate(model, prompt, mask, params, eos_token_id=999, pad_token_id=0)
        assert torch.equal(out.response_ids, ref), type(engine).__name__
        assert out.truncated.all()


# ---------------------------------------------------------------- 6. kept top-k / top-p support


def _teacher_forced_logits(model, out, prompt_len):
    ids = torch.cat([out.prompt_ids, out.response_ids], dim=1)
    attn = torch.cat([out.prompt_mask, out.response_mask], dim=1)
    with torch.inference_mode():
        return model(ids, attention_mask=attn).logits[:, prompt_len - 1 : -1].float()


def _rank(logits, tokens):
    """0-based rank of each token among its position's logits (0 = largest)."""
    picked = logits.gather(2, tokens[..., None])
    return (logits > picked).sum(-1)


@pytest.mark.parametrize("name", ENGINES)
def test_support_size_is_top_k_and_contains_sample(qwen, name):
    prompt, mask = _left_padded(32, (0, 2, 4, 1), 6)
    params = SamplingParams(max_new_tokens=8, top_k=5, return_support=True)
    out = build_rollout(name).generate(qwen, prompt, mask, params, [1, 2], 0, generator=torch.Generator().manual_seed(2))
    assert out.support_size.shape == (4, 8) and out.support_size.dtype == torch.int32
    real = out.response_mask.bool()
    assert not real.all(), "test needs some padding"
    assert (out.support_size[real] == 5).all()
    assert (out.support_size[~real] == 0).all() and (out.support_logprobs[~real] == 0).all()
    rank = _rank(_teacher_forced_logits(qwen, out, prompt.shape[1]), out.response_ids)
    assert (rank[real] < out.support_size[real]).all()


@pytest.mark.parametrize("name", ENGINES)
def test_support_size_top_p_is_the_smallest_nucleus(qwen, name):
    prompt, mask = _left_padded(32, (0, 3), 6)
    params = SamplingParams(max_new_tokens=6, temperature=0.5, top_p=0.6, return_support=True)
    out = build_rollout(name).generate(qwen, prompt, mask, params, 999, 0, generator=torch.Generator().manual_seed(3))
    probs = (_teacher_forced_logits(qwen, out, prompt.shape[1]) / 0.5).softmax(-1)
    sorted_probs = probs.sort(-1, descending=True).values
    k = out.support_size.long()
    assert (k >= 1).all() and (k < 32).all()
    kept_mass = sorted_probs.cumsum(-1).gather(2, (k - 1)[..., None]).squeeze(2)
    smallest_kept = sorted_probs.gather(2, (k - 1)[..., None]).squeeze(2)
    assert (kept_mass >= 0.6 - 1e-5).all()
    assert (kept_mass - smallest_kept < 0.6 + 1e-5).all()
    rank = _rank(probs, out.response_ids)
    assert (rank < k).all()


@pytest.mark.parametrize("name", ENGINES)
def test_renormalised_logprobs_from_support_size_equal_the_dense_mask(qwen, name):
    """The trainer's renormalisation from support_size reproduces the old dense [B, T, V]
    sampling mask, and the sampler's own support_logprobs."""
    from posttrain.core import logprobs_from_logits, token_logprobs_and_entropy
    from posttrain.rollout import sampling_logits_processor

    prompt, mask = _left_padded(32, (0, 4, 2, 1), 6)
    params = SamplingParams(max_new_tokens=8, temperature=0.7, top_k=6, top_p=0.8, return_support=True)
    out = build_rollout(name).generate(qwen, prompt, mask, params, [1, 2, 3], 0, generator=torch.Generator().manual_seed(4))
    logits = _teacher_forced_logits(qwen, out, prompt.shape[1])
    real = out.response_mask.bool()
    labels = out.response_ids.masked_fill(~real, -100)

    # the old method: a dense keep-mask from the sampler's processor, -inf outside it
    _, dense = sampling_logits_processor(logits, params)
    dense = dense | ~real[..., None]
    assert (dense.sum(-1)[real] == out.support_size[real]).all()
    expected = logprobs_from_logits((logits / 0.7).masked_fill(~dense, float("-inf")), labels)

    logp, _ = token_logprobs_and_entropy(logits, labels, with_entropy=False, support_size=out.support_size,
                                         temperature=0.7, chunk_tokens=5)
    torch.testing.assert_close(logp, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.support_logprobs[real], logp[real], atol=1e-4, rtol=0)
    assert (out.support_logprobs[real] >= out.logprobs[real] - 1e-6).all()  # renormalising only raises them


@pytest.mark.parametrize("name", ENGINES)
def test_support_without_filter_is_the_full_vocabulary(qwen, name):
    prompt, mask = _left_padded(32, (0, 2), 5)
    params = SamplingParams(max_new_tokens=4, temperature=0.8, return_support=True)
    out = build_rollout(name).generate(qwen, prompt, mask, params, 999, 0, generator=torch.Generator().manual_seed(5))
    assert (out.support_size == 32).all()
    torch.testing.assert_close(out.support_logprobs, out.logprobs)


def test_no_support_unless_asked(qwen):
    prompt, mask = _left_padded(32, (0,), 4)
    out = FastSampler().generate(qwen, prompt, mask, SamplingParams(max_new_tokens=3, top_k=3), 1, 0)
    assert out.support_size is None and out.support_logprobs is None


# ---------------------------------------------------------------- 7. registry, errors, state


def test_unknown_engine_name_is_a_clear_error():
    with pytest.raises(ValueError, match="rollout='vllm_typo'.*fast.*hf"):
        build_rollout("vllm_typo")
    assert isinstance(build_rollout("fast"), FastSampler)
    assert isinstance(build_rollout("hf"), HFSampler)


def test_bad_inputs_are_refused(qwen):
    prompt, mask = _left_padded(32, (0,), 4)
    right_padded = torch.tensor([[1, 1, 0, 0]])
    with pytest.raises(ValueError, match="left-padded"):
        FastSampler().generate(qwen, prompt, right_padded, SamplingParams(max_new_tokens=2), 1, 0)
    with pytest.raises(ValueError, match="temperature"):
        FastSampler().generate(qwen, prompt, mask, SamplingParams(max_new_tokens=2, temperature=0.0), 1, 0)


@pytest.mark.parametrize("name", ENGINES)
def test_model_mode_is_restored_and_seeded_runs_repeat(qwen, name):
    prompt, mask = _left_padded(32, (0, 2), 5)
    params = SamplingParams(max_new_tokens=4)
    engine = build_rollout(name)
    qwen.train()
    qwen.model.layers[0].eval()  # a mixed state must come back exactly
    try:
        runs = [engine.generate(qwen, prompt, mask, params, 1, 0, generator=torch.Generator().manual_seed(7)) for _ in range(2)]
        assert qwen.training and qwen.model.training and not qwen.model.layers[0].training
        assert qwen.model.layers[1].training
    finally:
        qwen.eval()
    assert torch.equal(runs[0].response_ids, runs[1].response_ids)
    state = torch.random.get_rng_state()
    engine.generate(qwen, prompt, mask, params, 1, 0, generator=torch.Generator().manual_seed(7))
    assert torch.equal(state, torch.random.get_rng_state()), "a seeded run must not consume the global RNG"


def test_rollout_batch_helpers(qwen):
    prompt, mask = _left_padded(32, (0, 1), 4)
    out = FastSampler().generate(qwen, prompt, mask, SamplingParams(max_new_tokens=3, top_k=4, return_support=True), 999, 0)
    moved = out.to("cpu")
    assert torch.equal(moved.response_ids, out.response_ids)
    assert moved.response_lengths().tolist() == [3, 3]
    assert out.prompt_ids.shape == (2, 4) and out.prompt_mask.dtype == torch.long
    assert torch.equal(moved.support_size, out.support_size)


# ---------------------------------------------------------------- 7. repetition: looping rows stop


def _successor_model(successor: dict[int, int], vocab: int = 12):
    """A Qwen2 whose greedy next token is ``successor[last token]``: the attention and MLP
    outputs are zeroed (the residual stream is the last token's embedding) and the untied LM
    head's row for ``successor[t]`` is t's embedding, scaled up. Never produces EOS (1)."""
    config = transformers.Qwen2Config(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, intermediate_size=64, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    model = _init(transformers.Qwen2ForCausalLM, config, seed=4)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        embed.copy_(torch.linalg.qr(torch.randn(32, vocab, generator=torch.Generator().manual_seed(0)))[0].t())
        head = torch.zeros_like(model.lm_head.weight)
        for token, nxt in successor.items():
            head[nxt] = 50.0 * embed[token]
        model.lm_head.weight.copy_(head)
    return model


# prompt's last token -> the loop the model falls into: period 1 (7 7 7), 2 (3 2 3 2), 3 (5 6 4 5 6 4)
LOOPS = {7: 7, 2: 3, 3: 2, 4: 5, 5: 6, 6: 4}


@pytest.mark.parametrize("name", ENGINES)
def test_looping_rows_are_stopped_and_flagged(name):
    from posttrain.rollout.repetition import RepetitionRule

    model = _successor_model(LOOPS)
    prompt, mask = _left_padded(12, (0, 1, 0), 3)
    prompt[:, -1] = torch.tensor([7, 2, 4])  # periods 1, 2, 3
    engine = build_rollout(name)
    plain = engine.generate(model, prompt, mask, SamplingParams(max_new_tokens=16, greedy=True), 1, 0)
    assert plain.truncated.all() and not plain.repeated.any()
    assert plain.response_ids[:, :3].tolist() == [[7, 7, 7], [3, 2, 3], [5, 6, 4]]
    rule = RepetitionRule(ngram=3, window=6)
    out = engine.generate(model, prompt, mask, SamplingParams(max_new_tokens=16, greedy=True, repetition=rule), 1, 0)
    # each row loops from its first token: stopped once the 6-token window is full, no EOS
    assert out.repeated.all() and not out.truncated.any()
    assert out.response_lengths().tolist() == [6, 6, 6]
    assert torch.equal(out.response_ids[:, :6], plain.response_ids[:, :6]) and (out.response_ids[:, 6:] == 0).all()
    assert (out.logprobs[:, 6:] == 0).all()
    # a period-3 loop is longer than ngram=2: that row runs to the budget
    short = engine.generate(model, prompt, mask,
                            SamplingParams(max_new_tokens=16, greedy=True, repetition=RepetitionRule(2, 6)), 1, 0)
    assert short.repeated.tolist() == [True, True, False] and short.truncated.tolist() == [False, False, True]
    assert short.response_lengths().tolist() == [6, 6, 16]


@pytest.mark.parametrize("use_functional", [True, False])
def test_fast_samples_no_further_once_every_row_loops(monkeypatch, use_functional):
    """fast stops sampling when every row is looping (window - 1 decode steps after the
    prefill), where without the check it runs the whole budget."""
    from posttrain.rollout import fast
    from posttrain.rollout.repetition import RepetitionRule

    model = _successor_model(LOOPS)
    prompt, mask = _left_padded(12, (0, 0), 3)
    prompt[:, -1] = torch.tensor([7, 2])
    calls = []
    stepper = fast.FunctionalDecoder if use_functional else fast._HFStepper
    original = stepper.step
    monkeypatch.setattr(stepper, "step", lambda self, token: calls.append(1) or original(self, token))
    sampler = FastSampler(use_functional=use_functional)
    for rule, expected_steps in ((RepetitionRule(2, 5), 4), (None, 19)):
        calls.clear()
        params = SamplingParams(max_new_tokens=20, temperature=1.0, repetition=rule)
        out = sampler.generate(model, prompt, mask, params, 1, 0, generator=torch.Generator().manual_seed(0))
        assert len(calls) == expected_steps
        assert out.repeated.tolist() == [rule is not None] * 2


def test_fast_and_hf_cut_and_flag_the_same_rows(peaked):
    """Greedy decoding on a small vocabulary falls into loops of several periods at different
    steps, or ends with EOS: fast (stopping as it samples) and hf (cut after generate) agree
    on every token, mask and flag."""
    from posttrain.rollout.repetition import RepetitionRule

    prompt, mask = _left_padded(8, (0, 1, 2, 0, 0, 1, 0, 0), 4, seed=5)
    params = SamplingParams(max_new_tokens=24, greedy=True, repetition=RepetitionRule(ngram=4, window=8))
    outs = [build_rollout(name).generate(peaked, prompt, mask, params, eos_token_id=2, pad_token_id=0)
            for name in ENGINES]
    for field in ("response_ids", "response_mask", "repeated", "truncated"):
        assert torch.equal(getattr(outs[0], field), getattr(outs[1], field)), field
    torch.testing.assert_close(outs[0].logprobs, outs[1].logprobs, atol=1e-4, rtol=0)
    repeated, lengths = outs[0].repeated, outs[0].response_lengths()
    assert repeated.any() and (~repeated).any()
    assert len(set(lengths[repeated].tolist())) > 1  # loops found at different steps


def test_vllm_outputs_are_cut_where_fast_would_stop():
    """vLLM cannot stop a looping row: its finished tokens are cut post hoc by the same check."""
    from types import SimpleNamespace

    from posttrain.rollout.repetition import RepetitionRule
    from posttrain.rollout.vllm import rollout_from_outputs

    def completion(token_ids, reason):
        logprobs = [{t: SimpleNamespace(logprob=-0.5)} for t in token_ids]
        return SimpleNamespace(outputs=[SimpleNamespace(token_ids=token_ids, finish_reason=reason, logprobs=logprobs)])

    outputs = [completion([4, 3, 5, 3, 5, 3, 5, 3, 5, 3], "length"),  # period 2 from its second token
               completion([4, 3, 5, 3, 5, 2], "stop"),  # EOS before the window fills
               completion([4, 5, 6, 7, 8, 4, 5, 6, 7, 8], "length")]  # period 5 > ngram
    prompt_ids, prompt_mask = torch.tensor([[6, 7]] * 3), torch.ones(3, 2, dtype=torch.long)
    out = rollout_from_outputs(outputs, prompt_ids, prompt_mask, 10, torch.tensor([2]), 0, True,
                               repetition=RepetitionRule(ngram=2, window=6))
    assert out.repeated.tolist() == [True, False, False] and out.truncated.tolist() == [False, False, True]
    assert out.response_lengths().tolist() == [7, 6, 10]  # tokens 1..6 are 3 5 3 5 3 5
    assert out.response_ids[0].tolist() == [4, 3, 5, 3, 5, 3, 5, 0, 0, 0]


def test_a_bfloat16_sampler_rounds_an_fp32_policys_weights_once_and_reports_its_own_logprobs(llama):
    """rollout.dtype=bfloat16 (SamplingParams.weights_dtype): the fused decoder holds bf16 copies
    of an fp32 policy's weights, so its logits are those of the bf16-rounded model (within bf16's
    own rounding), not the fp32 ones; the policy itself is not touched."""
    model = copy.deepcopy(llama)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prompt, prompt_mask = _left_padded(model.config.vocab_size, (0, 2, 4), 6)
    with torch.inference_mode():
        fp32 = FunctionalDecoder(model, 3, 8).prefill(prompt, prompt_mask, all_logits=True)
        bf16 = FunctionalDecoder(model, 3, 8, dtype=torch.bfloat16).prefill(prompt, prompt_mask, all_logits=True)
        rounded = FunctionalDecoder(copy.deepcopy(model).to(torch.bfloat16), 3, 8).prefill(prompt, prompt_mask,
                                                                                           all_logits=True)
    real = prompt_mask.bool()
    assert bf16.dtype == torch.bfloat16
    gap = (bf16.float() - fp32)[real].abs().max()
    assert gap > 0
    assert (bf16.float() - rounded.float())[real].abs().max() <= gap  # nearer the bf16 model than the fp32 one
    for name, value in model.state_dict().items():
        assert value.dtype == torch.float32 and torch.equal(value, before[name]), name

    params = SamplingParams(max_new_tokens=5, temperature=1.0)
    seeded = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    sampled = FastSampler().generate(model, prompt, prompt_mask, replace(params, weights_dtype=torch.bfloat16),
                                     eos_token_id=1, pad_token_id=0, generator=seeded())
    # the trainer's fp32 log-probs of the very tokens the bf16 sampler drew differ from its own
    ids = torch.cat([prompt, sampled.response_ids], 1)
    mask = torch.cat([prompt_mask, sampled.response_mask], 1)
    with torch.inference_mode():
        logits = model(ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
    trainer = logits[:, 5:-1].log_softmax(-1).gather(-1, sampled.response_ids[..., None]).squeeze(-1)
    valid = sampled.response_mask.bool()
    difference = (trainer - sampled.logprobs)[valid].abs()
    assert 0 < difference.max() < 0.5


def test_only_the_fused_path_samples_in_another_precision():
    config = transformers.GPT2Config(vocab_size=16, n_embd=32, n_layer=2, n_head=2, n_positions=64)
    model = _init(transformers.GPT2LMHeadModel, config)
    prompt, mask = _left_padded(16, (0, 0), 5)
    params = SamplingParams(max_new_tokens=3, weights_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rollout.dtype=bfloat16 needs the fused sampling path"):
        FastSampler().generate(model, prompt, mask, params, eos_token_id=1, pad_token_id=0)
    with pytest.raises(ValueError, match="rollout=hf samples with the policy's own weights"):
        HFSampler().generate(model, prompt, mask, params, eos_token_id=1, pad_token_id=0)
