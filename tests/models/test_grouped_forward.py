"""The grouped scoring forward (models/grouped_forward.py) reproduces the HF forward.

Every online-RL log-prob (training, reference, old, teacher) goes through it, so its
logits and its gradients must equal those of the model's own forward over the whole
prompt + response, with each prompt shared by its group and padding left out.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import transformers
from held_tensors import OpOutputs

from posttrain.models.forward import sequence_logits
from posttrain.models.grouped_forward import grouped_forward_unsupported_reason, grouped_logits


def _init(model_cls, config, seed=0):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_cls(config)
    with torch.no_grad():  # random init zeroes biases and sets gains to 1: make both matter
        for name, p in model.named_parameters():
            generator = torch.Generator().manual_seed(len(name) + seed)
            if name.endswith("bias"):
                p.normal_(0.0, 0.5, generator=generator)
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5, generator=generator)
    return model.train()


def _qwen():
    config = transformers.Qwen2Config(vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=4, intermediate_size=96, max_position_embeddings=128,
                                      tie_word_embeddings=True, pad_token_id=0)
    return _init(transformers.Qwen2ForCausalLM, config)


def _llama(**overrides):
    """GQA (4 query / 2 kv heads), untied head, biases everywhere."""
    config = dict(vocab_size=40, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, max_position_embeddings=128, tie_word_embeddings=False, attention_bias=True,
                  mlp_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    return _init(transformers.LlamaForCausalLM, transformers.LlamaConfig(**(config | overrides)), seed=1)


def _llama_yarn():
    rope = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "attention_factor": 1.3,
            "original_max_position_embeddings": 32}
    return _llama(rope_parameters=rope)


MODELS = {"qwen": _qwen, "llama": _llama, "llama_yarn": _llama_yarn}


def _batch(vocab: int, group_size: int, pads=(0, 2, 1), plen=6, width=7, seed=0):
    """Groups of `group_size` rows sharing a left-padded prompt (a different padding each),
    responses of lengths from 1 to `width` (a prefix mask, pad id 0 after the end)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, vocab, (len(pads), plen), generator=g)
    prompt_mask = torch.ones_like(prompts)
    for row, n in enumerate(pads):
        prompts[row, :n], prompt_mask[row, :n] = 0, 0
    rows = len(pads) * group_size
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    lengths[0], lengths[-1] = 1, width
    response_ids = torch.randint(3, vocab, (rows, width), generator=g)
    response_mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    response_ids[response_mask == 0] = 0
    return (prompts.repeat_interleave(group_size, 0), prompt_mask.repeat_interleave(group_size, 0),
            response_ids, response_mask)


def _hf_logits(model, prompt_ids, prompt_mask, response_ids, response_mask):
    """The plain forward: prompt + response through the HF module, every row whole."""
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, response_mask.long()], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    return logits[:, prompt_ids.shape[1] - 1: -1]


def _masked_logprob_sum(logits, response_ids, response_mask):
    logp = logits.log_softmax(-1).gather(-1, response_ids.unsqueeze(-1)).squeeze(-1)
    return (logp * response_mask).sum()


@pytest.mark.parametrize("arch", sorted(MODELS))
@pytest.mark.parametrize("group_size", [1, 3])
def test_logits_equal_the_hf_forward_at_every_real_token(arch, group_size):
    model = MODELS[arch]()
    batch = _batch(model.config.vocab_size, group_size)
    with torch.no_grad():
        expected = _hf_logits(model, *batch)
        got = grouped_logits(model, *batch, group_size)
    real = batch[3].bool()
    assert got.shape == expected.shape
    assert torch.allclose(got[real], expected[real], atol=1e-5, rtol=1e-5)
    # positions that predict padding are not computed: zeros (finite), never NaN
    assert torch.equal(got[~real], torch.zeros_like(got[~real]))


