"""data=word_problems: generated GSM8K-shaped stories whose solution lines recompute to their
answer, deterministic, split by a stable hash, with knobs that do what they say, checked with
math-verify, composed and run through the real CLI."""

import re
import sys

import pytest
from omegaconf import OmegaConf

from posttrain.config.check import check_config
from posttrain.data.arithmetic import SPLITS, split_of
from posttrain.data.curriculum import DifficultySchedule
from posttrain.data.datamodule import ExampleCursor
from posttrain.data.sources import build_source
from posttrain.data.templates import get_template
from posttrain.data.word_problems import (OPERATIONS, QUANTITY_CAP, WordProblemSource, WordProblemTask,
                                          evaluate_line)
from posttrain.errors import ConfigError

from forked_cli import run_command
from conftest import compose_config

# (name, knobs): each difficulty the recomputation runs over
DIFFICULTIES = [
    ("1 step, small numbers", dict(min_steps=1, max_steps=1, max_number=10)),
    ("the default", dict()),
    ("3 steps, every operation", dict(min_steps=3, max_steps=3, operations=OPERATIONS)),
    ("1-5 steps, every operation, numbers to 50, distractors",
     dict(min_steps=1, max_steps=5, max_number=50, operations=OPERATIONS, distractors=0.5)),
    ("divide alone", dict(min_steps=1, max_steps=2, max_number=20, operations=("divide",))),
]
NUMBER = re.compile(r"\d+")


def source(*overrides) -> WordProblemSource:
    return build_source(compose_config(["data=word_problems", *overrides]).data)


def recompute(question: str, lines: tuple[str, ...]) -> int:
    """The answer the solution lines give, each checked: it evaluates to what it states and
    starts from the quantity the line before left (the first from the story's first number)."""
    quantity = int(NUMBER.search(question).group())
    for line in lines:
        evaluated = evaluate_line(line)
        assert evaluated is not None, line
        value, stated = evaluated
        assert value == stated and int(NUMBER.match(line).group()) == quantity, (question, line)
        quantity = stated
    return quantity


# --- hand-checked examples ---------------------------------------------------------------

def test_the_first_problems_of_a_fixed_seed():
    problem = WordProblemTask(seed=0).problem("train", 0)
    assert problem.question == "Leo has 6 plums. He buys 4 more plums. How many plums does Leo have now?"
    assert problem.lines == ("6 + 4 = 10",) and problem.answer == 10
    two = WordProblemTask(seed=0, max_steps=2).problem("train", 0)  # other knobs, other problems
    assert (two.question, two.solution, two.answer) == (
        "Sam has 7 pancakes. He eats 4 pancakes. How many pancakes does Sam have at the end?", "7 - 4 = 3", 3)

    hard = WordProblemTask(min_steps=3, max_steps=3, operations=OPERATIONS, distractors=1.0).problem("train", 0)
    assert hard.question == (
        "Noah has 8 pencils. He collects more until he has 5 times as many pencils as before. Tom is 3 years "
        "old. Then Noah ends up with twice as many pencils as before. After that, he buys 2 packs of pencils "
        "with 10 pencils in each pack. How many pencils does Noah have now?")  # after Tom: "Noah", not "he"
    assert hard.solution == "8 × 5 = 40\n40 × 2 = 80\n80 + 2 × 10 = 100" and hard.answer == 100


def test_an_example_asks_after_a_worked_example_and_targets_the_solution():
    """The defaults: the question alone (template=plain) after one worked example as earlier chat
    turns (shots=1); the target is the solution lines and "#### <answer>"."""
    question = "Leo has 6 plums. He buys 4 more plums. How many plums does Leo have now?"
    example = source("data.seed=0").example("train", 0)
    assert example.prompt == question and example.answer == "10"
    assert example.response == "6 + 4 = 10\n#### 10"
    shot, solved, asked = example.messages
    assert (shot["role"], solved["role"], asked) == ("user", "assistant", {"role": "user", "content": question})
    assert split_of(shot["content"]) == "train"  # a training problem, with its reference answer
    assert re.fullmatch(r"(?s)(\d+ [-+] \d+ = \d+\n)+#### \d+", solved["content"])

    boxed = source("data.seed=0", "data.template=boxed", "data.shots=0").example("train", 0)
    instruction = "Reason step by step, then put your final answer within \\boxed{}."
    assert boxed.messages == [{"role": "user", "content": f"{question}\n{instruction}"}]
    assert boxed.response == "6 + 4 = 10\nThe final answer is $\\boxed{10}$."
    text = source("data.seed=0", "data.chat=false").example("train", 0)
    assert text.messages is None and text.prompt.endswith(f"\n{question}") and "\n\n" not in text.prompt


