"""Process reward math: step scores of a process reward model (PRM) -> step rewards,
sequence scores, step labels, and the best-of-n / majority-vote accuracy they give.

Per-step tensors::

    scores [B, K] float   step k's score s_k = PRM(x, y_<=k) (a probability for learned or
                          oracle PRMs; only ``monte_carlo_step_labels`` assumes a range)
    valid  [B, K] bool    step k of row b exists; left-aligned: each row is True... then False

Padded entries may hold anything (NaN too): they are replaced with ``torch.where`` before any
arithmetic, so they reach neither a result nor a gradient.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Hashable, Sequence

import torch

from .checks import check_finite, check_shape, lookup, valid_mask
from .masked import masked_mean


def _validate_steps(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    if scores.dim() != 2:
        raise ValueError(f"scores must be [B, K], got shape {tuple(scores.shape)}")
    check_shape("valid", valid, scores.shape, "scores")
    valid = valid_mask(valid)
    # Left alignment is what makes "step k-1" and "the last step" well defined.
    if bool((valid[:, 1:] & ~valid[:, :-1]).any()):
        raise ValueError("valid must be left-aligned: each row a run of True followed by False")
    check_finite("scores", scores, valid)
    return valid


# ---------------------------------------------------------------- step rewards


def raw_step_rewards(s: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """r_k = s_k: each step is rewarded with its own score (sum form; the return is sum_k s_k)."""
    return s


def marginal_step_rewards(s: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Marginal form r_k = PRM(x, y_<=k) - PRM(x, y_<=k-1), s_0 := 0.

    The sum over steps telescopes to the last step's score s_K: the return is the PRM's
    judgement of the whole response, and each step is credited with how much it changed it.
    """
    previous = torch.cat([torch.zeros_like(s[:, :1]), s[:, :-1]], dim=1)
    return s - previous


