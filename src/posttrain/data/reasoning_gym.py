"""reasoning-gym tasks as data (`data=reasoning_gym`): the procedural task generators of the
`reasoning-gym` package (about 100: arithmetic, algebra, logic, games, graphs, ciphers, ARC, ...),
each scored by its own `score_answer`, with no files and no network.

`data.tasks` lists the tasks, each a name or a mapping::

    data.tasks=[chain_sum,basic_arithmetic]
    data.tasks=[{name: basic_arithmetic, size: 500, config: {min_terms: 2, max_terms: 3}}, {name: chain_sum, level: 1}]

with the keys of TASK_KEYS: ``name`` (a key of `reasoning_gym.factory.DATASETS`), ``size``
(training examples, default `data.size`), ``heldout_size`` (examples of each held-out split,
default `data.heldout_size`), ``seed`` (draws the training examples, default `data.seed`),
``config`` (fields of the task's own config dataclass, e.g. basic_arithmetic's ``min_terms``)
and ``level`` (null: the config's defaults; an integer: the task's reasoning-gym curriculum at
that level, its ``*Curriculum`` class's `generate_configuration`, with ``config`` on top).

An `Example` of the source:

    prompt    the task's question, then the answer format's instruction (ANSWER_FORMATS)
    response  the reference answer in that format, e.g. ``<answer>42</answer>`` (the SFT target;
              empty for the few tasks with no single reference answer, e.g. rush_hour)
    answer    the reference answer as text (None where the task has none)
    messages  the prompt as one user message, with `data.chat`; after `data.shots` worked
              examples of the same task as earlier user and assistant turns (plain text: before it)
    source    the task's name (`Example.source`: metrics per task)
    entry     the reasoning-gym entry the scorer reads (pickled, base64 text)

Correctness: the answer a response gives (`extract_answer`: the content of its last
``<answer>...</answer>``, or what follows its last ``####``, by `data.answer_format`) is scored
by the task's own `score_answer(answer=..., entry=...)`, and is correct when the score is at
least `data.correct_threshold` (1.0: only what the task counts fully right). Scorers parse
model text (some with sympy), so scoring runs in the `AnswerChecker` worker process under
`data.verify_timeout_s`, as math answers do (data/answers.py); a scorer that raises counts as
wrong.

Splits and determinism. Held-out examples (validation and test) are drawn with
`data.validation_seed`, the same in every run of a sweep whatever its seed: a task's held-out
stream keeps distinct questions only, alternately to validation and test. Training examples
are drawn with the task's seed and skip every question the held-out splits hold, so no
question is in two splits. Each stream's reasoning-gym seed is a hash of (task, config, seed,
role): reasoning-gym draws item ``i`` of seed ``s`` from ``Random(s + i)``, so seeds 0 and 1
would otherwise be the same items shifted by one. The training examples are a pure function of
(task settings, seed), the held-out ones of (task settings, validation_seed, heldout_size).

Difficulty: `data_curriculum=difficulty_schedule` raises `level` (the source's
`difficulty_knob`) by one at a time: every task with a ``level`` is then drawn at its level
plus the raise (at most its curriculum's top level); tasks without one keep their config. The
held-out splits stay at the starting levels, so evaluations compare.
"""

from __future__ import annotations

import base64
import bisect
import dataclasses
import difflib
import hashlib
import json
import logging
import os
import pickle
import random
from dataclasses import dataclass

from posttrain.core.options import MAX_SEED, is_int
from posttrain.data.answers import ANSWER_TAGS, HASH_MARKER, AnswerChecker
from posttrain.data.arithmetic import SPLITS
from posttrain.data.examples import Example, PromptLimits
from posttrain.errors import ConfigError, DataError

log = logging.getLogger(__name__)

PACKAGE = "reasoning-gym==0.1.25"
INSTALL = "pip install 'posttrain[reasoning-gym]' (or pip install reasoning-gym==0.1.25)"
TASK_KEYS = ("name", "size", "heldout_size", "seed", "config", "level")
RESERVED_CONFIG_KEYS = {"seed": "seed", "size": "size"}  # set through the task's own keys
REFUSED_TASKS = {"composite": "list the tasks as entries of data.tasks instead (each with its own size and config)"}

