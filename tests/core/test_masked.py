import math
import threading

import pytest
import torch

from posttrain.core import masked_mean, masked_sum, masked_var, masked_whiten
from posttrain.core.groups import group_ids, group_max, group_mean, group_min, group_std

X = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 0.0, 0.0]], dtype=torch.float64)
M = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)


def test_masked_sum_and_mean_hand_values():
    assert masked_sum(X, M).item() == 36.0
    assert masked_sum(X, M, dim=-1).tolist() == [6.0, 30.0]
    assert masked_mean(X, M).item() == pytest.approx(36.0 / 5)
    assert masked_mean(X, M, dim=-1).tolist() == [2.0, 15.0]
    # float masks act as weights
    w = torch.tensor([[0.5, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    assert masked_mean(X, w).item() == pytest.approx((0.5 + 2.0) / 1.5)


def test_masked_mean_empty_is_zero_not_nan():
    empty = torch.zeros_like(M)
    assert masked_mean(X, empty).item() == 0.0
    assert masked_mean(X, empty, dim=-1).tolist() == [0.0, 0.0]
    rows = masked_mean(X, torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0]]), dim=-1)
    assert rows.tolist() == [1.0, 0.0]


def test_nan_and_inf_in_padding_do_not_leak():
    x = X.clone()
    x[0, 3] = float("nan")
    x[1, 2] = float("inf")
    x.requires_grad_(True)
    out = masked_mean(x, M)
    assert out.item() == pytest.approx(36.0 / 5)
    out.backward()
    assert torch.isfinite(x.grad).all()
    assert x.grad[0, 3] == 0 and x.grad[1, 2] == 0


def test_masked_var_matches_torch_and_single_element_is_zero():
    assert masked_var(X, M).item() == pytest.approx(torch.tensor([1.0, 2, 3, 10, 20]).var().item())
    assert masked_var(X, M, unbiased=False).item() == pytest.approx(
        torch.tensor([1.0, 2, 3, 10, 20]).var(unbiased=False).item()
    )
    one = torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0]])
    assert masked_var(X, one).item() == 0.0
    assert masked_var(X, torch.zeros_like(M)).item() == 0.0


def test_masked_whiten():
    w = masked_whiten(X, M)
    vals = w[M]
    assert vals.mean().item() == pytest.approx(0.0, abs=1e-12)
    assert vals.var().item() == pytest.approx(1.0, rel=1e-6)
    assert (w[~M] == 0).all()
    scaled = masked_whiten(X, M, shift_mean=False)
    assert scaled[M].mean().item() == pytest.approx(36.0 / 5)
    const = masked_whiten(torch.full_like(X, 3.0), M)
    assert (const == 0).all()
    assert masked_whiten(X, torch.zeros_like(M)).abs().sum() == 0


def two_parts_summed(parts, fn):
    """fn(x, mask, batch_sum) on each part in a thread of its own, with a batch_sum that adds the
    other part's statistic, as an all-reduce over two ranks would."""
    barrier, shared, results = threading.Barrier(2), [None, None], [None, None]

    def run(i):
        def batch_sum(t):
            shared[i] = t
            barrier.wait()
            total = shared[0] + shared[1]
            barrier.wait()  # both have read before the next statistic is written
            return total

        results[i] = fn(*parts[i], batch_sum)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_batch_statistics_with_batch_sum_are_the_whole_batchs():
    # parts [1, 2, (pad 9)] and [3, 4, 5]: the union 1..5 has mean 3, unbiased var 2.5
    parts = [(torch.tensor([[1.0, 2.0, 9.0]]), torch.tensor([[1, 1, 0]])),
             (torch.tensor([[3.0, 4.0, 5.0]]), torch.tensor([[1, 1, 1]]))]
    means = two_parts_summed(parts, lambda x, m, bs: masked_mean(x, m, batch_sum=bs))
    variances = two_parts_summed(parts, lambda x, m, bs: masked_var(x, m, batch_sum=bs))
    whitened = two_parts_summed(parts, lambda x, m, bs: masked_whiten(x, m, eps=0.0, batch_sum=bs))
    assert [float(v) for v in means] == [3.0, 3.0]
    assert [float(v) for v in variances] == pytest.approx([2.5, 2.5])
    scale = 1 / math.sqrt(2.5)
    assert whitened[0][0].tolist() == pytest.approx([-2 * scale, -scale, 0.0])  # padding: 0
    assert whitened[1][0].tolist() == pytest.approx([0.0, scale, 2 * scale])
    with pytest.raises(ValueError, match="dim=None"):
        masked_mean(parts[0][0], parts[0][1], dim=1, batch_sum=lambda t: t)


