"""Task sources: where prompts, reference responses and answer checks come from.

A source hands out `Example`s by (split, index) and judges generated responses. Kinds:
`arithmetic` (generated, endless, verifiable), `word_problems` (generated GSM8K-shaped stories,
data/word_problems.py), `code_tasks` (generated Python functions with unit tests, scored in the
sandbox by env=code: data/code_tasks.py), `reasoning_gym` (the reasoning-gym package's task
generators, each scored by its own scorer: data/reasoning_gym.py), `jsonl` (your files), the
datasets-backed `gsm8k`, `math` and `prompt_answer` (data/hub.py: hub names or local json/jsonl/parquet),
and `mixture` (several of these by weight, each example judged by its own: data/mixture.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from posttrain.data import arithmetic
from posttrain.data.code_tasks import build_code_task_source
from posttrain.data.examples import Example, ListSource, PromptLimits
from posttrain.data.guess_number import build_guess_number_source
from posttrain.data.hub import build_hub_source
from posttrain.data.mixture import MixtureSource, build_mixture_source
from posttrain.data.reasoning_gym import build_reasoning_gym_source
from posttrain.data.steps import StepRule
from posttrain.data.verifiers_source import build_verifiers_source
from posttrain.data.templates import check_messages, last_user_content
from posttrain.data.word_problems import WordProblemSource, build_word_problem_source
from posttrain.errors import ConfigError, DataError

TRUNCATE_OPTIONS = ("left",)  # left: keep a prompt's last tokens (the question usually ends it)
ARITHMETIC_TEMPLATES = ("plain", "r1")  # data.template of the arithmetic task (plain: the prompt as is)


class ArithmeticSource:
    """Endless seeded addition problems; `style` picks the reference solution format
    (``mixed``: verbose for a `verbose_share` of the problems, by a stable hash of the prompt)."""

    def __init__(self, min_digits=3, max_digits=3, num_operands=2, style="concise", seed=0, verbose_share=0.5,
                 template="plain"):
        if style not in arithmetic.STYLES:
            raise ConfigError(f"data.style={style!r} is not one of {arithmetic.STYLES}")
        if template not in ARITHMETIC_TEMPLATES:
            raise ConfigError(f"data.template={template!r}: the arithmetic task is asked in one of "
                              f"{list(ARITHMETIC_TEMPLATES)} (r1: the column steps in <think>, the sum in <answer>)")
        if template == "r1" and style != "verbose":
            raise ConfigError(f"data.template=r1 puts the arithmetic task's written column steps inside <think>: it "
                              f"needs data.style=verbose, got data.style={style}")
        is_number = isinstance(verbose_share, (int, float)) and not isinstance(verbose_share, bool)
        if not (is_number and 0 <= verbose_share <= 1):
            raise ConfigError(f"data.verbose_share={verbose_share!r} must be a number in [0, 1] (style=mixed: "
                              f"the share of problems whose reference solution is verbose)")
        try:
            self.task = arithmetic.ArithmeticTask(min_digits, max_digits, num_operands, seed)
        except ValueError as err:
            raise ConfigError(f"data: {err}") from None
        self.style = style
        # a written column is a step (build_source sets data.step_separators' rule, this by default)
        self.step_rule = StepRule((arithmetic.STEP_SEPARATOR, arithmetic.ANSWER_MARKER))
        self.verbose_share = float(verbose_share)
        self.r1 = template == "r1"
        # r1: each tag is one token of the embedded tokenizer (models/tiny.py)
        self.alphabet = (*arithmetic.ALPHABET, *arithmetic.R1_TAGS) if self.r1 else arithmetic.ALPHABET
        # what closes a response's reasoning (posttrain-eval's thinking budget): the r1 template's
        # </think>, else the answer marker after a verbose solution's column steps
        self.end_of_thinking = "</think>" if self.r1 else None if style == "concise" else arithmetic.ANSWER_MARKER
        self.prompt_limits = PromptLimits()

    def size(self, split: str) -> int | None:
        return None

    def origin(self, split: str, index: int) -> str | None:
        return None  # generated: no file to point at

    def set_difficulty(self, **knobs) -> None:
        """Change difficulty knobs (min_digits, max_digits, num_operands) from now on."""
        fields = {"min_digits": self.task.min_digits, "max_digits": self.task.max_digits,
                  "num_operands": self.task.num_operands, **knobs}
        self.task = arithmetic.ArithmeticTask(seed=self.task.seed, **fields)

    def example(self, split: str, index: int) -> Example:
        problem = self.task.problem(split, index)
        if self.r1:
            return Example(problem.prompt, arithmetic.r1_solution(problem), str(problem.answer))
        form = arithmetic.solution_style(problem.prompt, self.style, self.verbose_share)
        return Example(problem.prompt, problem.solution(form), str(problem.answer))

    def is_correct(self, example: Example, response: str) -> bool:
        if self.r1:
            return arithmetic.verify_r1_answer(example.prompt, response)
        return arithmetic.verify_answer(example.prompt, response)

    def step_correctness(self, example: Example, response: str) -> list[bool]:
        return arithmetic.verify_steps(example.prompt, response)

    def final_answer(self, response: str) -> str | None:
        """What the response answers (majority voting compares these), None when nothing."""
        if self.r1:
            return arithmetic.r1_answer(response) or None
        return arithmetic.extract_answer(response) or None

    def step_labels(self, example: Example, steps: list[str]) -> list[bool]:
        """Each step's correctness (the oracle process reward; data/steps.py splits them)."""
        return arithmetic.label_steps(example.prompt, steps)

    def has_style(self, response: str) -> bool:
        if self.r1:
            return arithmetic.r1_format_score(response) == 1.0
        return arithmetic.matches_style(response, self.style)

    def format_score(self, response: str) -> float:
        """The format reward's partial credit (reward.components.format.partial): the share of
        the r1 form a response has; the other templates' shapes are all or nothing."""
        if self.r1:
            return arithmetic.r1_format_score(response)
        return float(self.has_style(response))


