"""The grouped forward's response attention in length buckets (models/grouped_forward.py):
which rows share a bucket, and that the log-probs and gradients do not depend on it."""

from __future__ import annotations

import pytest
import torch

from posttrain.models import grouped_forward
from posttrain.models.forward import sequence_hidden_states, sequence_logprobs
from posttrain.models.grouped_forward import response_buckets
from posttrain.models.tiny import build_tiny_model
from scoring_batches import smollm2_shaped, uneven_batch


def test_even_or_short_rows_stay_one_bucket_in_their_own_order():
    assert response_buckets([3, 3, 3], prompt_length=2, cost_pairs=0) == [[0, 1, 2]]
    # the embedded task's shape: 128 rows of at most 7 queries after a 12-token prompt
    # pad 128 x 7 x 19 = 17,024 pairs in all, under the cost of one more bucket
    assert response_buckets([7] * 100 + [1] * 28, prompt_length=12) == [list(range(128))]


def test_uneven_rows_are_cut_where_the_padding_saved_outweighs_a_bucket():
    # padded: 4 x 100 x 110 = 44,000 pairs; by length: 2 x 100 x 110 + 2 x 2 x 12 = 22,048 (+1,000 a bucket)
    assert response_buckets([100, 2, 100, 2], prompt_length=10, cost_pairs=1_000) == [[0, 2], [1, 3]]
    # the same cut would save 21,952 pairs: not worth a bucket that costs more
    assert response_buckets([100, 2, 100, 2], prompt_length=10, cost_pairs=30_000) == [[0, 1, 2, 3]]
    # three lengths, the two short ones close: 2 buckets (100 | 10, 9), longest first
    assert response_buckets([9, 100, 10, 100], prompt_length=0, cost_pairs=500) == [[1, 3], [2, 0]]
    # with no cost per bucket every distinct length gets its own
    assert response_buckets([9, 100, 10, 100], prompt_length=0, cost_pairs=0) == [[1, 3], [2], [0]]


def test_rows_without_a_query_are_left_out_only_among_several_buckets():
    assert response_buckets([5, 0, 5], prompt_length=1, cost_pairs=0) == [[0, 1, 2]]
    assert response_buckets([50, 0, 3], prompt_length=1, cost_pairs=0) == [[0], [2]]


MODELS = {"embedded": lambda: build_tiny_model(vocab_size=40).train(), "smollm2_shaped": smollm2_shaped}


def _scored(monkeypatch, model, batch, cost_pairs, plans):
    """log-probs, entropies, hidden states and the gradients of a weighted sum of them, with
    `BUCKET_COST_PAIRS` = cost_pairs; each forward's bucket plan is appended to `plans`."""
    monkeypatch.setattr(grouped_forward, "BUCKET_COST_PAIRS", cost_pairs)
    monkeypatch.setattr(grouped_forward, "response_buckets",
                        lambda *a, **k: plans.append(response_buckets(*a, **k)) or plans[-1])
    logp, entropy = sequence_logprobs(model, *batch, with_entropy=True, temperature=0.9)
    hidden = sequence_hidden_states(model, *batch)
    weights = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(1))
    loss = (logp * batch[3]).sum() + 0.1 * entropy.sum() + (hidden * weights).sum()
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return logp.detach(), entropy.detach(), hidden.detach(), grads


@pytest.mark.parametrize("arch", sorted(MODELS))
@pytest.mark.parametrize("group_size", [1, 4])
def test_buckets_give_the_padded_layouts_logprobs_and_gradients(monkeypatch, arch, group_size):
    """fp32: every distinct length in its own bucket (cost 0) against one padded bucket (cost
    never met), for the policy's log-probs and entropies (the reference's and the teacher's are
    the same call without grad) and the critic's hidden states."""
    model = MODELS[arch]()
    batch = uneven_batch(model.config.vocab_size, group_size, seed=group_size)
    one_plans, many_plans = [], []
    padded = _scored(monkeypatch, model, batch, 1 << 40, one_plans)
    bucketed = _scored(monkeypatch, model, batch, 0, many_plans)
    rows = len(batch[0])
    assert all(plan == [list(range(rows))] for plan in one_plans)
    distinct = {n for n in batch[3][:, 1:].sum(dim=1).long().tolist() if n > 0}
    assert len(distinct) >= 2 and len(many_plans) == 2  # both forwards, every distinct length its own bucket
    assert all(len(plan) == len(distinct) for plan in many_plans)
    real = batch[3].bool()
    for name, a, b in zip(("logp", "entropy", "hidden"), bucketed[:3], padded[:3]):
        torch.testing.assert_close(a[real], b[real], atol=1e-5, rtol=1e-5, msg=name)
        assert torch.equal(a[~real], torch.zeros_like(a[~real])), name
    for (name, _), a, b in zip(model.named_parameters(), bucketed[3], padded[3]):  # float32 rounding of sums
        torch.testing.assert_close(a, b, atol=1e-5 * float(b.abs().max()), rtol=1e-5, msg=name)


def test_bucketed_checkpointed_forward_gives_the_same_gradients(monkeypatch):
    model = smollm2_shaped()
    batch = uneven_batch(model.config.vocab_size, 2)
    plain = _scored(monkeypatch, model, batch, 0, [])
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed = _scored(monkeypatch, model, batch, 0, [])
    for a, b in zip(plain[3], checkpointed[3]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