def test_worked_examples_are_training_problems_fixed_for_every_run():
    task = source("data.shots=2", "data.max_steps=3")
    for split in ("validation", "test"):
        for index in range(10):
            shots = task.worked_examples(split, index)
            assert len(shots) == 2 and all(split_of(shot.question) == "train" for shot in shots)
            assert all(recompute(shot.question, shot.lines) == shot.answer for shot in shots)
        assert source("data.shots=2", "data.max_steps=3", "seed=9").example(split, 4) == task.example(split, 4)
    assert task.worked_examples("test", 0) != task.worked_examples("test", 1)  # each prompt its own
    bare = source("data.shots=0", "data.max_steps=3").example("test", 0)
    assert bare.messages == [{"role": "user", "content": task.example("test", 0).prompt}]


# --- every answer is its solution's ----------------------------------------------------------

@pytest.mark.parametrize("name,knobs", DIFFICULTIES, ids=[name for name, _ in DIFFICULTIES])
def test_every_answer_recomputes_from_its_solution_lines(name, knobs):
    task = WordProblemTask(**knobs)
    for split, count in (("train", 300), ("test", 30)):
        for problem in task.problems(split, count):
            assert recompute(problem.question, problem.lines) == problem.answer
            assert isinstance(problem.answer, int) and 1 <= problem.answer <= QUANTITY_CAP * task.max_number
            assert task.min_steps <= len(problem.lines) <= task.max_steps
            written = [int(n) for n in NUMBER.findall(problem.question)]
            assert all(2 <= n <= task.max_number for n in written), problem.question
            for line in problem.lines:  # every intermediate quantity is whole, positive and capped
                assert all(1 <= int(n) <= QUANTITY_CAP * task.max_number for n in NUMBER.findall(line)), line


def test_the_line_reader_refuses_what_is_not_one_step():
    assert evaluate_line("12 + 3 × 4 = 24") == (24, 24)
    assert evaluate_line("24 ÷ 5 = 4") is None  # not whole
    assert evaluate_line("7 - 4 = 2") == (3, 2)  # read, and wrong
    assert evaluate_line("12 - 3 × 4 = 0") is None and evaluate_line("so 12 apples") is None


# --- determinism and splits -------------------------------------------------------------------

def test_problem_i_is_a_pure_function_of_seed_split_and_index():
    task = WordProblemTask(seed=3, operations=OPERATIONS)
    assert task.problems("train", 40) == WordProblemTask(seed=3, operations=OPERATIONS).problems("train", 40)
    assert task.problem("train", 17) == task.problems("train", 30)[17] == task.problems("train", 10, start=17)[0]
    assert task.problems("train", 40) != WordProblemTask(seed=4, operations=OPERATIONS).problems("train", 40)


def test_held_out_problems_are_the_same_for_every_run_seed():
    """The run's seed draws the training problems; validation and test are drawn with
    heldout_seed (data.validation_seed), fixed, so every run of a sweep evaluates alike."""
    for split in ("validation", "test"):
        assert WordProblemTask(seed=0).problems(split, 20) == WordProblemTask(seed=7).problems(split, 20)
        assert WordProblemTask(heldout_seed=1).problems(split, 20) != WordProblemTask().problems(split, 20)
    assert source("seed=5").example("test", 3) == source("seed=6").example("test", 3)
    # they do depend on the difficulty knobs (documented)
    assert WordProblemTask(max_steps=3).problems("test", 20) != WordProblemTask().problems("test", 20)


def test_splits_are_disjoint_by_a_stable_hash_of_the_question():
    task = WordProblemTask(min_steps=1, max_steps=1, max_number=5)  # a small space: collisions would show
    questions = {split: {p.question for p in task.problems(split, 300)} for split in SPLITS}
    assert not questions["train"] & questions["validation"]
    assert not questions["train"] & questions["test"]
    assert not questions["validation"] & questions["test"]
    assert all(split_of(q) == split for split in SPLITS for q in questions[split])


