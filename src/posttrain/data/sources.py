"""Task sources: where prompts, reference responses and answer checks come from.

A source hands out `Example`s by (split, index) and judges generated responses. Two kinds:
`arithmetic` (generated, endless, verifiable) and `jsonl` (your files).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from posttrain.data import arithmetic
from posttrain.errors import ConfigError, DataError


@dataclass  # not frozen: Lightning rebuilds dataclasses when moving batches to a device
class Example:
    prompt: str
    response: str          # the reference solution (SFT target)
    answer: str | None     # the final answer a verifier compares against


class ArithmeticSource:
    """Endless seeded addition problems; `style` picks the reference solution format."""

    def __init__(self, min_digits=3, max_digits=3, num_operands=2, style="concise", seed=0):
        if style not in arithmetic.STYLES:
            raise ConfigError(f"data.style={style!r} is not one of {arithmetic.STYLES}")
        try:
            self.task = arithmetic.ArithmeticTask(min_digits, max_digits, num_operands, seed)
        except ValueError as err:
            raise ConfigError(f"data: {err}") from None
        self.style = style
        self.alphabet = arithmetic.ALPHABET

    def size(self, split: str) -> int | None:
        return None

    def set_difficulty(self, **knobs) -> None:
        """Change difficulty knobs (min_digits, max_digits, num_operands) from now on."""
        fields = {"min_digits": self.task.min_digits, "max_digits": self.task.max_digits,
                  "num_operands": self.task.num_operands, **knobs}
        self.task = arithmetic.ArithmeticTask(seed=self.task.seed, **fields)

    def example(self, split: str, index: int) -> Example:
        problem = self.task.problem(split, index)
        return Example(problem.prompt, problem.solution(self.style), str(problem.answer))

    def is_correct(self, example: Example, response: str) -> bool:
        return arithmetic.verify_answer(example.prompt, response)

    def step_correctness(self, example: Example, response: str) -> list[bool]:
        return arithmetic.verify_steps(example.prompt, response)

    def has_style(self, response: str) -> bool:
        return arithmetic.matches_style(response, self.style)


class JsonlSource:
    """Examples read from JSON-lines files, one object per line.

    Required string fields: ``prompt`` and ``response``; optional ``answer``. A
    response is judged correct when its text after the last ``>`` (or all of it)
    equals the answer, whitespace stripped.
    """

    def __init__(self, files: dict[str, str | None]):
        self.examples: dict[str, list[Example]] = {}
        for split in arithmetic.SPLITS:
            path = files.get(split)
            if path is not None:
                self.examples[split] = read_jsonl_examples(Path(path), f"data.files.{split}")
        if "train" not in self.examples:
            raise ConfigError("data.files.train must name a JSON-lines file")
        text = "".join(e.prompt + e.response + (e.answer or "") for ex in self.examples.values() for e in ex)
        self.alphabet = "".join(sorted(set(text)))

    def size(self, split: str) -> int | None:
        return len(self._split(split))

    def _split(self, split: str) -> list[Example]:
        if split not in self.examples:
            raise ConfigError(f"data.files.{split} is not set, but this run needs the {split} split")
        return self.examples[split]

    def example(self, split: str, index: int) -> Example:
        return self._split(split)[index]

    def is_correct(self, example: Example, response: str) -> bool:
        if example.answer is None:
            raise DataError(f"example with prompt {example.prompt[:60]!r} has no 'answer' field to verify against")
        return arithmetic.extract_answer(response) == example.answer.strip()

    def has_style(self, response: str) -> bool:
        return len(response.strip()) > 0


def read_jsonl_examples(path: Path, key: str) -> list[Example]:
    if not path.is_file():
        raise DataError(f"{key}={str(path)!r}: no such file")
    examples = []
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number} ({key})"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{where} is not valid JSON: {err.msg} at column {err.colno}") from None
            if not isinstance(record, dict):
                raise DataError(f"{where} must be a JSON object with 'prompt' and 'response', got {type(record).__name__}")
            for field in ("prompt", "response"):
                if not isinstance(record.get(field), str):
                    raise DataError(f"{where} needs a string field {field!r}; found keys {sorted(record)}")
            answer = record.get("answer")
            if answer is not None and not isinstance(answer, (str, int)):
                raise DataError(f"{where}: 'answer' must be a string or integer")
            examples.append(Example(record["prompt"], record["response"], None if answer is None else str(answer)))
    if not examples:
        raise DataError(f"{key}={str(path)!r} holds no examples")
    return examples


def build_source(data_cfg) -> ArithmeticSource | JsonlSource:
    """The task source named by ``data.source``."""
    if data_cfg.source == "arithmetic":
        return ArithmeticSource(
            data_cfg.min_digits, data_cfg.max_digits, data_cfg.num_operands, data_cfg.style, data_cfg.seed
        )
    if data_cfg.source == "jsonl":
        return JsonlSource(dict(data_cfg.files))
    raise ConfigError(f"data.source={data_cfg.source!r} is not one of ['arithmetic', 'jsonl']")
