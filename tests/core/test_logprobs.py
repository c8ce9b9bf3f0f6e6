import math

import pytest
import torch

from posttrain.core import entropy_from_logits, logprobs_from_logits, token_logprobs_and_entropy
from posttrain.core import head_logprobs
from posttrain.core.logprobs import token_logprobs_and_entropy_from_hidden


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


# ---------------------------------------------------------------- token_logprobs_and_entropy


def _reference(logits, labels, support=None):
    """Unchunked float32 (float64 stays float64) log-probs and entropy, optionally with
    logits outside a dense [B, T, V] support mask set to -inf (the old sampling-mask path)."""
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if support is not None:
        z = z.masked_fill(~support, float("-inf"))
    logp_all = torch.log_softmax(z, -1)
    logp = logp_all.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    logp = torch.where(labels < 0, torch.zeros_like(logp), logp)
    p = logp_all.exp()
    entropy = -(p * torch.where(p > 0, logp_all, torch.zeros_like(logp_all))).sum(-1)
    return logp, entropy


def _grads(fn, logits, weights):
    z = logits.detach().clone().requires_grad_(True)
    logp, entropy = fn(z)
    ((logp * weights[0]).sum() + (entropy * weights[1]).sum()).backward()
    return logp.detach(), entropy.detach(), z.grad


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5), (torch.bfloat16, 1e-5)])
@pytest.mark.parametrize("chunk_tokens", [1, 5, 4096])
def test_token_logprobs_and_entropy_match_unchunked_reference_with_grads(dtype, tol, chunk_tokens):
    torch.manual_seed(3)
    logits = (torch.randn(3, 7, 50, dtype=torch.float64) * 4).to(dtype)
    labels = torch.randint(0, 50, (3, 7))
    labels[1, 5:] = -100
    weights = torch.randn(2, 3, 7, dtype=torch.float64).to(torch.float32 if dtype != torch.float64 else dtype)
    ours = _grads(lambda z: token_logprobs_and_entropy(z, labels, with_entropy=True, chunk_tokens=chunk_tokens),
                  logits, weights)
    ref = _grads(lambda z: _reference(z, labels), logits, weights)
    assert ours[0].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    for a, b in zip(ours, ref):
        # the bf16 gradient is rounded to bf16 in both paths (a bf16 ulp is ~0.4% of the value)
        rtol = 1e-2 if a.dtype == torch.bfloat16 else tol
        torch.testing.assert_close(a, b, atol=tol, rtol=rtol)
    assert (ours[0][1, 5:] == 0).all()


def test_chunk_size_does_not_change_results_or_grads():
    torch.manual_seed(4)
    logits = torch.randn(4, 9, 33, dtype=torch.bfloat16)
    labels = torch.randint(0, 33, (4, 9))
    support = torch.randint(0, 34, (4, 9), dtype=torch.int32)
    weights = torch.randn(2, 4, 9)

    def run(chunk):
        return _grads(lambda z: token_logprobs_and_entropy(z, labels, with_entropy=True, support_size=support,
                                                           chunk_tokens=chunk), logits, weights)

    one_chunk = run(4 * 9)
    for chunk in (1, 4, 7):  # smaller than B*T, dividing it or not
        for a, b in zip(run(chunk), one_chunk):
            assert torch.equal(a, b)


def test_sliced_logits_are_chunked_without_copy_and_give_same_result():
    """logits[:, P-1:-1] is not flattenable as a view; rows are chunked separately."""
    torch.manual_seed(5)
    full = torch.randn(2, 8, 13, dtype=torch.float64)
    sliced = full[:, 2:-1]
    labels = torch.randint(0, 13, (2, 5))
    logp, entropy = token_logprobs_and_entropy(sliced, labels, with_entropy=True, chunk_tokens=3)
    ref_logp, ref_entropy = _reference(sliced.contiguous(), labels)
    torch.testing.assert_close(logp, ref_logp)
    torch.testing.assert_close(entropy, ref_entropy)


def test_entropy_is_skipped_or_detached_on_request():
    logits = torch.randn(2, 3, 10, requires_grad=True)
    labels = torch.randint(0, 10, (2, 3))
    logp, entropy = token_logprobs_and_entropy(logits, labels, with_entropy=False)
    assert entropy is None and logp.grad_fn is not None
    logp, entropy = token_logprobs_and_entropy(logits, labels, with_entropy=True, entropy_grad=False)
    assert entropy.grad_fn is None and not entropy.requires_grad
    assert logp.grad_fn is not None
    torch.testing.assert_close(entropy, _reference(logits.detach(), labels)[1])
    logp.sum().backward()  # the log-prob gradient still flows
    assert logits.grad is not None and torch.isfinite(logits.grad).all()


