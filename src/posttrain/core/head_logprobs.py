"""log pi(y_t) of the LM head's logits z = h W^T + b, chunk by chunk, with a written-out backward.

The formula is that of `core.logprobs` (``log pi(y_t) = z_t[y_t]/T - logsumexp(z_t/T)``, the
entropy ``-sum_v p_v log p_v`` for logging); only the work differs. Checkpointing each chunk
through autograd (`core.logprobs._chunked`) runs a dozen [n, V] passes a chunk and allocates a
fresh [n, V] tensor for each: on a CPU they cost twice the chunk's matmul (16 rows x 512 tokens,
SmolLM2's V = 49152, bf16: 12.6 s for the head's forward and backward against 5.5 s for its four
matmuls), mostly in page faults on memory the process has just mapped. Here each call allocates
three [chunk, V] buffers and writes every chunk into them:

* forward:  z_c = h_c W^T (the matmul's dtype: autocast's, else the inputs'), upcast and divided
            by T into a float32 buffer, ``log_softmax`` into another, the label's entry picked;
            the entropy from the same buffers (``exp`` into the first, a row-wise dot).
* backward: z_c recomputed (the same matmul), p = softmax(z_c / T), and in place
            dlogp/dz = (onehot(y) - p) * g / T, cast to the matmul's dtype for
            dh_c = dz W and dW += dz^T h_c. dW and db add up in float32 across chunks.

It covers the log-probs and an entropy without gradient. A differentiable entropy and the
sampler's top-k/top-p support stay on the autograd path (`core.logprobs`)."""

from __future__ import annotations

from typing import Optional

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)  # scored in float32
UPCAST_ROWS = 2048  # rows of the weight gradient upcast at a time (4.7 MB at H = 576)


def covers(support_size, with_entropy: bool, entropy_grad: bool) -> bool:
    """Whether `head_logprobs` computes what was asked for (else `core.logprobs` does)."""
    return support_size is None and not (with_entropy and entropy_grad and torch.is_grad_enabled())


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor, *,
                  temperature: float, with_entropy: bool, chunk_tokens: int):
    """(log pi(y) [N], entropy [N] without gradient or None) for hidden [N, H], weight [V, H],
    bias [V] or None, labels [N] (< 0: ignored, log-prob 0). Float32 for half-precision
    matmuls, else the matmul's dtype. Gradients reach hidden, weight and bias."""
    differentiable = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    if differentiable:
        logp, entropy = _HeadLogprobs.apply(hidden, weight, bias, labels, temperature, with_entropy, chunk_tokens)
    else:
        matmul = _matmul_dtype(hidden, weight)
        with torch.no_grad(), _autocast_off(hidden):
            logp, entropy = _forward(hidden, weight, bias, labels, temperature, with_entropy, chunk_tokens, matmul)
    return logp, (entropy if with_entropy else None)


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, with_entropy, chunk_tokens):
        ctx.matmul_dtype = _matmul_dtype(hidden, weight)  # autocast's state is the forward's
        ctx.options = (temperature, chunk_tokens)
        ctx.save_for_backward(hidden, weight, bias, labels)
        with _autocast_off(hidden):
            logp, entropy = _forward(hidden, weight, bias, labels, temperature, with_entropy, chunk_tokens,
                                     ctx.matmul_dtype)
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        with _autocast_off(grad_logp):
            return _backward(ctx, grad_logp)


def _backward(ctx, grad_logp):
    hidden, weight, bias, labels = ctx.saved_tensors
    temperature, chunk_tokens = ctx.options
    need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
    matmul = ctx.matmul_dtype
    score = _score_dtype(matmul)
    h, w, b = (None if t is None else t.to(matmul) for t in (hidden, weight, bias))
    # d logp / d z = (onehot(y) - p) / T; ignored positions pass no gradient.
    g = torch.where(labels >= 0, grad_logp.to(score), 0.0) / temperature
    grad_hidden = torch.empty(hidden.shape, dtype=matmul, device=hidden.device) if need_hidden else None
    grad_weight = torch.zeros(weight.shape, dtype=_accumulation_dtype(weight), device=weight.device) if need_weight else None
    grad_bias = torch.zeros(bias.shape, dtype=_accumulation_dtype(bias), device=bias.device) if need_bias else None
    buffers = _Buffers(len(hidden), weight.shape[0], chunk_tokens, matmul, score, hidden.device)
    weight_part = torch.empty(weight.shape, dtype=matmul, device=weight.device) if need_weight and matmul != grad_weight.dtype else None
    upcast = None if weight_part is None else torch.empty(UPCAST_ROWS, weight.shape[1], dtype=grad_weight.dtype,
                                                           device=weight.device)
    for rows in buffers.chunks():
        zf = buffers.scaled_logits(h[rows], w, b, temperature)
        p = torch.softmax(zf, -1, out=buffers.second(zf))
        p.mul_(-g[rows, None]).scatter_add_(1, labels[rows].clamp_min(0)[:, None], g[rows, None])
        if need_bias:
            grad_bias.add_(p.sum(0))
        dz = buffers.in_matmul_dtype(p)
        if need_hidden:
            torch.mm(dz, w, out=grad_hidden[rows])
        if need_weight:
            if weight_part is None:
                grad_weight.addmm_(dz.T, h[rows])
            else:
                _add_upcast(grad_weight, torch.mm(dz.T, h[rows], out=weight_part), upcast)
    return (None if grad_hidden is None else grad_hidden.to(hidden.dtype),
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None, None)