@pytest.mark.parametrize("arch", ["qwen", "llama"])
def test_gradients_equal_the_hf_forward(arch):
    """Each prompt runs once, so its gradient is the sum over its group's responses: the same
    as through the copies of the plain forward (the tied embedding of qwen included)."""
    model = MODELS[arch]()
    batch = _batch(model.config.vocab_size, group_size=4)
    expected_loss = _masked_logprob_sum(_hf_logits(model, *batch), batch[2], batch[3])
    expected = torch.autograd.grad(expected_loss, list(model.parameters()))
    loss = _masked_logprob_sum(grouped_logits(model, *batch, 4), batch[2], batch[3])
    got = torch.autograd.grad(loss, list(model.parameters()))
    assert torch.allclose(loss, expected_loss, rtol=1e-5)
    for (name, _), a, b in zip(model.named_parameters(), got, expected):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), name


def test_lora_adapter_gradients_equal_the_hf_forward():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj",
                                                                                           "up_proj"]))
    with torch.no_grad():  # B starts at zero: make the adapter change the output
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    batch = _batch(model.config.vocab_size, group_size=2)
    trainable = [p for p in model.parameters() if p.requires_grad]
    expected = torch.autograd.grad(_masked_logprob_sum(_hf_logits(model, *batch), batch[2], batch[3]), trainable)
    assert grouped_forward_unsupported_reason(model) is None
    got = torch.autograd.grad(_masked_logprob_sum(sequence_logits(model, *batch), batch[2], batch[3]),
                              trainable)
    for a, b in zip(got, expected):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["qwen", "llama"])  # tied and untied embeddings
@pytest.mark.parametrize("targets", [["lm_head"], ["embed_tokens"], ["embed_tokens", "q_proj", "lm_head"]])
def test_lora_on_the_embedding_and_the_lm_head_is_read_by_the_sampler_and_the_grouped_forward(arch, targets):
    """An adapter on lm_head / embed_tokens: the fused sampler's logits and the grouped
    forward's logits and gradients are those of PEFT's own forward."""
    peft = pytest.importorskip("peft")
    from posttrain.models.functional import FunctionalDecoder, without_adapter_wrapper

    model = peft.get_peft_model(MODELS[arch](), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    with torch.no_grad():  # a fresh adapter adds 0 (B or, on an embedding, A is zero): make it matter
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    batch = _batch(model.config.vocab_size, group_size=2)
    real = batch[3].bool()
    adapters = {name: p for name, p in model.named_parameters() if p.requires_grad}
    expected_logits = _hf_logits(model, *batch)
    with model.disable_adapter(), torch.no_grad():  # the adapter moves the logits (the test can fail)
        assert not torch.allclose(_hf_logits(model, *batch)[real], expected_logits[real], atol=1e-2)
    expected = torch.autograd.grad(_masked_logprob_sum(expected_logits, batch[2], batch[3]), list(adapters.values()))

    assert grouped_forward_unsupported_reason(model) is None
    logits = sequence_logits(model, *batch)
    assert torch.allclose(logits[real], expected_logits[real], atol=1e-5, rtol=1e-5)
    got = torch.autograd.grad(_masked_logprob_sum(logits, batch[2], batch[3]), list(adapters.values()))
    for name, a, b in zip(adapters, got, expected):
        assert b.abs().sum() > 0 and torch.allclose(a, b, atol=1e-4, rtol=1e-4), name

    prompt_ids, prompt_mask = batch[0], batch[1]
    with torch.inference_mode():  # the fused sampler's prefill, every prompt position
        sampled = FunctionalDecoder(without_adapter_wrapper(model), len(prompt_ids), prompt_ids.shape[1] + 1).prefill(
            prompt_ids, prompt_mask, all_logits=True)
        position_ids = (prompt_mask.cumsum(dim=1) - 1).clamp(min=0)
        peft_logits = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=position_ids).logits
    assert torch.allclose(sampled[prompt_mask.bool()], peft_logits[prompt_mask.bool()], atol=1e-4, rtol=1e-4)