def test_logged_entropy_matches_the_differentiable_one_banned_tokens_and_hand_values():
    """The entropy without gradient (its buffers reused in place) gives the differentiable
    formula's values: hand-computed ones, banned (-inf) tokens counted as 0, float32 sums."""
    from posttrain.core.logprobs import _entropy_for_logging, _entropy_with_grad

    two = torch.log(torch.tensor([[0.25, 0.75, 0.0]]))  # a banned third token
    lse = torch.logsumexp(two, -1)
    expected = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert _entropy_for_logging(two, lse).item() == pytest.approx(expected, abs=1e-6)
    torch.manual_seed(3)
    z = torch.randn(64, 5000) * 4
    z[:8, :1000] = float("-inf")
    lse = torch.logsumexp(z, -1)
    logged, exact = _entropy_for_logging(z, lse), _entropy_with_grad(z, lse)
    assert torch.isfinite(logged).all()
    torch.testing.assert_close(logged, exact, rtol=1e-6, atol=1e-6)
    reference = _entropy_with_grad(z.double(), lse.double()).float()  # float64: the truth
    assert (logged - reference).abs().max() <= (exact - reference).abs().max() + 1e-6
    z[0, 0] = float("nan")  # a NaN logit is not hidden
    assert _entropy_for_logging(z, torch.logsumexp(z, -1))[0].isnan()


