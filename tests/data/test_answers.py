"""Final-answer extraction, math-verify comparison with its numeric fallback, and the
per-check timeout of the answer-check worker (data/answers.py)."""

import time

import pytest

from posttrain.data import answers
from posttrain.data.answers import AnswerChecker, answers_match, extract_final_answer, last_boxed_content


def hang_on_marked_answer(predicted, reference):
    """A checker that never returns for the answer "hang" (runs in the worker process)."""
    if predicted == "hang":
        time.sleep(600)
    return predicted == reference


def raise_on_every_answer(predicted, reference):
    raise ValueError("broken checker")


@pytest.mark.parametrize("response, expected", [
    ("so x = \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),                       # nested braces
    ("first \\boxed{3}, then \\boxed{\\sqrt{\\frac{a}{b}}}", "\\sqrt{\\frac{a}{b}}"),  # the last box
    ("\\fbox{7}", "7"),
    ("She sold 48 + 24 = 72 clips.\n#### 72", "72"),                         # GSM8K's marker
    ("#### 1,000\nThat is all.", "1,000"),                                    # only the marker's line
    ("It costs 1,250 dollars and then 3.5 more, so 1,253.5,", "1,253.5"),    # the last number, commas kept
    ("<think>maybe 5, or \\boxed{6}</think> <answer>7</answer>", "7"),       # r1: inside <answer>
    ("<think>x</think><answer>\\boxed{\\frac{3}{4}}</answer>", "\\frac{3}{4}"),
    ("<think>x</think><answer>Paris</answer>", "Paris"),                     # a tagged non-number
    ("I do not know.", None),
    ("\\boxed{1 + {2", "2"),                                                  # an unclosed box: the last number
])
def test_extract_final_answer(response, expected):
    assert extract_final_answer(response) == expected


def test_last_boxed_content_balances_braces():
    assert last_boxed_content("\\boxed{\\{1, 2\\} \\cup {3}}") == "\\{1, 2\\} \\cup {3}"
    assert last_boxed_content("no box here") is None


@pytest.mark.parametrize("predicted, reference, same", [
    ("0.5", "\\frac{1}{2}", True),
    ("\\frac{1}{2}", "1/2", True),
    ("\\dfrac{1}{2}", "0.5", True),
    ("72.0", "72", True),
    ("1,000", "1000", True),
    ("x^2+1", "1+x^2", True),
    ("73", "72", False),
    ("\\frac{1}{3}", "0.5", False),
    (None, "72", False),
])
def test_answers_match(predicted, reference, same):
    assert answers_match(predicted, reference) is same


def test_numbers_are_compared_when_math_verify_cannot_parse(monkeypatch):
    import math_verify

    monkeypatch.setattr(math_verify, "parse", lambda *args, **kwargs: [])  # it understands nothing
    assert answers_match("72.0", "72") and answers_match("1,000", "1000.00") and answers_match("$5", "5")
    assert answers_match("3/4", "0.75")
    assert not answers_match("7", "72") and not answers_match("seventy-two", "72")


def test_checker_verifies_in_its_worker():
    checker = AnswerChecker(timeout_s=30)
    try:
        assert checker("0.5", "\\frac{1}{2}") and checker("1,000", "1000")
        assert not checker("73", "72") and not checker(None, "72")
        assert checker.take_timeouts() == 0
    finally:
        checker.close()


def test_a_hanging_check_is_cut_counted_and_the_worker_restarted(caplog):
    checker = AnswerChecker(timeout_s=1.0, check=hang_on_marked_answer)
    try:
        assert checker("5", "5")
        first_worker = checker._process.pid
        started = time.monotonic()
        assert checker("hang", "5") is False  # cut: counted as incorrect
        assert time.monotonic() - started < 10
        assert "timed out after 1 s" in caplog.text and "'hang'" in caplog.text
        assert checker("6", "6") and checker._process.pid != first_worker  # a fresh worker
        assert checker.take_timeouts() == 1 and checker.take_timeouts() == 0  # counted once, then reset
    finally:
        checker.close()


def test_a_raising_check_names_the_answer():
    checker = AnswerChecker(timeout_s=30, check=raise_on_every_answer)
    try:
        with pytest.raises(RuntimeError, match=r"'41'.*'42'.*ValueError: broken checker"):
            checker("41", "42")
    finally:
        checker.close()


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout"):
        AnswerChecker(timeout_s=0)


def test_tolerance_is_relative_for_large_numbers():
    assert answers.numbers_match("1000000.0000001", "1000000")
    assert not answers.numbers_match("0.3334", "0.3333")
