"""env=code: a turn's code runs against the example's tests in one sandbox call (run_tests), and
the episode is rewarded with the share passed; code that hangs, exits, prints a fake report,
does not compile or returns an always-equal object gets what it earned, and no more."""

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from posttrain.conf import CONFIG_DIR
from posttrain.data.code_tasks import FAMILIES, CodeTaskGenerator, CodeTaskSource
from posttrain.data.examples import Example
from posttrain.envs import code as code_env
from posttrain.envs.base import Turn
from posttrain.envs.build import build_env
from posttrain.envs.code import CodeEnvironment, TestOutcome, run_tests
from posttrain.envs.sandbox import SandboxLimits, SandboxResult
from posttrain.errors import ConfigError, DataError

TESTS = ["assert f(1) == 2", "assert f(2) == 3", "assert f(3) == 5", "assert f(4) == 5"]
PLUS_ONE = "def f(x):\n    return x + 1\n"   # passes 3 of TESTS: f(3) == 5 is false for it


def fenced(code: str) -> str:
    return f"Here it is:\n```python\n{code}```\n"


def turn(text: str, index: int = 0) -> Turn:
    return Turn(text=text, token_ids=[], ended=True, index=index)


def example(tests=TESTS) -> Example:
    return Example("Write f.", fenced("def f(x):\n    return {1: 2, 2: 3, 3: 5, 4: 5}[x]\n"), json.dumps(tests))


# --- the reference solutions pass, a wrong one passes what it should -------------------------------

@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_familys_reference_solution_passes_all_its_tests_in_the_sandbox(family):
    for seed in (0, 1):
        task = CodeTaskGenerator(families=(family,), seed=seed).task("train", seed)
        outcome = run_tests(task.solution, list(task.tests))
        assert outcome == TestOutcome(len(task.tests), len(task.tests), "ok"), task.solution


def test_a_wrong_solution_passes_a_known_share():
    assert run_tests(PLUS_ONE, TESTS) == TestOutcome(3, 4, "ok", "assert f(3) == 5 failed: f(3) returned 4")
    # a generated clamp task answered with the identity: right exactly where x is inside the range
    task = CodeTaskGenerator(families=("clamp",), seed=2).task("train", 0)
    namespace = {}
    exec(task.solution, namespace)
    inside = sum(namespace[task.name](x) == x for x in (eval(t.split("(", 1)[1].split(")")[0]) for t in task.tests))
    assert 0 < inside < len(task.tests)  # the edge cases are in range, some drawn inputs are not
    identity = f"def {task.name}({task.params[0]}):\n    return {task.params[0]}\n"
    outcome = run_tests(identity, list(task.tests))
    assert (outcome.passed, outcome.total, outcome.status) == (inside, len(task.tests), "ok")


def test_plain_equal_values_pass_as_an_assert_would():
    """The value goes back as its repr and compares with ==: 5.0 == 5 and True == 1, as in Python."""
    assert run_tests("def f(x):\n    return x + 1.0\n", ["assert f(4) == 5"]).passed == 1
    assert run_tests("def f(x):\n    return (x, [x])\n", ["assert f(1) == (1, [1])"]).passed == 1
    assert run_tests("def f(x):\n    return None\n", ["assert f(1) == None"]).passed == 1
    assert run_tests("def f(x):\n    return 'a\\nb'\n", ["assert f(1) == 'a\\nb'"]).passed == 1


def test_other_assert_statements_run_in_the_sandbox():
    tests = ["assert f(1) > 0", "assert f(-5) > 0", "assert isinstance(f(2), int)", "assert f(1) == 2, 'message'"]
    outcome = run_tests(PLUS_ONE, tests)
    assert (outcome.passed, outcome.status) == (3, "ok")
    assert outcome.first_failure == "assert f(-5) > 0 failed: AssertionError: "


# --- code that misbehaves -----------------------------------------------------------------------------

