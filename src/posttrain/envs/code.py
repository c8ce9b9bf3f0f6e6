"""Code tasks scored in the sandbox (`env=code`, usually with `data=code_tasks`): each turn's
code block runs against the example's unit tests, and the episode is rewarded with the share
of tests passed.

`extract_code` (data/code_tasks.py) takes the last ```python block of a turn (else its last
bare ``` block). `run_tests` runs the code and all the tests in ONE sandbox call (envs/
sandbox.py) through a harness that:

  - reads the code, the tests and a random per-call nonce from its stdin (nothing in files,
    nothing on the command line), then points stdin, stdout and stderr at /dev/null: what the
    code prints, and any marker line it forges, never reaches the harness's report;
  - reports on a private duplicate of the original stdout, one line per event, each starting
    with the nonce, so the parent reads only the harness's own lines;
  - runs the code's top level (as module ``solution``, so an ``if __name__ == "__main__":``
    block does not run), then each test on its own: an exception (SystemExit included) or a
    per-test time limit (SIGALRM) fails that test only, and every result is written as soon as
    it is known, so a run cut short by the sandbox (a hang, memory, os._exit) keeps the results
    it had;
  - for a test ``assert <call> == <literal>`` (every generated test), evaluates only the call
    in the sandbox and sends back the repr of its value, which must be plain data (None, bool,
    int, float, str, and lists, tuples, sets and dicts of them, exact types): the parent
    compares it with the literal, which never enters the sandbox, and an object whose __eq__
    always says yes is refused. Any other assert statement runs as it is.

The nonce keeps the report from being forged by accident or by printing; code that goes out of
its way (walking the harness's frames) could still find it: this isolates mistakes and
ordinary reward hacks, not a determined adversary, whom the sandbox's limits still contain.

`CodeEnvironment` replies to a turn that fails some tests, while turns remain, with a user
message (chat messages: it needs a model with a chat template) giving how many passed and the
first failure (`feedback=true`), or only that some failed (`feedback=false`). Rebuilding an
episode replays its turns through the sandbox again: a turn whose outcome depends on timing (a
test close to its time limit) may then be scored differently.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

from posttrain.data.code_tasks import ALPHABET, extract_code, tests_of
from posttrain.data.examples import Example
from posttrain.envs.base import Environment, Reply, Turn
from posttrain.envs.sandbox import SandboxLimits, SandboxResult, check_isolation, run_python
from posttrain.errors import ConfigError

__all__ = ["CodeEnvironment", "CodeEpisode", "TestOutcome", "extract_code", "run_tests", "sandbox_limits", "score"]

FAILURE_CHARS = 500    # longest first_failure run_tests reports
FEEDBACK_CHARS = 800   # longest feedback message
VALUE_CHARS = 4000     # longest repr of a test's value the harness sends back
STARTUP_S = 0.2        # of the sandbox's time, kept for the interpreter's start-up and the harness


@dataclass(frozen=True)
class TestOutcome:
    """What running a code's tests came to.

    status: ``ok`` every test ran (each passed or failed); ``syntax_error`` the code does not
    compile, no test ran; ``error`` the process ended before reporting every test (os._exit, a
    crash); or the sandbox's own ``timeout``, ``memory``, ``output_limit``, ``killed``,
    ``refused``; and (from `score`) ``no_code``: the response has no code block. Tests that did
    not run count as failed."""

    __test__ = False  # not a pytest class

    passed: int
    total: int
    status: str
    first_failure: str = ""   # the first failing test and why ("" when all passed)
    timed_out: bool = False   # the sandbox or a test's own limit stopped something

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total

    @property
    def share(self) -> float:
        return self.passed / self.total if self.total else 0.0


# --- the harness ---------------------------------------------------------------------------

HARNESS = r'''
import builtins, json, os, signal, sys

_type, _repr, _len, _str, _dumps, _write = type, repr, len, str, json.dumps, os.write
_ATOMS = (type(None), bool, int, float, str)
_BAGS = (list, tuple, set, frozenset)


class _Timeout(BaseException):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def _limited(fn, seconds):
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _plain(value, depth=0):
    kind = _type(value)
    if kind in _ATOMS:
        return True
    if depth > 30:
        return False
    if kind in _BAGS:
        return all(_plain(item, depth + 1) for item in value)
    if kind is dict:
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in value.items())
    return False


def _main():
    payload = json.loads(sys.stdin.read())
    nonce, per_test, limit = payload["nonce"], payload["per_test_s"], payload["value_chars"]
    out = os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    signal.signal(signal.SIGALRM, _alarm)

    def emit(*fields):
        _write(out, (nonce + " " + " ".join(fields) + "\n").encode("utf-8", "replace"))

    def describe(err):
        try:
            text = _limited(lambda: _type(err).__name__ + ": " + _str(err), per_test)
        except BaseException:
            text = "an exception that cannot be described"
        return _dumps(text[:500])

    namespace = {"__name__": "solution", "__builtins__": builtins}
    try:
        compiled = compile(payload["code"], "solution.py", "exec")
    except BaseException as err:
        emit("load", "syntax", describe(err))
        emit("done")
        os._exit(0)
    try:
        _limited(lambda: exec(compiled, namespace), per_test)
        emit("load", "ok")
    except _Timeout:
        emit("load", "timeout", _dumps("its top level took longer than %.2f s" % per_test))
    except BaseException as err:
        emit("load", "error", describe(err))
    for index, (kind, source) in enumerate(payload["tests"]):
        try:
            if kind == "value":
                test = compile(source, "<test>", "eval")
                value = _limited(lambda: eval(test, namespace), per_test)
                if not _plain(value):
                    emit(_str(index), "fail", _dumps("it returned a %s object, not plain data (None, bool, int, "
                                                     "float, str, or lists, tuples, sets, dicts of them)"
                                                     % _type(value).__name__))
                    continue
                text = _limited(lambda: _repr(value), per_test)
                if _len(text) > limit:
                    emit(_str(index), "fail", _dumps("it returned a value whose repr is longer than %d characters"
                                                     % limit))
                else:
                    emit(_str(index), "value", _dumps(text))
            else:
                test = compile(source, "<test>", "exec")
                _limited(lambda: exec(test, namespace), per_test)
                emit(_str(index), "pass")
        except _Timeout:
            emit(_str(index), "timeout", _dumps("it took longer than %.2f s" % per_test))
        except BaseException as err:
            emit(_str(index), "fail", describe(err))
    emit("done")
    os._exit(0)


_main()
'''


def split_test(test: str) -> tuple[str, str, object] | None:
    """``assert <call> == <literal>`` as (the call's source, the literal's source, its value), or
    None for any other statement (which then runs in the sandbox as it is)."""
    try:
        tree = ast.parse(test)
    except SyntaxError:
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert) or tree.body[0].msg is not None:
        return None
    compare = tree.body[0].test
    if not (isinstance(compare, ast.Compare) and len(compare.ops) == 1 and isinstance(compare.ops[0], ast.Eq)):
        return None
    call, expected = ast.get_source_segment(test, compare.left), ast.get_source_segment(test, compare.comparators[0])
    try:
        value = ast.literal_eval(expected)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    return call, expected, value


UNREADABLE = object()  # a value equal to no expected one


def read_value(text: str):
    """A value the harness sent back (a repr of plain data), or UNREADABLE for a repr that
    literal_eval cannot read (a NaN, an empty set: never what a generated test expects)."""
    try:
        return ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return UNREADABLE


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def per_test_seconds(limits: SandboxLimits, tests: int) -> float:
    """Each test's (and the code's top level's) share of the sandbox's time."""
    budget = min(limits.cpu_s, limits.wall_s) * 0.8 - STARTUP_S
    return max(0.05, budget / (tests + 1))


def run_tests(code: str, tests: list[str], limits: SandboxLimits = SandboxLimits()) -> TestOutcome:
    """Run `code` and its `tests` (assert statements) in one sandbox call; see the module's
    docstring for how. Never raises for anything the code does."""
    if not tests:
        return TestOutcome(0, 0, "ok")
    nonce = secrets.token_hex(16)
    checks = [split_test(t) for t in tests]
    payload = {"nonce": nonce, "per_test_s": per_test_seconds(limits, len(tests)), "value_chars": VALUE_CHARS,
               "code": code, "tests": [["value", c[0]] if c else ["statement", t] for c, t in zip(checks, tests)]}
    result = run_python(HARNESS, stdin=json.dumps(payload), limits=limits)
    return read_report(result, nonce, tests, checks)


def read_report(result: SandboxResult, nonce: str, tests: list[str], checks: list) -> TestOutcome:
    """The outcome the harness's lines (those starting with `nonce`) report; a line cut short
    by the sandbox's output limit is skipped."""
    load, done, records = None, False, {}
    for line in result.stdout.splitlines():
        fields = line.split(" ", 3)
        if fields[0] != nonce or len(fields) < 2:
            continue
        if fields[1] == "done":
            done = True
            continue
        try:
            entry = (fields[2], json.loads(fields[3]) if len(fields) > 3 else "")
        except (IndexError, json.JSONDecodeError):
            continue
        if fields[1] == "load":
            load = load or entry
        elif fields[1].isdigit():
            records.setdefault(int(fields[1]), entry)
    if load is not None and load[0] == "syntax":
        return TestOutcome(0, len(tests), "syntax_error", clip(f"the code does not compile: {load[1]}",
                                                               FAILURE_CHARS))
    passed, failures, timed_out = 0, [], result.status == "timeout"
    for index, (test, check) in enumerate(zip(tests, checks)):
        kind, detail = records.get(index, (None, ""))
        if kind == "pass":
            passed += 1
        elif kind == "value":
            value = read_value(detail)
            if check is not None and value is not UNREADABLE and value == check[2]:
                passed += 1
            else:
                failures.append(f"{test} failed: {check[0] if check else 'the call'} returned {clip(detail, 200)}")
        elif kind in ("fail", "timeout"):
            timed_out = timed_out or kind == "timeout"
            failures.append(f"{test} failed: {detail}")
        else:
            failures.append(f"{test} did not run")
    if done:
        status = "ok"
    elif result.status != "ok":
        status = result.status
    else:
        status = "error"
    if load is not None and load[0] == "timeout":
        timed_out = True
        if failures:
            failures.insert(0, f"running the code: {load[1]}")
    if failures and load is not None and load[0] == "error":
        failures.insert(0, f"running the code raised {load[1]}")
    if failures and status != "ok":
        reason = {"timeout": "ran out of time", "memory": "ran out of memory", "output_limit": "wrote too much output",
                  "refused": "was refused by the sandbox", "killed": "was killed"}.get(status, "ended early")
        stopped = f"the program {reason} before every test ran"
        failures.insert(0, f"{stopped}; {failures[0]}" if records else stopped)
    return TestOutcome(passed, len(tests), status, clip(failures[0], FAILURE_CHARS) if failures else "", timed_out)