class JsonlSource(ListSource):
    """Examples read from JSON-lines files, one object per line.

    Required fields: ``prompt`` (a string, or a chat: a list of {role, content} messages,
    rendered with the tokenizer's chat template) and ``response`` (a string); optional
    ``answer``. A response is judged correct when its text after the last ``>`` (or all of
    it) equals the answer, whitespace stripped.
    """

    def __init__(self, files: dict[str, str | None]):
        super().__init__()
        for split in arithmetic.SPLITS:
            path = files.get(split)
            if path is not None:
                key = f"data.files.{split}"
                lines = []
                self.examples[split] = read_jsonl_examples(Path(path), key, line_numbers=lines)
                self.origins[split] = [f"{path}:{line} ({key})" for line in lines]
        if "train" not in self.examples:
            raise ConfigError("data.files.train must name a JSON-lines file")

    def missing_split(self, split: str) -> str:
        return f"data.files.{split} is not set, but this run needs the {split} split"

    def is_correct(self, example: Example, response: str) -> bool:
        if example.answer is None:
            raise DataError(f"example with prompt {example.prompt[:60]!r} has no 'answer' field to verify against")
        return arithmetic.extract_answer(response) == example.answer.strip()

    def final_answer(self, response: str) -> str | None:
        return arithmetic.extract_answer(response) or None

    def has_style(self, response: str) -> bool:
        return len(response.strip()) > 0


def decode_line(raw: bytes, where: str, line_offset: int) -> str:
    """A line of a UTF-8 file as text; undecodable bytes are a DataError naming where they are.
    ``line_offset`` is the line's byte offset in the file."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        column = len(raw[: err.start].decode("utf-8", errors="replace")) + 1
        bad = raw[err.start:err.end].hex(" ")
        raise DataError(
            f"{where}: byte 0x{bad} at column {column} (byte {line_offset + err.start} of the file) is not valid "
            f"UTF-8 ({err.reason}); data files must be UTF-8: re-encode the file (e.g. `iconv -f latin1 -t utf-8`) "
            f"or fix that line"
        ) from None


def json_lines(path: Path, key: str | None = None) -> Iterator[tuple[str, int, object]]:
    """Each non-blank line of a UTF-8 JSON-lines file, parsed: (where, line number, value), `where`
    being `<path>:<line> (<key>)` (without a key: `<path>:<line>`), for the caller's own messages.
    Undecodable bytes and invalid JSON are DataErrors naming the line."""
    offset = 0
    # Bytes, decoded line by line: a bad byte is then reported with its line, not as a bare
    # UnicodeDecodeError from deep inside the file iterator.
    with path.open("rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            where = f"{path}:{line_number}" + (f" ({key})" if key else "")
            line = decode_line(raw, where, offset)
            offset += len(raw)
            if line_number == 1:
                line = line.removeprefix("\ufeff")  # a byte-order mark some editors write
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{where} is not valid JSON: {err.msg} at column {err.colno}") from None
            yield where, line_number, record


def read_jsonl_examples(path: Path, key: str, line_numbers: list[int] | None = None) -> list[Example]:
    """The examples of a JSON-lines file; ``line_numbers``, if given, receives each one's line."""
    if not path.is_file():
        raise DataError(f"{key}={str(path)!r}: no such file")
    examples = []
    for where, line_number, record in json_lines(path, key):
        if not isinstance(record, dict):
            raise DataError(f"{where} must be a JSON object with 'prompt' and 'response', got {type(record).__name__}")
        messages = None
        if isinstance(record.get("prompt"), list):  # a chat: rendered with the model's chat template
            messages = check_messages(record["prompt"], where)
            record["prompt"] = last_user_content(messages)
        for field in ("prompt", "response"):
            if not isinstance(record.get(field), str):
                raise DataError(f"{where} needs a string field {field!r}; found keys {sorted(record)}")
        answer = record.get("answer")
        if answer is not None and not isinstance(answer, (str, int)):
            raise DataError(f"{where}: 'answer' must be a string or integer")
        examples.append(Example(record["prompt"], record["response"], None if answer is None else str(answer),
                                messages=messages))
        if line_numbers is not None:
            line_numbers.append(line_number)
    if not examples:
        raise DataError(f"{key}={str(path)!r} holds no examples")
    return examples