def test_a_syntax_error_runs_no_test():
    outcome = run_tests("def f(x)\n    return x\n", TESTS)
    assert (outcome.passed, outcome.status) == (0, "syntax_error")
    assert outcome.first_failure.startswith("the code does not compile: SyntaxError: ")


def test_a_test_that_hangs_fails_alone():
    code = "def f(x):\n    while x == 3:\n        pass\n    return x + 1\n"
    outcome = run_tests(code, ["assert f(3) == 4", "assert f(1) == 2", "assert f(2) == 3"])
    assert (outcome.passed, outcome.status, outcome.timed_out) == (2, "ok", True)
    assert outcome.first_failure.startswith("assert f(3) == 4 failed: it took longer than ")


def test_a_top_level_that_hangs_is_stopped_and_the_tests_still_run():
    outcome = run_tests("def f(x):\n    return x + 1\nwhile True:\n    pass\n", TESTS)
    assert (outcome.passed, outcome.status, outcome.timed_out) == (3, "ok", True)
    assert outcome.first_failure.startswith("running the code: its top level took longer than ")


def test_a_report_cut_short_by_the_output_limit_is_read_up_to_its_last_whole_line():
    nonce = "n" * 32
    stdout = f'{nonce} load ok\n{nonce} 0 value "2"\n{nonce} 1 value "3"\n{nonce} 2 fail "Value'
    result = SandboxResult(status="output_limit", returncode=None, stdout=stdout, stderr="", wall_s=0.1,
                           truncated=True)
    checks = [code_env.split_test(t) for t in TESTS]
    outcome = code_env.read_report(result, nonce, TESTS, checks)
    assert outcome == TestOutcome(2, 4, "output_limit", "the program wrote too much output before every test ran; "
                                                        "assert f(3) == 5 did not run")


def test_a_hang_that_swallows_the_alarm_is_stopped_by_the_sandbox_and_keeps_earlier_results():
    code = ("import time\ndef f(x):\n    while x == 3:\n        try:\n            time.sleep(10)\n"
            "        except BaseException:\n            pass\n    return x + 1\n")
    outcome = run_tests(code, ["assert f(1) == 2", "assert f(3) == 4", "assert f(2) == 3"],
                        SandboxLimits(cpu_s=1.0, wall_s=1.5))
    assert (outcome.passed, outcome.status, outcome.timed_out) == (1, "timeout", True)
    assert outcome.first_failure.startswith("the program ran out of time before every test ran")


def test_exiting_at_the_top_level_still_runs_the_tests():
    outcome = run_tests("import sys\ndef f(x):\n    return x + 1\nsys.exit(3)\n", TESTS)
    assert (outcome.passed, outcome.status) == (3, "ok")
    assert outcome.first_failure == "running the code raised SystemExit: 3"
    assert run_tests("import sys\ndef f(x):\n    sys.exit(0)\n", TESTS) == TestOutcome(
        0, 4, "ok", "assert f(1) == 2 failed: SystemExit: 0")


def test_ending_the_process_keeps_the_results_so_far():
    code = "import os\ndef f(x):\n    if x == 3:\n        os._exit(0)\n    return x + 1\n"
    outcome = run_tests(code, ["assert f(1) == 2", "assert f(2) == 3", "assert f(3) == 4", "assert f(4) == 5"])
    assert (outcome.passed, outcome.status) == (2, "error")
    assert outcome.first_failure == "the program ended early before every test ran; assert f(3) == 4 did not run"


def test_running_out_of_memory_in_a_test_fails_that_test():
    code = "def f(x):\n    if x == 3:\n        return len(bytearray(2 ** 33))\n    return x + 1\n"
    outcome = run_tests(code, ["assert f(1) == 2", "assert f(3) == 4", "assert f(2) == 3"])  # 8 GiB > memory_mb
    assert outcome == TestOutcome(2, 3, "ok", "assert f(3) == 4 failed: MemoryError: ")