def test_sequence_logits_uses_it_only_where_it_is_exact(monkeypatch):
    model = _qwen()
    assert grouped_forward_unsupported_reason(model) is None
    assert grouped_forward_unsupported_reason(_checkpointed(model)) is None  # it checkpoints its own layers
    dropout = _llama(attention_dropout=0.1)
    assert "dropout" in grouped_forward_unsupported_reason(dropout)
    assert grouped_forward_unsupported_reason(dropout.eval()) is None  # no dropout in eval mode
    batch = _batch(model.config.vocab_size, group_size=2)
    with torch.no_grad():
        grouped = sequence_logits(model.eval(), *batch)[batch[3].bool()]
        _model_forward_only(monkeypatch)
        assert torch.allclose(sequence_logits(model, *batch)[batch[3].bool()], grouped, atol=1e-5)  # the fallback


def test_sequence_logits_runs_each_prompt_of_a_group_once(monkeypatch):
    import posttrain.models.forward as experience

    seen = []
    real = experience.grouped_logits
    monkeypatch.setattr(experience, "grouped_logits", lambda *args: seen.append(args[-1]) or real(*args))
    model = _qwen()
    batch = _batch(model.config.vocab_size, group_size=4)
    sequence_logits(model, *batch)
    shuffled = [x[torch.randperm(len(x), generator=torch.Generator().manual_seed(0))] for x in batch]
    sequence_logits(model, *shuffled)  # rows out of group order: nothing is shared
    assert seen == [4, 1]


@pytest.mark.parametrize("width", [1, 5, 15, 16, 23])
def test_padded_softmax_equals_softmax_with_its_gradient(width):
    from posttrain.models.functional import softmax_last

    x = torch.randn(6, 3, width, requires_grad=True)
    if width > 1:
        x.data[0, 0, 0] = float("-inf")  # masked entries stay at weight 0
    weights = torch.randn(6, 3, width)
    got = softmax_last(x)
    assert got.shape == x.shape
    assert torch.allclose(got, x.softmax(-1), atol=1e-7)
    (grad,) = torch.autograd.grad((got * weights).sum(), x)
    (expected,) = torch.autograd.grad((x.softmax(-1) * weights).sum(), x)
    assert torch.allclose(grad, expected, atol=1e-6)


def test_lora_dropout_keeps_the_hf_forward():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_llama(), peft.LoraConfig(r=4, target_modules=["q_proj"], lora_dropout=0.1))
    assert "LoRA dropout" in grouped_forward_unsupported_reason(model.train())
    assert grouped_forward_unsupported_reason(model.eval()) is None


# ------------------------------------------------- fused attention, memory linear in length


def _qwen3():
    """q/k norms: the grouped forward refuses it, the model's own forward (SDPA) scores it."""
    config = transformers.Qwen3Config(vocab_size=48, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, intermediate_size=96,
                                      max_position_embeddings=128, tie_word_embeddings=False)
    return _init(transformers.Qwen3ForCausalLM, config, seed=2)