# How a response states its final answer: the instruction after the question, the reference
# response, and (extract_answer) where the answer is read back.
ANSWER_FORMATS = {
    "tags": "Give your final answer between <answer> and </answer>.",
    "hash": "End your response with #### followed by your final answer.",
}
ANSWER_TAG_TOKENS = ("<answer>", "</answer>")  # one token each in the embedded tokenizer (as the r1 template's)
# Every character the embedded tokenizer knows whatever the tasks write: the newline and printable ASCII.
BASE_ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))
# Tasks whose items follow Python's string hashing (the order of a set), which changes between
# processes unless PYTHONHASHSEED is set (found by drawing every task under two hash seeds, 0.1.25).
HASH_ORDER_TASKS = ("isomorphic_strings", "knight_swap", "polynomial_multiplication", "ransom_note", "word_ladder")
# Draws a stream may take per example it must keep before the task is declared unable to
# give that many (held-out: distinct questions; training: questions not held out).
DRAWS_PER_EXAMPLE, EXTRA_DRAWS = 4, 64
SHOT_POOL = 16  # worked examples per task that data.shots draws from


def reasoning_gym():
    """The reasoning_gym package (importing it registers every task), or a ConfigError saying how to install it."""
    try:
        # optional: reasoning-gym is an extra (posttrain[reasoning-gym]); importing it takes about a second
        import reasoning_gym.factory
    except ImportError as err:
        raise ConfigError(f"data=reasoning_gym needs the reasoning-gym package, which is not importable ({err}): "
                          f"{INSTALL}") from None
    return reasoning_gym.factory


# --- the task list ----------------------------------------------------------------------------

@dataclass(frozen=True)
class TaskSpec:
    """One entry of data.tasks, checked, with the defaults filled in."""

    index: int            # its position in data.tasks (for messages: data.tasks[index])
    name: str
    size: int             # training examples
    heldout_size: int     # examples of each held-out split (validation, test)
    seed: int             # draws the training examples
    config: str           # the user's config fields, as sorted JSON (hashable)
    level: int | None     # curriculum level; None: the config's defaults

    @property
    def key(self) -> str:
        return f"data.tasks[{self.index}]"

    @property
    def overrides(self) -> dict:
        return json.loads(self.config)


def _plain(value):
    """OmegaConf containers as plain Python (lists, dicts), other values as they are."""
    # start-up: omegaconf is already loaded wherever a config exists
    from omegaconf import DictConfig, ListConfig, OmegaConf

    return OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value


