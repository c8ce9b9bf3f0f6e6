"""data=reasoning_gym: reasoning-gym's task generators as a task source. The scorer agrees with
each task's own score_answer on the task's own examples, answers are read in the stated format
only, the splits are deterministic and disjoint, bad task lists are refused at start-up naming
the key, the difficulty schedule raises curriculum levels, the embedded tokenizer knows every
character, and two GRPO steps run through the CLI on the embedded model."""

import json
import re
import sys

import pytest
from omegaconf import OmegaConf

pytest.importorskip("reasoning_gym", reason="data=reasoning_gym needs the reasoning-gym package: "
                                            "pip install 'posttrain[reasoning-gym]'")

import reasoning_gym.factory as gym  # noqa: E402

from posttrain.config.check import check_config  # noqa: E402
from posttrain.data.arithmetic import SPLITS  # noqa: E402
from posttrain.data.curriculum import DifficultySchedule  # noqa: E402
from posttrain.data.datamodule import ExampleCursor  # noqa: E402
from posttrain.data.reasoning_gym import (ANSWER_TAG_TOKENS, ReasoningGymSource, TaskExample,  # noqa: E402
                                          extract_answer, parse_tasks, reference_response)
from posttrain.data.sources import build_source  # noqa: E402
from posttrain.errors import ConfigError  # noqa: E402
from posttrain.models.tiny import build_char_tokenizer  # noqa: E402

from conftest import compose_config  # noqa: E402
from forked_cli import run_command  # noqa: E402

# tasks with one reference answer each, of several kinds: numbers, words, lists, a grid
SCORED_TASKS = ("basic_arithmetic", "chain_sum", "spell_backward", "word_sorting", "base_conversion",
                "number_sorting", "rotate_matrix")


def source(*overrides, tasks="[{name: chain_sum, size: 40, heldout_size: 6}]") -> ReasoningGymSource:
    return build_source(compose_config(["data=reasoning_gym", f"data.tasks={tasks}", *overrides]).data)


def refusal(*overrides) -> str:
    cfg = compose_config(["data=reasoning_gym", *overrides])
    OmegaConf.resolve(cfg)
    with pytest.raises(ConfigError) as caught:
        check_config(cfg, {})
    return str(caught.value)


@pytest.fixture(scope="module")
def scored():
    """A source (plain prompts, tags) and, per task, reasoning-gym's own dataset and 6 of its entries."""
    built = source("data.chat=false", tasks="[" + ",".join(SCORED_TASKS) + "]")
    own = {}
    for spec in built.tasks:
        dataset = gym.create_dataset(spec.name, seed=42, size=6)
        own[spec.name] = (dataset, [dataset[i] for i in range(6)])
    yield built, own
    built.checker.close()


def as_example(built: ReasoningGymSource, name: str, entry: dict) -> TaskExample:
    """reasoning-gym's own entry as an example of the source (the config is the task's default)."""
    (spec,) = [s for s in built.tasks if s.name == name]
    return built._make(spec, {}, entry)


# --- the scorer against reasoning-gym's own -------------------------------------------------------

@pytest.mark.parametrize("name", SCORED_TASKS)
def test_the_scorer_agrees_with_the_tasks_own_score_answer(scored, name):
    built, own = scored
    dataset, entries = own[name]
    for entry in entries:
        example = as_example(built, name, entry)
        right, wrong = entry["answer"], entry["answer"] + "9"
        assert dataset.score_answer(answer=right, entry=entry) == 1.0
        for response, answer in [
            (example.response, right),                                        # the reference itself
            (f"Let me think.\n<answer>{right}</answer>", right),             # reasoning before it
            (f"<answer> {right}\n</answer>", right),                         # spaces and a newline inside
            (f"<answer>{wrong}</answer> no, <answer>{right}</answer>", right),  # the last one counts
            (f"<answer>{wrong}</answer>", wrong),                             # a wrong answer
            (f"<answer>{right}</answer> no, <answer>{wrong}</answer>", wrong),
        ]:
            expected = dataset.score_answer(answer=answer, entry=entry) >= 1.0
            assert built.is_correct(example, response) is expected, (name, response)
            assert built.score(example, response) == dataset.score_answer(answer=answer, entry=entry)
        for unstated in (right, f"<answer>{right}", f"#### {right}", ""):  # not in the stated format
            assert built.final_answer(unstated) is None and not built.is_correct(example, unstated)


