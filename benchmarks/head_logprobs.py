"""The LM head's log-probs, forward and backward: `core/head_logprobs.py` (a written-out backward
over reused buffers) against autograd's checkpointed chunks (`core/logprobs.py`), side by side.

    OMP_NUM_THREADS=1 python benchmarks/head_logprobs.py [--tokens 4096] [--vocab 49152] [--hidden 576]
                                                         [--repeats 3] [--fp32] [--json out.json]

One call scores `--tokens` positions of random hidden states through a random [V, H] head (the
entropy for logging, as every online forward asks), then backpropagates a random upstream
gradient into the hidden states and the weight, under CPU bf16 autocast unless ``--fp32``. The
two paths alternate (A/B, then B/A) after one untimed call each; the medians and their ratio
are printed, with the four matmuls' own time (the floor both paths share) and the largest
difference between the paths' log-probs and gradients.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from posttrain.core import head_logprobs
from posttrain.core.logprobs import HIDDEN_CHUNK_ELEMENTS, token_logprobs_and_entropy_from_hidden

PATHS = ("written", "autograd")


def one_call(path: str, hidden, weight, labels, upstream, bf16: bool) -> tuple[float, float, tuple]:
    """(forward s, backward s, (log-probs, hidden grad, weight grad)) of one call of `path`."""
    covers = head_logprobs.covers
    if path == "autograd":  # what every call took before core/head_logprobs.py
        head_logprobs.covers = lambda *args: False
    try:
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        started = time.perf_counter()
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            logp, _ = token_logprobs_and_entropy_from_hidden(h, w, labels, with_entropy=True, entropy_grad=False)
        forward = time.perf_counter() - started
        (logp * upstream).sum().backward()
        return forward, time.perf_counter() - started - forward, (logp.detach(), h.grad, w.grad)
    finally:
        head_logprobs.covers = covers


def matmul_floor(tokens: int, vocab: int, hidden: int, bf16: bool) -> float:
    """Seconds of the four matmuls a call needs (logits, their recomputation, both gradients)
    over the same chunks, in the matmul dtype, into preallocated outputs."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    chunk = max(1, HIDDEN_CHUNK_ELEMENTS // vocab)
    w, h = torch.randn(vocab, hidden, dtype=dtype), torch.randn(min(chunk, tokens), hidden, dtype=dtype)
    logits, grad_h, grad_w = torch.empty(len(h), vocab, dtype=dtype), torch.empty_like(h), torch.empty_like(w)
    started = time.perf_counter()
    for start in range(0, tokens, chunk):
        n = min(chunk, tokens - start)
        torch.mm(h[:n], w.T, out=logits[:n])
        torch.mm(h[:n], w.T, out=logits[:n])
        torch.mm(logits[:n], w, out=grad_h[:n])
        torch.mm(logits[:n].T, h[:n], out=grad_w)
    return time.perf_counter() - started


def measure(tokens: int, vocab: int, hidden: int, repeats: int, bf16: bool) -> dict:
    torch.manual_seed(0)
    hidden_states = torch.randn(tokens, hidden)
    weight = torch.randn(vocab, hidden) * hidden ** -0.5
    labels = torch.randint(0, vocab, (tokens,))
    upstream = torch.randn(tokens)
    times = {path: {"forward": [], "backward": []} for path in PATHS}
    outputs = {path: one_call(path, hidden_states, weight, labels, upstream, bf16)[2] for path in PATHS}  # warm-up
    for repeat in range(repeats):
        for path in PATHS if repeat % 2 == 0 else reversed(PATHS):
            forward, backward, _ = one_call(path, hidden_states, weight, labels, upstream, bf16)
            times[path]["forward"].append(forward)
            times[path]["backward"].append(backward)
    medians = {path: {part: statistics.median(values) for part, values in parts.items()}
               for path, parts in times.items()}
    total = {path: sum(parts.values()) for path, parts in medians.items()}
    differences = {name: (a - b).abs().max().item()
                   for name, a, b in zip(("logp", "hidden_grad", "weight_grad"), *outputs.values())}
    return {"settings": {"tokens": tokens, "vocab": vocab, "hidden": hidden, "repeats": repeats, "bf16": bf16,
                         "threads": torch.get_num_threads()},
            "seconds": times, "median_s": medians, "total_s": total,
            "autograd_over_written": total["autograd"] / total["written"],
            "matmul_floor_s": matmul_floor(tokens, vocab, hidden, bf16), "max_abs_difference": differences}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fp32", action="store_true", help="no autocast (default: CPU bf16 autocast)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    result = measure(args.tokens, args.vocab, args.hidden, args.repeats, not args.fp32)
    for path in PATHS:
        m = result["median_s"][path]
        print(f"{path:>9}: forward {m['forward']:.2f} s, backward {m['backward']:.2f} s, total {result['total_s'][path]:.2f} s")
    print(f"autograd / written: {result['autograd_over_written']:.2f}x; the four matmuls alone: "
          f"{result['matmul_floor_s']:.2f} s; largest differences: {result['max_abs_difference']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