def task_problems(tasks, size=500, heldout_size=32, seed=0) -> tuple[list[str], list[TaskSpec]]:
    """(a sentence per problem of `data.tasks`, the entries that passed as TaskSpecs). Reads
    reasoning-gym's registry and each task's config class; draws nothing."""
    tasks = _plain(tasks)
    if not isinstance(tasks, list) or not tasks:
        return [f"data.tasks={tasks!r} must be a non-empty list of reasoning-gym task names or mappings with keys "
                f"{list(TASK_KEYS)} (e.g. data.tasks=[chain_sum] or data.tasks=[{{name: basic_arithmetic, size: 200, "
                f"config: {{min_terms: 2}}}}])"], []
    factory = reasoning_gym()
    problems, specs = [], []
    for index, entry in enumerate(tasks):
        key = f"data.tasks[{index}]"
        found = []
        if isinstance(entry, str):
            entry = {"name": entry}
        if not isinstance(entry, dict):
            problems.append(f"{key}={entry!r} must be a task name or a mapping with keys {list(TASK_KEYS)}")
            continue
        unknown = sorted(set(map(str, entry)) - set(TASK_KEYS))
        if unknown:
            found.append(f"{key}: unknown key(s) {unknown}; valid keys: {', '.join(TASK_KEYS)}")
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            problems.extend([*found, f"{key}.name={name!r}: each task needs a name, one of reasoning-gym's tasks"])
            continue
        if name in REFUSED_TASKS:
            problems.extend([*found, f"{key}.name={name}: {REFUSED_TASKS[name]}"])
            continue
        if name not in factory.DATASETS:
            close = difflib.get_close_matches(name, list(factory.DATASETS), n=3)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            problems.extend([*found, f"{key}.name={name!r} is not a reasoning-gym task; {hint}the "
                                     f"{len(factory.DATASETS)} tasks are the keys of reasoning_gym.factory.DATASETS "
                                     f"(python -c 'import reasoning_gym.factory as f; print(sorted(f.DATASETS))')"])
            continue
        values = {"size": entry.get("size", size), "heldout_size": entry.get("heldout_size", heldout_size),
                  "seed": entry.get("seed", seed)}
        for field, low in (("size", 1), ("heldout_size", 0)):
            if not is_int(values[field]) or values[field] < low:
                found.append(f"{key}.{field}={values[field]!r} must be an integer >= {low}")
        if not is_int(values["seed"]) or not 0 <= values["seed"] <= MAX_SEED:
            found.append(f"{key}.seed={values['seed']!r} must be an integer in [0, {MAX_SEED}]")
        level = entry.get("level")
        if level is not None:
            top = max_level(factory, name)
            if top is None:
                found.append(f"{key}.level={level!r}: {name} has no reasoning-gym curriculum (no difficulty levels); "
                             f"drop level and set its config instead")
            elif not is_int(level) or not 0 <= level <= top:
                found.append(f"{key}.level={level!r} must be an integer in [0, {top}] ({name}'s curriculum levels)")
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            found.append(f"{key}.config={config!r} must be a mapping of {name}'s config fields")
            config = {}
        valid = config_fields(factory, name)
        for field in sorted(config):
            if field in RESERVED_CONFIG_KEYS:
                found.append(f"{key}.config.{field}: set the task's {field} with {key}.{RESERVED_CONFIG_KEYS[field]}")
            elif field not in valid:
                found.append(f"{key}.config.{field}: unknown config key of {name}; valid keys: {', '.join(valid)}")
        if found:
            problems.extend(found)
            continue
        spec = TaskSpec(index, name, values["size"], values["heldout_size"], values["seed"],
                        json.dumps(config, sort_keys=True), level)
        try:
            task_config(factory, spec, spec.level)
        except ConfigError as err:
            problems.append(str(err))
            continue
        specs.append(spec)
    if specs and not problems and not sum(s.heldout_size for s in specs):
        problems.append("every task of data.tasks has heldout_size 0: evaluation needs held-out examples; set "
                        "data.heldout_size (or a task's heldout_size) to at least 1")
    return problems, specs


def parse_tasks(tasks, size=500, heldout_size=32, seed=0) -> list[TaskSpec]:
    """The TaskSpecs of `data.tasks`, or one ConfigError listing every problem."""
    problems, specs = task_problems(tasks, size, heldout_size, seed)
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"data.tasks has {len(problems)} problems: " + " ".join(
            f"({i}) {p.rstrip('.')}." for i, p in enumerate(problems, start=1)))
    return specs


def config_fields(factory, name: str) -> list[str]:
    """The fields of a task's config dataclass a user may set (not seed and size: the task's own keys)."""
    _, config_cls = factory.DATASETS[name]
    return [f.name for f in dataclasses.fields(config_cls) if f.init and f.name not in RESERVED_CONFIG_KEYS]


def max_level(factory, name: str) -> int | None:
    """The top level of a task's curriculum (its longest attribute's), None without one."""
    if name not in factory.CURRICULA:
        return None
    attributes = factory.create_curriculum(name).attributes.values()
    return max((len(a.levels) for a in attributes), default=1) - 1


def task_config(factory, spec: TaskSpec, level: int | None) -> dict:
    """The task's config fields (without seed and size): its curriculum's at `level` (None: the
    config class's defaults), the user's on top. The one check that settings work: the config's
    own validate(), then its generator's item 0 (simple_equations' operators without
    operators_weights pass validate() and break the generator)."""
    _, config_cls = factory.DATASETS[spec.name]
    if level is None:
        base = config_cls()
    else:
        curriculum = factory.create_curriculum(spec.name)
        curriculum.set_global_level(min(level, max_level(factory, spec.name)))
        base = curriculum.generate_configuration()
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(config_cls)
              if f.init and f.name not in RESERVED_CONFIG_KEYS}
    fields.update(spec.overrides)
    stage = "config"
    try:
        config = config_cls(**fields, seed=0, size=1)
        if hasattr(config, "validate"):
            config.validate()
        stage = "generator"
        factory.create_dataset(spec.name, **fields, seed=0, size=1)[0]
    except Exception as err:  # reasoning-gym's checks are asserts, ValueErrors or a TypeError; a generator raises anything
        where = f" at level {level}" if level is not None else ""
        raise ConfigError(f"{spec.key}.config={spec.overrides} is refused by {spec.name}'s {stage}{where}: "
                          f"{type(err).__name__}: {err}") from None
    return fields


