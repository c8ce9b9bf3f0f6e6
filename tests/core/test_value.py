import pytest
import torch

from posttrain.core.logprobs import logprobs_from_logits
from posttrain.core.value import ptx_loss, value_loss

D = torch.float64


def test_value_loss_clipping_hand_values():
    values = torch.tensor([[1.5, 0.9, 7.0]], dtype=D, requires_grad=True)
    old = torch.tensor([[1.0, 1.0, 0.0]], dtype=D)
    returns = torch.tensor([[2.0, 0.5, 0.0]], dtype=D)
    mask = torch.tensor([[1, 1, 0]])
    loss, stats = value_loss(values, old, returns, mask, clip_range=0.2)
    # token 0: V clipped to 1.2; max((1.5-2)^2, (1.2-2)^2) = 0.64 -> 0.32 (clipped branch wins)
    # token 1: 0.9 is inside [0.8, 1.2]; 0.5 * 0.16 = 0.08
    assert loss.item() == pytest.approx((0.32 + 0.08) / 2)
    loss.backward()
    assert values.grad[0, 0].item() == 0.0  # clipped: no gradient
    assert values.grad[0, 1].item() == pytest.approx((0.9 - 0.5) / 2)
    assert values.grad[0, 2].item() == 0.0
    assert stats["vf_clip_frac"].item() == 0.5
    assert stats["vpred_mean"].item() == pytest.approx(1.2)
    assert stats["value_mse"].item() == pytest.approx((0.25 + 0.16) / 2)


def test_value_loss_unclipped_and_errors():
    values = torch.tensor([[1.5, 0.9]], dtype=D)
    loss, stats = value_loss(values, values, torch.tensor([[2.0, 0.5]], dtype=D), torch.ones(1, 2))
    assert loss.item() == pytest.approx(0.5 * (0.25 + 0.16) / 2)
    assert stats["vf_clip_frac"].item() == 0.0
    with pytest.raises(ValueError, match="returns"):
        value_loss(values, values, torch.tensor([[float("nan"), 0.5]], dtype=D), torch.ones(1, 2))
    empty, _ = value_loss(values, values, values, torch.zeros(1, 2), clip_range=0.2)
    assert empty.item() == 0.0


def test_ptx_loss_is_pretraining_nll():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5, dtype=D)
    labels = torch.randint(0, 5, (2, 3))
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    logp = logprobs_from_logits(logits, labels)
    expected = -(logp[0].sum() + logp[1, 0]) / 4
    assert ptx_loss(logp, mask).item() == pytest.approx(expected.item())
    assert ptx_loss(logits, mask, labels).item() == pytest.approx(expected.item())
    assert ptx_loss(logp, mask, agg_mode="seq-mean-token-mean").item() == pytest.approx(
        -(logp[0].mean() + logp[1, 0]).item() / 2
    )
    with pytest.raises(ValueError, match="labels"):
        ptx_loss(logits, mask)


def test_value_and_ptx_pass_dp_size_and_count_empty_rows():
    values = torch.tensor([[1.5, 0.9], [2.0, 0.0], [7.0, 7.0]], dtype=D)
    returns = torch.tensor([[2.0, 0.5], [1.0, 0.0], [0.0, 0.0]], dtype=D)
    mask = torch.tensor([[1, 1], [1, 0], [0, 0]])  # last row all padding
    per_seq = [0.5 * (0.25 + 0.16) / 2, 0.5 * 1.0]
    loss, _ = value_loss(values, values, returns, mask, agg_mode="seq-mean-token-mean")
    assert loss.item() == pytest.approx(sum(per_seq) / 2)
    kw = dict(agg_mode="seq-mean-token-mean", count_empty_rows=True, dp_size=4)
    loss, _ = value_loss(values, values, returns, mask, **kw)
    assert loss.item() == pytest.approx(sum(per_seq) / 3 * 4)
    loss, _ = value_loss(values, values, returns, mask, agg_mode="token-sum")
    assert loss.item() == pytest.approx(0.5 * (0.25 + 0.16 + 1.0))
    logp = torch.tensor([[-1.0, -2.0], [-4.0, 0.0], [0.0, 0.0]], dtype=D)
    assert ptx_loss(logp, mask, agg_mode="seq-mean-token-mean", count_empty_rows=True).item() == pytest.approx(
        (1.5 + 4.0) / 3
    )
    assert ptx_loss(logp, mask, num_tokens=6, dp_size=2).item() == pytest.approx(7.0 / 6 * 2)
    with pytest.raises(ValueError, match="dp_size"):
        ptx_loss(logp, mask, dp_size=0)


def test_explained_variance_hand_values():
    from posttrain.core import explained_variance

    returns = torch.tensor([[1.0, 2.0, 3.0, 99.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the padded 99 must not count
    # Var(R) = 2/3 (population); residual R - V = [0, 0, 1] has Var = 2/9 -> 1 - (2/9)/(2/3) = 2/3
    values = torch.tensor([[1.0, 2.0, 2.0, 0.0]])
    torch.testing.assert_close(explained_variance(values, returns, mask), torch.tensor(2.0 / 3.0))
    torch.testing.assert_close(explained_variance(returns, returns, mask), torch.tensor(1.0))  # perfect
    flat = torch.tensor([[5.0, 5.0, 5.0, 0.0]])
    assert float(explained_variance(values, flat, mask)) == 0.0  # targets that do not vary
