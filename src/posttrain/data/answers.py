"""Final answers of math problems: extracted from a response, compared with a reference.

`extract_final_answer` reads what a response commits to (the content of the last
``\\boxed{}``, else what follows the last ``####``, else its last number), looking inside
``<answer>...</answer>`` first when the response has those tags (the r1 template asks for
them). `answers_match` compares two answers with math-verify (so 1/2, 0.5 and \\frac{1}{2}
are equal) and falls back to a plain numeric comparison ("72" == "72.0" == "72.00",
"1,000" == "1000") when math-verify cannot parse one of them.

A check may take very long on a pathological answer (sympy simplifying a huge expression),
and math-verify's own timeouts use `signal.alarm`, which works only in a main thread. So
`AnswerChecker` runs checks in a long-lived worker process, started on first use, and kills
and restarts it when a check outlives `timeout_s`: such a check counts as incorrect and is
counted (`take_timeouts`), which the reward logs as `rewards/verifier_timeouts`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import select
import subprocess
import sys
from typing import Callable

log = logging.getLogger(__name__)

ANSWER_TAGS = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
HASH_MARKER = "####"
BOXED_COMMANDS = ("\\boxed", "\\fbox")
# A number as written in a solution: sign, thousands separators, decimals, a fraction a/b.
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
# Relative tolerance of the numeric fallback (the answers are written decimals, not floats
# computed two ways, so this only forgives "0.3333333" against "0.33333333").
NUMERIC_TOLERANCE = 1e-6
# How long a new worker may take to import math-verify and sympy and answer a first check
# (seconds on a busy machine); the per-check timeout starts counting only after that.
WORKER_STARTUP_S = 300.0


def last_boxed_content(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces
    inside it balanced (``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``); None when there is
    none or it is never closed."""
    start = max(text.rfind(command + "{") for command in BOXED_COMMANDS)
    if start < 0:
        return None
    opening = text.index("{", start)
    depth = 0
    for position in range(opening, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                return text[opening + 1: position].strip()
    return None


def after_hash_marker(text: str) -> str | None:
    """What follows the last ``####`` (GSM8K's final-answer marker), on its line."""
    if HASH_MARKER not in text:
        return None
    tail = text.rsplit(HASH_MARKER, 1)[1].strip()
    return tail.splitlines()[0].strip() if tail else None


def last_number(text: str) -> str | None:
    numbers = NUMBER.findall(text)
    return numbers[-1].rstrip(",") if numbers else None


def extract_final_answer(response: str) -> str | None:
    """The answer ``response`` commits to, or None when it states none (see the module doc)."""
    tagged = ANSWER_TAGS.findall(response)
    if tagged:
        response = tagged[-1]
    for extract in (last_boxed_content, after_hash_marker, last_number):
        answer = extract(response)
        if answer:
            return answer
    return response.strip() if tagged and response.strip() else None


def as_number(answer: str) -> float | None:
    """``answer`` as a number when it is one, written plainly: "1,000", "72.0", "$5", "3/4", "-2."."""
    cleaned = answer.strip().strip("$").replace(",", "").replace(" ", "").rstrip(".")
    if cleaned.startswith("\\$"):
        cleaned = cleaned[2:]
    if re.fullmatch(r"-?\d+/\d+", cleaned):
        numerator, denominator = cleaned.split("/")
        return int(numerator) / int(denominator) if int(denominator) else None
    try:
        return float(cleaned)
    except ValueError:
        return None


def numbers_match(predicted: str, reference: str) -> bool:
    a, b = as_number(predicted), as_number(reference)
    if a is None or b is None:
        return False
    return abs(a - b) <= NUMERIC_TOLERANCE * max(1.0, abs(a), abs(b))


def answers_match(predicted: str | None, reference: str) -> bool:
    """Whether ``predicted`` and ``reference`` are the same answer (math-verify, else numbers)."""
    if predicted is None:
        return False
    # start-up: math-verify loads only for math answers
    from math_verify import parse, verify

    # \boxed{} tells math-verify where the answer is: bare "\frac12" or "x^2" would not parse.
    # Its signal-based timeouts are off (None): AnswerChecker bounds the whole check instead.
    gold = parse(f"\\boxed{{{reference}}}", parsing_timeout=None)
    target = parse(f"\\boxed{{{predicted}}}", parsing_timeout=None)
    if not gold or not target:
        return numbers_match(predicted, reference)
    return bool(verify(gold, target, timeout_seconds=None))


def serve_checks(check_name: str) -> None:
    """The worker process: reads one JSON [predicted, reference] a line on stdin, writes one
    JSON line ["ok", verdict] or ["error", message] on stdout, until stdin closes."""
    # optional: probes for an installed package
    import importlib

    channel = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything a library prints goes to stderr, never into the answers
    module, _, name = check_name.partition(":")
    check = getattr(importlib.import_module(module), name)
    # math-verify warns on every call that its own timeouts are off; they are, on purpose
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    answers_match("1", "1")  # imports and first-use setup here, outside every check's time limit
    reply(channel, "ready", None)
    for line in sys.stdin:
        predicted, reference = json.loads(line)
        try:
            reply(channel, "ok", bool(check(predicted, reference)))
        except Exception as err:  # reported to the parent, which names the answer
            reply(channel, "error", f"{type(err).__name__}: {err}")


def reply(channel, status: str, value) -> None:
    channel.write(json.dumps([status, value]) + "\n")
    channel.flush()


class AnswerChecker:
    """Runs ``check(predicted, reference)`` in a worker process, each call bounded by ``timeout_s``.

    The worker is a fresh interpreter (a subprocess: never a fork of a process holding torch's
    threads, and unlike multiprocessing's spawn it does not re-run the user's main script),
    started on first use and reused; a check that outlives ``timeout_s`` kills it, counts as
    False and adds one to the timeout count (a new worker starts on the next check).
    ``check`` must be a module-level function the worker can import.
    """

    def __init__(self, timeout_s: float = 5.0, check: Callable[[str | None, str], bool] = answers_match):
        if not timeout_s > 0:
            raise ValueError(f"the answer-check timeout must be > 0 seconds, got {timeout_s!r}")
        self.timeout_s, self.check = float(timeout_s), check
        self.timeouts = 0  # since the last take_timeouts()
        self._process: subprocess.Popen | None = None

    def __call__(self, predicted: str | None, reference: str) -> bool:
        if predicted is None:
            return False  # nothing to compare: no need to ask the worker
        if self._process is None or self._process.poll() is not None:
            self._start()
        self._process.stdin.write(json.dumps([predicted, reference]) + "\n")
        self._process.stdin.flush()
        answer = self._read(self.timeout_s)
        if answer is None:
            self._stop()
            self.timeouts += 1
            log.warning(f"answer check timed out after {self.timeout_s:g} s (data.verify_timeout_s) on answer "
                        f"{predicted[:80]!r} against reference {reference[:80]!r}; counted as incorrect")
            return False
        status, value = answer
        if status == "error":
            raise RuntimeError(f"checking answer {predicted[:80]!r} against {reference[:80]!r} raised {value}")
        return value

    def take_timeouts(self) -> int:
        """How many checks timed out since the last call (then starts counting again)."""
        count, self.timeouts = self.timeouts, 0
        return count

    def _read(self, timeout_s: float):
        """The worker's next reply, or None when none came within ``timeout_s``."""
        ready, _, _ = select.select([self._process.stdout], [], [], timeout_s)
        if not ready:
            return None
        line = self._process.stdout.readline()
        if not line:  # the worker died (out of memory, killed): start afresh next time
            self._stop()
            raise RuntimeError("the answer-check worker exited unexpectedly (see its stderr above)")
        return json.loads(line)

    def _start(self) -> None:
        check_name = f"{self.check.__module__}:{self.check.__qualname__}"
        code = f"from posttrain.data.answers import serve_checks; serve_checks({check_name!r})"
        # the worker imports what this process can (the package, a test's own checker)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True, env=env)
        if self._read(WORKER_STARTUP_S) != ["ready", None]:
            self._stop()
            raise RuntimeError(f"the answer-check worker did not start within {WORKER_STARTUP_S:g} s")

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process.stdin.close()
            self._process.stdout.close()
        self._process = None

    def close(self) -> None:
        self._stop()

    def __del__(self):
        try:
            self._stop()
        except Exception:  # at interpreter exit the modules it needs may be gone; the worker's stdin closes anyway
            pass

    def __getstate__(self):  # a copy (e.g. a deep-copied source) starts its own worker
        return {**self.__dict__, "_process": None}


class CheckedAnswers:
    """The answer side of a task source whose responses end in a final answer checked by an
    `AnswerChecker` (`self.checker`) in the shape of a prompt template (`self.template`):
    the hub datasets (data/hub.py) and the generated word problems (data/word_problems.py)."""

    def is_correct(self, example, response: str) -> bool:
        return self.checker(extract_final_answer(response), example.answer)

    def final_answer(self, response: str) -> str | None:
        """What the response answers (majority voting compares these), None when nothing."""
        return extract_final_answer(response)

    def has_style(self, response: str) -> bool:
        return self.template.has_style(response)

    def take_verifier_timeouts(self) -> int:
        """Answer checks that timed out since the last call (logged as rewards/verifier_timeouts)."""
        return self.checker.take_timeouts()