def test_group_statistics_non_contiguous_ids():
    x = torch.tensor([1.0, 10.0, 2.0, 3.0, 20.0, 7.0], dtype=torch.float64)
    gid = torch.tensor([5, 2, 5, 5, 2, 9])
    g = group_ids(gid, 6)
    assert g.num_groups == 3
    assert group_mean(x, g).tolist() == [2.0, 15.0, 2.0, 2.0, 15.0, 7.0]
    std = group_std(x, g)
    assert std[0].item() == pytest.approx(1.0)
    assert std[1].item() == pytest.approx(math.sqrt(50.0))
    assert std[5].item() == 0.0  # size-1 group: defined as 0, not NaN
    assert group_min(x, g).tolist() == [1.0, 10.0, 1.0, 1.0, 10.0, 7.0]
    assert group_max(x, g).tolist() == [3.0, 20.0, 3.0, 3.0, 20.0, 7.0]
    with pytest.raises(ValueError, match="group_index"):
        group_ids(torch.tensor([0, 1]), 3)
    with pytest.raises(ValueError, match="integer"):
        group_ids(torch.tensor([0.0, 1.0, 1.0]), 3)


def _masked_losses():
    """Every differentiable masked loss in core as fn(x [2,3], garbage-bearing inputs) -> scalar."""
    from posttrain.core import (
        POLICY_LOSSES, aggregate_loss, kdrl_loss, kl_penalty, ptx_loss, value_loss,
    )

    out = {f"policy/{n}": (lambda n: lambda x, o, a: POLICY_LOSSES[n](x, o, a, PAD_MASK)[0])(n) for n in POLICY_LOSSES}
    for k in ("k1", "k2", "k3", "k3_unbiased", "k3_st"):
        out[f"kl/{k}"] = (lambda k: lambda x, o, a: aggregate_loss(kl_penalty(k, x, o, o, mask=PAD_MASK), PAD_MASK, "token-mean"))(k)
    out["value"] = lambda x, o, a: value_loss(x, o, a, PAD_MASK, clip_range=0.2)[0]
    out["kdrl"] = lambda x, o, a: kdrl_loss(x, o, PAD_MASK)[0]
    out["ptx"] = lambda x, o, a: ptx_loss(x, PAD_MASK)
    return out


PAD_MASK = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)


@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("name", sorted(_masked_losses()))
def test_padding_garbage_never_reaches_values_or_gradients(name, garbage):
    """NaN/inf in padding of any input (here also of the differentiated one) gives the same loss and
    gradient as clean padding, and exactly 0 gradient at padded positions."""
    fn = _masked_losses()[name]
    base = torch.tensor([[-1.0, -2.0, -1.5], [-0.5, -1.2, -0.7]], dtype=torch.float64)
    other = torch.tensor([[-1.1, -1.8, -1.0], [-0.3, -1.0, -1.0]], dtype=torch.float64)
    third = torch.tensor([[1.0, -0.5, 2.0], [-1.0, 0.3, 0.1]], dtype=torch.float64)
    results = []
    for fill in (0.0, garbage):
        x = base.masked_fill(~PAD_MASK, fill).requires_grad_(True)
        o, a = other.masked_fill(~PAD_MASK, fill), third.masked_fill(~PAD_MASK, fill)
        loss = fn(x, o, a)
        (grad,) = torch.autograd.grad(loss, x)
        results.append((loss, grad))
    (clean_loss, clean_grad), (loss, grad) = results
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    torch.testing.assert_close(loss, clean_loss)
    torch.testing.assert_close(grad, clean_grad)
    assert (grad[~PAD_MASK] == 0).all() and grad[PAD_MASK].abs().sum() > 0


def test_drop_truncated_empties_the_truncated_rows_only():
    from posttrain.core import count_tokens_and_seqs, drop_truncated

    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    out = drop_truncated(mask, torch.tensor([True, False, False]))
    assert torch.equal(out, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))
    # the dropped row leaves the token count; whether it is still a sequence is the aggregation's choice
    assert [float(x) for x in count_tokens_and_seqs(out)] == [3.0, 2.0]
    assert [float(x) for x in count_tokens_and_seqs(out, count_empty_rows=True)] == [3.0, 3.0]
    with pytest.raises(ValueError, match="truncated"):
        drop_truncated(mask, torch.tensor([True, False]))