# --- the knobs do what they say -------------------------------------------------------------

def test_more_steps_make_more_solution_lines_and_sentences():
    for steps in (1, 2, 4):
        for problem in WordProblemTask(min_steps=steps, max_steps=steps).problems("train", 50):
            assert len(problem.lines) == steps
            assert problem.question.count(". ") == steps + 1  # the first quantity and each step, before the question
    counts = {len(p.lines) for p in WordProblemTask(min_steps=1, max_steps=3).problems("train", 200)}
    assert counts == {1, 2, 3}


def test_operations_limit_the_symbols_of_the_solution():
    symbols = {"add": "+", "subtract": "-", "multiply": "×", "divide": "÷"}
    for operations in (("add",), ("subtract",), ("multiply",), ("divide",), ("add", "multiply")):
        task = WordProblemTask(min_steps=2, max_steps=2, max_number=20, operations=operations)
        used = {symbol for problem in task.problems("train", 100) for line in problem.lines
                for symbol in symbols.values() if f" {symbol} " in line}
        assert used == {symbols[op] for op in operations}, operations  # each allowed one shows up, no other


def test_max_number_bounds_the_written_numbers():
    small = [p for p in WordProblemTask(max_number=3).problems("train", 100)]
    assert max(int(n) for p in small for n in NUMBER.findall(p.question)) == 3
    large = [p for p in WordProblemTask(max_number=50).problems("train", 100)]
    assert max(int(n) for p in large for n in NUMBER.findall(p.question)) > 10


def test_distractors_add_one_sentence_with_a_number_the_solution_never_uses():
    bare = WordProblemTask(min_steps=2, max_steps=2, distractors=0.0).problems("train", 50)
    assert all(p.question.count(". ") == 3 for p in bare)
    noisy = WordProblemTask(min_steps=2, max_steps=2, distractors=1.0).problems("train", 50)
    assert all(p.question.count(". ") == 4 for p in noisy)
    half = WordProblemTask(min_steps=2, max_steps=2, distractors=0.5).problems("train", 200)
    assert 60 < sum(p.question.count(". ") == 4 for p in half) < 140


@pytest.mark.parametrize("knobs,message", [
    (dict(min_steps=3, max_steps=2), "min_steps <= max_steps"),
    (dict(max_number=1), "max_number must be >= 2"),
    (dict(operations=("add", "power")), "operations="),
    (dict(operations=()), "operations="),
    (dict(distractors=1.5), "distractors=1.5"),
])
def test_bad_knobs_are_refused(knobs, message):
    with pytest.raises(ValueError, match=message):
        WordProblemTask(**knobs)


def test_knobs_no_story_can_meet_are_a_clear_error():
    with pytest.raises(ValueError, match="cannot chain that many steps"):
        WordProblemTask(min_steps=3, max_steps=3, max_number=2, operations=("divide",)).problem("train", 0)


# --- answer checking ----------------------------------------------------------------------------

@pytest.mark.parametrize("template", ["plain", "boxed"])
def test_the_checker_accepts_the_reference_and_rejects_a_wrong_number(template):
    task = source(f"data.template={template}", "data.operations=[add,subtract,multiply,divide]", "data.max_steps=3")
    marker = {"plain": "#### {}", "boxed": "\\boxed{{{}}}"}[template]
    try:
        for index in range(4):
            example = task.example("test", index)
            right, wrong = marker.format(example.answer), marker.format(int(example.answer) + 1)
            assert right in example.response
            assert task.is_correct(example, example.response) and task.has_style(example.response)
            assert task.final_answer(example.response) == example.answer
            assert not task.is_correct(example, example.response.replace(right, wrong))
            assert task.is_correct(example, f"So she has {example.answer} left.")  # the last number, unmarked
            assert not task.is_correct(example, "I do not know.") and not task.has_style("I do not know.")
        assert task.take_verifier_timeouts() == 0
    finally:
        task.checker.close()


# --- config, curriculum and the command line -----------------------------------------------------