def _reference_logprobs(model, batch, temperature):
    """log-probs and entropy of the plain HF forward's full logits (the unchunked formula)."""
    logits = _hf_logits(model, *batch).float() / temperature
    logp_all = logits.log_softmax(-1)
    logp = logp_all.gather(-1, batch[2].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def _checkpointed(model):
    model = copy.deepcopy(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _model_forward_only(monkeypatch):
    """From here on `models.forward` takes the model's own forward (the fallback), as for a
    model the grouped forward cannot run."""
    from posttrain.models import forward

    monkeypatch.setattr(forward, "grouped_forward_unsupported_reason", lambda model: "the test's fallback")


@pytest.mark.parametrize("arch", ["qwen", "llama", "llama_yarn", "qwen3", "llama_checkpointed"])
@pytest.mark.parametrize("group_size", [1, 3])
def test_sequence_logprobs_and_gradients_equal_the_hf_forward(arch, group_size):
    """The training forward's log-probs and entropies (hidden states, LM head chunk by chunk)
    and their gradients equal those of the HF forward's full logits, for uneven prompt and
    response lengths; on the grouped forward (GQA in llama; checkpointed llama: each layer's
    step recomputed in the backward) and on the model's own forward (qwen3's q/k norms: the
    LM head replaced by the scorer)."""
    from posttrain.models.forward import sequence_logprobs

    model = _qwen3() if arch == "qwen3" else MODELS[arch.removesuffix("_checkpointed")]()
    scored = _checkpointed(model) if arch.endswith("_checkpointed") else model
    grouped = grouped_forward_unsupported_reason(scored) is None
    assert grouped == (arch != "qwen3")
    batch = _batch(model.config.vocab_size, group_size, pads=(0, 3, 1, 2), width=9, seed=group_size)
    real = batch[3].bool()
    weights = torch.randn(2, *real.shape, generator=torch.Generator().manual_seed(3)) * batch[3]

    logp, entropy = _reference_logprobs(model, batch, 0.7)
    expected = torch.autograd.grad((logp * weights[0]).sum() + (entropy * weights[1]).sum(), list(model.parameters()))
    got_logp, got_entropy = sequence_logprobs(scored, *batch, with_entropy=True, temperature=0.7, chunk_tokens=5)
    got = torch.autograd.grad((got_logp * weights[0]).sum() + (got_entropy * weights[1]).sum(),
                              list(scored.parameters()))
    torch.testing.assert_close(got_logp[real], logp[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_entropy[real], entropy[real], atol=1e-5, rtol=1e-5)
    assert torch.equal(got_logp[~real], torch.zeros_like(got_logp[~real]))  # padding is not scored
    for (name, _), a, b in zip(model.named_parameters(), got, expected):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=name)


def test_sequence_logprobs_of_a_lora_policy_equal_the_hf_forward(monkeypatch):
    peft = pytest.importorskip("peft")
    from posttrain.models.forward import sequence_logprobs

    model = peft.get_peft_model(_llama(), peft.LoraConfig(r=4, lora_alpha=8,
                                                          target_modules=["q_proj", "v_proj", "lm_head"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    batch = _batch(model.config.vocab_size, group_size=2, width=9)
    trainable = [p for p in model.parameters() if p.requires_grad]
    for path in ("grouped", "grouped_checkpointed", "model_forward"):
        scored = _checkpointed(model) if path == "grouped_checkpointed" else model
        if path == "model_forward":
            _model_forward_only(monkeypatch)
        params = [p for p in scored.parameters() if p.requires_grad]
        logp, _ = _reference_logprobs(scored, batch, 1.0)
        expected = torch.autograd.grad((logp * batch[3]).sum(), params)
        got_logp, _ = sequence_logprobs(scored, *batch, chunk_tokens=4)
        got = torch.autograd.grad((got_logp * batch[3]).sum(), params)
        for a, b in zip(got, expected):
            assert b.abs().sum() > 0
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        assert len(trainable) == len(params)


def test_sequence_hidden_states_are_the_hf_decoders_on_both_paths(monkeypatch):
    from posttrain.models.forward import sequence_hidden_states

    model = _llama()
    batch = _batch(model.config.vocab_size, group_size=3)
    real = batch[3].bool()
    with torch.no_grad():
        grouped = sequence_hidden_states(model, *batch)
        _model_forward_only(monkeypatch)
        hf = sequence_hidden_states(model, *batch)
        input_ids = torch.cat([batch[0], batch[2]], dim=1)
        mask = torch.cat([batch[1], batch[3].long()], dim=1)
        plain = model.model(input_ids=input_ids, attention_mask=mask,
                            position_ids=(mask.cumsum(1) - 1).clamp(min=0)).last_hidden_state[:, 5:-1]
    torch.testing.assert_close(grouped[real], plain[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hf[real], plain[real], atol=1e-5, rtol=1e-5)


def test_the_float_mask_is_used_only_where_it_is_exact():
    from posttrain.models.forward import _float_mask_dtype

    device = torch.device("cpu")
    assert _float_mask_dtype(_llama(), device) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _float_mask_dtype(_llama(), device) == torch.bfloat16  # the queries' dtype under autocast
    sliding = transformers.MistralConfig(vocab_size=40, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=2, intermediate_size=64, sliding_window=4)
    assert _float_mask_dtype(transformers.MistralForCausalLM(sliding), device) is None
    eager = _llama(attn_implementation="eager")
    assert _float_mask_dtype(eager, device) is None


def _saved_during(fn):
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


@pytest.mark.parametrize("autocast", [False, True])
def test_no_square_scores_are_saved_for_the_backward(autocast):
    """At T = 64 the grouped forward saves no [.., T, T] float tensor per layer: attention is
    SDPA's fused kernel (it saves q, k, v, the output and the log-sum-exp), and the one
    [B, 1, T - 1, P + T - 1] mask it reads is the same storage in every layer (also under
    bf16 autocast, which would cast a mask of another dtype at every layer)."""
    from posttrain.models.forward import sequence_logprobs

    model = _llama(num_hidden_layers=3)
    width = 64
    batch = _batch(model.config.vocab_size, group_size=2, width=width)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        _, saved = _saved_during(lambda: sequence_logprobs(model, *batch, with_entropy=True))
    square = [t for t in saved if t.dim() >= 3 and t.is_floating_point() and t.shape[-2] == width - 1
              and t.shape[-1] >= width - 1]
    assert len(square) == 3, "the mask is saved by each layer's SDPA"
    assert len({t.untyped_storage().data_ptr() for t in square}) == 1  # one mask, shared by the layers
    assert all(t.shape == (len(batch[0]), 1, width - 1, batch[0].shape[1] + width - 1) for t in square)


def test_checkpointing_keeps_only_each_layers_inputs_and_gives_the_same_gradients(monkeypatch):
    """With the model's gradient checkpointing on, each layer's step (its fused weights, both
    blocks) is recomputed in the backward: the log-probs and gradients are the plain grouped
    forward's, the fused q/k/v and gate/up copies are no longer kept for the backward (they are
    built again: one more `fuse` per layer), and far less is saved."""
    from posttrain.models.forward import sequence_logprobs
    from posttrain.models.functional import DecoderWeights

    layers = 3
    model = _llama(num_hidden_layers=layers)
    batch = _batch(model.config.vocab_size, group_size=2, width=16)
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    fused_shapes = {((config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim, config.hidden_size),
                    (2 * config.intermediate_size, config.hidden_size)}
    fuse = DecoderWeights.fuse
    results = {}
    for scored in (model, _checkpointed(model)):
        fused = []
        monkeypatch.setattr(DecoderWeights, "fuse", lambda self, layer, fused=fused: fused.append(layer) or
                            fuse(self, layer))
        (logp, entropy), saved = _saved_during(
            lambda scored=scored: sequence_logprobs(scored, *batch, with_entropy=True))
        grads = torch.autograd.grad((logp * batch[3]).sum() + entropy.sum(), list(scored.parameters()))
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
        results[scored.is_activation_checkpointing] = {
            "logp": logp, "entropy": entropy, "grads": grads, "fuses": len(fused),
            "saved_bytes": sum(storages.values()), "fused_saved": sum(tuple(t.shape) in fused_shapes for t in saved)}
    plain, checkpointed = results[False], results[True]
    assert torch.equal(checkpointed["logp"], plain["logp"]) and torch.equal(checkpointed["entropy"], plain["entropy"])
    for (name, _), a, b in zip(model.named_parameters(), checkpointed["grads"], plain["grads"]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=name)
    assert (plain["fuses"], checkpointed["fuses"]) == (layers, 2 * layers)
    assert plain["fused_saved"] >= 2 * layers and checkpointed["fused_saved"] == 0
    assert checkpointed["saved_bytes"] < plain["saved_bytes"] / 5


@pytest.mark.parametrize("path", ["grouped", "model_forward"])
def test_selective_checkpointing_keeps_the_matmul_outputs_and_runs_no_matmul_twice(monkeypatch, path):
    """model.gradient_checkpointing=selective, on both training forwards: the log-probs and
    gradients are the unchecked ones; the backward runs no matmul again (full checkpointing
    runs most of them twice); what the forward leaves held for the backward lies between full
    checkpointing's and no checkpointing's."""
    from posttrain.distributed.recompute import enable_activation_checkpointing
    from posttrain.models.forward import sequence_logprobs

    if path == "model_forward":
        _model_forward_only(monkeypatch)
    model = _llama(num_hidden_layers=3)
    batch = _batch(model.config.vocab_size, group_size=2, width=16)
    runs = {}
    for mode in (False, True, "selective"):
        scored = copy.deepcopy(model)
        if mode:
            enable_activation_checkpointing(scored, mode)
        with OpOutputs() as ops:
            logp, entropy = sequence_logprobs(scored, *batch, with_entropy=True)
            held = ops.held_bytes()
            forward_matmuls = ops.matmuls
            grads = torch.autograd.grad((logp * batch[3]).sum() + entropy.sum(), list(scored.parameters()))
        runs[mode] = dict(logp=logp, grads=grads, held=held, recomputed=ops.matmuls - 3 * forward_matmuls)
    plain, full, selective = runs[False], runs[True], runs["selective"]
    assert torch.equal(selective["logp"], plain["logp"])
    for (name, _), a, b in zip(model.named_parameters(), selective["grads"], plain["grads"]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=name)
    # a matmul's backward is two matmuls (its input's and its weight's gradients), one where the input needs none
    assert selective["recomputed"] == plain["recomputed"] and full["recomputed"] > plain["recomputed"] + 3 * 3
    assert full["held"] < selective["held"] < plain["held"]


def test_the_training_forward_never_allocates_the_full_logits(monkeypatch):
    """Every tensor the forward and the backward of `sequence_logprobs` create (seen at the
    dispatcher) is smaller than one chunk of logits: no [B, T, V] logits, in any dtype, on
    the grouped forward or on the model's own."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from posttrain.models.forward import sequence_logprobs

    class Largest(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.shapes.append(tuple(t.shape))
            return out

    vocab, chunk = 3000, 8
    model = _llama(vocab_size=vocab, hidden_size=32, intermediate_size=48)
    batch = _batch(vocab, group_size=3, width=12)
    batch_tokens = batch[2].numel()
    for path in ("grouped", "grouped_checkpointed", "model_forward"):
        scored = _checkpointed(model) if path == "grouped_checkpointed" else model
        if path == "model_forward":
            _model_forward_only(monkeypatch)
        with Largest() as seen:
            logp, entropy = sequence_logprobs(scored, *batch, with_entropy=True, chunk_tokens=chunk)
            (logp.sum() + entropy.sum()).backward()
        # [positions, V] tensors ([H, V]: the LM head's weight, transposed, and its gradient)
        logits_sized = [s for s in seen.shapes if s and s[-1] == vocab and s != (32, vocab)]
        assert logits_sized, "the chunks' logits are seen"
        assert max(math.prod(s) for s in logits_sized) <= chunk * vocab < batch_tokens * vocab


def test_the_rotary_module_gets_batch_by_sequence_positions(monkeypatch):
    """transformers 5.17's Llama and Qwen2 rotary modules index `position_ids[:, None, :]`: the
    grouped forward (and the sampler, which shares `functional.rotation`) gives them 2-D
    positions, as every transformers version takes them. Seen on a GPU machine with 5.17."""
    model = MODELS["llama"]()
    rotary = model.model.rotary_emb
    forward = type(rotary).forward

    def indexes_a_second_dimension(self, x, position_ids, *args, **kwargs):
        assert position_ids.dim() == 2, position_ids.shape
        return forward(self, x, position_ids, *args, **kwargs)

    monkeypatch.setattr(type(rotary), "forward", indexes_a_second_dimension)
    batch = _batch(model.config.vocab_size, 3)
    with torch.no_grad():
        expected = _hf_logits(model, *batch)
        got = grouped_logits(model, *batch, 3)
    real = batch[3].bool()
    assert torch.allclose(got[real], expected[real], atol=1e-5, rtol=1e-5)
