"""Generated grade-school word problems (`data=word_problems`): short stories of one to a few
arithmetic steps, shaped like GSM8K, with a verifiable integer answer and no files or hub.

A story follows one quantity: someone has some things, then each step changes how many they
have, using the quantity the step before left::

    Mia has 12 apples. She buys 3 bags of apples with 4 apples in each bag. Then she gives
    5 apples to Tom. How many apples does Mia have now?

The reference solution (the SFT target, before the template adds its final-answer line) has
one line per step, the previous quantity first::

    12 + 3 × 4 = 24
    24 - 5 = 19

Steps are one of four operations: ``add`` (``12 + 5``, or ``12 + 3 × 4`` for containers of
things when ``multiply`` is allowed too), ``subtract``, ``multiply`` ("twice as many") and
``divide`` (shared into equal containers, one kept); every quantity stays a whole number in
[1, 10 × max_number]. A distractor sentence (someone else's irrelevant number) is added to a
share ``distractors`` of the stories. The stories come from a few scenes (fruit, a collection,
baking, school things), each with its own things, containers and verbs, and a cast of names.

Difficulty knobs: ``min_steps`` / ``max_steps`` (steps per story, drawn uniformly),
``max_number`` (the largest number written in a story), ``operations`` and ``distractors``.

Splits and determinism, as in data/arithmetic.py: a problem belongs to exactly one split by
a stable hash of its question (`arithmetic.split_of`), so train, validation and test never
share a question; problem ``i`` of a split is a pure function of (seed, split, i, the
difficulty knobs). The training split is drawn with the run's ``seed``; the held-out splits
with ``heldout_seed`` (`data.validation_seed`), so every run of a sweep evaluates on the same
problems whatever its seed, batch size or length. Changing a difficulty knob changes the
problems, held-out ones included.

`WordProblemSource` is the task source: the question through a template (data/templates.py;
conf/data/word_problems.yaml picks ``plain``, whose answers end "#### N") after ``shots``
worked examples, as chat messages or plain text; answers checked with math-verify in a worker
process (data/answers.py), as `data=gsm8k` does.
"""

from __future__ import annotations

import dataclasses
import random
import re
from dataclasses import dataclass, field

from posttrain.data.answers import AnswerChecker, CheckedAnswers
from posttrain.data.arithmetic import SPLITS, split_of
from posttrain.data.examples import Example, PromptLimits
from posttrain.data.steps import StepRule
from posttrain.data.templates import PromptTemplate, get_template
from posttrain.errors import ConfigError

OPERATIONS = ("add", "subtract", "multiply", "divide")
SYMBOLS = {"add": "+", "subtract": "-", "multiply": "×", "divide": "÷"}  # as solution lines write them
MAX_FACTOR = 5        # a "times as many" multiplier or a number of containers bought: 2 .. 5
MAX_DIVISOR = 10      # equal containers a quantity is split into: 2 .. 10 (and <= max_number)
QUANTITY_CAP = 10     # every quantity stays <= QUANTITY_CAP * max_number
MAX_TRIES = 1000      # draws of a problem before its knobs are declared impossible

# Every character a question, a solution or a template's text can hold: printable ASCII, the
# newline and the solution's × and ÷ (the embedded tiny model's character vocabulary).
ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127)) + "×÷"


@dataclass(frozen=True)
class Person:
    name: str
    subject: str     # she / he
    possessive: str  # her / his
    object: str      # her / him


SHE, HE = ("she", "her", "her"), ("he", "his", "him")
PEOPLE = tuple(Person(name, *pronouns) for name, pronouns in (
    ("Mia", SHE), ("Tom", HE), ("Ava", SHE), ("Liam", HE), ("Zoe", SHE), ("Noah", HE), ("Emma", SHE),
    ("Omar", HE), ("Lily", SHE), ("Ben", HE), ("Sara", SHE), ("Leo", HE), ("Nina", SHE), ("Sam", HE)))


@dataclass(frozen=True)
class Scene:
    """A vocabulary: plural things, containers (singular, plural, preposition), and the
    sentences of a gain or a loss of k things. Fields: {s}/{p}/{o} the protagonist's
    pronouns, {other} another person, {k} the number, {thing} the things."""

    things: tuple[str, ...]
    containers: tuple[tuple[str, str, str], ...]
    gains: tuple[str, ...]
    losses: tuple[str, ...]
    bulk_verb: str  # "{s} {bulk_verb} {b} bags of apples with {k} apples in each bag."