def derived_seed(*parts) -> int:
    """A 32-bit reasoning-gym seed from a stable hash of `parts`."""
    return int(hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()[:8], 16)


# --- answers ----------------------------------------------------------------------------------

def extract_answer(response: str, answer_format: str) -> str | None:
    """The final answer `response` states in `answer_format`: the content of its last
    <answer>...</answer> (`tags`), or everything after its last ``####`` (`hash`; an answer may
    span lines, a grid say), stripped; None when it states none. The one place answers are read."""
    if answer_format == "tags":
        tagged = ANSWER_TAGS.findall(response)
        answer = tagged[-1].strip() if tagged else ""
    elif answer_format == "hash":
        answer = response.rsplit(HASH_MARKER, 1)[1].strip() if HASH_MARKER in response else ""
    else:
        raise ConfigError(f"data.answer_format={answer_format!r} is not one of {sorted(ANSWER_FORMATS)}")
    return answer or None


def reference_response(answer: str | None, answer_format: str) -> str:
    """The SFT target: the reference answer in the answer format (empty where the task has none)."""
    if answer is None:
        return ""
    return f"<answer>{answer}</answer>" if answer_format == "tags" else f"{HASH_MARKER} {answer}"


def pack(name: str, config: dict, entry: dict) -> str:
    """What the scorer needs, as text an Example carries: the task, its config and the entry."""
    return base64.b64encode(pickle.dumps((name, config, entry))).decode("ascii")


_SCORERS: dict[tuple[str, str], object] = {}  # (task, config) -> a dataset instance whose score_answer scores


def score(predicted: str | None, packed: str) -> float:
    """The task's own score_answer of `predicted` on the packed entry (0.0 when it raises)."""
    name, config, entry = pickle.loads(base64.b64decode(packed))  # our own packing (`pack`), never a model's text
    key = (name, json.dumps(config, sort_keys=True, default=repr))
    if key not in _SCORERS:
        _SCORERS[key] = reasoning_gym().create_dataset(name, **config, seed=0, size=1)
    try:
        return float(_SCORERS[key].score_answer(answer=predicted, entry=entry))
    except Exception as err:  # a scorer failing on a model's text: that answer is wrong, the run goes on
        log.warning(f"reasoning-gym {name}.score_answer raised {type(err).__name__}: {err} on {predicted!r:.80}; "
                    f"scored 0")
        return 0.0


def _passes(predicted: str | None, reference: str) -> bool:
    """The AnswerChecker's check (run in its worker): `reference` is JSON [threshold, packed entry]."""
    threshold, packed = json.loads(reference)
    return score(predicted, packed) >= threshold


# The worker finds its check as `passes` of this module, through the module's __getattr__, which
# imports reasoning-gym first: the import (a second or more on a busy machine) then happens while
# the worker starts, outside every check's time limit, also in a worker restarted after a timeout.
_passes.__qualname__ = _passes.__name__ = "passes"


def __getattr__(name: str):
    if name == "passes":
        reasoning_gym()
        return _passes
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- the source -------------------------------------------------------------------------------

@dataclass
class TaskExample(Example):
    """An Example that keeps the entry its reasoning-gym scorer reads (its `source` is the task's name)."""

    entry: str | None = None   # pack(name, config, entry): what `score` reads


@dataclass
class Difficulty:
    """What data_curriculum=difficulty_schedule raises (`source.task.level`): levels above each task's own."""

    level: int = 0