def test_posttrain_data_word_problems_composes_and_passes_the_config_check():
    cfg = compose_config(["data=word_problems"])
    OmegaConf.resolve(cfg)
    check_config(cfg, {"data": "word_problems"})
    built = build_source(cfg.data)
    assert isinstance(built, WordProblemSource) and built.chat and built.template is get_template("plain")
    assert built.shots == 1 and built.task == WordProblemTask(seed=cfg.seed)  # the yaml's knobs are the defaults
    assert built.prompt_limits.max_response_tokens == cfg.data.max_response_tokens
    for split in SPLITS:
        assert built.example(split, 0).answer.isdigit()
    hf = compose_config(["data=word_problems", "model=hf", "model.name_or_path=/some/chat/model",
                         "algorithm=grpo"])
    OmegaConf.resolve(hf)
    check_config(hf, {"data": "word_problems", "algorithm": "grpo"})


def test_bad_values_are_refused_by_the_config_check():
    cfg = compose_config(["data=word_problems", "data.min_steps=3", "data.max_steps=2", "data.operations=[add,power]"])
    OmegaConf.resolve(cfg)
    with pytest.raises(ConfigError) as caught:
        check_config(cfg, {})
    assert "data.operations=['add', 'power'] is not valid" in str(caught.value)
    with pytest.raises(ConfigError, match="min_steps <= max_steps"):
        source("data.min_steps=3", "data.max_steps=2")


def test_the_difficulty_schedule_raises_max_steps():
    task = source("data.min_steps=1", "data.max_steps=1")
    schedule = DifficultySchedule(ExampleCursor(task, "train", seed=0), milestones=[2, 4], max_level=1)
    assert all(len(p.lines) == 1 for p in task.task.problems("train", 20))
    assert schedule.on_step_end(1, None) == {"curriculum/difficulty_level": 0.0}
    assert schedule.on_step_end(2, None) == {"curriculum/difficulty_level": 1.0}
    assert task.task.max_steps == 2 and {len(p.lines) for p in task.task.problems("train", 50)} == {1, 2}
    schedule.on_step_end(4, None)
    assert task.task.max_steps == 2  # max_level reached
    resumed = DifficultySchedule(ExampleCursor(source("data.min_steps=1", "data.max_steps=1"), "train", seed=0),
                                 milestones=[2])
    resumed.load_state_dict(schedule.state_dict())
    assert resumed.cursor.source.task.max_steps == 2


QUICK = ("logger=none", "callbacks.progress_bar=none", "trainer.max_steps=2", "trainer.val_check_interval=2",
         "callbacks.checkpoint.every_n_train_steps=2", "eval.num_prompts=4", "eval.batch_size=4",
         "eval.at_start=false")


def test_two_sft_steps_through_the_cli_on_the_embedded_model(tmp_path):
    """model=tiny (a character tokenizer, a 256-token context) runs the task with plain prompts
    and a longer context: `posttrain data=word_problems data.chat=false model.max_position_embeddings=512`."""
    command = [sys.executable, "-m", "posttrain.train", "data=word_problems", "data.chat=false",
               "model.max_position_embeddings=512", "data.max_response_tokens=48", "algorithm.batch_size=8", *QUICK,
               f"paths.log_dir={tmp_path}"]
    ran = run_command(command, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    (summary,) = tmp_path.rglob("summary.json")
    assert '"global_step": 2' in summary.read_text()


def test_the_embedded_model_refuses_chat_prompts_naming_data_chat(make_config):
    from posttrain.errors import DataError
    from posttrain.train import run

    with pytest.raises(DataError, match=r"has no chat template .* set data.chat=false"):
        run(make_config("data=word_problems", *QUICK))


def test_grpo_on_word_problems_with_a_chat_model(tiny_hf_model, make_config):
    """The default prompts (chat, boxed) through a model's chat template, GRPO's rollouts scored by
    math-verify, two steps."""
    from posttrain.train import run

    cfg = make_config(*QUICK, "model=hf", f"model.name_or_path={tiny_hf_model('qwen2')}", "data=word_problems",
                      "data.max_response_tokens=8", "algorithm=grpo", "algorithm.warm_start.steps=0",
                      "algorithm.prompts_per_step=2", "algorithm.group_size=2")
    summary = run(cfg)
    assert summary["global_step"] == 2 and 0.0 <= summary["eval/accuracy"] <= 1.0