def test_the_threshold_counts_partial_credit_when_lowered():
    """reasoning-gym's default scorer gives len(answer)/len(response) to a response that contains the
    answer; data.correct_threshold decides whether that is correct."""
    entry = gym.create_dataset("spell_backward", seed=3, size=1)[0]
    padded = f"<answer>{entry['answer']} and more</answer>"
    strict = source(tasks="[spell_backward]")
    lenient = source("data.correct_threshold=0.1", tasks="[spell_backward]")
    example = as_example(strict, "spell_backward", entry)
    partial = strict.score(example, padded)
    assert 0.1 < partial < 1.0
    assert not strict.is_correct(example, padded) and lenient.is_correct(example, padded)
    strict.checker.close(), lenient.checker.close()


@pytest.mark.parametrize("response,answer_format,answer", [
    ("<answer>42</answer>", "tags", "42"),
    ("x <answer>1</answer> y <answer> a, b </answer>", "tags", "a, b"),
    ("<answer>\n1 2\n3 4\n</answer>", "tags", "1 2\n3 4"),   # a grid keeps its lines
    ("<answer></answer>", "tags", None),
    ("<answer>42", "tags", None),                            # never closed
    ("42", "tags", None),
    ("work\n#### 42", "hash", "42"),
    ("#### 1\n#### 2\n", "hash", "2"),
    ("#### \n1 2\n3 4", "hash", "1 2\n3 4"),
    ("42", "hash", None),
])
def test_extract_answer(response, answer_format, answer):
    assert extract_answer(response, answer_format) == answer


def test_the_hash_format_asks_for_and_reads_its_marker():
    built = source("data.answer_format=hash")
    example = built.example("train", 0)
    assert "####" in example.prompt and example.response == f"#### {example.answer}"
    assert built.is_correct(example, example.response) and built.is_correct(example, f"so\n#### {example.answer}\n")
    assert not built.is_correct(example, f"<answer>{example.answer}</answer>")
    assert reference_response(None, "hash") == "" and reference_response("7", "tags") == "<answer>7</answer>"
    built.checker.close()


# --- examples, splits, determinism ------------------------------------------------------------------

def test_an_example_asks_the_question_and_keeps_its_task():
    built = source("data.shots=0", tasks="[{name: basic_arithmetic, size: 5, heldout_size: 2}, {name: chain_sum, size: 5}]")
    entry = gym.create_dataset("chain_sum", seed=0, size=1)[0]
    example = built.example("train", 7)  # after basic_arithmetic's 5
    assert isinstance(example, TaskExample) and example.source == "chain_sum"
    assert built.source_names == ("basic_arithmetic", "chain_sum")  # metrics per task
    assert example.messages == [{"role": "user", "content": example.prompt}]
    assert example.prompt.endswith("\nGive your final answer between <answer> and </answer>.")
    assert example.response == f"<answer>{example.answer}</answer>" and entry["question"].split(":")[0] in example.prompt
    plain = source("data.chat=false", "data.shots=0", tasks="[chain_sum]").example("train", 0)
    assert plain.messages is None and plain.prompt.endswith("</answer>.\n")
    # held-out prompts take the tasks in turn
    assert [built.example("validation", i).source for i in range(4)] == ["basic_arithmetic", "chain_sum"] * 2
    assert built.size("train") == 10 and built.size("validation") == built.size("test") == 2 + 32


