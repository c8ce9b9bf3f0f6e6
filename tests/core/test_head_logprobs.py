"""The LM head's log-probs with a written-out backward (`core.head_logprobs`), reached through
`token_logprobs_and_entropy_from_hidden` when the entropy is for logging only."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from posttrain.core import head_logprobs
from posttrain.core.logprobs import token_logprobs_and_entropy, token_logprobs_and_entropy_from_hidden


def scored(hidden, weight, bias, labels, **options):
    options = {"with_entropy": True, "entropy_grad": False, **options}
    return token_logprobs_and_entropy_from_hidden(hidden, weight, labels, bias=bias, **options)


def test_covers_only_what_it_computes():
    assert head_logprobs.covers(None, with_entropy=False, entropy_grad=True)
    assert head_logprobs.covers(None, with_entropy=True, entropy_grad=False)
    assert not head_logprobs.covers(None, with_entropy=True, entropy_grad=True)  # a weighted entropy
    assert not head_logprobs.covers(torch.ones(3), with_entropy=False, entropy_grad=False)  # the sampler's support
    with torch.no_grad():  # no backward: a weighted entropy is only a value
        assert head_logprobs.covers(None, with_entropy=True, entropy_grad=True)


def test_hand_values_and_gradients():
    """Vocabulary of 2, hidden size 1: logits h * w + b = (0, log 3) at the first position give
    p = (1/4, 3/4); the label is token 1, so d log p / d z = onehot - p = (-1/4, 1/4), and
    d/dw_v = h dz_v, d/db_v = dz_v, d/dh = sum_v dz_v w_v = log(3) / 4. The second position is
    ignored: log-prob 0 and no gradient."""
    hidden = torch.tensor([[[1.0], [2.0]]], dtype=torch.float64, requires_grad=True)
    weight = torch.tensor([[0.0], [math.log(3.0)]], dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    logp, entropy = scored(hidden, weight, bias, torch.tensor([[1, -100]]))
    assert logp.grad_fn is not None and entropy.grad_fn is None
    assert logp[0, 0].item() == pytest.approx(math.log(0.75)) and logp[0, 1].item() == 0.0
    assert entropy[0, 0].item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))
    assert entropy[0, 1].item() == pytest.approx(-(0.1 * math.log(0.1) + 0.9 * math.log(0.9)))
    (3.0 * logp.sum()).backward()
    torch.testing.assert_close(hidden.grad, torch.tensor([[[3 * math.log(3.0) / 4], [0.0]]], dtype=torch.float64))
    torch.testing.assert_close(weight.grad, torch.tensor([[-0.75], [0.75]], dtype=torch.float64))
    torch.testing.assert_close(bias.grad, torch.tensor([-0.75, 0.75], dtype=torch.float64))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gradcheck(temperature):
    """Finite differences in float64, chunks of 3 positions over 8, a bias, ignored positions."""
    torch.manual_seed(0)
    hidden = torch.randn(8, 5, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 5, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(11, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (8,))
    labels[[2, 7]] = -100

    def logp(h, w, b):
        return scored(h, w, b, labels, temperature=temperature, chunk_tokens=3)[0]

    assert torch.autograd.gradcheck(logp, (hidden, weight, bias))


def test_bf16_autocast_matches_autograd():
    """Under CPU bf16 autocast the logits are F.linear's (bf16) on both paths, so the log-probs
    agree to float32 rounding; the gradients, over 64 one-position chunks, are as close to the
    float32 ones as autograd's (the chunks' bf16 weight gradients add up in float32 here)."""
    torch.manual_seed(1)
    hidden = torch.randn(64, 32)
    weight = torch.randn(200, 32) * 0.3
    labels = torch.randint(0, 200, (64,))
    upstream = torch.randn(64)

    def grads(dtype, fused):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cpu", torch.bfloat16, enabled=dtype == torch.bfloat16):
            if fused:
                logp, entropy = scored(h, w, None, labels, chunk_tokens=1)
            else:
                logp, entropy = token_logprobs_and_entropy(torch.nn.functional.linear(h, w), labels,
                                                           with_entropy=True, entropy_grad=False, chunk_tokens=1)
        (logp * upstream).sum().backward()
        return logp.detach(), entropy, h.grad, w.grad

    fused, autograd, exact = grads(torch.bfloat16, True), grads(torch.bfloat16, False), grads(torch.float32, True)
    torch.testing.assert_close(fused[0], autograd[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused[1], autograd[1], atol=1e-4, rtol=1e-5)
    assert fused[3].dtype == torch.float32

    def error(x):
        return ((x - exact[3]).norm() / exact[3].norm()).item()

    assert error(fused[3]) < 0.01
    assert error(fused[3]) < 1.1 * error(autograd[3])
    torch.testing.assert_close(fused[2], autograd[2], atol=2e-2, rtol=2e-2)


class BigAllocations(TorchDispatchMode):
    """Counts the tensors created of at least `numel` elements."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default):
            self.count += out.numel() >= self.numel
        return out


@pytest.mark.parametrize("positions", [8, 40])
def test_every_chunk_reuses_the_same_buffers(positions):
    """Three [chunk, V] buffers in the forward and three in the backward (bf16 logits, two
    float32), however many chunks: none is allocated per chunk."""
    vocab, width, chunk = 500, 16, 4
    hidden = torch.randn(positions, width, requires_grad=True)
    weight = torch.randn(vocab, width, requires_grad=True)
    labels = torch.randint(0, vocab, (positions,))
    with BigAllocations(chunk * vocab) as forward, torch.autocast("cpu", torch.bfloat16):
        logp, _ = scored(hidden, weight, None, labels, chunk_tokens=chunk)
    with BigAllocations(chunk * vocab) as backward:
        logp.sum().backward()
    assert forward.count == 3
    assert backward.count == 3 + 2  # and the weight's gradient: its bf16 part and its float32 sum


def test_without_a_backward_and_with_a_frozen_head():
    """Under no_grad (the reference's scores) the same values; with a frozen head only the
    hidden states get a gradient, the same as autograd's."""
    torch.manual_seed(2)
    hidden, weight = torch.randn(2, 6, 8, requires_grad=True), torch.randn(30, 8)
    labels = torch.randint(0, 30, (2, 6))
    with torch.no_grad():
        plain = scored(hidden, weight, None, labels, chunk_tokens=5)
    assert plain[0].grad_fn is None
    logp, entropy = scored(hidden, weight, None, labels, chunk_tokens=5)
    torch.testing.assert_close(logp.detach(), plain[0])
    torch.testing.assert_close(entropy, plain[1])
    logp.sum().backward()
    reference = hidden.detach().clone().requires_grad_()
    token_logprobs_and_entropy(reference @ weight.T, labels, with_entropy=False)[0].sum().backward()
    torch.testing.assert_close(hidden.grad, reference.grad)


def test_a_banned_token_adds_nothing_to_the_entropy():
    """A bias of -inf bans a token: p = 0, log p = -inf; its entropy term is 0, not NaN."""
    torch.manual_seed(3)
    hidden, weight = torch.randn(5, 4), torch.randn(6, 4)
    bias = torch.zeros(6)
    bias[2] = float("-inf")
    labels = torch.randint(3, 6, (5,))
    logp, entropy = scored(hidden, weight, bias, labels)
    expected = token_logprobs_and_entropy(torch.nn.functional.linear(hidden, weight, bias), labels,
                                          with_entropy=True)
    assert torch.isfinite(entropy).all()
    torch.testing.assert_close(logp, expected[0])
    torch.testing.assert_close(entropy, expected[1])
