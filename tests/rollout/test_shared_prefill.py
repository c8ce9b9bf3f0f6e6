"""Shared-prompt prefill (src/posttrain/models/functional.py): a batch of runs of identical
prompts (online RL's ``repeat_interleave(group_size)``) is prefilled once per run, and the
rollout is the same as prefilling every row."""

from __future__ import annotations

import pytest
import torch
from test_rollout import _left_padded, llama, qwen  # noqa: F401  (fixtures: the tiny qwen2 and GQA llama)

from posttrain.rollout import FastSampler, SamplingParams
from posttrain.models import functional
from posttrain.models.functional import prompt_group_size

PADS = (0, 3, 1, 5)  # left padding of different widths, one width per distinct prompt
PLEN = 7


def _runs(pads, group, vocab, seed=0):
    """len(pads) distinct left-padded prompts, each repeated ``group`` times in a row."""
    ids, mask = _left_padded(vocab, pads, PLEN, seed=seed)
    return ids.repeat_interleave(group, dim=0), mask.repeat_interleave(group, dim=0)


def test_prompt_group_size_finds_equal_runs_of_identical_rows():
    ids, mask = _runs(PADS, 3, vocab=20)
    assert prompt_group_size(ids, mask) == 3
    assert prompt_group_size(ids[:1], mask[:1]) == 1  # one row: nothing to share
    assert prompt_group_size(ids[:3], mask[:3]) == 3  # one prompt, all rows the same
    assert prompt_group_size(ids[:-1], mask[:-1]) == 1  # the last run is shorter
    order = torch.arange(len(ids)).view(len(PADS), 3).t().reshape(-1)  # repeat(), not repeat_interleave()
    assert prompt_group_size(ids[order], mask[order]) == 1  # identical rows, not consecutive
    distinct, distinct_mask = _left_padded(20, PADS, PLEN)
    assert prompt_group_size(distinct, distinct_mask) == 1
    # same ids, a different mask: a different prompt
    ids, mask = _runs((0,), 2, vocab=20)
    mask[1, 0] = 0
    assert prompt_group_size(ids, mask) == 1


def _generate(model, ids, mask, seed=0, **sampler):
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    generator = torch.Generator().manual_seed(seed)
    return FastSampler(**sampler).generate(model, ids, mask, params, eos_token_id=1, pad_token_id=0, generator=generator)


def _prefill_rows(monkeypatch):
    """Record how many rows the prefill forward runs on (the first rotary call of a prefill)."""
    seen = []
    original = functional._rope_
    monkeypatch.setattr(functional, "_rope_", lambda x, rotation: seen.append(x.shape[0]) or original(x, rotation))
    return seen


@pytest.mark.parametrize("arch", ["qwen", "llama"])  # llama: GQA (4 query / 2 kv heads), biases
@pytest.mark.parametrize("group", [1, 4])
def test_rollout_is_the_same_with_and_without_sharing(arch, group, request, monkeypatch):
    model = request.getfixturevalue(arch)
    ids, mask = _runs(PADS, group, model.config.vocab_size)
    seen = _prefill_rows(monkeypatch)
    shared = _generate(model, ids, mask)
    assert seen[0] == len(PADS)  # one forward row per distinct prompt
    monkeypatch.setattr(functional, "prompt_group_size", lambda ids, mask: 1)  # sharing off
    seen.clear()
    every_row = _generate(model, ids, mask)
    assert seen[0] == len(ids)
    assert torch.equal(shared.response_ids, every_row.response_ids)
    assert torch.equal(shared.response_mask, every_row.response_mask)
    torch.testing.assert_close(shared.logprobs, every_row.logprobs, atol=1e-6, rtol=0)
    # the rows of a run do not repeat each other's samples: each draws its own
    if group > 1:
        assert not torch.equal(shared.response_ids[0], shared.response_ids[1])


def test_unequal_runs_are_prefilled_row_by_row(qwen, monkeypatch):
    ids, mask = _left_padded(qwen.config.vocab_size, PADS, PLEN)
    runs = torch.tensor([2, 2, 2, 1])
    ids, mask = ids.repeat_interleave(runs, dim=0), mask.repeat_interleave(runs, dim=0)
    seen = _prefill_rows(monkeypatch)
    _generate(qwen, ids, mask)
    assert seen[0] == len(ids)


@pytest.mark.parametrize("arch", ["qwen", "llama"])
def test_hf_loop_fallback_agrees_with_the_shared_prefill(arch, request):
    """``use_functional=False`` never shares (it is the HF forward with its own cache) and
    samples the same tokens as the shared functional path."""
    model = request.getfixturevalue(arch)
    ids, mask = _runs(PADS, 4, model.config.vocab_size)
    shared = _generate(model, ids, mask)
    hf_loop = _generate(model, ids, mask, use_functional=False)
    assert torch.equal(shared.response_ids, hf_loop.response_ids)
    torch.testing.assert_close(shared.logprobs, hf_loop.logprobs, atol=1e-4, rtol=0)