SOURCES = ("arithmetic", "word_problems", "guess_number", "code_tasks", "reasoning_gym", "jsonl", "gsm8k", "math",
           "prompt_answer", "mixture", "verifiers")


def build_source(data_cfg) -> ArithmeticSource | WordProblemSource | ListSource | MixtureSource:
    """The task source named by ``data.source``, with its prompt-length limits (checked
    against the tokenizer and the model's context by the datamodule)."""
    limits = prompt_limits(data_cfg)
    if data_cfg.source == "arithmetic":
        source = ArithmeticSource(
            data_cfg.min_digits, data_cfg.max_digits, data_cfg.num_operands, data_cfg.style, data_cfg.seed,
            data_cfg.get("verbose_share", 0.5),  # read only by style=mixed (older configs lack the key)
            data_cfg.get("template", "plain"),  # r1 (conf/experiment/r1_zero.yaml); the file sets none
        )
    elif data_cfg.source == "word_problems":
        source = build_word_problem_source(data_cfg)
    elif data_cfg.source == "guess_number":
        source = build_guess_number_source(data_cfg)
    elif data_cfg.source == "code_tasks":
        source = build_code_task_source(data_cfg)
    elif data_cfg.source == "reasoning_gym":
        source = build_reasoning_gym_source(data_cfg)
    elif data_cfg.source == "jsonl":
        source = JsonlSource(dict(data_cfg.files))
    elif data_cfg.source == "verifiers":  # a verifiers environment's tasks (env=verifiers plays them)
        source = build_verifiers_source(data_cfg)
    elif data_cfg.source == "mixture":  # each of its sources built by this function from its own data node
        source = build_mixture_source(data_cfg, build_source)
    elif data_cfg.source in SOURCES:
        source = build_hub_source(data_cfg)
    else:
        raise ConfigError(f"data.source={data_cfg.source!r} is not one of {list(SOURCES)}")
    source.prompt_limits = limits
    separators = data_cfg.get("step_separators")
    source.step_rule = StepRule(tuple(separators)) if separators else None  # process rewards split steps by it
    return source


def _positive_int_or_none(data_cfg, key: str) -> int | None:
    value = data_cfg.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"data.{key}={value!r} must be a positive number of tokens (or null)")
    return value


def prompt_limits(data_cfg) -> PromptLimits:
    """`data.max_response_tokens`, `data.max_prompt_tokens` and `data.truncate_prompts`, checked."""
    truncate = data_cfg.get("truncate_prompts")
    if truncate is not None and truncate not in TRUNCATE_OPTIONS:
        raise ConfigError(f"data.truncate_prompts={truncate!r} is not one of {[None, *TRUNCATE_OPTIONS]} "
                          f"(null: an over-long prompt is an error; left: keep its last tokens)")
    return PromptLimits(max_response_tokens=_positive_int_or_none(data_cfg, "max_response_tokens") or 0,
                        max_prompt_tokens=_positive_int_or_none(data_cfg, "max_prompt_tokens"),
                        truncate=truncate)
