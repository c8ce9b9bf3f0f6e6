import math

import pytest
import torch

from posttrain.core import entropy_from_logits, logprobs_from_logits


def test_logprobs_match_log_softmax_gather():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, dtype=torch.float64)
    labels = torch.randint(0, 11, (3, 5))
    expected = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logprobs_from_logits(logits, labels), expected)


def test_logprobs_hand_value_and_ignore_index():
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0]]])
    labels = torch.tensor([[1, -100]])
    out = logprobs_from_logits(logits, labels)
    assert out[0, 0].item() == pytest.approx(math.log(0.75))
    assert out[0, 1].item() == 0.0


def test_logprobs_half_precision_runs_in_float32():
    torch.manual_seed(1)
    logits = torch.randn(2, 4, 50) * 5
    labels = torch.randint(0, 50, (2, 4))
    out = logprobs_from_logits(logits.to(torch.bfloat16), labels)
    assert out.dtype == torch.float32
    ref = logprobs_from_logits(logits.to(torch.bfloat16).float(), labels)
    torch.testing.assert_close(out, ref)


def test_logprobs_shape_mismatch_raises():
    with pytest.raises(ValueError, match="labels"):
        logprobs_from_logits(torch.zeros(2, 3, 4), torch.zeros(2, 4, dtype=torch.long))


def test_entropy_hand_values():
    uniform = torch.zeros(1, 1, 8, dtype=torch.float64)
    assert entropy_from_logits(uniform).item() == pytest.approx(math.log(8))
    two = torch.log(torch.tensor([[[0.25, 0.75]]], dtype=torch.float64))
    expected = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert entropy_from_logits(two).item() == pytest.approx(expected)


def test_entropy_with_banned_tokens_is_finite_with_finite_grad():
    logits = torch.tensor([[[0.0, 0.0, float("-inf"), float("-inf")]]], requires_grad=True)
    h = entropy_from_logits(logits)
    assert h.item() == pytest.approx(math.log(2))
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_entropy_half_precision():
    torch.manual_seed(2)
    logits = torch.randn(2, 3, 20)
    out = entropy_from_logits(logits.half())
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, entropy_from_logits(logits.half().float()))


def test_nan_logits_are_caught_before_the_loss():
    from posttrain.core import aggregate_loss

    logits = torch.zeros(1, 2, 3)
    logits[0, 0, 1] = float("nan")
    with pytest.raises(ValueError, match="loss_mat"):
        aggregate_loss(-entropy_from_logits(logits), torch.ones(1, 2), "token-mean")