class ReasoningGymSource:
    """The tasks of data.tasks: finite training and held-out splits (sizes summed over the
    tasks), asked as chat messages (`chat`) or plain text, scored by each task's score_answer."""

    difficulty_knob = "level"

    def __init__(self, tasks: list[TaskSpec], heldout_seed: int = 0, answer_format: str = "tags", chat: bool = True,
                 correct_threshold: float = 1.0, verify_timeout_s: float = 5.0, shots: int = 0):
        if answer_format not in ANSWER_FORMATS:
            raise ConfigError(f"data.answer_format={answer_format!r} is not one of {sorted(ANSWER_FORMATS)} (tags: "
                              f"<answer>...</answer>; hash: '#### ' and the answer)")
        if not isinstance(chat, bool):
            raise ConfigError(f"data.chat={chat!r} must be true or false")
        if isinstance(correct_threshold, bool) or not isinstance(correct_threshold, (int, float)) or not (
                0 < correct_threshold <= 1):
            raise ConfigError(f"data.correct_threshold={correct_threshold!r} must be a number in (0, 1] (a response "
                              f"is correct when its task's score_answer is at least this)")
        if not tasks:
            raise ConfigError("data.tasks is empty: name at least one reasoning-gym task")
        if isinstance(shots, bool) or not isinstance(shots, int) or shots < 0:
            raise ConfigError(f"data.shots={shots!r} must be a whole number >= 0 (worked examples before the question)")
        self.shots = shots
        unstable = sorted({s.name for s in tasks} & set(HASH_ORDER_TASKS))
        if unstable and os.environ.get("PYTHONHASHSEED") in (None, "random"):
            log.warning(f"reasoning-gym's {', '.join(unstable)} draw(s) examples in the order of Python's string "
                        f"hashing, which differs between processes: set PYTHONHASHSEED=0 for the same examples in "
                        f"every run and on every rank")
        self.factory = reasoning_gym()
        self.tasks, self.heldout_seed, self.answer_format = list(tasks), heldout_seed, answer_format
        self.chat, self.correct_threshold = chat, float(correct_threshold)
        self.instruction = ANSWER_FORMATS[answer_format]
        self.checker = AnswerChecker(verify_timeout_s, check=_passes)
        self.task = Difficulty()
        self.source_names = tuple(dict.fromkeys(spec.name for spec in self.tasks))  # metrics per task
        self.prompt_limits = PromptLimits()
        self.step_rule = None  # build_source sets data.step_separators' rule, if any
        self._heldout: dict[int, dict[str, list[TaskExample]]] = {}  # task index -> split -> examples
        self._heldout_questions: dict[int, set[str]] = {}
        self._excluded: set[str] | None = None  # every task's held-out questions
        self._train: dict[int, list[TaskExample]] = {}
        self._shots: dict[int, list[TaskExample]] = {}
        self._starts = [0]  # training index where each task's examples start
        for spec in self.tasks:
            self._starts.append(self._starts[-1] + spec.size)
        self._orders = {split: self._interleaved() for split in SPLITS[1:]}

    # -- sizes and places

    def _interleaved(self) -> list[tuple[int, int]]:
        """(task, k) of each held-out index: the tasks in turn, so any prefix mixes them."""
        order, k = [], 0
        while any(k < s.heldout_size for s in self.tasks):
            order.extend((t, k) for t, s in enumerate(self.tasks) if k < s.heldout_size)
            k += 1
        return order

    def _check_split(self, split: str) -> None:
        if split not in SPLITS:
            raise ConfigError(f"data=reasoning_gym has splits {list(SPLITS)}, not {split!r}")

    def size(self, split: str) -> int:
        self._check_split(split)
        return self._starts[-1] if split == "train" else len(self._orders[split])

    def _place(self, split: str, index: int) -> tuple[int, int]:
        self._check_split(split)
        if not 0 <= index < self.size(split):
            raise IndexError(f"{split} example {index} of data=reasoning_gym, which has {self.size(split)}")
        if split == "train":
            task = bisect.bisect_right(self._starts, index) - 1
            return task, index - self._starts[task]
        return self._orders[split][index]

    def origin(self, split: str, index: int) -> str | None:
        task, k = self._place(split, index)
        return f"{self.tasks[task].key} ({self.tasks[task].name}) {split} example {k}"

    def example(self, split: str, index: int) -> TaskExample:
        task, k = self._place(split, index)
        examples = self._training(task) if split == "train" else self._held_out(task)[split]
        example = dataclasses.replace(examples[k])  # a copy: the datamodule may set prompt_ids on it
        return self._with_shots(example, task, split, index) if self.shots else example

    def _with_shots(self, example: TaskExample, task: int, split: str, index: int) -> TaskExample:
        """`example` after `shots` worked examples of its task (earlier user and assistant turns, or
        question and answer before the question in plain text), drawn by (split, index) from the
        task's shot pool: the same in every run, never a held-out question."""
        pool = [e for e in self._shot_pool(task) if e.entry != example.entry]
        rng = random.Random(f"reasoning_gym/shots/{self.heldout_seed}/{split}/{index}")
        shots = rng.sample(pool, min(self.shots, len(pool)))
        if self.chat:
            turns = [turn for shot in shots for turn in (*shot.messages, {"role": "assistant", "content": shot.response})]
            return dataclasses.replace(example, messages=[*turns, *example.messages])
        text = "".join(f"{shot.prompt}{shot.response}\n" for shot in shots)
        return dataclasses.replace(example, prompt=text + example.prompt)

    def _shot_pool(self, task: int) -> list[TaskExample]:
        """Up to SHOT_POOL examples with a reference answer, of a stream of their own drawn with the
        held-out seed at the task's starting level, without held-out questions."""
        if task not in self._shots:
            spec = self.tasks[task]
            excluded = self.heldout_questions()
            config, entries = self._stream(spec, spec.level, "shots", self.heldout_seed, SHOT_POOL + EXTRA_DRAWS)
            self._shots[task] = [self._make(spec, config, entry) for entry in entries
                                 if entry.get("answer") is not None and entry["question"] not in excluded][:SHOT_POOL]
        return self._shots[task]

    # -- drawing

    def _stream(self, spec: TaskSpec, level: int | None, role: str, seed: int, draws: int):
        """(config, entries) of a task's stream: its reasoning-gym dataset, item by item."""
        config = task_config(self.factory, spec, level)
        dataset = self.factory.create_dataset(spec.name, **config, seed=derived_seed(
            "reasoning_gym", spec.name, json.dumps(config, sort_keys=True, default=repr), role, seed), size=draws)

        def entries():
            for i in range(draws):
                try:
                    yield dataset[i]
                except IndexError:  # a task with few distinct items ends its stream early (word_ladder)
                    return
        return config, entries()

    def _make(self, spec: TaskSpec, config: dict, entry: dict) -> TaskExample:
        answer = None if entry.get("answer") is None else str(entry["answer"])
        text = f"{str(entry['question']).rstrip()}\n{self.instruction}"  # the question, then the answer format
        messages = [{"role": "user", "content": text}] if self.chat else None
        prompt = text if self.chat else f"{text}\n"
        return TaskExample(prompt, reference_response(answer, self.answer_format), answer, messages=messages,
                           source=spec.name, entry=pack(spec.name, config, entry))

    def _held_out(self, task: int) -> dict[str, list[TaskExample]]:
        """The task's validation and test examples: distinct questions of its held-out stream, alternately."""
        if task not in self._heldout:
            spec = self.tasks[task]
            wanted = 2 * spec.heldout_size
            draws = DRAWS_PER_EXAMPLE * wanted + EXTRA_DRAWS
            config, entries = self._stream(spec, spec.level, "heldout", self.heldout_seed, draws)
            kept, seen = [], set()
            for entry in entries:
                if len(kept) == wanted:
                    break
                if entry["question"] not in seen:
                    seen.add(entry["question"])
                    kept.append(self._make(spec, config, entry))
            if len(kept) < wanted:
                raise ConfigError(f"{spec.key} ({spec.name}): only {len(kept)} distinct questions in {draws} held-out "
                                  f"draws, fewer than 2 x heldout_size={spec.heldout_size} (validation and test); "
                                  f"lower its heldout_size or make the task larger through its config or level")
            self._heldout[task] = {"validation": kept[0::2], "test": kept[1::2]}
            self._heldout_questions[task] = seen
        return self._heldout[task]

    def heldout_questions(self) -> set[str]:
        """Every question of the held-out splits, of every task (no training example asks one)."""
        if self._excluded is None:
            for task in range(len(self.tasks)):
                self._held_out(task)
            self._excluded = set().union(*self._heldout_questions.values())
        return self._excluded

    def _training(self, task: int) -> list[TaskExample]:
        """The task's training examples at the current level: its stream without held-out questions."""
        if task not in self._train:
            spec = self.tasks[task]
            level = None if spec.level is None else spec.level + self.task.level
            excluded = self.heldout_questions()
            draws = DRAWS_PER_EXAMPLE * spec.size + EXTRA_DRAWS
            config, entries = self._stream(spec, level, "train", spec.seed, draws)
            kept = []
            for entry in entries:
                if len(kept) == spec.size:
                    break
                if entry["question"] not in excluded:
                    kept.append(self._make(spec, config, entry))
            if len(kept) < spec.size:
                raise ConfigError(f"{spec.key} ({spec.name}): only {len(kept)} training questions outside the held-out "
                                  f"splits in {draws} draws, fewer than its size={spec.size}; lower its size or "
                                  f"heldout_size, or make the task larger through its config or level")
            self._train[task] = kept
        return self._train[task]

    # -- difficulty

    def set_difficulty(self, level: int) -> None:
        """Draw the training examples of every task with a level at that level + `level` from now on."""
        if not is_int(level) or level < 0:
            raise ConfigError(f"the difficulty level above the tasks' own must be an integer >= 0, got {level!r}")
        if level != self.task.level:
            self.task = Difficulty(level)
            for task, spec in enumerate(self.tasks):
                if spec.level is not None:
                    self._train.pop(task, None)

    # -- the tokenizer's characters

    @property
    def alphabet(self) -> tuple[str, ...]:
        """The embedded tokenizer's symbols: printable ASCII and the newline, every other
        character of the examples (drawn now: all of them), and with the tags format
        <answer> and </answer> as one token each."""
        chars = set(BASE_ALPHABET) | set(self.instruction)
        for split in SPLITS:
            for index in range(self.size(split)):
                e = self.example(split, index)
                chars.update(e.prompt, e.response, e.answer or "")
        for task in range(len(self.tasks) if self.shots else 0):
            chars.update(*(e.prompt + e.response for e in self._shot_pool(task)))
        tags = ANSWER_TAG_TOKENS if self.answer_format == "tags" else ()
        return (*sorted(chars), *tags)

    # -- judging responses

    def final_answer(self, response: str) -> str | None:
        """What the response answers (majority voting compares these), None when nothing."""
        return extract_answer(response, self.answer_format)

    def has_style(self, response: str) -> bool:
        return self.final_answer(response) is not None

    def reference(self, example: Example) -> str:
        """What the checker's worker reads: the threshold and the packed entry."""
        if not isinstance(example, TaskExample) or example.entry is None:
            raise DataError(f"the example with prompt {example.prompt[:60]!r} carries no reasoning-gym entry to score "
                            f"against (it was not made by data=reasoning_gym)")
        return json.dumps([self.correct_threshold, example.entry])

    def is_correct(self, example: Example, response: str) -> bool:
        """The task's score_answer of the response's final answer reaches data.correct_threshold."""
        return self.checker(self.final_answer(response), self.reference(example))

    def score(self, example: Example, response: str) -> float:
        """The task's score_answer of the response's final answer, in this process (no time limit)."""
        self.reference(example)  # refuses an example without an entry
        return score(self.final_answer(response), example.entry)

    def take_verifier_timeouts(self) -> int:
        """Answer checks that timed out since the last call (logged as rewards/verifier_timeouts)."""
        return self.checker.take_timeouts()


def build_reasoning_gym_source(data_cfg) -> ReasoningGymSource:
    """The source of a `data=reasoning_gym` config node."""
    tasks = parse_tasks(data_cfg.tasks, data_cfg.size, data_cfg.heldout_size, data_cfg.seed)
    return ReasoningGymSource(tasks, data_cfg.validation_seed, data_cfg.answer_format, data_cfg.chat,
                              data_cfg.correct_threshold, data_cfg.verify_timeout_s, data_cfg.shots)