def test_no_float32_copy_of_the_whole_logits_is_kept_for_backward():
    """Per-chunk recomputation: what autograd stores until the backward is the half-precision
    logits (views), never float32 tensors larger than one chunk."""
    logits = torch.randn(4, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 64, (4, 16))
    saved = []

    def pack(t):
        saved.append((t.dtype, t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, entropy = token_logprobs_and_entropy(logits, labels, with_entropy=True, chunk_tokens=8)
    assert saved, "expected the chunk inputs to be saved"
    assert all(n <= 8 * 64 for dtype, n in saved if dtype == torch.float32)
    (logp.sum() + entropy.sum()).backward()
    assert logits.grad.dtype == torch.bfloat16


def test_temperature_is_applied_per_chunk():
    torch.manual_seed(6)
    logits = torch.randn(2, 4, 12, dtype=torch.float64)
    labels = torch.randint(0, 12, (2, 4))
    ours = token_logprobs_and_entropy(logits, labels, with_entropy=True, temperature=0.7)
    for a, b in zip(ours, _reference(logits / 0.7, labels)):
        torch.testing.assert_close(a, b)


def _dense_top_k(logits, k):
    """The old dense [B, T, V] mask: True on the k largest logits per position (k = 0: all)."""
    rank = logits.argsort(-1, descending=True).argsort(-1)
    return (rank < k.unsqueeze(-1)) | (k == 0).unsqueeze(-1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_support_size_renormalisation_equals_dense_mask(dtype):
    torch.manual_seed(7)
    vocab = 40
    logits = torch.randn(3, 6, vocab, dtype=torch.float64).to(dtype)
    if dtype == torch.bfloat16:  # distinct values per position (exact in bf16): no ties at the boundary
        logits = (torch.stack([torch.randperm(vocab) for _ in range(3 * 6)]).view(3, 6, vocab) / 8.0).to(dtype)
    k = torch.randint(1, vocab + 1, (3, 6), dtype=torch.int32)
    k[0, 4:] = 0  # padding: no restriction
    dense = _dense_top_k(logits, k)
    # a label inside the support (the sampler only draws from it)
    labels = torch.multinomial(dense.flatten(0, 1).float(), 1).view(3, 6)
    labels[0, 4:] = -100
    weights = torch.randn(2, 3, 6)
    if dtype == torch.float64:
        weights = weights.double()
    ours = _grads(lambda z: token_logprobs_and_entropy(z, labels, with_entropy=True, support_size=k, chunk_tokens=4),
                  logits, weights)
    ref = _grads(lambda z: _reference(z, labels, support=dense), logits, weights)
    for a, b in zip(ours, ref):
        tol = 1e-10 if dtype == torch.float64 else 1e-5
        torch.testing.assert_close(a, b, atol=tol, rtol=1e-2 if a.dtype == torch.bfloat16 else tol)
    assert torch.isfinite(ref[2]).all()


def test_support_size_full_vocab_or_zero_changes_nothing():
    torch.manual_seed(8)
    logits = torch.randn(2, 5, 9, dtype=torch.float64)
    labels = torch.randint(0, 9, (2, 5))
    plain = token_logprobs_and_entropy(logits, labels, with_entropy=True)
    for k in (0, 9):
        full = torch.full((2, 5), k, dtype=torch.int32)
        for a, b in zip(token_logprobs_and_entropy(logits, labels, with_entropy=True, support_size=full), plain):
            torch.testing.assert_close(a, b)


def test_support_is_widened_to_keep_a_label_ranked_just_outside():
    """A sampler/trainer rounding mismatch can rank the sampled token k+1 in the trainer's
    logits; the support then grows to reach it rather than giving log-prob -inf."""
    logits = torch.tensor([[[3.0, 2.0, 1.0, 0.0]]], dtype=torch.float64)
    labels = torch.tensor([[2]])  # rank 3, support_size 2
    logp, _ = token_logprobs_and_entropy(logits, labels, with_entropy=False, support_size=torch.tensor([[2]]))
    expected = torch.log_softmax(logits[..., :3], -1)[..., 2]
    torch.testing.assert_close(logp, expected)


def test_support_size_shape_mismatch_raises():
    with pytest.raises(ValueError, match="support_size"):
        token_logprobs_and_entropy(torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.long), with_entropy=False,
                                   support_size=torch.zeros(2, 4, dtype=torch.int32))


# ---------------------------------------------------------------- from hidden states and the LM head


def test_from_hidden_hand_values():
    """A 2-token vocabulary, hidden size 1: logits (h * w + b) = (0, log 3) give p = (1/4, 3/4)."""
    hidden = torch.tensor([[[1.0], [2.0]]], dtype=torch.float64)
    weight = torch.tensor([[0.0], [math.log(3.0)]], dtype=torch.float64)
    bias = torch.tensor([0.0, 0.0], dtype=torch.float64)
    labels = torch.tensor([[1, -100]])
    logp, entropy = token_logprobs_and_entropy_from_hidden(hidden, weight, labels, bias=bias, with_entropy=True)
    assert logp[0, 0].item() == pytest.approx(math.log(0.75))
    assert logp[0, 1].item() == 0.0  # ignore index
    expected = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert entropy[0, 0].item() == pytest.approx(expected)
    # second position: logits (0, 2 log 3) -> p = (1/10, 9/10)
    assert entropy[0, 1].item() == pytest.approx(-(0.1 * math.log(0.1) + 0.9 * math.log(0.9)))


def _hidden_grads(fn, hidden, weight, bias, weights):
    leaves = [t.detach().clone().requires_grad_(True) for t in (hidden, weight, bias)]
    logp, entropy = fn(*leaves)
    ((logp * weights[0]).sum() + (entropy * weights[1]).sum()).backward()
    return (logp.detach(), entropy.detach(), *(t.grad for t in leaves))


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5), (torch.bfloat16, 1e-5)])
@pytest.mark.parametrize("chunk_tokens", [1, 5, None])
@pytest.mark.parametrize("options", [{}, {"temperature": 0.7}, {"support": True}])
@pytest.mark.parametrize("entropy_grad", [True, False])
def test_from_hidden_equals_the_logits_path_with_grads(dtype, tol, chunk_tokens, options, entropy_grad):
    """The same numbers and the same gradients (into hidden, weight and bias) as
    `token_logprobs_and_entropy` of the full logits F.linear(hidden, weight, bias), on both
    paths: autograd's checkpointed chunks (a weighted entropy, the sampler's support) and the
    written-out backward of `core.head_logprobs` (an entropy for logging)."""
    torch.manual_seed(9)
    vocab, width = 30, 8
    hidden = torch.randn(3, 7, width, dtype=torch.float64).to(dtype)
    weight = torch.randn(vocab, width, dtype=torch.float64).to(dtype)
    bias = torch.randn(vocab, dtype=torch.float64).to(dtype)
    labels = torch.randint(0, vocab, (3, 7))
    labels[1, 5:] = -100
    kwargs = {"temperature": options.get("temperature", 1.0)}
    if options.get("support"):
        kwargs["support_size"] = torch.randint(0, vocab + 1, (3, 7), dtype=torch.int32)
    weights = torch.randn(2, 3, 7, dtype=torch.float64).to(torch.float32 if dtype != torch.float64 else dtype)

    if not entropy_grad:
        weights[1] = 0
        kwargs["entropy_grad"] = False
    ours = _hidden_grads(lambda h, w, b: token_logprobs_and_entropy_from_hidden(
        h, w, labels, bias=b, with_entropy=True, chunk_tokens=chunk_tokens, **kwargs), hidden, weight, bias, weights)
    ref = _hidden_grads(lambda h, w, b: token_logprobs_and_entropy(
        torch.nn.functional.linear(h, w, b), labels, with_entropy=True, chunk_tokens=4096, **kwargs),
        hidden, weight, bias, weights)
    assert ours[0].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    for a, b in zip(ours, ref):
        rtol = 2e-2 if a.dtype == torch.bfloat16 else tol
        torch.testing.assert_close(a, b, atol=tol if a.dtype != torch.bfloat16 else 2e-2, rtol=rtol)
    assert (ours[0][1, 5:] == 0).all()