# --- the environment ------------------------------------------------------------------------

LIMIT_KEYS = tuple(f.name for f in dataclasses.fields(SandboxLimits))


def sandbox_limits(options: Mapping | None) -> SandboxLimits:
    """`env.sandbox` (a mapping of SandboxLimits' fields) as limits; unknown keys are refused."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(LIMIT_KEYS))
    if unknown:
        raise ConfigError(f"env.sandbox: unknown key(s) {unknown}; valid keys: {', '.join(LIMIT_KEYS)}")
    try:
        return SandboxLimits(**options)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"env.sandbox: {err}") from None


def score(response: str, tests: list[str], limits: SandboxLimits) -> TestOutcome:
    """The outcome of a response's code (`extract_code`) on `tests`; status ``no_code`` when it
    has none."""
    code = extract_code(response)
    if code is None:
        return TestOutcome(0, len(tests), "no_code", "the answer has no ```python code block")
    return run_tests(code, tests, limits)


def in_alphabet(text: str) -> str:
    """`text` with every character outside the code tasks' alphabet (printable ASCII and the
    newline) as '?': the embedded model's tokenizer knows those only."""
    return "".join(c if c in ALPHABET else "?" for c in text)


class CodeEpisode:
    def __init__(self, env: CodeEnvironment, tests: list[str]):
        self.env, self.tests, self.turns = env, tests, 0

    def step(self, turn: Turn) -> Reply:
        self.turns += 1
        outcome = score(turn.text, self.tests, self.env.limits)
        metrics = {"sandbox_timeouts": float(outcome.timed_out),
                   "sandbox_errors": float(outcome.status not in ("ok", "timeout", "no_code")),
                   "no_code": float(outcome.status == "no_code")}
        if outcome.all_passed or self.turns >= self.env.max_turns:
            metrics.update(tests_passed=float(outcome.passed), tests_total=float(outcome.total))
            return Reply(reward=outcome.share, done=True, correct=outcome.all_passed, metrics=metrics)
        return Reply(reward=0.0, messages=[{"role": "user", "content": self.env.feedback_text(outcome)}],
                     metrics=metrics)


