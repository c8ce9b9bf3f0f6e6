import itertools
from collections import Counter

import pytest
import torch

from posttrain.core.eval_metrics import majority_at_k, mean_at_k, shared_answer_verdicts


def test_majority_at_k_hand_values():
    # answers 5, 5, 7 and one without an answer; 5 is right
    answers = [["5", "5", "7", None]]
    correct = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    # k=4: 5 has two votes, 7 one: right
    assert majority_at_k(answers, correct, 4).tolist() == [1.0]
    # k=2, the 6 pairs: {5,5} 1, {5,7} tie 0.5, {5,-} 1, {5,7} 0.5, {5,-} 1, {7,-} 0 -> 4/6
    assert majority_at_k(answers, correct, 2).tolist() == pytest.approx([4 / 6])
    # k=1: 5, 5 right; 7 wrong; no answer casts no vote: wrong -> 2/4
    assert majority_at_k(answers, correct, 1).tolist() == pytest.approx([0.5])


def test_majority_at_k_tie_counts_the_mean_of_the_tied_answers():
    # 3 and 4 two votes each, 4 right: the tie is worth 1/2, every time
    answers = [["3", "4", "4", "3"]]
    correct = torch.tensor([[0, 1, 1, 0]], dtype=torch.bool)
    assert majority_at_k(answers, correct, 4).tolist() == [0.5]
    # a three-way tie among 1, 2, 3 with 2 right: 1/3
    assert majority_at_k([["1", "2", "3"]], torch.tensor([[0.0, 1.0, 0.0]]), 3).tolist() == pytest.approx([1 / 3])


def test_majority_at_k_without_answers_is_wrong_and_split_verdicts_are_shared():
    assert majority_at_k([[None, None]], torch.tensor([[1.0, 1.0]]), 2).tolist() == [0.0]
    # the same answer judged right once and wrong once (a verifier timeout): worth 1/2
    assert majority_at_k([["8", "8"]], torch.tensor([[1.0, 0.0]]), 2).tolist() == [0.5]
    assert shared_answer_verdicts([["8", "8", None]], torch.tensor([[1.0, 0.0, 1.0]])).tolist() == [[0.5, 0.5, 1.0]]


def test_majority_at_k_several_prompts():
    answers = [["1", "1", "2"], ["9", "6", "6"]]
    correct = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # prompt 0: 1 wins with 2 of 3 votes (right); prompt 1: 6 wins (wrong)
    assert majority_at_k(answers, correct, 3).tolist() == [1.0, 0.0]


def test_majority_at_k_with_too_many_subsets_is_deterministic_and_close_to_exact():
    # C(16, 8) = 12870 subsets: sampled with a fixed seed; compared with the exact enumeration
    row = ["a"] * 6 + ["b"] * 5 + ["c"] * 3 + [None] * 2
    right = {"a": 0.0, "b": 1.0, "c": 0.0, None: 0.0}
    correct = torch.tensor([[right[a] for a in row]])
    exact = 0.0
    subsets = list(itertools.combinations(range(16), 8))
    for subset in subsets:
        votes = Counter(row[i] for i in subset if row[i] is not None)
        top = max(votes.values())
        winners = [a for a, v in votes.items() if v == top]
        exact += sum(right[a] for a in winners) / len(winners)
    exact /= len(subsets)
    first, second = majority_at_k([row], correct, 8), majority_at_k([row], correct, 8)
    assert first.tolist() == second.tolist()
    assert float(first) == pytest.approx(exact, abs=4 * 0.5 / 4096 ** 0.5)


def test_mean_at_k_hand_values():
    # 3 of 4 right: any k of them hold 3/4 right on average
    assert float(mean_at_k(4, 3, 2)) == 0.75
    assert float(mean_at_k(4, 3, 4)) == 0.75
    assert mean_at_k(4, torch.tensor([0, 1, 4]), 1).tolist() == [0.0, 0.25, 1.0]
    with pytest.raises(ValueError, match="larger than num_samples"):
        mean_at_k(2, 1, 3)
