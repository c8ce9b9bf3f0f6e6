"""Procedurally generated multi-digit addition with written carries.

A problem is a list of operands, e.g. ``[347, 185]``; its prompt is ``"347+185="``.
Two solution styles:

* ``concise``: the sum alone, ``"532"``.
* ``verbose``: one step per column, least significant first, each step adding the
  column's digits and the carry from the step before, then ``>`` and the sum:
  ``"7+5=12,4+8+1=13,3+1+1=5>532"``. Missing digits of shorter operands are written 0.

A task can also be ``mixed``: each problem's reference solution is verbose or concise by a
stable hash of its prompt (:func:`solution_style`), a ``verbose_share`` of them verbose. A
model trained on it mostly writes long solutions, yet a shorter right answer is within its
reach (Long2Short needs both).

Every problem is assigned to exactly one split by a stable hash of its prompt, so
train / validation / test never share a problem however many are drawn. Problem ``i`` of
a split is a pure function of ``(seed, split, i)``: streams are reproducible and can
resume at any index.

Verifiers: :func:`verify_answer` checks the final answer, :func:`verify_steps` checks
each written column step (used by process rewards).
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass, field

from posttrain.data.answers import ANSWER_TAGS

SPLITS = ("train", "validation", "test")
SOLUTION_STYLES = ("concise", "verbose")  # the forms a solution is written in
STYLES = (*SOLUTION_STYLES, "mixed")       # a task's style: one form, or each problem's by hash
ALPHABET = "0123456789+=,>"  # every character a prompt or a solution can contain

STEP_SEPARATOR = ","
ANSWER_MARKER = ">"


@dataclass(frozen=True)
class Problem:
    operands: tuple[int, ...]

    @property
    def prompt(self) -> str:
        return "+".join(str(x) for x in self.operands) + "="

    @property
    def answer(self) -> int:
        return sum(self.operands)

    def solution(self, style: str) -> str:
        if style == "concise":
            return str(self.answer)
        if style == "verbose":
            steps = [_format_step(digits, carry, total) for digits, carry, total in column_steps(self.operands)]
            return STEP_SEPARATOR.join(steps) + ANSWER_MARKER + str(self.answer)
        raise ValueError(f"unknown solution style {style!r}; choose one of {SOLUTION_STYLES}")


def column_steps(operands: tuple[int, ...]) -> list[tuple[list[int], int, int]]:
    """The written-carry columns: (digits of the column, carry in, column total)."""
    width = max(len(str(x)) for x in operands)
    steps, carry = [], 0
    for column in range(width):
        digits = [(x // 10**column) % 10 for x in operands]
        total = sum(digits) + carry
        steps.append((digits, carry, total))
        carry = total // 10
    return steps


def _format_step(digits: list[int], carry: int, total: int) -> str:
    terms = [str(d) for d in digits] + ([str(carry)] if carry else [])
    return "+".join(terms) + "=" + str(total)


def stable_fraction(prompt: str, salt: bytes = b"") -> float:
    """A number in [0, 1) that depends only on the prompt (and `salt`, which makes the draws
    of different uses independent): the same on every seed, run and machine."""
    digest = hashlib.blake2b(prompt.encode(), digest_size=8, person=salt).digest()
    return int.from_bytes(digest, "big") / 2**64


def split_of(prompt: str, fractions: tuple[float, float, float] = (0.9, 0.05, 0.05)) -> str:
    """Stable hash bucket of a prompt: the split it belongs to, for every seed and run."""
    bucket = stable_fraction(prompt)
    cumulative = 0.0
    for split, fraction in zip(SPLITS, fractions):
        cumulative += fraction
        if bucket < cumulative:
            return split
    return SPLITS[-1]


def solution_style(prompt: str, style: str, verbose_share: float) -> str:
    """The form of a problem's reference solution: `style` itself, or for ``mixed`` verbose
    when the prompt's stable hash falls below `verbose_share`, else concise. The hash is
    salted apart from `split_of`'s, so every split gets the same share."""
    if style != "mixed":
        return style
    return "verbose" if stable_fraction(prompt, salt=b"style") < verbose_share else "concise"