def test_worked_examples_come_before_the_question_fixed_for_every_run():
    """data.shots: earlier turns of the same task with their answers in the format (the yaml's 1),
    drawn with the held-out seed, never a held-out question."""
    tasks = "[{name: chain_sum, size: 10, heldout_size: 4}, {name: spell_backward, size: 10, heldout_size: 4}]"
    built, other_seed = source("data.shots=2", tasks=tasks), source("data.shots=2", "seed=3", tasks=tasks)
    held_out = {built.example(split, i).prompt for split in ("validation", "test") for i in range(8)}
    for split in SPLITS:
        for i in range(built.size(split)):
            example = built.example(split, i)
            *shots, question = example.messages
            assert [m["role"] for m in shots] == ["user", "assistant"] * 2 and question["content"] == example.prompt
            for ask, answer in zip(shots[0::2], shots[1::2]):
                assert ask["content"] not in held_out and ask["content"] != example.prompt
                assert re.fullmatch(r"<answer>.+</answer>", answer["content"])
                assert ask["content"].split(" ")[0] == example.prompt.split(" ")[0]  # the same task
            if split != "train":
                assert example == other_seed.example(split, i)
    plain = source("data.chat=false", tasks=tasks).example("test", 0)
    assert plain.messages is None and plain.prompt.count("<answer>") == 3  # the shot's answer and 2 instructions


def test_examples_are_a_pure_function_of_the_seeds():
    a, b = source(), source()
    other = source("seed=1")
    for split in SPLITS:
        assert [a.example(split, i) for i in range(a.size(split))] == [b.example(split, i) for i in range(b.size(split))]
    train = [e.prompt for e in (a.example("train", i) for i in range(40))]
    assert len(set(train) & {other.example("train", i).prompt for i in range(40)}) < 10  # another seed: other problems
    for split in ("validation", "test"):  # the held-out ones stay, whatever the run's seed
        assert [a.example(split, i) for i in range(6)] == [other.example(split, i) for i in range(6)]
    moved = source("data.validation_seed=5")
    assert {moved.example("test", i).prompt for i in range(6)} != {a.example("test", i).prompt for i in range(6)}
    assert source(tasks="[{name: chain_sum, size: 40, heldout_size: 6, seed: 1}]").example("train", 0) == \
        other.example("train", 0)  # a task's own seed is the run's seed for that task


def test_the_splits_never_share_a_question():
    built = source(tasks="[{name: chain_sum, size: 300, heldout_size: 40, config: {max_digits: 1}}]")
    questions = {split: [built.example(split, i).prompt for i in range(built.size(split))] for split in SPLITS}
    assert len(set(questions["validation"])) == len(questions["validation"]) == 40
    assert not set(questions["train"]) & set(questions["validation"])
    assert not set(questions["train"]) & set(questions["test"])
    assert not set(questions["validation"]) & set(questions["test"])


def test_a_task_too_small_for_its_held_out_splits_is_a_clear_error():
    # 2 one-digit terms, + or -: 200 distinct questions, fewer than 2 x 150
    with pytest.raises(ConfigError, match=r"data.tasks\[0\] \(chain_sum\): only \d+ distinct questions"):
        source(tasks="[{name: chain_sum, heldout_size: 150, config: {max_terms: 2, max_digits: 1}}]").example("test", 0)


# --- start-up refusals ------------------------------------------------------------------------------

def test_the_yaml_and_a_mapping_task_list_pass_the_config_check():
    for tasks in ("[chain_sum]", "[{name: basic_arithmetic, size: 500, config: {min_terms: 2}}, {name: chain_sum}]"):
        cfg = compose_config(["data=reasoning_gym", f"data.tasks={tasks}", "algorithm=grpo"])
        OmegaConf.resolve(cfg)
        check_config(cfg, {"data": "reasoning_gym", "algorithm": "grpo"})


