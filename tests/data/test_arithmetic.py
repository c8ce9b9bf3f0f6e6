from posttrain.data import arithmetic
import pytest

from posttrain.data.arithmetic import ArithmeticTask, Problem, matches_style, verify_answer, verify_steps
from posttrain.data.sources import ArithmeticSource
from posttrain.errors import ConfigError


def test_solutions_in_both_styles():
    problem = Problem((347, 185))
    assert problem.prompt == "347+185="
    assert problem.solution("concise") == "532"
    assert problem.solution("verbose") == "7+5=12,4+8+1=13,3+1+1=5>532"
    # a final carry becomes its own column step; shorter operands are padded with 0
    assert Problem((95, 7)).solution("verbose") == "5+7=12,9+0+1=10>102"
    assert Problem((999, 1, 5)).solution("verbose") == "9+1+5=15,9+0+0+1=10,9+0+0+1=10>1005"


def test_generation_is_deterministic_and_seeded():
    a, b = ArithmeticTask(seed=3), ArithmeticTask(seed=3)
    assert a.problems("train", 50) == b.problems("train", 50)
    assert a.problems("train", 50) != ArithmeticTask(seed=4).problems("train", 50)
    # problem i does not depend on which other problems were drawn
    assert a.problem("train", 17) == a.problems("train", 30)[17]


def test_splits_are_disjoint():
    task = ArithmeticTask(min_digits=2, max_digits=2)  # small space: collisions would show
    prompts = {split: {p.prompt for p in task.problems(split, 400)} for split in arithmetic.SPLITS}
    assert not prompts["train"] & prompts["validation"]
    assert not prompts["train"] & prompts["test"]
    assert not prompts["validation"] & prompts["test"]
    assert all(arithmetic.split_of(p) == "test" for p in prompts["test"])


def test_difficulty_knobs():
    task = ArithmeticTask(min_digits=4, max_digits=5, num_operands=3)
    for problem in task.problems("train", 100):
        assert len(problem.operands) == 3
        assert all(4 <= len(str(x)) <= 5 for x in problem.operands)


def test_answer_verifier_accepts_right_and_rejects_wrong():
    assert verify_answer("347+185=", "532")
    assert verify_answer("347+185=", "7+5=12,4+8+1=13,3+1+1=5>532")
    assert verify_answer("1+2+3=", "6")
    for wrong in ["533", "", "53", "532x", ">", "7+5=12>531", "5 32"]:
        assert not verify_answer("347+185=", wrong), wrong


def test_step_verifier_marks_each_step():
    prompt = "347+185="
    assert verify_steps(prompt, "7+5=12,4+8+1=13,3+1+1=5>532") == [True, True, True]
    # wrong carry in the second step, right third step
    assert verify_steps(prompt, "7+5=12,4+8=12,3+1+1=5>522") == [True, False, True]
    assert verify_steps(prompt, "7+5=13,4+8+1=13") == [False, True]
    # a step beyond the last column is wrong
    assert verify_steps(prompt, "7+5=12,4+8+1=13,3+1+1=5,0+0=0>532") == [True, True, True, False]
    assert verify_steps(prompt, "") == []


def test_style_matcher():
    assert matches_style("532", "concise") and not matches_style("5+3=8>8", "concise")
    assert matches_style("7+5=12,4+8+1=13,3+1+1=5>532", "verbose")
    assert not matches_style("532", "verbose") and not matches_style("7+5=12,>532", "verbose")
    # mixed: either form, nothing else
    assert matches_style("532", "mixed") and matches_style("7+5=12,4+8+1=13,3+1+1=5>532", "mixed")
    assert not matches_style("", "mixed") and not matches_style("7+5=12,>532", "mixed")


@pytest.mark.parametrize("share", [0.0, 0.3, 0.7, 1.0])
def test_mixed_style_gives_each_problem_one_form_at_the_verbose_share(share):
    source = ArithmeticSource(min_digits=2, max_digits=3, style="mixed", seed=1, verbose_share=share)
    for split, count in (("train", 2000), ("validation", 1000)):
        examples = [source.example(split, i) for i in range(count)]
        verbose = [matches_style(e.response, "verbose") for e in examples]
        assert all(v or matches_style(e.response, "concise") for v, e in zip(verbose, examples))
        assert all(verify_answer(e.prompt, e.response) and source.has_style(e.response) for e in examples)
        # binomial std at n=1000 is at most 0.016: 0.05 is over 3 sigma
        assert abs(sum(verbose) / count - share) <= 0.05, (split, sum(verbose) / count)


def test_mixed_style_is_a_function_of_the_prompt():
    a = ArithmeticSource(min_digits=1, max_digits=1, style="mixed", seed=0, verbose_share=0.5)
    b = ArithmeticSource(min_digits=1, max_digits=1, style="mixed", seed=5, verbose_share=0.5)
    first = {e.prompt: e.response for e in (a.example("train", i) for i in range(300))}
    # another seed, drawn in another order: a prompt it shares gets the same reference solution
    shared = [e for e in (b.example("train", i) for i in range(300)) if e.prompt in first]
    assert len(shared) > 100 and all(first[e.prompt] == e.response for e in shared)
    # and a resumed stream (index 150 on) is the same as the uninterrupted one
    assert [a.example("train", i) for i in range(150, 160)] == \
        [ArithmeticSource(1, 1, style="mixed", seed=0, verbose_share=0.5).example("train", i) for i in range(150, 160)]


def test_mixed_style_share_is_checked():
    with pytest.raises(ConfigError, match="data.verbose_share"):
        ArithmeticSource(style="mixed", verbose_share=1.5)