def test_printed_and_forged_report_lines_count_for_nothing():
    code = ("import os, sys\n"
            "def f(x):\n"
            "    for n in range(12):\n"
            "        print(f'{n} pass')\n"
            "        print('0' * 32 + f' {n} value \"{x + 1}\"')\n"
            "    for fd in range(1, 20):\n"
            "        try:\n"
            "            os.write(fd, b'deadbeef 0 pass\\ndone\\n')\n"
            "        except OSError:\n"
            "            pass\n"
            "    sys.__stdout__.write('load ok\\n')\n"
            "    return 0\n")
    outcome = run_tests(code, TESTS)
    assert (outcome.passed, outcome.status) == (0, "ok")
    assert outcome.first_failure == "assert f(1) == 2 failed: f(1) returned 0"


def test_garbage_output_does_not_hide_the_results():
    code = ("import sys\ndef f(x):\n    print('garbage\\x00\\xff' * 50000)\n    sys.stderr.write('e' * 200000)\n"
            "    return x + 1\n")
    assert run_tests(code, TESTS).passed == 3


def test_an_always_equal_object_is_refused():
    code = "class Yes:\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return Yes()\n"
    outcome = run_tests(code, TESTS)
    assert outcome.passed == 0
    assert "it returned a Yes object, not plain data" in outcome.first_failure
    subclass = "class Int(int):\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return Int(0)\n"
    assert run_tests(subclass, TESTS).passed == 0


def test_other_failures_name_their_cause():
    assert run_tests("def g(x):\n    return x + 1\n", TESTS).first_failure == (
        "assert f(1) == 2 failed: NameError: name 'f' is not defined")
    reading = run_tests("def f(x):\n    return x + 1\nname = input()\n", TESTS)
    assert reading.passed == 3 and reading.first_failure == "running the code raised EOFError: EOF when reading a line"
    assert "ZeroDivisionError: integer division or modulo by zero" in run_tests(
        "def f(x):\n    return 1 // 0\n", TESTS).first_failure


def test_no_tests_is_nothing_run():
    assert run_tests(PLUS_ONE, []) == TestOutcome(0, 0, "ok")


# --- the environment ------------------------------------------------------------------------------

def test_one_turn_episodes_reward_the_share_passed():
    env = CodeEnvironment()
    reply = env.start(example()).step(turn(fenced(PLUS_ONE)))
    assert (reply.reward, reply.done, reply.correct) == (0.75, True, False)
    assert reply.messages is None and reply.text is None
    assert reply.metrics == {"tests_passed": 3.0, "tests_total": 4.0, "sandbox_timeouts": 0.0, "sandbox_errors": 0.0,
                             "no_code": 0.0}
    right = env.start(example()).step(turn(fenced("def f(x):\n    return x + 1 + (x == 3)\n")))
    assert (right.reward, right.done, right.correct, right.metrics["tests_passed"]) == (1.0, True, True, 4.0)
    none = env.start(example()).step(turn("def f(x): return x + 1"))
    assert (none.reward, none.done, none.correct) == (0.0, True, False)
    assert none.metrics == {"tests_passed": 0.0, "tests_total": 4.0, "sandbox_timeouts": 0.0, "sandbox_errors": 0.0,
                            "no_code": 1.0}
    broken = env.start(example()).step(turn(fenced("def f(x)\n    return x\n")))
    assert broken.reward == 0.0 and broken.metrics["sandbox_errors"] == 1.0