@pytest.mark.parametrize("tasks,message", [
    ("[basic_arithmetik]", "data.tasks[0].name='basic_arithmetik' is not a reasoning-gym task; did you mean "
                           "basic_arithmetic"),
    ("[chain_sum, {name: chain_sum, sise: 3}]", "data.tasks[1]: unknown key(s) ['sise']; valid keys: name, size"),
    ("[{name: chain_sum, config: {min_termz: 2}}]", "data.tasks[0].config.min_termz: unknown config key of chain_sum"),
    ("[{name: chain_sum, config: {seed: 3}}]", "data.tasks[0].config.seed: set the task's seed with data.tasks[0].seed"),
    ("[{name: chain_sum, config: {min_terms: 5, max_terms: 2}}]",
     "data.tasks[0].config={'max_terms': 2, 'min_terms': 5} is refused by chain_sum's config: AssertionError"),
    ("[3]", "data.tasks[0]=3 must be a task name or a mapping"),
    ("[{size: 3}]", "data.tasks[0].name=None: each task needs a name"),
    ("[{name: chain_sum, size: 0}]", "data.tasks[0].size=0 must be an integer >= 1"),
    ("[{name: gsm_symbolic, level: 1}]", "data.tasks[0].level=1: gsm_symbolic has no reasoning-gym curriculum"),
    ("[{name: chain_sum, level: 99}]", "data.tasks[0].level=99 must be an integer in [0, "),
    ("[{name: chain_sum, config: [1]}]", "data.tasks[0].config=[1] must be a mapping"),
    ("[{name: simple_equations, config: {operators: ['+', '-']}}]",  # its validate() passes; item 0 raises
     "data.tasks[0].config={'operators': ['+', '-']} is refused by simple_equations's generator: ValueError"),
    ("[composite]", "data.tasks[0].name=composite: list the tasks as entries of data.tasks instead"),
    ("[{name: chain_sum, heldout_size: 0}]", "every task of data.tasks has heldout_size 0"),
    ("[]", "data.tasks=[] is not valid: expected a non-empty list"),
])
def test_a_bad_task_list_is_refused_at_start_up_naming_the_key(tasks, message):
    assert message in refusal(f"data.tasks={tasks}")
    if tasks != "[]":  # the builder refuses the same (a caller without the config check)
        with pytest.raises(ConfigError, match="data.tasks"):
            parse_tasks(compose_config(["data=reasoning_gym", f"data.tasks={tasks}"]).data.tasks)


def test_every_problem_of_the_list_is_reported_at_once():
    text = refusal("data.tasks=[nope, {name: chain_sum, config: {x: 1}}]", "data.answer_format=xml")
    assert text.startswith("the config has 3 problems") and "data.tasks[0].name='nope'" in text
    assert "data.tasks[1].config.x" in text and "data.answer_format='xml' is not valid" in text


# --- difficulty ----------------------------------------------------------------------------------

def numbers(prompt: str) -> int:
    """The terms of a chain_sum question (its first line: "... problem: 3 - 2 + 4 =")."""
    return len(re.findall(r"\d+", prompt.splitlines()[0]))


def test_the_difficulty_schedule_raises_the_curriculum_level_of_the_tasks_that_set_one():
    assert "no entry of data.tasks does" in refusal("algorithm=grpo", "data_curriculum=difficulty_schedule",
                                                    "data_curriculum.milestones=[2]")
    tasks = "[{name: chain_sum, size: 60, heldout_size: 4, level: 0}, {name: basic_arithmetic, size: 20}]"
    built = source(tasks=tasks)
    held_out = [built.example("test", i) for i in range(built.size("test"))]
    fixed = [built.example("train", i) for i in range(60, 80)]

    def terms():
        return {numbers(built.example("train", i).prompt) for i in range(60)}

    assert terms() == {2}  # level 0: two terms of one digit
    schedule = DifficultySchedule(ExampleCursor(built, "train", seed=0), milestones=[2], max_level=3)
    assert schedule.on_step_end(2, None) == {"curriculum/difficulty_level": 1.0}
    assert terms() == {2, 3}  # level 1: two or three terms
    assert [built.example("train", i) for i in range(60, 80)] == fixed  # no level: its config stays
    assert [built.example("test", i) for i in range(len(held_out))] == held_out  # evaluations compare
    resumed = DifficultySchedule(ExampleCursor(source(tasks=tasks), "train", seed=0), milestones=[2])
    resumed.load_state_dict(schedule.state_dict())
    assert resumed.cursor.source.task.level == 1 and resumed.cursor.source.example("train", 5) == built.example("train", 5)


