"""data=code_tasks: generated Python function tasks whose tests come from their reference
solution; splits disjoint and deterministic per seed; the code of a response read back. (Running
code, the reference's included, in the sandbox: tests/envs/test_code_env.py.)"""

import ast
import json

import pytest
from omegaconf import OmegaConf

from posttrain.config.check import check_config
from posttrain.data.arithmetic import SPLITS
from posttrain.data.code_tasks import (ALPHABET, FAMILIES, MAX_TESTS, MIN_TESTS, CodeTaskGenerator, CodeTaskSource,
                                       extract_code)
from posttrain.data import code_tasks
from posttrain.data.examples import Example
from posttrain.data.sources import build_source
from posttrain.errors import ConfigError, DataError

from conftest import compose_config


def source(*overrides: str) -> CodeTaskSource:
    cfg = compose_config(["data=code_tasks", *overrides])
    OmegaConf.resolve(cfg)
    return build_source(cfg.data)


def test_there_are_at_least_fifteen_families_and_each_draws_tasks():
    assert len(FAMILIES) >= 15
    for family in FAMILIES:
        task = CodeTaskGenerator(families=(family,)).task("train", 0)
        assert task.family == family
        assert MIN_TESTS <= len(task.tests) <= MAX_TESTS


def test_a_task_is_a_pure_function_of_seed_split_and_index():
    a, b = CodeTaskGenerator(seed=3), CodeTaskGenerator(seed=3)
    assert a.tasks("train", 20) == b.tasks("train", 20)
    assert a.task("train", 7) == CodeTaskGenerator(seed=3).task("train", 7)  # not a sequence: index 7 alone
    other = CodeTaskGenerator(seed=4).tasks("train", 20)
    assert [t.prompt for t in other] != [t.prompt for t in a.tasks("train", 20)]
    # the held-out splits follow heldout_seed, not the run's seed
    assert CodeTaskGenerator(seed=3).tasks("validation", 10) == CodeTaskGenerator(seed=9).tasks("validation", 10)
    assert CodeTaskGenerator(heldout_seed=1).tasks("test", 10) != CodeTaskGenerator(heldout_seed=2).tasks("test", 10)


def test_splits_never_share_a_function_request():
    generator = CodeTaskGenerator(seed=0)
    requests = {split: {t.request for t in generator.tasks(split, 150)} for split in SPLITS}
    assert not requests["train"] & requests["validation"]
    assert not requests["train"] & requests["test"]
    assert not requests["validation"] & requests["test"]
    assert len(requests["train"]) > 120  # endless: few repeats


def test_tasks_vary_their_names_and_constants_within_a_family():
    tasks = CodeTaskGenerator(families=("sum_multiples",)).tasks("train", 40)
    assert len({t.name for t in tasks}) >= 3
    assert len({t.params for t in tasks}) >= 3
    assert len({t.description for t in tasks}) >= 4
    fizz = CodeTaskGenerator(families=("fizzbuzz",)).tasks("train", 20)
    assert len({t.solution for t in fizz}) >= 10


def test_tests_are_asserts_of_literals_that_hold_for_the_reference():
    for task in CodeTaskGenerator(seed=5).tasks("train", 60):
        namespace = {}
        exec(task.solution, namespace)
        assert len(set(task.tests)) == len(task.tests)  # distinct inputs
        for test in task.tests:
            statement = ast.parse(test).body[0]
            assert isinstance(statement, ast.Assert) and isinstance(statement.test.ops[0], ast.Eq)
            assert isinstance(statement.test.left, ast.Call) and statement.test.left.func.id == task.name
            ast.literal_eval(statement.test.comparators[0])  # the expected value is a literal
            for argument in statement.test.left.args:
                ast.literal_eval(argument)
            exec(test, dict(namespace))


def test_the_example_carries_prompt_reference_and_tests():
    built = source()
    assert isinstance(built, CodeTaskSource) and built.chat
    example = built.example("train", 0)
    task = built.generator.task("train", 0)
    assert example.prompt == task.prompt and example.messages == [{"role": "user", "content": task.prompt}]
    assert example.response == f"```python\n{task.solution}\n```"
    assert example.prompt.startswith(f"Write a Python function `{task.signature}` that ")
    assert "```python" in example.prompt and task.tests[-1].removeprefix("assert ") in example.prompt
    assert code_tasks.tests_of(example) == list(task.tests) == json.loads(example.answer)
    assert extract_code(example.response) == task.solution + "\n"
    assert built.has_style(example.response) and built.final_answer(example.response) == task.solution + "\n"
    assert not built.has_style("def f(): pass")
    for split in SPLITS:
        text = built.example(split, 3)
        assert set(text.prompt + text.response + text.answer) <= set(ALPHABET)
    assert source("data.chat=false").example("train", 0).messages is None


def test_the_yaml_passes_the_config_check_and_families_narrow_the_draw():
    cfg = compose_config(["data=code_tasks"])
    OmegaConf.resolve(cfg)
    check_config(cfg, {"data": "code_tasks"})
    built = source("data.families=[clamp,caesar]", "data.seed=1")
    assert {built.generator.task("train", i).family for i in range(30)} == {"clamp", "caesar"}
    assert built.generator.seed == 1 and built.generator.heldout_seed == cfg.data.validation_seed
    assert built.size("train") is None and built.origin("train", 0) is None
    bad = compose_config(["data=code_tasks", "data.families=[clamp,quicksort]"])
    OmegaConf.resolve(bad)
    with pytest.raises(ConfigError, match="data.families"):
        check_config(bad, {})
    with pytest.raises(ConfigError, match="families"):
        source("data.families=[]")


def test_correctness_needs_the_sandbox_verifier():
    built = source()
    example = built.example("train", 0)
    with pytest.raises(ConfigError, match="env=code"):
        built.is_correct(example, example.response)
    seen = []
    built.verifier = lambda e, r: seen.append((e, r)) or True
    assert built.is_correct(example, "x") and seen == [(example, "x")]


@pytest.mark.parametrize("response,code", [
    ("```python\ndef f():\n    return 1\n```", "def f():\n    return 1\n"),
    ("Here:\n```py\nx = 1\n```\nand better:\n```python3\nx = 2\n```\ndone", "x = 2\n"),
    ("```python\nfirst = 1\n```\n```\nbare = 2\n```", "first = 1\n"),       # a python block beats a bare one
    ("```\nbare = 2\n```\ntext", "bare = 2\n"),                              # else the last bare block
    ("```bash\nls\n```", None),                                               # another language
    ("def f():\n    return 1", None),                                         # no block at all
    ("```python\ndef f():\n    return", None),                                # left open (cut at the budget)
    ("```python\n\n```\n```python\ny = 3\n```", "y = 3\n"),                   # an empty block does not count
    ("```Python \ndef g(): pass\n```", "def g(): pass\n"),                    # tag case and spaces
    ("```python\na = 1\n```\n```python\n   \n```", "a = 1\n"),
])
def test_extract_code(response, code):
    assert extract_code(response) == code


def test_an_example_without_tests_is_a_data_error():
    for answer in (None, "not json", "[]", '["assert True", 3]', '{"a": 1}'):
        with pytest.raises(DataError, match="no tests"):
            code_tasks.tests_of(Example("p", "r", answer))