SCENES = (
    Scene(things=("apples", "oranges", "pears", "plums", "lemons", "peaches"),
          containers=(("bag", "bags", "in"), ("basket", "baskets", "in"), ("box", "boxes", "in")),
          gains=("{s} buys {k} more {thing}.", "{s} picks {k} more {thing}.", "{other} gives {o} {k} {thing}."),
          losses=("{s} eats {k} {thing}.", "{s} gives {k} {thing} to {other}.", "{s} sells {k} {thing}."),
          bulk_verb="buys"),
    Scene(things=("stickers", "marbles", "cards", "stamps", "shells", "beads"),
          containers=(("pack", "packs", "in"), ("jar", "jars", "in"), ("box", "boxes", "in")),
          gains=("{s} wins {k} {thing} in a game.", "{s} finds {k} more {thing}.", "{other} gives {o} {k} {thing}."),
          losses=("{s} gives {k} {thing} to {other}.", "{s} loses {k} {thing}.", "{s} trades away {k} {thing}."),
          bulk_verb="gets"),
    Scene(things=("cookies", "muffins", "cupcakes", "rolls", "pancakes"),
          containers=(("tray", "trays", "on"), ("plate", "plates", "on"), ("box", "boxes", "in")),
          gains=("{s} bakes {k} more {thing}.", "{other} brings {o} {k} {thing}.", "{s} makes {k} more {thing}."),
          losses=("{s} eats {k} {thing}.", "{s} sells {k} {thing}.", "{s} gives {k} {thing} to {other}."),
          bulk_verb="bakes"),
    Scene(things=("pencils", "crayons", "notebooks", "erasers", "markers"),
          containers=(("pack", "packs", "in"), ("box", "boxes", "in"), ("case", "cases", "in")),
          gains=("{s} buys {k} more {thing}.", "{other} gives {o} {k} {thing}.", "{s} finds {k} {thing} in {p} desk."),
          losses=("{s} gives {k} {thing} to {other}.", "{s} loses {k} {thing}.", "{s} uses up {k} {thing}."),
          bulk_verb="buys"),
)
CONNECTORS = ("", "Then ", "After that, ", "Later, ")
QUESTIONS = ("How many {thing} does {name} have now?", "How many {thing} does {name} have at the end?")
DISTRACTORS = ("{other} has {k} {thing2}.", "{other} is {k} years old.", "It is {k} degrees outside.")


@dataclass(frozen=True)
class WordProblem:
    question: str
    answer: int
    lines: tuple[str, ...]  # one "12 + 3 × 4 = 24" per step

    @property
    def solution(self) -> str:
        """The step-by-step reference, one line per step (a template adds the final answer)."""
        return "\n".join(self.lines)