def test_a_level_draws_the_curriculums_config_under_the_users_fields():
    level1 = source(tasks="[{name: chain_sum, level: 1, size: 30}]")
    assert {numbers(level1.example("train", i).prompt) for i in range(30)} == {2, 3}
    capped = source(tasks="[{name: chain_sum, level: 1, size: 30, config: {max_terms: 2}}]")
    assert {numbers(capped.example("train", i).prompt) for i in range(30)} == {2}


# --- the embedded model -------------------------------------------------------------------------

def test_the_embedded_tokenizer_knows_every_character_and_the_tags_are_one_token():
    built = source("data.chat=false", tasks="[{name: advanced_geometry, size: 8, heldout_size: 2}, "
                                            "{name: chain_sum, size: 8, heldout_size: 2}]")
    tokenizer = build_char_tokenizer(built.alphabet)
    assert "°" in built.alphabet  # advanced_geometry writes angles in degrees
    for split in SPLITS:
        for i in range(built.size(split)):
            example = built.example(split, i)
            ids = tokenizer(example.prompt + example.response, add_special_tokens=False)["input_ids"]
            assert tokenizer.unk_token_id not in ids
    for tag in ANSWER_TAG_TOKENS:
        assert len(tokenizer(tag, add_special_tokens=False)["input_ids"]) == 1


@pytest.mark.slow  # 17 s; data=reasoning_gym is composed and checked in CI by the docs' commands, its held-out scoring in test_suites.py
def test_two_grpo_steps_through_the_cli_on_the_embedded_model(tmp_path):
    """`posttrain algorithm=grpo data=reasoning_gym 'data.tasks=[...]'` on model=tiny: plain prompts,
    a short answer budget, no warm start (a random policy: the steps run, accuracy stays near 0)."""
    command = [sys.executable, "-m", "posttrain.train", "algorithm=grpo", "data=reasoning_gym",
               "data.tasks=[{name: chain_sum, size: 40}, {name: basic_arithmetic, size: 20, config: {max_terms: 3}}]",
               "data.heldout_size=2", "data.chat=false", "data.shots=0", "data.max_response_tokens=16", "algorithm.warm_start.steps=0",
               "algorithm.prompts_per_step=2", "algorithm.group_size=2", "logger=none", "callbacks.progress_bar=none",
               "trainer.max_steps=2", "trainer.val_check_interval=2", "callbacks.checkpoint.every_n_train_steps=2",
               "eval.num_prompts=4", "eval.batch_size=4", "eval.at_start=false", f"paths.log_dir={tmp_path}"]
    ran = run_command(command, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    (summary,) = tmp_path.rglob("summary.json")
    assert '"global_step": 2' in summary.read_text() and '"data": "reasoning_gym"' in summary.read_text()
    (metrics,) = tmp_path.rglob("metrics.jsonl")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    counts = [sum(row[f"rollout/{task}/count"] for task in ("chain_sum", "basic_arithmetic"))
              for row in rows if "rollout/chain_sum/count" in row]
    assert counts == [4, 4]  # each step's 2 prompts x 2 samples, counted under their task
    assert any("eval/chain_sum/accuracy" in row and "eval/basic_arithmetic/accuracy" in row for row in rows)


def test_an_unknown_task_on_the_command_line_fails_before_any_run_directory(tmp_path):
    command = [sys.executable, "-m", "posttrain.train", "algorithm=grpo", "data=reasoning_gym",
               "data.tasks=[chain_sum, no_such_task]", f"paths.log_dir={tmp_path}"]
    ran = run_command(command, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 1 and "data.tasks[1].name='no_such_task' is not a reasoning-gym task" in ran.stderr
    assert "Traceback" not in ran.stderr and not list(tmp_path.rglob("config.yaml"))
