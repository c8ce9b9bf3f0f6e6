"""core.weighted_head_sum: the reward of a multi-head reward model, sum_h w_h * r_h, by hand."""

from __future__ import annotations

import pytest
import torch

from posttrain.core import weighted_head_sum


def test_weighted_sum_of_two_heads_by_hand():
    scores = torch.tensor([[2.0, -1.0], [0.5, 4.0], [-3.0, 0.0]])  # [B=3, H=2]: correct, concise
    reward = weighted_head_sum(scores, [1.0, 0.3])
    # 2 - 0.3 = 1.7; 0.5 + 1.2 = 1.7; -3 + 0 = -3
    assert reward.tolist() == pytest.approx([1.7, 1.7, -3.0])


def test_a_zero_weight_drops_its_head_and_one_head_is_scaled():
    scores = torch.tensor([[2.0, -1.0], [0.5, 4.0]])
    assert weighted_head_sum(scores, [0.0, 1.0]).tolist() == pytest.approx([-1.0, 4.0])
    assert weighted_head_sum(scores[:, :1], [2.5]).tolist() == pytest.approx([5.0, 1.25])


def test_leading_dimensions_are_kept():
    scores = torch.arange(12, dtype=torch.float32).reshape(2, 3, 2)  # [models, B, H]
    reward = weighted_head_sum(scores, torch.tensor([1.0, -1.0]))
    assert reward.shape == (2, 3)
    assert reward.tolist() == [[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]]  # 2k - (2k + 1)


def test_weights_must_match_the_heads_and_be_finite():
    scores = torch.zeros(4, 2)
    with pytest.raises(ValueError, match="weights must be"):
        weighted_head_sum(scores, [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="weights"):
        weighted_head_sum(scores, [1.0, float("nan")])