class CodeEnvironment(Environment):
    """Rewards a turn's code with the share of the example's tests it passes (the answer of a
    `data=code_tasks` example: a JSON list of assert statements), on the episode's last turn;
    the episode ends when every test passes or after `max_turns`. `sandbox`: the SandboxLimits
    of each run (cpu_s, wall_s, memory_mb, ...). Replies are chat messages: a chat model.

    Metrics per turn: ``no_code`` (no code block), ``sandbox_timeouts`` (the run or one of its
    tests ran out of time), ``sandbox_errors`` (the run ended before reporting every test for
    another reason, or the code does not compile); on the last turn ``tests_passed`` and
    ``tests_total``."""

    name = "code"
    metric_names = ("no_code", "sandbox_timeouts", "sandbox_errors", "tests_passed", "tests_total")

    def __init__(self, max_turns: int = 1, sandbox: Mapping | None = None, feedback: bool = True):
        super().__init__(max_turns)
        if sandbox is not None and not isinstance(sandbox, Mapping):
            raise ConfigError(f"env.sandbox must be a mapping of sandbox limits, got {sandbox!r}")
        if not isinstance(feedback, bool):
            raise ConfigError(f"env.feedback must be true or false, got {feedback!r}")
        self.limits = sandbox_limits(sandbox)
        self.feedback = feedback

    def check(self) -> None:
        check_isolation(self.limits)

    def start(self, example: Example) -> CodeEpisode:
        return CodeEpisode(self, tests_of(example))

    def is_correct(self, example: Example, response: str) -> bool:
        """Every test of the example passes (one sandbox run)."""
        return score(response, tests_of(example), self.limits).all_passed

    def attach(self, source) -> None:
        """Let a code task source (data/code_tasks.py) judge correctness through this sandbox."""
        if hasattr(source, "verifier"):
            source.verifier = self.is_correct

    def feedback_text(self, outcome: TestOutcome) -> str:
        if outcome.status == "no_code":
            text = "Your answer has no ```python code block. Answer with the complete function in a ```python block."
        elif not self.feedback:
            text = "Your function does not pass all the tests yet. Fix it and answer with the complete function."
        else:
            text = (f"Your function passed {outcome.passed} of {outcome.total} tests. The first failure:\n"
                    f"{outcome.first_failure}\nFix it and answer with the complete function in a ```python block.")
        return in_alphabet(clip(text, FEEDBACK_CHARS))
