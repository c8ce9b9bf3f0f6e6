"""The model's own forward without padding (models/plain_forward.py): rows laid out again as
real prompt ++ real response, in length buckets; its log-probs, entropies, hidden states,
logits and gradients equal those of the padded HF forward."""

from __future__ import annotations

import pytest
import torch
import transformers

from posttrain.models import forward, plain_forward
from posttrain.models.plain_forward import plain_buckets
from posttrain.models.tiny import build_tiny_model
from scoring_batches import smollm2_shaped, uneven_batch


def _qwen3():
    """q/k norms: the grouped forward refuses it, so it takes this path without being forced."""
    config = transformers.Qwen3Config(vocab_size=48, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, intermediate_size=96,
                                      max_position_embeddings=256, tie_word_embeddings=False)
    with torch.random.fork_rng():
        torch.manual_seed(2)
        return transformers.Qwen3ForCausalLM(config).train()


MODELS = {"embedded": lambda: build_tiny_model(vocab_size=40).train(), "smollm2_shaped": smollm2_shaped,
          "qwen3": _qwen3}


def _padded_logits(model, prompt_ids, prompt_mask, response_ids, response_mask):
    """The reference: every row whole through the HF module, left-padded prompt ++ right-padded
    response, positions counting real tokens."""
    attention_mask = torch.cat([prompt_mask, response_mask.long()], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    logits = model(input_ids=torch.cat([prompt_ids, response_ids], dim=1), attention_mask=attention_mask,
                   position_ids=position_ids).logits
    return logits[:, prompt_ids.shape[1] - 1: -1]


def _fallback(monkeypatch, cost_tokens):
    """The model's own forward for every model, with `BUCKET_COST_TOKENS` = cost_tokens; returns
    the list each call's bucket plan (rows per bucket) is appended to."""
    monkeypatch.setattr(forward, "grouped_forward_unsupported_reason", lambda model: "the test's fallback")
    monkeypatch.setattr(plain_forward, "BUCKET_COST_TOKENS", {"cpu": cost_tokens})
    plans, original = [], plain_forward.plain_buckets

    def recorded(*args, **kwargs):
        buckets = original(*args, **kwargs)
        plans.append([b.rows.tolist() for b in buckets])
        return buckets

    monkeypatch.setattr(forward, "plain_buckets", recorded)
    return plans


def test_rows_are_laid_out_as_their_real_tokens_in_buckets_by_length():
    prompt_ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    prompt_mask = (prompt_ids > 0).long()
    response_ids = torch.tensor([[11, 12, 0, 0, 0, 0], [13, 14, 15, 16, 17, 18]])
    response_mask = (response_ids > 0).float()
    model = build_tiny_model(vocab_size=40)
    one, = plain_buckets(model, prompt_ids, prompt_mask, response_ids, response_mask, None)
    assert one.rows.tolist() == [0, 1]
    ids, mask = one.inputs["input_ids"], one.inputs["attention_mask"]
    assert ids.shape == (2, 10)  # the longest row's 4 + 6 real tokens: no column of padding in both
    assert ids[0, :4].tolist() == [5, 6, 11, 12] and mask[0].tolist() == [1] * 4 + [0] * 6
    assert ids[1].tolist() == [7, 8, 9, 10, 13, 14, 15, 16, 17, 18] and mask[1].tolist() == [1] * 10
    assert one.inputs["position_ids"][0].tolist() == list(range(10))
    # row 0's response tokens are predicted at its positions 1, 2; row 1's at 3..8 (of the kept last 9)
    assert one.kept == 10 - 2 + 1
    assert one.picked.tolist() == [0, 1] + [9 + t for t in range(2, 8)]
    assert one.placed.tolist() == [0, 1] + [6 + t for t in range(6)]


def test_uneven_rows_split_where_the_padding_outweighs_a_forward_and_a_sharded_model_never_does(monkeypatch):
    model = build_tiny_model(vocab_size=40)
    prompt_ids, prompt_mask = torch.full((4, 10), 5), torch.ones(4, 10, dtype=torch.long)
    lengths = torch.tensor([300, 5, 290, 8])
    response_mask = (torch.arange(300)[None, :] < lengths[:, None]).float()
    response_ids = torch.full((4, 300), 7) * response_mask.long()
    batch = (prompt_ids, prompt_mask, response_ids, response_mask)
    buckets = plain_buckets(model, *batch, None)
    assert [b.rows.tolist() for b in buckets] == [[0, 2], [3, 1]]  # longest first
    assert [b.inputs["input_ids"].shape[1] for b in buckets] == [310, 18]
    even = plain_buckets(model, prompt_ids, prompt_mask, response_ids[:, :8], torch.ones(4, 8), None)
    assert [b.rows.tolist() for b in even] == [[0, 1, 2, 3]]
    # FSDP2: each rank's own lengths must not change how many forwards (all-gathers) it runs
    monkeypatch.setattr(plain_forward, "any_sharded", lambda model: True)
    assert [b.rows.tolist() for b in plain_buckets(model, *batch, None)] == [[0, 1, 2, 3]]


def test_an_empty_prompt_is_refused():
    model = build_tiny_model(vocab_size=40)
    with pytest.raises(ValueError, match="prompt is empty"):
        plain_buckets(model, torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3), torch.ones(1, 2, dtype=torch.long),
                      torch.ones(1, 2), None)