def test_from_hidden_without_bias_and_with_detached_entropy():
    torch.manual_seed(10)
    hidden = torch.randn(2, 5, 6, requires_grad=True)
    weight = torch.randn(11, 6, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5))
    logp, entropy = token_logprobs_and_entropy_from_hidden(hidden, weight, labels, with_entropy=True,
                                                           entropy_grad=False, chunk_tokens=3)
    assert entropy.grad_fn is None and logp.grad_fn is not None
    expected = token_logprobs_and_entropy(hidden.detach() @ weight.detach().T, labels, with_entropy=True)
    torch.testing.assert_close(logp, expected[0])
    torch.testing.assert_close(entropy, expected[1])
    logp, none = token_logprobs_and_entropy_from_hidden(hidden, weight, labels, with_entropy=False)
    assert none is None
    logp.sum().backward()
    assert hidden.grad is not None and weight.grad is not None


def test_from_hidden_keeps_no_logits_for_backward():
    """The LM head is inside the recomputed chunk: what autograd stores is the hidden states
    and the weight, never a tensor of one chunk's logits or more ([n, V], any dtype)."""
    vocab, width, chunk = 512, 16, 8
    hidden = torch.randn(4, 16, width, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(vocab, width, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (4, 16))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        logp, entropy = token_logprobs_and_entropy_from_hidden(hidden, weight, labels, with_entropy=True,
                                                               chunk_tokens=chunk)
    assert saved and all(shape[-1] != vocab for shape in saved)
    assert max(math.prod(shape) for shape in saved) <= vocab * width  # the weight itself
    (logp.sum() + entropy.sum()).backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.shape == weight.shape


def test_from_hidden_default_chunk_follows_the_vocabulary(monkeypatch):
    from posttrain.core import logprobs

    monkeypatch.setattr(logprobs, "HIDDEN_CHUNK_ELEMENTS", 40)
    seen = []
    real = logprobs._score_hidden_chunk
    monkeypatch.setattr(logprobs, "_score_hidden_chunk", lambda h, *a, **k: seen.append(len(h)) or real(h, *a, **k))
    real_fused = head_logprobs._Buffers.scaled_logits
    monkeypatch.setattr(head_logprobs._Buffers, "scaled_logits",
                        lambda self, h, *a: seen.append(len(h)) or real_fused(self, h, *a))
    for entropy_grad in (False, True):  # the written-out backward, then autograd's checkpointed chunks
        seen.clear()
        token_logprobs_and_entropy_from_hidden(torch.randn(2, 9, 4), torch.randn(10, 4),
                                               torch.zeros(2, 9, dtype=torch.long), with_entropy=True,
                                               entropy_grad=entropy_grad)
        assert seen == [4, 4, 4, 4, 2]  # 40 logits per chunk at V = 10


def test_from_hidden_shape_mismatch_raises():
    with pytest.raises(ValueError, match="labels"):
        token_logprobs_and_entropy_from_hidden(torch.zeros(2, 3, 4), torch.zeros(5, 4),
                                               torch.zeros(2, 4, dtype=torch.long), with_entropy=False)
    with pytest.raises(ValueError, match="weight"):
        token_logprobs_and_entropy_from_hidden(torch.zeros(2, 3, 4), torch.zeros(5, 3),
                                               torch.zeros(2, 3, dtype=torch.long), with_entropy=False)


def test_a_detached_entropy_is_not_recomputed_in_the_backward(monkeypatch):
    """The backward recomputes each chunk's log-probs; an entropy without gradient is part of
    no graph, so its [n, V] passes run in the forward only (and a weighted one is recomputed).
    From hidden states, only a weighted entropy takes this path (tests/core/test_head_logprobs.py)."""
    from posttrain.core import logprobs

    calls = []
    real = logprobs._score_chunk
    monkeypatch.setattr(logprobs, "_score_chunk", lambda *a, **k: calls.append(k["with_entropy"]) or real(*a, **k))
    torch.manual_seed(11)
    hidden, weight = torch.randn(2, 5, 8, requires_grad=True), torch.randn(30, 8, requires_grad=True)
    labels = torch.randint(0, 30, (2, 5))
    for from_hidden, entropy_grad, expected in ((False, False, [True] * 3 + [False] * 3), (False, True, [True] * 6),
                                                (True, True, [True] * 6), (True, False, [])):
        calls.clear()
        if from_hidden:
            logp, entropy = token_logprobs_and_entropy_from_hidden(hidden, weight, labels, with_entropy=True,
                                                                   entropy_grad=entropy_grad, chunk_tokens=4)
        else:
            logp, entropy = token_logprobs_and_entropy(hidden @ weight.T, labels, with_entropy=True,
                                                       entropy_grad=entropy_grad, chunk_tokens=4)
        (logp.sum() + (entropy.sum() if entropy_grad else 0)).backward()
        assert calls == expected