def _forward(hidden, weight, bias, labels, temperature, with_entropy, chunk_tokens, matmul):
    score = _score_dtype(matmul)
    h, w, b = (None if t is None else t.to(matmul) for t in (hidden, weight, bias))
    logp = torch.empty(len(hidden), dtype=score, device=hidden.device)
    entropy = torch.empty(len(hidden) if with_entropy else 0, dtype=score, device=hidden.device)
    buffers = _Buffers(len(hidden), weight.shape[0], chunk_tokens, matmul, score, hidden.device)
    for rows in buffers.chunks():
        zf = buffers.scaled_logits(h[rows], w, b, temperature)
        logp_all = torch.log_softmax(zf, -1, out=buffers.second(zf))
        y = labels[rows]
        picked = logp_all.gather(1, y.clamp_min(0)[:, None])[:, 0]  # an in-range index on ignored positions
        logp[rows] = torch.where(y < 0, 0.0, picked)
        if with_entropy:  # a banned token's log p (-inf) raised to the lowest finite value: its term is 0, not NaN
            logp_all.clamp_min_(torch.finfo(score).min)
            p = torch.exp(logp_all, out=zf)
            entropy[rows] = -torch.bmm(p[:, None, :], logp_all[:, :, None]).view(-1)
    return logp, entropy


class _Buffers:
    """The [chunk, V] buffers of one call, reused by every chunk: the matmul's output (skipped
    where the matmul already runs in the score dtype) and two in the score dtype."""

    def __init__(self, n: int, vocab: int, chunk_tokens: int, matmul: torch.dtype, score: torch.dtype, device):
        self.n, self.chunk = n, max(1, min(chunk_tokens, n))
        self.logits = torch.empty(self.chunk, vocab, dtype=matmul, device=device) if matmul != score else None
        self.first = torch.empty(self.chunk, vocab, dtype=score, device=device)
        self.other = torch.empty(self.chunk, vocab, dtype=score, device=device)

    def chunks(self):
        return (slice(start, min(start + self.chunk, self.n)) for start in range(0, self.n, self.chunk))

    def scaled_logits(self, h_rows, w, bias, temperature):
        """(h W^T + b) / T for these rows in the score dtype, the logits rounded to the matmul's
        dtype first, as F.linear computes them (the bias inside the matmul)."""
        k = len(h_rows)
        zf = self.first[:k]
        out = zf if self.logits is None else self.logits[:k]
        if bias is None:
            torch.mm(h_rows, w.T, out=out)
        else:
            torch.addmm(bias, h_rows, w.T, out=out)
        if out is not zf:
            zf.copy_(out)
        if temperature != 1.0:
            zf.div_(temperature)
        return zf

    def second(self, like):
        return self.other[:len(like)]

    def in_matmul_dtype(self, x):
        return x if self.logits is None else self.logits[:len(x)].copy_(x)


def _matmul_dtype(hidden, weight) -> torch.dtype:
    """The dtype F.linear(hidden, weight) would compute in: autocast's where it is on and applies
    (float64 is never cast), else the inputs' promoted dtype."""
    device = hidden.device.type
    promoted = torch.promote_types(hidden.dtype, weight.dtype)
    if torch.is_autocast_enabled(device) and promoted != torch.float64:
        return torch.get_autocast_dtype(device)
    return promoted


def _add_upcast(total: torch.Tensor, part: torch.Tensor, upcast: torch.Tensor) -> None:
    """total += part for a float32 total and a half-precision part, a block of rows at a time
    through a float32 buffer: one mixed-dtype add_ over a [V, H] tensor runs at a quarter of the
    speed (60 against 9 ms at V = 49152, H = 576, one CPU thread)."""
    for start in range(0, len(part), len(upcast)):
        block = part[start:start + len(upcast)]
        total[start:start + len(block)].add_(upcast[:len(block)].copy_(block))


def _autocast_off(like: torch.Tensor):
    """Every op here runs in the dtype chosen for it: autocast would run the entropy's float32
    row-wise dot in bf16."""
    return torch.autocast(like.device.type, enabled=False)


def _score_dtype(matmul: torch.dtype) -> torch.dtype:
    return torch.float32 if matmul in HALF_DTYPES else matmul


def _accumulation_dtype(param: torch.Tensor) -> torch.dtype:
    return torch.promote_types(param.dtype, torch.float32)