@pytest.mark.parametrize("arch", sorted(MODELS))
@pytest.mark.parametrize("checkpointed", [False, True])
def test_bucketed_rows_give_the_padded_forwards_logprobs_hidden_states_and_gradients(monkeypatch, arch, checkpointed):
    """fp32, every distinct length its own forward (cost 0): the policy's log-probs and entropies
    (the reference's and the teacher's are the same call without grad), the critic's hidden
    states and full logits (distillation), and the gradients of all of them, against the HF
    forward over the padded rows."""
    model = MODELS[arch]()
    if checkpointed:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = uneven_batch(model.config.vocab_size, group_size=2, seed=3, width=30)
    real = batch[3].bool()
    weights = torch.randn(3, *real.shape, generator=torch.Generator().manual_seed(1)) * batch[3]
    logits = _padded_logits(model, *batch).float() / 0.9
    logp_all = logits.log_softmax(-1)
    expected_logp = logp_all.gather(-1, batch[2].unsqueeze(-1)).squeeze(-1)
    expected_entropy = -(logp_all.exp() * logp_all).sum(-1)
    expected_loss = ((expected_logp * weights[0]).sum() + (expected_entropy * weights[1]).sum()
                     + (logits * weights[2, ..., None]).sum())
    expected = torch.autograd.grad(expected_loss, list(model.parameters()))

    plans = _fallback(monkeypatch, cost_tokens=0)
    logp, entropy = forward.sequence_logprobs(model, *batch, with_entropy=True, temperature=0.9, chunk_tokens=7)
    got_logits = forward.sequence_logits(model, *batch).float() / 0.9
    hidden = forward.sequence_hidden_states(model, *batch)
    loss = (logp * weights[0]).sum() + (entropy * weights[1]).sum() + (got_logits * weights[2, ..., None]).sum()
    got = torch.autograd.grad(loss, list(model.parameters()))

    distinct = {int(n) for n in (batch[1].sum(1) + batch[3].sum(1)).tolist()}
    assert len(plans) == 3 and all(len(plan) == len(distinct) > 2 for plan in plans)
    torch.testing.assert_close(logp[real], expected_logp[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy[real], expected_entropy[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_logits[real], logits[real], atol=1e-5, rtol=1e-5)
    assert torch.equal(logp[~real], torch.zeros_like(logp[~real]))  # padding is not scored
    with torch.no_grad():
        decoder = model.get_decoder()
        attention_mask = torch.cat([batch[1], batch[3].long()], dim=1)
        padded_hidden = decoder(input_ids=torch.cat([batch[0], batch[2]], dim=1), attention_mask=attention_mask,
                                position_ids=(attention_mask.cumsum(1) - 1).clamp(min=0)).last_hidden_state
        padded_hidden = padded_hidden[:, batch[0].shape[1] - 1: -1]
    torch.testing.assert_close(hidden[real].detach(), padded_hidden[real], atol=1e-5, rtol=1e-5)
    for (name, _), a, b in zip(model.named_parameters(), got, expected):
        torch.testing.assert_close(a, b, atol=1e-5 * max(1.0, float(b.abs().max())), rtol=1e-4, msg=name)


def test_the_samplers_support_is_read_at_each_rows_own_tokens(monkeypatch):
    """keep_sampling_mask (DeepSeek-V3.2): each token's top-k support size travels with it into
    its bucket, so log-probs restricted to it do not depend on the buckets."""
    model = smollm2_shaped()
    batch = uneven_batch(model.config.vocab_size, group_size=2, seed=4, width=30)
    support = torch.randint(1, 6, batch[3].shape, generator=torch.Generator().manual_seed(5))
    _fallback(monkeypatch, cost_tokens=1 << 30)
    one, _ = forward.sequence_logprobs(model, *batch, support_size=support)
    plans = _fallback(monkeypatch, cost_tokens=0)
    many, _ = forward.sequence_logprobs(model, *batch, support_size=support)
    assert len(plans[0]) > 2
    real = batch[3].bool()
    torch.testing.assert_close(many[real], one[real], atol=1e-5, rtol=1e-5)
    full, _ = forward.sequence_logprobs(model, *batch)
    assert (many[real] > full[real] + 1e-4).any()  # the support changed them: the test reads it
