"""Datasets-backed task sources: GSM8K, MATH, and generic prompt/answer tables.

`data.path` is a hub name (``openai/gsm8k``, read with `datasets.load_dataset` where a hub
is reachable) or a local directory or json/jsonl/parquet file. A directory is read the way
the hub lays a dataset out: files named by split (``train.jsonl``, ``test.parquet``,
``main/train-00000-of-00001.parquet``; a subdirectory named ``data.config`` is used when
there is one); a single file is the train split. How a row becomes an example:

    gsm8k          columns.prompt (question); columns.answer holds "<solution> #### <final
                   answer>" (the solution, without its <<48/2=24>> calculator notes, is the SFT target)
    math           columns.prompt (problem); columns.solution whose last \\boxed{} is the final
                   answer, unless columns.answer names a column holding it
    prompt_answer  columns.prompt (a string, or a chat: a list of {role, content}),
                   columns.answer, and optionally columns.solution (the SFT target's reasoning)

Without a validation split (`data.splits.validation: null`) a fixed number of training
examples (`data.validation_size`, drawn with `data.validation_seed`) is held out, disjoint
from the training stream and the same in every run of a sweep.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

from posttrain.data.answers import AnswerChecker, CheckedAnswers, last_boxed_content
from posttrain.data.examples import Example, ListSource
from posttrain.data.templates import PromptTemplate, check_messages, get_template, last_user_content
from posttrain.errors import ConfigError, DataError

LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
CALCULATOR_NOTE = re.compile(r"<<[^<>]*>>")  # GSM8K's "<<48/2=24>>" annotations
# The columns each kind reads (config key under data.columns); others are optional.
REQUIRED_COLUMNS = {"gsm8k": ("prompt", "answer"), "math": ("prompt", "solution"),
                    "prompt_answer": ("prompt", "answer")}


def load_splits(path: str, config: str | None) -> tuple[dict, str]:
    """The dataset's splits (`datasets.Dataset` by split name) and how to name it in errors."""
    local = Path(path).expanduser()
    if local.exists():
        return load_local(local, config), str(local)
    if local.is_absolute() or path.startswith("."):
        raise DataError(f"data.path={path!r}: no such file or directory")
    return load_from_hub(path, config), f"{path} ({config})" if config else path


def load_local(local: Path, config: str | None) -> dict:
    # start-up: `datasets` loads only for hub data
    import datasets

    if local.is_dir() and config and (local / config).is_dir():
        local = local / config  # a hub snapshot holds one subdirectory per config
    refuse_empty_files(local)  # `datasets` would fail on them with a message that names no file
    try:
        if (local / "dataset_dict.json").is_file():  # written by DatasetDict.save_to_disk
            return dict(datasets.load_from_disk(str(local)))
        if local.is_dir():
            return dict(datasets.load_dataset(str(local)))
        builder = LOCAL_BUILDERS.get(local.suffix.lower())
        if builder is None:
            raise DataError(f"data.path={str(local)!r}: a local file must be .json, .jsonl or .parquet")
        return dict(datasets.load_dataset(builder, data_files={"train": str(local)}))
    except DataError:
        raise
    except Exception as err:  # malformed json, unreadable parquet, no data files in the directory
        cause = f" ({type(err.__cause__).__name__}: {first_line(err.__cause__)})" if err.__cause__ else ""
        raise DataError(f"data.path={str(local)!r}: could not read it as a dataset: {type(err).__name__}: "
                        f"{first_line(err)}{cause}") from None


def load_from_hub(name: str, config: str | None) -> dict:
    # start-up: `datasets` loads only for hub data
    import datasets

    try:
        return dict(datasets.load_dataset(name, config))
    except Exception as err:  # no network, unknown name, unknown config
        raise DataError(
            f"data.path={name!r} (data.config={config!r}) could not be loaded from the Hugging Face hub: "
            f"{type(err).__name__}: {first_line(err)}. Without network, download the dataset where the hub is "
            f"reachable (its parquet files, or DatasetDict.save_to_disk) and set data.path to that local "
            f"directory or file") from None


def refuse_empty_files(local: Path) -> None:
    """A local data file without rows is a DataError naming it (an empty split)."""
    files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.suffix.lower() in LOCAL_BUILDERS)
    for file in files:
        if file.suffix.lower() == ".parquet":
            # start-up: parquet support loads only for parquet files
            import pyarrow.parquet

            try:
                empty = pyarrow.parquet.read_metadata(file).num_rows == 0
            except Exception as err:  # not parquet at all
                raise DataError(f"{file} (data.path) is not a readable parquet file: {first_line(err)}") from None
        else:
            with file.open("rb") as handle:
                empty = not any(line.strip() for line in handle)
        if empty:
            raise DataError(f"{file} (data.path) holds no rows: an empty split; remove the file or fill it")


def first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0]


