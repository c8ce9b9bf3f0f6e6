"""The metrics of an evaluation suite over k sampled responses per prompt, beside `pass_at_k`
(core/metrics.py): maj@k (self-consistency) and mean@k. Each takes a prompt's n >= k sampled
responses and gives the expectation over the k-subsets of them, as pass@k does, so the three
read the same k the same way whatever n is."""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

from posttrain.core.metrics import pass_at_k
from posttrain.core.process import majority_vote_expected_accuracy

# the seed of the generator that draws k-subsets when a prompt has too many to enumerate
# (C(n, k) > 5000): fixed, so that maj@k is the same number every time it is computed
MAJORITY_SEED = 0


def mean_at_k(num_samples, num_correct, k: int) -> torch.Tensor:
    """mean@k: the expected share of correct responses among k sampled ones, per prompt.

    Every response is equally likely to be one of the k, so the expectation is c / n for any
    k <= n: with n = k, the mean correctness of the k samples. Checks k as pass_at_k does.

    Args:
        num_samples: n, an int or a tensor of per-prompt counts.
        num_correct: c, an int or a tensor of per-prompt counts, 0 <= c <= n.
        k: responses per attempt, 1 <= k <= n.
    Returns:
        float64 tensor of per-prompt values, shaped like the broadcast of n and c.
    """
    pass_at_k(num_samples, num_correct, k)  # the same argument checks (k, whole counts, c <= n)
    device = num_correct.device if isinstance(num_correct, torch.Tensor) else None
    n = torch.as_tensor(num_samples, dtype=torch.float64, device=device)
    c = torch.as_tensor(num_correct, dtype=torch.float64, device=device)
    n, c = torch.broadcast_tensors(n, c)
    return c / n


def shared_answer_verdicts(answers: Sequence[Sequence[Hashable | None]], correct: torch.Tensor) -> torch.Tensor:
    """[P, N] correctness of each response's final answer, the same for every response that gave
    it: the share of those responses the verifier judged right. Responses with one answer can
    be judged differently (a verifier that timed out on one of them); a vote for that answer is
    then right by the expectation over which of its responses' verdicts it takes. A response
    without an answer (None) keeps its own verdict (it casts no vote)."""
    verdicts = correct.detach().to(torch.float64).cpu().clone()
    for p, row in enumerate(answers):
        for answer in {a for a in row if a is not None}:
            same = [i for i, other in enumerate(row) if other == answer]
            verdicts[p, same] = verdicts[p, same].mean()
    return verdicts


def majority_at_k(answers: Sequence[Sequence[Hashable | None]], correct: torch.Tensor, k: int) -> torch.Tensor:
    """maj@k (self-consistency, Wang et al. 2023): k sampled responses vote with their final
    answers; the vote is right iff the answer most of them gave is right. Per prompt, the
    expectation over the k-subsets of its n responses (exact when C(n, k) <= 5000, else over
    4096 subsets drawn with a fixed seed: the same value every time).

    Rules, deterministic: a response without an extracted answer (None) casts no vote, and a
    subset in which none has one is wrong; a tie between the most frequent answers counts the
    mean correctness of the tied answers (the expectation of breaking it uniformly at random,
    computed, not drawn); responses with the same answer but different verdicts share their mean
    (`shared_answer_verdicts`).

    Args:
        answers: P lists of n hashable final answers (None: none extracted).
        correct: [P, n] bool or 0/1 float, each response's verdict.
        k: votes, 1 <= k <= n.
    Returns:
        [P] float64.
    """
    verdicts = shared_answer_verdicts(answers, correct)
    generator = torch.Generator().manual_seed(MAJORITY_SEED)
    return majority_vote_expected_accuracy(answers, verdicts, k, generator=generator)