def test_a_failing_turn_gets_its_first_failure_back_while_turns_remain():
    env = CodeEnvironment(max_turns=2)
    episode = env.start(example())
    first = episode.step(turn(fenced(PLUS_ONE)))
    assert (first.reward, first.done, first.correct) == (0.0, False, None)
    assert first.metrics == {"sandbox_timeouts": 0.0, "sandbox_errors": 0.0, "no_code": 0.0}
    assert first.messages == [{"role": "user", "content": (
        "Your function passed 3 of 4 tests. The first failure:\nassert f(3) == 5 failed: f(3) returned 4\n"
        "Fix it and answer with the complete function in a ```python block.")}]
    second = episode.step(turn(fenced("def f(x):\n    return x + 1 + (x == 3)\n"), index=1))
    assert (second.reward, second.done, second.correct) == (1.0, True, True)
    assert second.metrics["tests_passed"] == 4.0


def test_the_last_turn_ends_the_episode_with_its_share_and_feedback_can_be_withheld():
    episode = CodeEnvironment(max_turns=2, feedback=False).start(example())
    first = episode.step(turn("no code"))
    assert first.messages[0]["content"].startswith("Your answer has no ```python code block.")
    assert first.metrics["no_code"] == 1.0
    second = episode.step(turn(fenced("def f(x):\n    return 2 * x\n"), index=1))  # only f(1) == 2
    assert (second.reward, second.done, second.correct) == (0.25, True, False)
    quiet = CodeEnvironment(max_turns=3, feedback=False).start(example()).step(turn(fenced(PLUS_ONE)))
    assert quiet.messages == [{"role": "user", "content": "Your function does not pass all the tests yet. Fix it "
                                                          "and answer with the complete function."}]
    right = fenced("def f(x):\n    return x + 1 + (x == 3)\n")
    passed_at_once = CodeEnvironment(max_turns=3).start(example()).step(turn(right))
    assert passed_at_once.done and passed_at_once.reward == 1.0


def test_feedback_is_clipped_to_printable_ascii():
    env = CodeEnvironment(max_turns=2)
    outcome = TestOutcome(0, 4, "ok", "assert f(1) == 2 failed: ValueError: caf\u00e9 \u2713 " + "x" * 2000)
    text = env.feedback_text(outcome)
    assert len(text) <= code_env.FEEDBACK_CHARS and "caf? ?" in text and text.endswith("...")
    assert all(c == "\n" or 32 <= ord(c) < 127 for c in text)


def test_a_generated_task_through_the_environment_and_the_sources_verifier():
    source = CodeTaskSource(CodeTaskGenerator(seed=4))
    env = CodeEnvironment()
    task_example = source.example("train", 0)
    reply = env.start(task_example).step(turn(task_example.response))
    assert (reply.reward, reply.correct) == (1.0, True)
    env.attach(source)
    assert source.is_correct(task_example, task_example.response)
    assert not source.is_correct(task_example, "```python\npass\n```")
    with pytest.raises(DataError, match="no tests"):
        env.start(Example("p", "r", None))


def test_options_are_checked_and_the_yaml_builds_the_environment(monkeypatch):
    with pytest.raises(ConfigError, match=r"env.sandbox: unknown key\(s\) \['cpu', 'ram'\]; valid keys: cpu_s"):
        CodeEnvironment(sandbox={"cpu": 1, "ram": 2, "wall_s": 1})
    with pytest.raises(ConfigError, match="env.feedback"):
        CodeEnvironment(feedback="yes")
    with pytest.raises(ConfigError, match="env.max_turns"):
        CodeEnvironment(max_turns=0)
    assert CodeEnvironment(sandbox={"cpu_s": 1.5}).limits == SandboxLimits(cpu_s=1.5)
    checked = []
    monkeypatch.setattr(code_env, "check_isolation", checked.append)
    node = OmegaConf.load(Path(CONFIG_DIR) / "env" / "code.yaml")
    source = CodeTaskSource(CodeTaskGenerator(seed=4))
    env = build_env(node, source)
    assert isinstance(env, CodeEnvironment) and env.max_turns == 1 and env.feedback
    assert env.limits == SandboxLimits(**node.sandbox) and checked == [env.limits]
    # attached: an episode cut before its verdict (a repetition stop) is judged by the source
    assert source.verifier == env.is_correct