@dataclass(frozen=True)
class WordProblemTask:
    """Difficulty knobs: steps per story, the largest number written, the operations and the
    share of stories with a distractor sentence."""

    min_steps: int = 1
    max_steps: int = 1
    max_number: int = 10
    operations: tuple[str, ...] = ("add", "subtract")
    distractors: float = 0.0
    seed: int = 0           # draws the training split
    heldout_seed: int = 0   # draws validation and test: the same in every run
    split_fractions: tuple[float, float, float] = field(default=(0.9, 0.05, 0.05))

    def __post_init__(self):
        object.__setattr__(self, "operations", tuple(self.operations))
        if not 1 <= self.min_steps <= self.max_steps:
            raise ValueError(f"need 1 <= min_steps <= max_steps, got min_steps={self.min_steps}, "
                             f"max_steps={self.max_steps}")
        if self.max_number < 2:
            raise ValueError(f"max_number must be >= 2, got {self.max_number}")
        unknown = [op for op in self.operations if op not in OPERATIONS]
        if not self.operations or unknown:
            raise ValueError(f"operations={list(self.operations)} must be a non-empty list of {list(OPERATIONS)}")
        if not 0.0 <= self.distractors <= 1.0:
            raise ValueError(f"distractors={self.distractors} must be a probability in [0, 1]")

    def problem(self, split: str, index: int) -> WordProblem:
        """Problem ``index`` of ``split``: drawn by rejection from a (seed, split, index, knobs) RNG
        until its question hashes into ``split``."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; choose one of {SPLITS}")
        seed = self.seed if split == "train" else self.heldout_seed
        knobs = f"{self.min_steps}-{self.max_steps}/{self.max_number}/{','.join(self.operations)}/{self.distractors}"
        rng = random.Random(f"word_problems/{seed}/{split}/{index}/{knobs}")
        for _ in range(MAX_TRIES):
            problem = self.draw(rng)
            if problem is not None and split_of(problem.question, self.split_fractions) == split:
                return problem
        raise ValueError(f"could not draw a {split} word problem with min_steps={self.min_steps}, max_steps="
                         f"{self.max_steps}, max_number={self.max_number}, operations={list(self.operations)} in "
                         f"{MAX_TRIES} tries: these operations cannot chain that many steps on numbers that small "
                         f"(e.g. divide alone needs quantities with many divisors); allow more operations or raise "
                         f"max_number")

    def problems(self, split: str, count: int, start: int = 0) -> list[WordProblem]:
        return [self.problem(split, i) for i in range(start, start + count)]

    def draw(self, rng: random.Random) -> WordProblem | None:
        """One story, or None when the chosen numbers leave some step no allowed operation."""
        scene = rng.choice(SCENES)
        person, other = rng.sample(PEOPLE, 2)
        thing = rng.choice(scene.things)
        names = dict(s=person.subject, p=person.possessive, o=person.object, other=other.name, thing=thing,
                     name=person.name)
        quantity = rng.randint(2, self.max_number)
        steps = rng.randint(self.min_steps, self.max_steps)
        # the distractor goes before step `before` (steps + 1: before the question)
        before = rng.randint(1, steps + 1) if self.distractors and rng.random() < self.distractors else None
        sentences, lines = [f"{person.name} has {quantity} {thing}."], []
        for number in range(1, steps + 1):
            step = self.step(rng, scene, quantity)
            if step is None:
                return None
            template, line, quantity = step
            if number == before and template.startswith("{s}"):
                template = "{name}" + template[3:]  # after a sentence about someone else, "he" would be them
            sentence = template.format(**names)
            connector = rng.choice(CONNECTORS) if number > 1 else ""
            sentences.append(connector + sentence if connector else sentence[0].upper() + sentence[1:])
            lines.append(line)
        if before is not None:
            thing2 = rng.choice([t for t in scene.things if t != thing])
            distractor = rng.choice(DISTRACTORS).format(k=rng.randint(2, self.max_number), thing2=thing2, **names)
            sentences.insert(before, distractor)
        sentences.append(rng.choice(QUESTIONS).format(**names))
        return WordProblem(" ".join(sentences), quantity, tuple(lines))

    def step(self, rng: random.Random, scene: Scene, x: int) -> tuple[str, str, int] | None:
        """(sentence template, solution line, new quantity) of one operation on quantity ``x``,
        chosen among the allowed operations that keep every number whole and in range; None
        when there is none."""
        top, cap = self.max_number, QUANTITY_CAP * self.max_number
        divisors = [d for d in range(2, min(top, MAX_DIVISOR) + 1) if x % d == 0]
        feasible = {"add": x + 2 <= cap, "subtract": x >= 3, "multiply": 2 * x <= cap, "divide": bool(divisors)}
        choices = [op for op in self.operations if feasible[op]]
        if not choices:
            return None
        op = rng.choice(choices)
        container, containers, preposition = rng.choice(scene.containers)
        if op == "add":
            if "multiply" in self.operations and x + 4 <= cap and rng.random() < 0.5:
                b = rng.randint(2, min(MAX_FACTOR, top, (cap - x) // 2))
                k = rng.randint(2, min(top, (cap - x) // b))
                template = (f"{{s}} {scene.bulk_verb} {b} {containers} of {{thing}} with {k} {{thing}} "
                            f"{preposition} each {container}.")
                return template, f"{x} + {b} {SYMBOLS['multiply']} {k} = {x + b * k}", x + b * k
            k = rng.randint(2, min(top, cap - x))
            return rng.choice(scene.gains).replace("{k}", str(k)), f"{x} + {k} = {x + k}", x + k
        if op == "subtract":
            k = rng.randint(2, min(top, x - 1))
            return rng.choice(scene.losses).replace("{k}", str(k)), f"{x} - {k} = {x - k}", x - k
        if op == "multiply":
            m = rng.randint(2, min(MAX_FACTOR, top, cap // x))
            times = "twice" if m == 2 else f"{m} times"
            template = rng.choice(("{s} ends up with {times} as many {thing} as before.",
                                   "{s} collects more until {s} has {times} as many {thing} as before."))
            return template.replace("{times}", times), f"{x} {SYMBOLS['multiply']} {m} = {x * m}", x * m
        d = rng.choice(divisors)
        if d == 2 and rng.random() < 0.5:
            template = "{s} gives half of {p} {thing} to {other}."
        else:
            onto = {"in": "into", "on": "onto"}[preposition]
            template = f"{{s}} splits {{p}} {{thing}} equally {onto} {d} {containers} and keeps only one {container}."
        return template, f"{x} {SYMBOLS['divide']} {d} = {x // d}", x // d


# --- reading solution lines back ------------------------------------------------------------

LINE = re.compile(r"^\s*(\d+)\s*([-+×÷])\s*(\d+)(?:\s*×\s*(\d+))?\s*=\s*(\d+)\s*$")


def evaluate_line(line: str) -> tuple[int, int] | None:
    """(what a solution line's left side evaluates to, the result it states), or None when the
    line is not one step ``a op b [× c] = r`` (× binds tighter than +)."""
    match = LINE.match(line)
    if match is None:
        return None
    a, op, b, c, result = match.groups()
    if c and op != "+":
        return None  # only "x + b × k" has a product on its right
    a, b = int(a), int(b) * (int(c) if c else 1)
    if op == "÷" and (b == 0 or a % b):
        return None  # not a whole number of things
    value = {"+": a + b, "-": a - b, "×": a * b, "÷": a // b if b else 0}[op]
    return value, int(result)


# --- the task source ------------------------------------------------------------------------

class WordProblemSource(CheckedAnswers):
    """Endless seeded word problems asked through a template, as chat messages (`chat`) or plain
    text, after `shots` worked examples; answers checked with math-verify like `data=gsm8k`.

    A worked example is a training problem at the same difficulty with its reference answer:
    earlier user and assistant turns of the chat (plain text: question and answer before the
    question). Each prompt gets its own, drawn by (split, index) with
    ``heldout_seed``, so a held-out prompt is the same in every run and never shows a held-out
    problem."""

    difficulty_knob = "max_steps"  # what data_curriculum=difficulty_schedule raises

    def __init__(self, task: WordProblemTask, template: PromptTemplate, chat: bool, verify_timeout_s: float = 5.0,
                 shots: int = 0):
        if isinstance(shots, bool) or not isinstance(shots, int) or shots < 0:
            raise ConfigError(f"data.shots={shots!r} must be a whole number >= 0 (worked examples before the question)")
        self.task, self.template, self.chat, self.shots = task, template, chat, shots
        self.checker = AnswerChecker(verify_timeout_s)
        self.alphabet = ALPHABET
        self.prompt_limits = PromptLimits()
        self.step_rule = StepRule(("\n",))  # a solution line is a step (build_source sets data.step_separators')

    def size(self, split: str) -> int | None:
        return None

    def origin(self, split: str, index: int) -> str | None:
        return None  # generated: no file to point at

    def set_difficulty(self, **knobs) -> None:
        """Change difficulty knobs (min_steps, max_steps, max_number, operations, distractors) from now on."""
        try:
            self.task = dataclasses.replace(self.task, **knobs)
        except ValueError as err:
            raise ConfigError(f"data: {err}") from None

    def worked_examples(self, split: str, index: int) -> list[WordProblem]:
        """The `shots` training problems shown before problem ``index`` of ``split``."""
        if not self.shots:
            return []
        rng = random.Random(f"word_problems/shots/{self.task.heldout_seed}/{split}/{index}")
        fixed = dataclasses.replace(self.task, seed=self.task.heldout_seed)  # not the run's seed: held-out prompts stay fixed
        return [fixed.problem("train", rng.randrange(10**9)) for _ in range(self.shots)]

    def example(self, split: str, index: int) -> Example:
        problem = self.task.problem(split, index)
        answer = str(problem.answer)
        response = self.template.response(problem.solution, answer)
        shots = [(shot.question, self.template.response(shot.solution, str(shot.answer)))
                 for shot in self.worked_examples(split, index)]
        if not self.chat:
            # one newline apart: the embedded model's character tokenizer has no token for a blank line
            text = "".join(f"{self.template.text(q)}\n{a}\n" for q, a in shots) + self.template.text(problem.question)
            return Example(text, response, answer)
        *system, user = self.template.messages(problem.question)
        turns = [turn for q, a in shots for turn in ({"role": "user", "content": self.template.user(q)},
                                                      {"role": "assistant", "content": a})]
        return Example(self.template.text(problem.question), response, answer, messages=[*system, *turns, user])


def build_word_problem_source(data_cfg) -> WordProblemSource:
    """The source of a `data=word_problems` config node."""
    try:
        task = WordProblemTask(data_cfg.min_steps, data_cfg.max_steps, data_cfg.max_number,
                               tuple(data_cfg.operations), float(data_cfg.distractors), data_cfg.seed,
                               data_cfg.validation_seed)
    except ValueError as err:
        raise ConfigError(f"data: {err}") from None
    return WordProblemSource(task, get_template(data_cfg.template), data_cfg.chat, data_cfg.verify_timeout_s,
                             data_cfg.shots)