@dataclass(frozen=True)
class ArithmeticTask:
    """Difficulty knobs: operand digit range and the number of operands."""

    min_digits: int = 3
    max_digits: int = 3
    num_operands: int = 2
    seed: int = 0
    split_fractions: tuple[float, float, float] = field(default=(0.9, 0.05, 0.05))

    def __post_init__(self):
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(f"need 1 <= min_digits <= max_digits, got {self.min_digits}, {self.max_digits}")
        if self.num_operands < 2:
            raise ValueError(f"num_operands must be >= 2, got {self.num_operands}")
        if abs(sum(self.split_fractions) - 1.0) > 1e-9 or min(self.split_fractions) <= 0:
            raise ValueError(f"split_fractions must be positive and sum to 1, got {self.split_fractions}")

    def problem(self, split: str, index: int) -> Problem:
        """Problem ``index`` of ``split``: drawn by rejection from a (seed, split, index) RNG."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; choose one of {SPLITS}")
        rng = random.Random(f"{self.seed}/{split}/{index}/{self.min_digits}-{self.max_digits}x{self.num_operands}")
        while True:
            operands = []
            for _ in range(self.num_operands):
                digits = rng.randint(self.min_digits, self.max_digits)
                low = 0 if digits == 1 else 10 ** (digits - 1)
                operands.append(rng.randrange(low, 10**digits))
            problem = Problem(tuple(operands))
            if split_of(problem.prompt, self.split_fractions) == split:
                return problem

    def problems(self, split: str, count: int, start: int = 0) -> list[Problem]:
        return [self.problem(split, i) for i in range(start, start + count)]


# --- verifiers -------------------------------------------------------------------------

_INT = re.compile(r"^\d+$")


def extract_answer(response: str) -> str:
    """The final-answer part of a response in either style."""
    return response.rsplit(ANSWER_MARKER, 1)[-1].strip()


def parse_prompt(prompt: str) -> tuple[int, ...]:
    """Operands of a prompt ``"a+b+...="``; raises ValueError on anything else."""
    body = prompt.strip()
    if not body.endswith("=") or not all(_INT.match(t) for t in body[:-1].split("+")):
        raise ValueError(f"malformed arithmetic prompt {prompt!r}: expected digits joined by '+' ending in '='")
    return tuple(int(t) for t in body[:-1].split("+"))


def verify_answer(prompt: str, response: str) -> bool:
    """True when the response's final answer equals the sum of the prompt's operands."""
    answer = extract_answer(response)
    return bool(_INT.match(answer)) and int(answer) == sum(parse_prompt(prompt))


def verify_steps(prompt: str, response: str) -> list[bool]:
    """Correctness of each written column step of a verbose response, in order.

    A step is right when it adds exactly the column's digits plus the carry left by the
    true previous column and states the right total. Steps beyond the last column are
    wrong; missing steps are simply absent (the answer verifier catches the result).
    """
    operands = parse_prompt(prompt)
    body = response.split(ANSWER_MARKER, 1)[0]
    written = [s for s in body.split(STEP_SEPARATOR)] if body else []
    truth = [_format_step(d, c, t) for d, c, t in column_steps(operands)]
    return [k < len(truth) and step.strip() == truth[k] for k, step in enumerate(written)]


def label_steps(prompt: str, steps: list[str]) -> list[bool]:
    """Correctness of each step of a response split into steps (data/steps.py: each text
    ending in its separator, the last one maybe without), for process rewards.

    A column step (ending in ``,`` or ``>``) is right when it is the next true column, written
    as :func:`verify_steps` expects, and comes before the answer marker. The last step carries
    the outcome: it is right only when the final answer is (and, if it is a column, the
    column too). A concise response is a single step: its answer.
    """
    truth = [_format_step(d, c, t) for d, c, t in column_steps(parse_prompt(prompt))]
    labels, column, answered = [], 0, False
    for text in steps:
        if text.endswith((STEP_SEPARATOR, ANSWER_MARKER)):
            labels.append(not answered and column < len(truth) and text[:-1].strip() == truth[column])
            column += 1
            answered = answered or text.endswith(ANSWER_MARKER)
        else:
            labels.append(True)  # the answer: judged with the whole response below
    if labels:
        labels[-1] = labels[-1] and verify_answer(prompt, "".join(steps))
    return labels


def matches_style(response: str, style: str) -> bool:
    """Format check: does the response have the shape of the given solution style (``mixed``:
    of either)."""
    if style == "mixed":
        return any(matches_style(response, form) for form in SOLUTION_STYLES)
    if style == "concise":
        return bool(_INT.match(response.strip()))
    step = r"\d+(\+\d+)+=\d+"
    return re.fullmatch(rf"{step}({STEP_SEPARATOR}{step})*{ANSWER_MARKER}\d+", response.strip()) is not None


# --- the r1 template (data.template=r1): the column steps as the reasoning, in DeepSeek-R1's tags ----
# "<think>7+5=12,4+8+1=13,3+1+1=5</think><answer>532</answer>"; each tag is one token of the
# embedded tokenizer (models/tiny.py), as "<think>" and "</think>" are in Qwen3's vocabulary.
R1_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
# The form, in the order a response writes it: each tag once, around text without tags (the
# task's alphabet has no "<"), and nothing after. Stricter than the r1 template's R1_SHAPE, which
# a response repeating the tags can match.
R1_STAGES = tuple(re.compile(stage) for stage in
                  (r"\s*<think>", r"[^<]+</think>", r"\s*<answer>", r"[^<]+</answer>", r"\s*\Z"))

def r1_solution(problem: Problem) -> str:
    """The reference response of the r1 template: the verbose solution's column steps inside
    <think>, the sum inside <answer>."""
    steps = problem.solution("verbose").split(ANSWER_MARKER, 1)[0]
    return f"<think>{steps}</think><answer>{problem.answer}</answer>"


def r1_answer(response: str) -> str:
    """The content of the last <answer>...</answer> of a response, stripped ("" when none)."""
    found = ANSWER_TAGS.findall(response)
    return found[-1].strip() if found else ""


def verify_r1_answer(prompt: str, response: str) -> bool:
    answer = r1_answer(response)
    return bool(_INT.match(answer)) and int(answer) == sum(parse_prompt(prompt))


def r1_format_score(response: str) -> float:
    """The share of the r1 form a response has: the stages of R1_STAGES it follows from its
    start, each a fifth (1: the whole form). Partial credit for the format reward
    (reward.components.format.partial): a model that has never seen the tags writes the whole
    form by chance about once in a million responses, and a binary reward gives it nothing to
    learn from until then; this one rewards each step towards the form, in order."""
    position = 0
    for done, stage in enumerate(R1_STAGES):
        match = stage.match(response, position)
        if match is None:
            return done / len(R1_STAGES)
        position = match.end()
    return 1.0