class HubSource(CheckedAnswers, ListSource):
    """Examples of one datasets-backed table; answers checked by math-verify (data/answers.py)."""

    def __init__(self, kind: str, path: str, config: str | None, splits: dict, columns: dict,
                 template: PromptTemplate, chat: bool, validation_size: int, validation_seed: int,
                 verify_timeout_s: float):
        super().__init__()
        if kind not in REQUIRED_COLUMNS:
            raise ConfigError(f"data.source={kind!r} is not one of {sorted(REQUIRED_COLUMNS)}")
        for key in REQUIRED_COLUMNS[kind]:
            if not columns.get(key):
                raise ConfigError(f"data.source={kind} needs data.columns.{key} (the column to read it from)")
        self.kind, self.template, self.chat, self.columns = kind, template, chat, columns
        self.checker = AnswerChecker(verify_timeout_s)
        tables, self.name = load_splits(path, config)
        self.splits_present = sorted(tables)
        self.split_names = splits
        for split, name in splits.items():
            if name is not None and name in tables:
                self.read_split(split, name, tables[name])
        if "train" not in self.examples:
            raise DataError(f"{self.name} has no split {splits['train']!r} (data.splits.train); its splits are "
                            f"{self.splits_present}")
        if splits.get("validation") is None and validation_size > 0:
            self.hold_out_validation(validation_size, validation_seed)

    def read_split(self, split: str, name: str, table) -> None:
        for key in (*REQUIRED_COLUMNS[self.kind], "answer", "solution"):
            column = self.columns.get(key)
            if column is not None and column not in table.column_names:
                raise DataError(f"{self.name} split {name!r} has no column {column!r} (data.columns.{key}); its "
                                f"columns are {table.column_names}")
        if len(table) == 0:
            raise DataError(f"{self.name} split {name!r} (data.splits.{split}) is empty")
        examples, origins = [], []
        for row_number, row in enumerate(table):
            where = f"{self.name} split {name!r} row {row_number}"
            examples.append(self.read_row(row, where))
            origins.append(where)
        self.examples[split], self.origins[split] = examples, origins

    def read_row(self, row: dict, where: str) -> Example:
        question = row[self.columns["prompt"]]
        solution = self.text_cell(row, "solution", where) if self.columns.get("solution") else ""
        if self.kind == "gsm8k":
            solution, answer = split_gsm8k_answer(self.text_cell(row, "answer", where), where,
                                                  self.columns["answer"])
        elif self.columns.get("answer"):
            answer = self.text_cell(row, "answer", where)
        else:  # math: the solution boxes its final answer
            answer = last_boxed_content(solution)
            if answer is None:
                raise DataError(f"{where}: column {self.columns['solution']!r} (data.columns.solution) has no "
                                f"\\boxed{{...}} final answer; set data.columns.answer to a column holding it")
        response = self.template.response(solution, answer)
        if isinstance(question, list):  # already a chat: the template does not apply
            messages = check_messages(question, where)
            return Example(last_user_content(messages), response, answer, messages=messages)
        if not isinstance(question, str) or not question.strip():
            raise DataError(f"{where}: column {self.columns['prompt']!r} (data.columns.prompt) must be a non-empty "
                            f"string or a list of chat messages, got {question!r:.80}")
        messages = self.template.messages(question) if self.chat else None
        return Example(self.template.text(question), response, answer, messages=messages)

    def text_cell(self, row: dict, key: str, where: str) -> str:
        value = row[self.columns[key]]
        if isinstance(value, bool) or not isinstance(value, (str, int, float)) or str(value).strip() == "":
            raise DataError(f"{where}: column {self.columns[key]!r} (data.columns.{key}) must be a non-empty "
                            f"string or number, got {value!r:.80}")
        return str(value).strip()

    def hold_out_validation(self, count: int, seed: int) -> None:
        """Move ``count`` seeded-random training examples to the validation split."""
        train, origins = self.examples["train"], self.origins["train"]
        if count >= len(train):
            raise DataError(f"data.validation_size={count} leaves no training examples: {self.name} split "
                            f"{self.split_names['train']!r} has {len(train)}; lower data.validation_size")
        held_out = random.Random(seed).sample(range(len(train)), count)
        kept = sorted(set(range(len(train))) - set(held_out))
        self.examples["validation"] = [train[i] for i in held_out]
        self.origins["validation"] = [f"{origins[i]} (held out: data.validation_size)" for i in held_out]
        self.examples["train"], self.origins["train"] = [train[i] for i in kept], [origins[i] for i in kept]

    def missing_split(self, split: str) -> str:
        name = self.split_names.get(split)
        if name is None and split == "validation":
            return ("this run needs a validation split: set data.splits.validation to the dataset's, or "
                    "data.validation_size > 0 to hold out training examples")
        if name is None:
            return f"data.splits.{split} is null, but this run needs the {split} split"
        return (f"{self.name} has no split {name!r} (data.splits.{split}); its splits are {self.splits_present}")


def split_gsm8k_answer(text: str, where: str, column: str) -> tuple[str, str]:
    """GSM8K's "<solution> #### <answer>" as (solution without calculator notes, answer)."""
    solution, marker, answer = text.rpartition("####")
    if not marker or not answer.strip():
        raise DataError(f"{where}: column {column!r} (data.columns.answer) must end with '#### <final answer>' "
                        f"(GSM8K's format), got {text[-80:]!r}")
    return CALCULATOR_NOTE.sub("", solution).strip(), answer.strip()


def build_hub_source(data_cfg) -> HubSource:
    return HubSource(
        data_cfg.source, data_cfg.path, data_cfg.get("config"), dict(data_cfg.splits), dict(data_cfg.columns),
        get_template(data_cfg.template), data_cfg.chat, data_cfg.validation_size, data_cfg.validation_seed,
        data_cfg.verify_timeout_s)
