import pytest
import torch

from posttrain.core import dapo_overlong_penalty, kimi_length_reward, linear_length_penalty


def test_kimi_length_reward_hand_values():
    lengths = torch.tensor([100, 200, 300, 300, 50, 50, 70])
    correct = torch.tensor([True, False, True, False, True, False, True])
    groups = torch.tensor([4, 4, 4, 4, 8, 8, 1])  # non-contiguous ids
    out = kimi_length_reward(lengths, correct, groups)
    # group 4: min 100, max 300 -> lambda = [0.5, 0, -0.5, -0.5]
    # correct -> lambda; incorrect -> min(0, lambda); group 8 equal lengths -> 0; group of one -> 0
    assert out.tolist() == pytest.approx([0.5, 0.0, -0.5, -0.5, 0.0, 0.0, 0.0])
    short_wrong = kimi_length_reward(torch.tensor([10, 20]), torch.tensor([False, True]), torch.tensor([0, 0]))
    assert short_wrong.tolist() == pytest.approx([0.0, -0.5])  # wrong but short earns nothing positive


def test_kimi_length_reward_only_in_groups_with_a_correct_answer():
    lengths = torch.tensor([0, 4, 8, 2, 6, 10])
    correct = torch.tensor([False, False, False, False, True, True])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    # group 0 (all wrong): lambda = [0.5, 0, -0.5] -> Kimi [0, 0, -0.5]: the empty answer is the best
    # group 1: min 2, max 10 -> lambda = [0.5, 0, -0.5]; wrong -> min(0, 0.5) = 0; right -> 0, -0.5
    kimi = kimi_length_reward(lengths, correct, groups)
    assert kimi.tolist() == pytest.approx([0.0, 0.0, -0.5, 0.0, 0.0, -0.5])
    guarded = kimi_length_reward(lengths, correct, groups, only_groups_with_a_correct_answer=True)
    assert guarded.tolist() == pytest.approx([0.0, 0.0, 0.0, 0.0, 0.0, -0.5])


def test_kimi_length_reward_errors():
    with pytest.raises(ValueError, match="correct"):
        kimi_length_reward(torch.tensor([1, 2]), torch.tensor([True]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="group_index"):
        kimi_length_reward(torch.tensor([1, 2]), torch.tensor([True, True]), torch.tensor([0]))


def test_dapo_overlong_penalty():
    lengths = torch.tensor([50, 80, 90, 100, 101, 120])
    out = dapo_overlong_penalty(lengths, max_len=100, cache_len=20)
    assert out.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0, -1.0])
    hard = dapo_overlong_penalty(lengths, max_len=100, cache_len=0)
    assert hard.tolist() == pytest.approx([0.0, 0.0, 0.0, 0.0, -1.0, -1.0])
    with pytest.raises(ValueError, match="cache_len"):
        dapo_overlong_penalty(lengths, max_len=100, cache_len=200)


def test_linear_length_penalty_hand_values():
    lengths = torch.tensor([0, 4, 10, 32])
    # per token: -0.01 * len
    assert linear_length_penalty(lengths, coef=0.01).tolist() == pytest.approx([0.0, -0.04, -0.1, -0.32])
    # per share of a budget of 32 tokens: -0.5 * len / 32
    assert linear_length_penalty(lengths, coef=0.5, normalizer=32).tolist() == pytest.approx(
        [0.0, -0.0625, -0.15625, -0.5])
    # no group: the same length pays the same wherever it stands (unlike Kimi's group-relative reward)
    assert linear_length_penalty(torch.tensor([7, 7]), coef=1.0).tolist() == [-7.0, -7.0]
    assert linear_length_penalty(torch.tensor([4.0]), coef=0.0).tolist() == [0.0]


def test_linear_length_penalty_errors():
    with pytest.raises(ValueError, match="normalizer"):
        linear_length_penalty(torch.tensor([1, 2]), coef=0.1, normalizer=0)
    with pytest.raises(ValueError, match=r"lengths must be \[B\]"):
        linear_length_penalty(torch.ones(2, 2), coef=0.1)
    with pytest.raises(ValueError, match="lengths"):
        linear_length_penalty(torch.tensor([1.0, float("nan")]), coef=0.1)