def min_form_step_rewards(s: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Min-form credit assignment (Cheng et al. 2025, "Stop Summation: Min-Form Credit
    Assignment Is All Process Reward Model Needs for Reasoning", PURE).

    PURE's value of step t is the minimum of the future step scores, m_t = min_{j>=t} s_j.
    The step rewards whose sum from step t onward is m_t are r_k = m_k - m_{k+1}, m_{K+1} := 0,
    so the return (t = 1) is min_k s_k and a plain return-to-go reproduces the min-form value.
    """
    # Suffix minimum; padding (after the last valid step) is +inf so it never is the minimum.
    at_valid = torch.where(valid, s, torch.full_like(s, math.inf))
    suffix_min = at_valid.flip(-1).cummin(-1).values.flip(-1)
    suffix_min = torch.where(valid, suffix_min, torch.zeros_like(s))  # m_{K+1} := 0
    following = torch.cat([suffix_min[:, 1:], torch.zeros_like(s[:, :1])], dim=1)
    return suffix_min - following


STEP_REWARD_FORMS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "marginal": marginal_step_rewards,
    "raw": raw_step_rewards,
    "min": min_form_step_rewards,
}


def process_step_rewards(scores: torch.Tensor, valid: torch.Tensor, form: str) -> torch.Tensor:
    """PRM step scores [B, K] -> step rewards r_k [B, K], 0 where no step.

    ``form`` (``STEP_REWARD_FORMS``): "raw" r_k = s_k; "marginal" r_k = s_k - s_{k-1}
    (s_0 = 0); "min" r_k = m_k - m_{k+1} with m_t = min_{j>=t} s_j (PURE). The sum of r_k over
    a row's steps is its PRM return: s_K, sum_k s_k and min_k s_k respectively (0 for a row
    without steps). Differentiable in ``scores``; padding gets no gradient.
    """
    fn = lookup(STEP_REWARD_FORMS, form, "step reward form")
    valid = _validate_steps(scores, valid)
    s = torch.where(valid, scores, torch.zeros_like(scores))
    rewards = fn(s, valid)
    return torch.where(valid, rewards, torch.zeros_like(rewards))


# ---------------------------------------------------------------- sequence scores


def _last_step(s: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    last = (valid.sum(-1) - 1).clamp_min(0)  # left-aligned: the last True; 0 for empty rows
    return s.gather(1, last.unsqueeze(-1)).squeeze(-1)


def _min_step(s: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, s, torch.full_like(s, math.inf)).amin(-1)


def _product_of_steps(s: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, s, torch.ones_like(s)).prod(-1)


def _mean_step(s: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return masked_mean(s, valid, dim=-1)


STEP_AGGREGATES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "last": _last_step,
    "min": _min_step,
    "product": _product_of_steps,
    "mean": _mean_step,
}


def aggregate_step_scores(
    scores: torch.Tensor, valid: torch.Tensor, how: str, empty: float = 0.0
) -> torch.Tensor:
    """One PRM score per response [B] from its step scores [B, K].

    ``how`` (``STEP_AGGREGATES``): "last" s_K (the PRM's view of the full response); "min"
    min_k s_k and "product" prod_k s_k (Lightman et al. 2023, "Let's Verify Step by Step":
    a solution is as good as the chance that every step is right; Math-Shepherd, Wang et al.
    2024, ranks by the minimum); "mean" the average step score.

    A row with no valid step gets ``empty``. The default 0.0 is the lowest probability: an
    empty response ranks last under a probability-valued PRM and is a finite reward if the
    score is trained on. For a best-of-n ranking on an unbounded scale pass
    ``empty=float("-inf")`` so an empty response never beats a scored one.
    """
    fn = lookup(STEP_AGGREGATES, how, "step aggregate")
    valid = _validate_steps(scores, valid)
    s = torch.where(valid, scores, torch.zeros_like(scores))
    out = fn(s, valid)
    return torch.where(valid.any(-1), out, torch.full_like(out, empty))


# ---------------------------------------------------------------- step labels


def monte_carlo_step_labels(num_correct, num_rollouts: int, hard: bool = True) -> torch.Tensor:
    """Math-Shepherd automatic step labels (Wang et al. 2024, "Math-Shepherd: Verify and
    Reinforce LLMs Step-by-step without Human Annotations").

    From the prefix ending at a step, N completions are sampled and checked against the
    reference answer; ``num_correct`` of them reach it. Hard estimation (HE): the step is good
    (1.0) if any completion reaches the answer, else 0.0. Soft estimation (SE): the fraction
    num_correct / N.

    Args:
        num_correct: counts, an int or a tensor of any shape, 0 <= num_correct <= N.
        num_rollouts: N, an int >= 1.
        hard: HE if True, SE if False.
    Returns:
        float labels shaped like ``num_correct`` (its dtype if floating, else the default).
    """
    if isinstance(num_rollouts, bool) or not isinstance(num_rollouts, int) or num_rollouts < 1:
        raise ValueError(f"monte_carlo_step_labels: num_rollouts must be an int >= 1, got {num_rollouts!r}")
    c = torch.as_tensor(num_correct)
    if not c.is_floating_point():
        c = c.to(torch.get_default_dtype())
    if bool(((c < 0) | (c > num_rollouts) | (c != c.round())).any()):
        raise ValueError(
            f"monte_carlo_step_labels: num_correct must be whole counts in [0, {num_rollouts}]"
        )
    if hard:
        return (c > 0).to(c.dtype)
    return c / num_rollouts


# ---------------------------------------------------------------- best-of-n and majority vote


def _check_subset_size(n, num_responses: int, fn: str) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= num_responses:
        raise ValueError(f"{fn}: n must be an int with 1 <= n <= N = {num_responses}, got {n!r}")


def best_of_n_expected_accuracy(scores: torch.Tensor, correct: torch.Tensor, n: int) -> torch.Tensor:
    """Exact best-of-n accuracy of a scorer (the verifier evaluation of Lightman et al. 2023
    and Math-Shepherd), averaged over every n-subset of N sampled responses.

    Per prompt: N responses with scores s_i and correctness c_i. Draw n of them uniformly
    without replacement, keep the highest-scored one (ties broken uniformly at random), and
    read its correctness. Its expectation, in closed form:

    For a score level v let a_v = #{i: s_i = v}, c_v = sum of c_i over those, and
    b_v = #{i: s_i < v}. The subset's top level is v iff all n responses lie among the
    a_v + b_v at or below v but not all among the b_v below it:

        P(top level = v) = [C(a_v + b_v, n) - C(b_v, n)] / C(N, n).

    Given that, the subset's responses at level v are a uniformly random subset of the a_v and
    the tie-break picks uniformly among them, so by symmetry the winner is each of the a_v with
    probability 1/a_v, and correct with probability c_v / a_v. Hence

        E = sum_v [C(a_v + b_v, n) - C(b_v, n)] / C(N, n) * c_v / a_v
          = sum_i c_i [C(a_i + b_i, n) - C(b_i, n)] / (C(N, n) a_i)   (a_i, b_i of s_i's level).

    n = 1 gives mean_i c_i; n = N gives the mean correctness of the top-scored responses.
    The ratios C(m, n) / C(N, n) are computed from exact integers (``math.comb``) and rounded
    once to float64, so large N (hundreds) neither overflows nor cancels badly.

    Args:
        scores: [P, N] float; -inf / +inf are allowed (each is a level), NaN is not.
        correct: [P, N] bool or float (any per-response value: the result is its expectation).
        n: subset size, 1 <= n <= N.
    Returns:
        [P] float64.
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must be [P, N], got shape {tuple(scores.shape)}")
    check_shape("correct", correct, scores.shape, "scores")
    num_responses = scores.shape[1]
    _check_subset_size(n, num_responses, "best_of_n_expected_accuracy")
    s = scores.detach().to(torch.float64)
    if bool(s.isnan().any()):
        raise ValueError("best_of_n_expected_accuracy: scores contain NaN")
    c = correct.detach().to(torch.float64)
    check_finite("correct", c)

    ordered = s.sort(dim=-1).values
    below = torch.searchsorted(ordered, s, side="left")  # b_i: responses strictly below s_i
    at_or_below = torch.searchsorted(ordered, s, side="right")  # a_i + b_i
    ties = at_or_below - below  # a_i >= 1
    total = math.comb(num_responses, n)
    ratio = torch.tensor(  # ratio[m] = C(m, n) / C(N, n), m = 0..N
        [math.comb(m, n) / total for m in range(num_responses + 1)], dtype=torch.float64, device=s.device
    )
    top_level_prob = ratio[at_or_below] - ratio[below]
    return (c * top_level_prob / ties).sum(-1)


MAJORITY_EXACT_MAX_SUBSETS = 5000  # enumerate every n-subset up to this many, else sample


def _vote_accuracy(subsets: torch.Tensor, answer_ids: torch.Tensor, answer_correct: torch.Tensor) -> torch.Tensor:
    """[S] expected correctness of the majority vote of each subset (rows of response indices).

    answer_ids [N]: answer class of each response (-1 = no answer); answer_correct [A].
    A tie between the most frequent answers is resolved by its expectation: the mean
    correctness of the tied answers.
    """
    num_answers = answer_correct.shape[0]
    if num_answers == 0:  # no response has an answer: every vote is wrong
        return torch.zeros(subsets.shape[0], dtype=torch.float64)
    ids = answer_ids[subsets]  # [S, n]
    has_answer = ids >= 0
    one_hot = torch.nn.functional.one_hot(ids.clamp_min(0), num_answers)  # [S, n, A]
    votes = (one_hot * has_answer.unsqueeze(-1)).sum(1)  # [S, A]; no-answer responses cast none
    top = votes.amax(-1, keepdim=True)
    winners = (votes == top) & (top > 0)
    num_winners = winners.sum(-1)
    hits = (winners.to(torch.float64) * answer_correct).sum(-1)
    return torch.where(num_winners > 0, hits / num_winners.clamp_min(1), torch.zeros_like(hits))


def majority_vote_expected_accuracy(
    answers: Sequence[Sequence[Hashable | None]],
    correct: torch.Tensor,
    n: int,
    num_draws: int = 4096,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Self-consistency accuracy (Wang et al. 2023, "Self-Consistency Improves Chain of Thought
    Reasoning in Language Models") of n votes, averaged over n-subsets of N sampled responses.

    Per prompt, a uniformly random n-subset (without replacement) of its N responses votes:
    the answer given by most of them wins, ties broken uniformly at random; a response whose
    answer is None (none extracted) casts no vote, and a subset without any answer counts as
    wrong. The vote is right iff the winning answer is (every response with that answer has
    the same ``correct``; a ValueError otherwise).

    When C(N, n) <= ``MAJORITY_EXACT_MAX_SUBSETS`` (5000) every subset is enumerated and the
    result is exact. Otherwise ``num_draws`` subsets are drawn uniformly at random with
    ``generator`` (torch's global generator when None) and averaged: an unbiased Monte-Carlo
    estimate with standard error <= 0.5 / sqrt(num_draws). In both cases the tie-break is
    averaged exactly (mean correctness of the tied answers), not sampled.

    Args:
        answers: P lists of N hashable final answers (None = no answer).
        correct: [P, N] bool or 0/1 float.
        n: votes per subset, 1 <= n <= N.
    Returns:
        [P] float64.
    """
    if correct.dim() != 2:
        raise ValueError(f"correct must be [P, N], got shape {tuple(correct.shape)}")
    num_prompts, num_responses = correct.shape
    if len(answers) != num_prompts or any(len(row) != num_responses for row in answers):
        raise ValueError(f"answers must be {num_prompts} lists of {num_responses} answers, like correct")
    _check_subset_size(n, num_responses, "majority_vote_expected_accuracy")
    if isinstance(num_draws, bool) or not isinstance(num_draws, int) or num_draws < 1:
        raise ValueError(f"majority_vote_expected_accuracy: num_draws must be an int >= 1, got {num_draws!r}")
    c = correct.detach().to(torch.float64).cpu()
    check_finite("correct", c)

    if math.comb(num_responses, n) <= MAJORITY_EXACT_MAX_SUBSETS:
        subsets = torch.tensor(list(itertools.combinations(range(num_responses), n)), dtype=torch.long)
    else:
        subsets = None
    out = torch.zeros(num_prompts, dtype=torch.float64)
    for p, row in enumerate(answers):
        classes: dict[Hashable, int] = {}
        answer_correct: list[float] = []
        answer_ids = []
        for i, answer in enumerate(row):
            if answer is None:
                answer_ids.append(-1)
                continue
            if answer not in classes:
                classes[answer] = len(classes)
                answer_correct.append(float(c[p, i]))
            elif answer_correct[classes[answer]] != float(c[p, i]):
                raise ValueError(
                    f"majority_vote_expected_accuracy: prompt {p}: responses with answer {answer!r} "
                    f"disagree on correct"
                )
            answer_ids.append(classes[answer])
        draws = subsets
        if draws is None:
            draws = torch.rand(num_draws, num_responses, generator=generator).argsort(-1)[:, :n]
        votes = _vote_accuracy(draws, torch.tensor(answer_ids), torch.tensor(answer_correct, dtype=torch.float64))
        out[p] = votes.mean()
    return out.to(correct.device)
