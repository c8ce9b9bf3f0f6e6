import pytest
import torch

from posttrain.core.aggregation import AGGREGATION_MODES, aggregate_loss, count_tokens_and_seqs

D = torch.float64
L = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [5.0, 5.0, 5.0]], dtype=D)
M = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)  # last row all padding


def test_hand_values():
    assert aggregate_loss(L, M, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate_loss(L, M, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate_loss(L, M, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate_loss(L, M, "seq-mean-token-sum-norm").item() == pytest.approx((6 / 3 + 4 / 3) / 2)
    assert aggregate_loss(L, M, "seq-mean-token-sum-norm", norm_constant=10).item() == pytest.approx((0.6 + 0.4) / 2)
    assert aggregate_loss(L, M, "token-mean", num_tokens=8).item() == pytest.approx(10 / 8)
    assert aggregate_loss(L, M, "seq-mean-token-sum", num_seqs=5).item() == pytest.approx(10 / 5)
    assert aggregate_loss(L, M, "token-sum").item() == pytest.approx(10)
    assert aggregate_loss(L, M, "token-sum", num_tokens=8, num_seqs=5, norm_constant=7).item() == pytest.approx(10)


def test_dp_size_multiplies_every_mode():
    """verl / OpenRLHF: masked_sum / global_tokens * dp_size (and / global_seqs * dp_size)."""
    assert aggregate_loss(L, M, "token-mean", num_tokens=8, dp_size=2).item() == pytest.approx(10 / 8 * 2)
    assert aggregate_loss(L, M, "seq-mean-token-mean", num_seqs=4, dp_size=4).item() == pytest.approx((2 + 4) / 4 * 4)
    assert aggregate_loss(L, M, "token-sum", dp_size=3).item() == pytest.approx(30)
    for mode in AGGREGATION_MODES:
        one = aggregate_loss(L, M, mode, num_tokens=8, num_seqs=5)
        assert aggregate_loss(L, M, mode, num_tokens=8, num_seqs=5, dp_size=8).item() == pytest.approx(8 * one.item())
    for bad in (0, -1, 1.5, 2.0, True, None):
        with pytest.raises(ValueError, match="dp_size"):
            aggregate_loss(L, M, "token-mean", dp_size=bad)


def test_count_empty_rows_counts_all_padding_rows():
    """TRL: ((l*m).sum(-1) / m.sum(-1).clamp(min=1)).mean() divides by all B = 3 rows; by
    default (verl, OpenRLHF) the all-padding row is not counted."""
    kw = dict(count_empty_rows=True)
    assert aggregate_loss(L, M, "seq-mean-token-mean", **kw).item() == pytest.approx((2 + 4) / 3)
    assert aggregate_loss(L, M, "seq-mean-token-sum", **kw).item() == pytest.approx((6 + 4) / 3)
    assert aggregate_loss(L, M, "seq-mean-token-sum-norm", **kw).item() == pytest.approx((6 / 3 + 4 / 3) / 3)
    # TRL dr_grpo: sum / (B * max_completion_length)
    assert aggregate_loss(L, M, "seq-mean-token-sum-norm", norm_constant=5, **kw).item() == pytest.approx(10 / (3 * 5))
    # token modes do not count sequences
    assert aggregate_loss(L, M, "token-mean", **kw).item() == pytest.approx(10 / 4)
    assert aggregate_loss(L, M, "token-sum", **kw).item() == pytest.approx(10)
    # explicit counts win
    assert aggregate_loss(L, M, "seq-mean-token-sum", num_seqs=5, **kw).item() == pytest.approx(10 / 5)
    n_tok, n_seq = count_tokens_and_seqs(M, count_empty_rows=True)
    assert (n_tok.item(), n_seq.item()) == (4, 3)
    assert count_tokens_and_seqs(M)[1].item() == 2
    # a batch of nothing but padding: 0, not NaN
    assert aggregate_loss(L, torch.zeros(3, 3), "seq-mean-token-mean", **kw).item() == 0.0
    with pytest.raises(ValueError, match="count_empty_rows"):
        aggregate_loss(L, M, "seq-mean-token-mean", count_empty_rows="yes")


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_micro_batches_with_empty_rows_counted(mode):
    torch.manual_seed(1)
    B, T = 6, 5
    lengths = torch.tensor([5, 0, 2, 0, 4, 1])
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    loss_mat = torch.randn(B, T, dtype=D)
    n_tok, n_seq = count_tokens_and_seqs(mask, count_empty_rows=True)
    assert n_seq.item() == 6
    full = aggregate_loss(loss_mat, mask, mode, count_empty_rows=True)
    total = sum(
        aggregate_loss(loss_mat[idx], mask[idx], mode, num_tokens=n_tok, num_seqs=n_seq, count_empty_rows=True)
        for idx in ([0, 1], [2, 3], [4, 5])
    )
    torch.testing.assert_close(total, full)


def test_modes_differ_on_unequal_lengths():
    values = {m: aggregate_loss(L, M, m).item() for m in AGGREGATION_MODES}
    assert len(set(values.values())) == len(AGGREGATION_MODES)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_micro_batches_with_global_counts_sum_to_full_batch(mode):
    torch.manual_seed(0)
    B, T = 7, 9
    lengths = torch.tensor([9, 3, 0, 5, 1, 9, 6])
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    loss_mat = torch.randn(B, T, dtype=D, requires_grad=True)
    n_tok, n_seq = count_tokens_and_seqs(mask)
    assert n_tok.item() == 33 and n_seq.item() == 6
    full = aggregate_loss(loss_mat, mask, mode, norm_constant=T)
    (g_full,) = torch.autograd.grad(full, loss_mat)
    total = 0.0
    for idx in ([0, 1], [2, 3, 4], [5, 6]):
        # micro-batches may be trimmed to their own max length: pass the constant explicitly
        t_max = max(int(lengths[idx].max()), 1)
        total = total + aggregate_loss(
            loss_mat[idx, :t_max], mask[idx, :t_max], mode,
            num_tokens=n_tok, num_seqs=n_seq, norm_constant=T,
        )
    (g_micro,) = torch.autograd.grad(total, loss_mat)
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(g_micro, g_full)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_empty_mask_gives_zero_and_zero_grad(mode):
    loss_mat = torch.randn(3, 4, dtype=D, requires_grad=True)
    out = aggregate_loss(loss_mat, torch.zeros(3, 4), mode)
    assert out.item() == 0.0
    out.backward()
    assert (loss_mat.grad == 0).all()
    # a zero global count is also defined
    assert aggregate_loss(loss_mat, torch.zeros(3, 4), mode, num_tokens=0, num_seqs=0).item() == 0.0


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_nan_in_padding_does_not_leak(mode):
    loss_mat = L.clone()
    loss_mat[1, 2] = float("nan")
    loss_mat[2, 0] = float("inf")
    assert torch.isfinite(aggregate_loss(loss_mat, M, mode))


def test_errors():
    with pytest.raises(ValueError, match=r"unknown loss aggregation mode 'mean'.*token-mean"):
        aggregate_loss(L, M, "mean")
    with pytest.raises(ValueError, match="mask"):
        aggregate_loss(L, M[:, :2], "token-mean")
    with pytest.raises(ValueError, match="num_tokens"):
        aggregate_loss(L, M, "token-mean", num_tokens=float("nan"))
    with pytest.raises(ValueError, match="norm_constant"):
        aggregate_loss(L, M, "seq-mean-token-sum-norm", norm_constant=0)


def test_nan_at_valid_token_raises():
    bad = L.clone()
    bad[0, 1] = float("nan")
    with pytest.raises(ValueError, match="loss_mat"):
        aggregate_loss(bad, M, "token-mean")
